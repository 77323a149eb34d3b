"""Block pool: free queue order, ref counts, lazy eviction, content hashes."""
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_pool import BlockPool, hash_block_tokens, hash_request_tokens


def test_initial_free_queue_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert pool.usage == 0.0


def test_get_new_blocks_pops_head_with_ref_one():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4]
    assert pool.usage == pytest.approx(0.6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_free_blocks_appends_hashed_to_tail_in_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_tokens(2, list(range(6)))
    assert pool.cache_full_blocks(blocks, hashes, 0, 3) == blocks
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert pool.free_block_ids() == [3, 2, 0, 1]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_unhashed_freed_blocks_go_to_head():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [hash_block_tokens(None, [1, 2])], 0, 1)
    pool.free_blocks([a])
    pool.free_blocks([b, c])       # no content worth keeping: reused before a and 3
    assert pool.free_block_ids() == [c.block_id, b.block_id, 3, a.block_id]


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


def test_touch_removes_free_block_from_queue_and_counts_refs():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hash_request_tokens(2, [1, 2, 3, 4]), 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [2, 3, 1, 0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert pool.free_block_ids() == [2, 3, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    assert pool.num_free_blocks == 3


def test_lazy_eviction_on_reuse():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(2, [1, 2, 3, 4])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))              # queue: 2, 1, 0
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    (new,) = pool.get_new_blocks(1)                 # block 2: had no hash
    assert new.block_id == 2
    assert pool.num_cached_blocks == 2
    (new,) = pool.get_new_blocks(1)                 # block 1 evicted now
    assert new.block_id == 1 and new.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_cache_full_blocks_skips_duplicate_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    assert pool.cache_full_blocks([a], [h], 0, 1) == [a]
    assert pool.cache_full_blocks([b], [h], 0, 1) == []
    assert b.block_hash is None and pool.get_cached_block(h) is a


def test_cache_full_blocks_noop_without_caching():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    assert pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1) == []
    assert blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None


def test_hash_is_chained_and_content_addressed():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h1) == 32
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2], ("lora-a",)) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
    # Large ids do not alias (packed as int64, with the count).
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0, 256])


def test_hash_request_tokens_full_blocks_only():
    toks = list(range(10))
    hashes = hash_request_tokens(4, toks)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, toks[:4])
    assert hashes[1] == hash_block_tokens(hashes[0], toks[4:8])
    assert hash_request_tokens(4, toks[:3]) == []


def test_hash_deterministic_across_processes():
    code = "from engine.block_pool import hash_block_tokens as h; print(h(None, [1, 2, 3]).hex())"
    repo = Path(__file__).resolve().parents[1]
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=repo).stdout.strip()
           for seed in ("1", "2")]
    assert out[0] == out[1] == hash_block_tokens(None, [1, 2, 3]).hex()
    assert len(bytes.fromhex(out[0])) == hashlib.sha256().digest_size
