"""Scheduler driven by a fake runner: chunking, ordering, seats, preemption, priorities, errors, stops.

The fake runner keeps a per-slot copy of the token each KV slot holds. Each step it first writes every
scheduled token (as a batched forward writes K/V before attention reads), then checks that each request's
whole context reads back its own tokens: a wrong block table, prefix hit or eviction fails the test.
"""
import dataclasses

import pytest

from engine.config import EngineConfig
from engine.outputs import StepStats
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4
EOS = 2


def make_sched(num_blocks=64, max_model_len=1024, **cfg):
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_num_seqs", 8)
    return Scheduler(EngineConfig(block_size=BS, **cfg), num_blocks=num_blocks, max_model_len=max_model_len)


def make_req(rid, prompt, priority=0, arrival=0.0, **sp):
    sp.setdefault("max_tokens", 4)
    return Request(rid, list(prompt), SamplingParams(**sp), priority=priority, arrival_time=arrival,
                   eos_token_ids=(EOS,))


def content_token(req):
    """Deterministic next token from the sequence content (never EOS)."""
    return 10 + (sum(t * (i + 1) for i, t in enumerate(req.all_token_ids)) % 89)


class FakeRunner:
    def __init__(self, sched, token_fn=content_token):
        self.sched = sched
        self.token_fn = token_fn
        self.slots = {}

    def step(self, out):
        bs = self.sched.block_size
        seen = set()
        for sr in out.scheduled:
            assert sr.request_id not in seen
            seen.add(sr.request_id)
            req = self.sched.get_request(sr.request_id)
            end = sr.start_pos + len(sr.token_ids)
            assert sr.token_ids == req.all_token_ids[sr.start_pos:end]
            assert len(sr.block_ids) * bs >= end
            assert sr.sample == (end == req.num_tokens)
            for pos in range(sr.start_pos, end):
                self.slots[sr.block_ids[pos // bs], pos % bs] = req.all_token_ids[pos]
        for sr in out.scheduled:
            req = self.sched.get_request(sr.request_id)
            for pos in range(sr.start_pos + len(sr.token_ids)):
                assert self.slots.get((sr.block_ids[pos // bs], pos % bs)) == req.all_token_ids[pos], \
                    f"{sr.request_id}: KV slot for position {pos} holds another token"
        return {sr.request_id: self.token_fn(self.sched.get_request(sr.request_id))
                for sr in out.scheduled if sr.sample}


def run_all(sched, reqs=(), token_fn=content_token, runner=None, max_steps=2000):
    for r in reqs:
        sched.add_request(r)
    runner = runner or FakeRunner(sched, token_fn)
    finished, outs = {}, []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outs.append(out)
        assert out.total_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        for r in sched.update_from_output(out, runner.step(out)):
            assert r.request_id not in finished
            finished[r.request_id] = r
        assert len(outs) < max_steps, "scheduler does not make progress"
    assert sched.kv_cache_manager.req_to_blocks == {}
    return finished, outs


def test_chunked_prefill_splits_prompt_under_budget():
    sched = make_sched(max_num_batched_tokens=8)
    req = make_req("a", range(100, 120), max_tokens=3)
    sched.add_request(req)
    runner = FakeRunner(sched)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (sr,) = out.scheduled
        chunks.append((sr.start_pos, len(sr.token_ids), sr.sample, sr.is_prefill))
        assert sr.block_ids == sched.kv_cache_manager.get_block_ids("a")
        sched.update_from_output(out, runner.step(out))
    assert chunks == [(0, 8, False, True), (8, 8, False, True), (16, 4, True, True)]
    assert req.num_output_tokens == 1 and req.prefill_end_time is not None
    assert req.first_scheduled_time <= req.prefill_start_time <= req.prefill_end_time <= req.first_token_time
    out = sched.schedule()
    assert [(s.start_pos, len(s.token_ids), s.sample, s.is_prefill) for s in out.scheduled] == [(20, 1, True, False)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


def test_decodes_scheduled_before_prefill_chunks():
    sched = make_sched(max_num_batched_tokens=10)
    sched.add_request(make_req("short", range(4), arrival=0.0))
    sched.add_request(make_req("long", range(50, 80), arrival=1.0))
    runner = FakeRunner(sched)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("short", 4), ("long", 6)]
    sched.update_from_output(out, runner.step(out))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.is_prefill) for s in out.scheduled] == \
        [("short", 1, False), ("long", 9, True)]
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.total_tokens) == (1, 9, 10)
    stats = sched.last_step_stats()
    assert (stats["num_decode_seqs"], stats["num_prefill_seqs"], stats["num_sampled"]) == (1, 1, 1)


def test_max_num_seqs_respected_and_continuous_batching():
    sched = make_sched(max_num_seqs=2)
    reqs = [make_req(f"r{i}", range(i, i + 5), arrival=float(i), max_tokens=2 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    runner = FakeRunner(sched)
    sched.update_from_output(out, runner.step(out))
    finished, outs = run_all(sched, runner=runner)
    assert max(len(o.scheduled) for o in outs) == 2
    assert set(finished) == {"r0", "r1", "r2", "r3", "r4"}
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [2, 3, 4, 5, 6]
    # r2 joined the batch right after r0 finished (continuous batching), before r1 finished.
    assert reqs[2].first_scheduled_time <= reqs[1].finish_time


def _workload():
    shared = list(range(300, 310))
    prompts = [shared + [1, 5, 7], list(range(40, 55)), shared + [9], list(range(60, 66)),
               shared + [4, 4, 4, 4, 4], list(range(70, 79))]
    return [make_req(f"q{i}", p, arrival=float(i), max_tokens=10) for i, p in enumerate(prompts)]


def test_preemption_in_tiny_pool_gives_same_tokens_as_roomy_pool():
    roomy, _ = run_all(make_sched(num_blocks=200, max_num_batched_tokens=16), _workload())
    tiny_sched = make_sched(num_blocks=8, max_num_batched_tokens=16)
    tiny, outs = run_all(tiny_sched, _workload())
    assert sum(r.num_preemptions for r in tiny.values()) > 0
    assert sum(len(o.preempted) for o in outs) == sum(r.num_preemptions for r in tiny.values())
    assert {k: r.output_token_ids for k, r in tiny.items()} == {k: r.output_token_ids for k, r in roomy.items()}
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 10 for r in tiny.values())
    assert sum(r.num_preemptions for r in roomy.values()) == 0
    assert tiny_sched.kv_cache_manager.num_free_blocks == 8


def test_preemption_without_prefix_caching():
    roomy, _ = run_all(make_sched(num_blocks=200, enable_prefix_caching=False), _workload())
    tiny, _ = run_all(make_sched(num_blocks=8, max_num_batched_tokens=16, enable_prefix_caching=False),
                      _workload())
    assert sum(r.num_preemptions for r in tiny.values()) > 0
    assert {k: r.output_token_ids for k, r in tiny.items()} == {k: r.output_token_ids for k, r in roomy.items()}


def test_preempt_already_scheduled_victim_is_undone():
    sched = make_sched(num_blocks=4)
    runner = FakeRunner(sched, token_fn=lambda r: 11)
    low = make_req("low", range(6), priority=1, arrival=0.0, max_tokens=8)
    sched.add_request(low)
    out = sched.schedule()                          # low: prompt 0..5 (blocks 0, 1)
    sched.update_from_output(out, runner.step(out))
    high = make_req("high", range(20, 28), priority=0, arrival=1.0, max_tokens=8)
    sched.add_request(high)
    out = sched.schedule()                          # low decodes position 6; high prefills (blocks 2, 3)
    sched.update_from_output(out, runner.step(out))
    # Step 3: low decodes position 7 (filling block 1), then high needs a 5th block: low is preempted and
    # its already granted decode is taken back out of this step.
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["high"] and out.preempted == ["low"]
    assert out.total_tokens == 1
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.output_token_ids == [11, 11] and low.num_preemptions == 1
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_cached_block(low.block_hashes[0]) is not None     # computed in step 1: still cached
    assert pool.get_cached_block(low.block_hashes[1]) is None         # never computed: hash dropped
    assert sched.last_step_stats()["num_preemptions"] == 1
    sched.update_from_output(out, runner.step(out))
    finished, _ = run_all(sched, runner=runner)
    assert low.output_token_ids == [11] * 8 and high.output_token_ids == [11] * 8


def test_priority_order_of_admission():
    sched = make_sched(max_num_seqs=1)
    reqs = [make_req("p2", range(5), priority=2, arrival=0.0), make_req("p0", range(5), priority=0, arrival=1.0),
            make_req("p1b", range(5), priority=1, arrival=3.0), make_req("p1a", range(5), priority=1, arrival=2.0)]
    finished, outs = run_all(sched, reqs)
    order = [o.scheduled[0].request_id for o in outs if o.scheduled and o.scheduled[0].is_prefill]
    assert order == ["p0", "p1a", "p1b", "p2"]


def test_lowest_priority_running_request_is_preempted():
    sched = make_sched(num_blocks=6, max_num_seqs=3)
    reqs = [make_req("a", range(0, 7), priority=0, arrival=0.0, max_tokens=12),
            make_req("b", range(20, 27), priority=5, arrival=1.0, max_tokens=12),
            make_req("c", range(40, 47), priority=1, arrival=2.0, max_tokens=12)]
    finished, outs = run_all(sched, reqs)
    preempted = [rid for o in outs for rid in o.preempted]
    assert preempted and set(preempted) <= {"b", "c"}
    assert preempted[0] == "b"
    assert reqs[0].num_preemptions == 0
    assert all(r.num_output_tokens == 12 for r in reqs)


def test_prompt_longer_than_max_model_len_is_an_error():
    sched = make_sched(max_model_len=16)
    bad = make_req("bad", range(17))
    ok = make_req("ok", range(16), max_tokens=5)
    finished, outs = run_all(sched, [bad, ok])
    assert bad.status == RequestStatus.FINISHED_ERROR and "max_model_len=16" in bad.error
    assert outs[0].finished_errors == ["bad"] and finished["bad"] is bad
    assert bad.finish_time is not None and bad.num_output_tokens == 0
    # A prompt of exactly max_model_len tokens gets one token, then stops on length.
    assert ok.status == RequestStatus.FINISHED_LENGTH and ok.num_output_tokens == 1


def test_prompt_larger_than_pool_is_an_error_not_a_hang():
    sched = make_sched(num_blocks=4)
    bad = make_req("bad", range(16))                # 16 + 1 tokens need 5 blocks of 4
    good = make_req("good", range(15), max_tokens=3)
    finished, _ = run_all(sched, [bad, good])
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert "needs 5 KV blocks" in bad.error and "only 4" in bad.error
    # good fits the pool alone (15 + 1 tokens); it stops when it would outgrow the whole pool
    assert good.status == RequestStatus.FINISHED_LENGTH and good.num_output_tokens == 2


def test_pins_holding_the_pool_error_instead_of_hang():
    sched = make_sched(num_blocks=4)
    warm = make_req("warm", range(13), max_tokens=1)
    run_all(sched, [warm])
    sched.kv_cache_manager.pin_budget_blocks = 4    # past the default half-pool budget, to reach this state
    sched.pin_prefix(list(range(12)))               # 3 of 4 blocks pinned
    big = make_req("big", range(50, 59))            # needs 3 blocks, only 1 left
    finished, _ = run_all(sched, [big])
    assert big.status == RequestStatus.FINISHED_ERROR and "pinned" in big.error


def test_stop_on_eos_and_min_tokens_and_ignore_eos():
    def eos_fn(r):
        return EOS
    for kwargs, expect_len, status in [({}, 1, RequestStatus.FINISHED_STOPPED),
                                       ({"min_tokens": 3}, 3, RequestStatus.FINISHED_STOPPED),
                                       ({"ignore_eos": True}, 4, RequestStatus.FINISHED_LENGTH)]:
        req = make_req("r", range(5), max_tokens=4, **kwargs)
        run_all(make_sched(), [req], token_fn=eos_fn)
        assert (req.num_output_tokens, req.status) == (expect_len, status), kwargs
        assert req.stop_reason is None


def test_stop_token_ids_set_stop_reason():
    toks = iter([30, 31, 32, 33, 34, 35])
    req = make_req("r", range(5), max_tokens=6, stop_token_ids=[32])
    run_all(make_sched(), [req], token_fn=lambda r: next(toks))
    assert req.output_token_ids == [30, 31, 32]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 32


def test_stop_token_respects_min_tokens_and_wins_over_length():
    req = make_req("r", range(5), max_tokens=3, min_tokens=2, stop_token_ids=[7])
    run_all(make_sched(), [req], token_fn=lambda r: 7)
    assert req.output_token_ids == [7, 7] and req.stop_reason == 7
    req = make_req("s", range(5), max_tokens=1, stop_token_ids=[7])
    run_all(make_sched(), [req], token_fn=lambda r: 7)
    assert req.status == RequestStatus.FINISHED_STOPPED


class StopStringAt:
    """A detokenizer stand-in: the stop string "END" completes with token ``token``."""

    def __init__(self, token):
        self.token, self.stop_reason, self.seen = token, None, []

    def append(self, token_id):
        self.seen.append(token_id)
        if token_id == self.token:
            self.stop_reason = "END"
        return self.stop_reason is not None


def test_stop_string_ends_the_run_where_it_completes():
    sched = make_sched()
    req = make_req("r", range(5), max_tokens=10)
    req.detokenizer = StopStringAt(31)
    sched.add_request(req)
    out = sched.schedule()
    # the sampled token, then tokens a grammar forced: nothing after the stop string is appended
    assert sched.update_from_output(out, {"r": 30}, forced={"r": [31, 32, 33]}) == [req]
    assert req.output_token_ids == [30, 31] and req.all_token_ids[5:] == [30, 31] and len(req.token_times) == 2
    assert req.detokenizer.seen == [30, 31] and req.num_forced_tokens == 1
    assert (req.status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, "END")
    assert (sched.last_step_stats()["num_emitted_tokens"], sched.kv_cache_manager.num_used_blocks) == (2, 0)
    assert sched.get_request("r") is None and not sched.has_unfinished_requests()


def test_stop_string_wins_over_eos_and_length_on_the_same_token():
    for kwargs in ({"max_tokens": 10}, {"max_tokens": 1, "ignore_eos": True}):
        req = make_req("r", range(5), **kwargs)
        req.detokenizer = StopStringAt(EOS)
        run_all(make_sched(), [req], token_fn=lambda r: EOS)
        assert (req.output_token_ids, req.status, req.stop_reason) == ([EOS], RequestStatus.FINISHED_STOPPED, "END")


def test_max_tokens_and_max_model_len():
    req = make_req("r", range(5), max_tokens=3)
    run_all(make_sched(), [req])
    assert req.num_output_tokens == 3 and req.status == RequestStatus.FINISHED_LENGTH
    req = make_req("m", range(5), max_tokens=50)
    run_all(make_sched(max_model_len=9), [req])
    assert req.num_tokens == 9 and req.status == RequestStatus.FINISHED_LENGTH


def test_abort_running_and_waiting():
    sched = make_sched(max_num_seqs=1)
    a, b = make_req("a", range(9), arrival=0.0), make_req("b", range(9), arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert sched.kv_cache_manager.num_used_blocks == 3
    assert sched.abort_request("b") is b and sched.num_waiting == 0
    assert sched.abort_request("a") is a
    assert sched.update_from_output(out, {"a": 11}) == []
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 0
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()
    assert sched.abort_request("a") is None
    assert sched.schedule().scheduled == []


def test_same_step_prefix_hit_and_stats():
    sched = make_sched()
    shared = list(range(100, 112))
    a, b = make_req("a", shared + [1], arrival=0.0), make_req("b", shared + [2, 3], arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 0, 13), ("b", 12, 2)]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12
    assert out.scheduled[1].block_ids[:3] == out.scheduled[0].block_ids[:3]
    runner = FakeRunner(sched)
    sched.update_from_output(out, runner.step(out))
    stats = sched.last_step_stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (13 + 14, 12)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"], stats["kv_blocks_total"]) == \
        (2, 0, 5, 64)
    # every StepStats counter (the engine adds the step's index and times)
    assert set(stats) == {f.name for f in dataclasses.fields(StepStats)} - {"step", "start_time", "end_time"}
    assert (stats["num_emitted_tokens"], stats["num_accepted_tokens"]) == (2, 0)
    finished, _ = run_all(sched, runner=runner)       # the fake runner verifies b's context reads a's KV
    assert len(finished) == 2


def test_duplicate_request_id_rejected():
    sched = make_sched()
    sched.add_request(make_req("a", range(3)))
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", range(3)))


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_match_roomy_pool(seed):
    """Random prompts with shared prefixes, priorities, stop tokens, tiny pools, budgets and seat counts:
    every request that fits ends with the same tokens as in a roomy pool, and all blocks come back."""
    import random
    rng = random.Random(seed)
    for _ in range(40):
        base = [rng.randrange(10, 99) for _ in range(rng.randrange(0, 20))]
        spec = [(base[:rng.randrange(len(base) + 1)] + [rng.randrange(10, 99) for _ in range(rng.randrange(1, 15))],
                 rng.randrange(3), rng.randrange(1, 15), [rng.randrange(10, 99)] if rng.random() < 0.3 else [])
                for _ in range(rng.randrange(1, 10))]

        def reqs():
            return [make_req(f"r{i}", p, priority=pr, arrival=float(i), max_tokens=mt, stop_token_ids=st)
                    for i, (p, pr, mt, st) in enumerate(spec)]
        caching = rng.random() < 0.8
        roomy, _ = run_all(make_sched(num_blocks=500, enable_prefix_caching=caching), reqs())
        nb = rng.randrange(3, 12)
        sched = make_sched(num_blocks=nb, max_num_batched_tokens=rng.randrange(1, 20),
                           max_num_seqs=rng.randrange(1, 6), enable_prefix_caching=caching)
        tiny, _ = run_all(sched, reqs())
        for rid, req in tiny.items():
            if req.status == RequestStatus.FINISHED_ERROR:
                assert "KV blocks" in req.error and req.num_prompt_tokens >= nb * BS
                continue
            full = roomy[rid].output_token_ids
            if req.num_tokens > nb * BS:          # outgrew the whole pool: a truncated copy
                assert full[:req.num_output_tokens] == req.output_token_ids
            else:
                assert req.output_token_ids == full
        assert sched.kv_cache_manager.num_free_blocks == nb
