"""KV cache manager: prefix hits, allocation, freeing order, pins, stats (block_size 4, exact block ids)."""
from engine.block_pool import hash_request_tokens
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(kv, req, num_new=None):
    """What the scheduler does for a waiting request: lookup, allocate, advance the counter."""
    hit, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(req, num_new, hit)
    if new is not None:
        req.num_computed_tokens = num_hit + num_new
    return hit, num_hit, new


def ids(blocks):
    return [b.block_id for b in blocks]


def test_prefill_allocates_and_caches_full_blocks():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(10))
    hit, num_hit, new = admit(kv, a)
    assert (hit, num_hit) == ([], 0)
    assert ids(new) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert a.block_hashes == hash_request_tokens(BS, list(range(10)))
    blocks = kv.req_to_blocks["a"]
    assert [b.block_hash for b in blocks] == [a.block_hashes[0], a.block_hashes[1], None]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 7 and abs(kv.usage - 0.3) < 1e-9


def test_prefix_hit_shares_blocks_with_ref_two():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(10))
    admit(kv, a)
    b = make_req("b", list(range(8)) + [100, 101, 102])
    hit, num_hit, new = admit(kv, b)
    assert ids(hit) == [0, 1] and num_hit == 8
    assert ids(new) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1]
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [1, 1, 1]
    assert kv.block_pool.free_block_ids() == [2, 4, 5, 6, 7, 8, 9]   # a's unhashed tail block reused first


def test_hit_is_capped_to_leave_last_token():
    kv = KVCacheManager(10, BS)
    admit(kv, make_req("a", range(9)))
    # Exactly two full blocks cached; an 8-token prompt may only reuse one (its last token must be computed).
    c = make_req("c", range(8))
    hit, num_hit = kv.get_computed_blocks(c)
    assert ids(hit) == [0] and num_hit == 4
    d = make_req("d", range(9))
    assert kv.get_computed_blocks(d)[1] == 8


def test_decode_growth_caches_block_when_it_fills():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(6))
    admit(kv, a)
    assert kv.get_block_ids("a") == [0, 1]
    for tok, expect_ids in ((50, [0, 1]), (51, [0, 1]), (52, [0, 1, 2])):
        a.append_output_token(tok, 0.0)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        assert kv.get_block_ids("a") == expect_ids
    # tokens 0..5, 50, 51 (computed) fill block 1 -> cached; block 2 holds only 52
    blocks = kv.req_to_blocks["a"]
    assert blocks[1].block_hash == hash_request_tokens(BS, list(range(6)) + [50, 51])[1]
    assert blocks[2].block_hash is None
    assert len(a.block_hashes) == 2


def test_block_hashes_are_incremental():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(5))
    kv.get_computed_blocks(a)
    first = a.block_hashes[0]
    a.all_token_ids.extend([7, 7, 7])
    kv.get_computed_blocks(a)
    assert a.block_hashes[0] is first and len(a.block_hashes) == 2


def test_freed_blocks_hittable_until_reused_lru():
    kv = KVCacheManager(6, BS)
    a = make_req("a", range(100, 109))                   # blocks 0,1 full + 2 partial
    b = make_req("b", range(200, 205))                   # blocks 3 full + 4 partial
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    # unhashed tails first (most recent at the head), then a's hashed blocks tail-first, then b's
    assert kv.block_pool.free_block_ids() == [4, 2, 5, 1, 0, 3]
    a2 = make_req("a2", range(100, 109))
    assert ids(kv.get_computed_blocks(a2)[0]) == [0, 1]
    # A new 16-token request takes blocks 4, 2, 5, 1: evicts a's block 1 but not 0 nor b's block 3.
    admit(kv, make_req("x", range(300, 316)))
    assert kv.get_block_ids("x") == [4, 2, 5, 1]
    assert ids(kv.get_computed_blocks(a2)[0]) == [0]
    assert ids(kv.get_computed_blocks(make_req("b2", range(200, 206)))[0]) == [3]


def test_allocate_returns_none_and_changes_nothing():
    kv = KVCacheManager(3, BS)
    admit(kv, make_req("a", range(8)))
    big = make_req("big", range(50, 59))
    hit, num_hit, new = admit(kv, big)
    assert new is None
    assert "big" not in kv.req_to_blocks and kv.get_block_ids("big") == []
    assert kv.num_free_blocks == 1
    assert kv.prefix_cache_queries == 8            # failed admissions are not counted


def test_hit_on_free_blocks_counts_against_pool():
    kv = KVCacheManager(3, BS)
    a = make_req("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    # Hits blocks 0,1 (free, cached) and needs 2 more: only block 2 is left once the hits are taken.
    b = make_req("b", list(range(8)) + [1, 2, 3, 4, 5])
    hit, num_hit, new = admit(kv, b)
    assert ids(hit) == [0, 1] and new is None
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hit)
    c = make_req("c", list(range(8)) + [9])
    hit, num_hit, new = admit(kv, c)
    assert ids(new) == [2] and kv.get_block_ids("c") == [0, 1, 2] and kv.num_free_blocks == 0


def test_chunked_allocation_grows_table():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(14))
    admit(kv, a, num_new=6)
    assert kv.get_block_ids("a") == [0, 1]
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]
    assert ids(kv.allocate_slots(a, 8)) == [2, 3]
    a.num_computed_tokens += 8
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, True, False]


def test_free_drops_hashes_of_uncomputed_blocks():
    """A request scheduled then preempted in the same step: its blocks never got computed."""
    kv = KVCacheManager(6, BS)
    a = make_req("a", range(9))
    admit(kv, a)
    a.num_computed_tokens = 4                     # rollback: only the first block was really computed
    kv.free(a)
    assert ids(kv.get_computed_blocks(make_req("b", range(9)))[0]) == [0]


def test_pin_existing_blocks_blocks_eviction_then_unpin():
    kv = KVCacheManager(4, BS)
    a = make_req("a", range(9))
    admit(kv, a)
    kv.free(a)
    pin = kv.pin_prefix(list(range(8)))
    blocks = [kv.block_pool.blocks[0], kv.block_pool.blocks[1]]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert kv.num_free_blocks == 2 and kv.num_pinned_blocks() == 2
    # Only blocks 2, 3 can be allocated: a 3-block request does not fit, a 2-block one takes 2 and 3.
    assert admit(kv, make_req("x", range(50, 59)))[2] is None
    x = make_req("x", range(50, 58))
    assert ids(admit(kv, x)[2]) == [2, 3]
    # Pinned prefix is still a hit.
    assert ids(kv.get_computed_blocks(make_req("y", range(10)))[0]) == [0, 1]
    kv.unpin(pin)
    assert [b.ref_cnt for b in blocks] == [0, 0]
    assert kv.block_pool.free_block_ids() == [1, 0]
    kv.unpin(pin)                                   # idempotent
    assert kv.num_free_blocks == 2


def test_pin_takes_ref_when_blocks_get_cached_later():
    kv = KVCacheManager(8, BS)
    pin = kv.pin_prefix(list(range(10)))            # two full blocks in the chain, none cached yet
    assert kv.num_pinned_blocks() == 0 and kv.num_free_blocks == 8
    a = make_req("a", range(12))
    admit(kv, a, num_new=6)                         # block 0 is full -> cached -> pinned
    assert [b.ref_cnt for b in kv.req_to_blocks["a"]] == [2, 1]
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    assert [b.ref_cnt for b in kv.req_to_blocks["a"]] == [2, 2, 1]
    kv.free(a)                                      # block 2 is full (cached) too: to the tail
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 2]
    kv.unpin(pin)
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert kv.num_pinned_blocks() == 0 and kv._pins_by_hash == {}


def test_two_pins_same_chain_each_hold_a_ref():
    kv = KVCacheManager(4, BS)
    p1 = kv.pin_prefix(list(range(4)))
    p2 = kv.pin_prefix(list(range(4)))
    a = make_req("a", range(5))
    admit(kv, a)
    block0 = kv.req_to_blocks["a"][0]
    assert block0.ref_cnt == 3
    kv.free(a)
    kv.unpin(p1)
    assert block0.ref_cnt == 1
    kv.unpin(p2)
    assert block0.ref_cnt == 0


def test_preempted_rollback_releases_pin_ref():
    kv = KVCacheManager(4, BS)
    pin = kv.pin_prefix(list(range(4)))
    a = make_req("a", range(6))
    admit(kv, a)
    block0 = kv.req_to_blocks["a"][0]
    assert block0.ref_cnt == 2
    a.num_computed_tokens = 0                        # scheduled then preempted: never computed
    kv.free(a)
    assert block0.ref_cnt == 0 and block0.block_hash is None and kv.num_pinned_blocks() == 0
    b = make_req("b", range(6))                      # recomputed later: the pin takes its ref again
    admit(kv, b)
    assert kv.req_to_blocks["b"][0].ref_cnt == 2
    kv.free(b)
    kv.unpin(pin)
    assert kv.num_free_blocks == 4


def test_stats_deltas():
    kv = KVCacheManager(10, BS)
    admit(kv, make_req("a", range(9)))
    assert kv.take_prefix_cache_stats() == (9, 0)
    admit(kv, make_req("b", range(9)))
    admit(kv, make_req("c", range(5)))
    assert kv.take_prefix_cache_stats() == (14, 8 + 4)
    assert kv.take_prefix_cache_stats() == (0, 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (23, 12)


def test_caching_disabled():
    kv = KVCacheManager(4, BS, enable_caching=False)
    a = make_req("a", range(9))
    assert kv.get_computed_blocks(a) == ([], 0)
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_req("b", range(9))) == ([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.take_prefix_cache_stats() == (0, 0)
    pin = kv.pin_prefix(list(range(8)))
    kv.unpin(pin)


def test_reset_prefix_cache():
    kv = KVCacheManager(4, BS)
    a = make_req("a", range(9))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_req("b", range(9))) == ([], 0)


def test_pin_budget_is_half_the_pool_counting_future_blocks():
    """Pins claim at most half the pool, counting blocks not cached yet; a refused pin returns None and takes
    nothing; unpinning gives the room back."""
    kv = KVCacheManager(8, BS)
    assert kv.pin_budget_blocks == 4
    first = kv.pin_prefix(list(range(12)))          # 3 blocks claimed, none cached yet
    assert first is not None and kv.num_pin_claimed_blocks() == 3 and kv.num_pinned_blocks() == 0
    assert kv.pin_prefix(list(range(100, 108))) is None          # 3 + 2 > 4: refused
    assert kv.num_pin_claimed_blocks() == 3
    second = kv.pin_prefix(list(range(100, 104)))                # 3 + 1 = 4: fits
    assert second is not None and kv.num_pin_claimed_blocks() == 4
    kv.unpin(first)
    assert kv.num_pin_claimed_blocks() == 1 and kv.pin_prefix(list(range(100, 108))) is not None
