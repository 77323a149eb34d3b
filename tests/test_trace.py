"""pipeline.run.trace: trace files exist and agree with each other, on a simulated run and (when the engine can run
a tiny model) on a real one."""
from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from engine.outputs import RequestMetrics, RequestOutput, StepStats
from pipeline.run.trace import RunTrace, check_trace, read_run


# ---- a tiny engine simulator: RequestOutput + StepStats with the engine's contracts ------------------
def simulate(shapes, budget=64, max_seqs=4, block_size=16, num_blocks=256, t0=1000.0, preempt_at=None):
    """Run ``shapes`` = [(prompt_len, cached, max_tokens)] through a token-budget scheduler on a fake clock.

    Each step: running decodes take one token each, then prefills take what is left of the budget (chunked).
    A step lasts 2 ms + 20 us per prefill token + 100 us per decode sequence. Returns (outputs, steps).
    """
    reqs = []
    for i, (p, c, m) in enumerate(shapes):
        reqs.append(dict(id=f"r{i}", prompt=p, cached=c, max=m, done=c, out=[], times=[],
                         metrics=RequestMetrics(arrival_time=t0)))
    waiting, running, finished, steps = list(reqs), [], [], []
    now, step = t0 + 0.5, 0                     # 0.5 s of setup before the first step
    while waiting or running:
        start, left = now, budget
        n_pre = n_dec = s_pre = s_dec = sampled = queries = hits = 0
        this_step = []
        for r in [r for r in running if r["done"] >= r["prompt"]]:
            this_step.append((r, 1, False))
            left -= 1
        for r in list(waiting):
            if len(running) >= max_seqs or left <= 0:
                break
            waiting.remove(r)
            running.append(r)
            r["metrics"].first_scheduled_time = start
            queries += r["prompt"]
            hits += r["cached"]
        for r in running:
            if r["done"] < r["prompt"] and left > 0:
                n = min(r["prompt"] - r["done"], left)
                left -= n
                this_step.append((r, n, True))
        dur = (0.002 + 2e-5 * sum(n for _, n, pre in this_step if pre)
               + 1e-4 * sum(1 for *_, pre in this_step if not pre))
        now = end = start + dur
        for r, n, pre in this_step:
            m = r["metrics"]
            if pre:
                n_pre += n
                s_pre += 1
                m.prefill_start_time = m.prefill_start_time or start
                r["done"] += n
                if r["done"] < r["prompt"]:
                    continue
                m.prefill_end_time = end
                m.first_token_time = end
            else:
                n_dec += 1
                s_dec += 1
            sampled += 1
            r["out"].append(7)
            m.token_times.append(end)
            if len(r["out"]) >= r["max"]:
                m.finish_time = end
                running.remove(r)
                finished.append(r)
        used = sum(math.ceil((r["prompt"] + len(r["out"])) / block_size) for r in running)
        steps.append(StepStats(step=step, start_time=start, end_time=end, num_prefill_tokens=n_pre,
                               num_decode_tokens=n_dec, num_prefill_seqs=s_pre, num_decode_seqs=s_dec,
                               num_running=len(running), num_waiting=len(waiting), kv_blocks_used=used,
                               kv_blocks_total=num_blocks, prefix_cache_queries=queries, prefix_cache_hits=hits,
                               num_preemptions=0, num_sampled=sampled))
        step += 1
    outputs = [RequestOutput(request_id=r["id"], prompt=None, prompt_token_ids=[1] * r["prompt"], text="",
                             token_ids=list(r["out"]), finish_reason="length", num_cached_tokens=r["cached"],
                             metrics=r["metrics"]) for r in finished]
    return outputs, steps


SHAPES = [(40, 0, 5), (40, 32, 5), (300, 0, 3), (10, 0, 40), (600, 512, 2), (25, 16, 20), (80, 0, 1)]
MODEL_INFO = {"name": "tiny", "dtype": "bfloat16", "device": "cpu", "architecture": "LlamaForCausalLM"}


def _traced(tmp_path, shapes=SHAPES, **kw):
    outputs, steps = simulate(shapes, **kw)
    trace = RunTrace(tmp_path / "run", MODEL_INFO, load_time_s=1.25, start_time=1000.0, calibration={})
    for i, o in enumerate(outputs):
        trace.add_request(o, job="even" if i % 2 == 0 else "odd", row_id=i)
    trace.add_steps(steps)
    trace.write()
    return trace, outputs, steps


def test_files_exist_and_are_consistent(tmp_path):
    trace, outputs, steps = _traced(tmp_path)
    run_dir = tmp_path / "run"
    assert (run_dir / "run.json").is_file()
    for name in ("requests.parquet", "steps.parquet"):
        assert sorted(p.name for p in (run_dir / name).iterdir()) == ["part-00000.parquet"]
    run = read_run(run_dir)
    assert run.num_requests == len(SHAPES) and run.num_steps == len(steps)
    assert check_trace(run) == []
    r, s = run.requests, run.steps
    assert sum(r["output_tokens"]) == sum(s["num_sampled"])
    assert sum(s["num_decode_tokens"]) == sum(o - 1 for o in r["output_tokens"])
    assert all(c + k == p for c, k, p in zip(r["cached_tokens"], r["computed_tokens"], r["prompt_tokens"]))
    assert all(t >= q for t, q in zip(r["ttft_s"], r["queue_s"]))
    assert sum(s["num_prefill_tokens"]) == sum(r["computed_tokens"])
    # times are relative to the run start; token times are a list column
    assert r["arrival"][0] == pytest.approx(0.0)
    assert pq.read_schema(run_dir / "requests.parquet" / "part-00000.parquet").field(
        "token_times").type.value_type.bit_width == 64
    assert all(len(tt) == o for tt, o in zip(r["token_times"], r["output_tokens"]))


def test_run_json_phases(tmp_path):
    trace, outputs, steps = _traced(tmp_path)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    ph = meta["phases"]
    assert ph["load_s"] == 1.25
    assert ph["setup_s"] == pytest.approx(0.5)
    assert ph["warmup_s"] == pytest.approx(steps[0].end_time - steps[0].start_time)
    assert ph["steady_s"] == pytest.approx(steps[-1].end_time - steps[0].end_time)
    assert meta["model_info"] == MODEL_INFO and meta["num_requests"] == len(SHAPES)


def test_incremental_writes_append_and_skip_seen_steps(tmp_path):
    outputs, steps = simulate(SHAPES)
    trace = RunTrace(tmp_path, MODEL_INFO, 0.0, start_time=1000.0, calibration={})
    half = len(steps) // 2
    trace.add_steps(steps[:half])
    trace.add_request(outputs[0], "j", 0)
    trace.write()
    trace.add_steps(steps)             # the whole list again: only new steps are added
    trace.add_steps(steps)
    for i, o in enumerate(outputs[1:], 1):
        trace.add_request(o, "j", i)
    trace.write()
    trace.write()                      # nothing new: no duplicates
    run = read_run(tmp_path)
    assert run.num_steps == len(steps) and run.num_requests == len(outputs)
    assert run.steps["step"] == list(range(len(steps)))
    assert check_trace(run) == []


def test_resumed_session_continues_the_time_axis(tmp_path):
    outputs, steps = simulate(SHAPES[:3])
    t1 = RunTrace(tmp_path, MODEL_INFO, 0.5, start_time=1000.0, calibration={})
    t1.add_steps(steps)
    [t1.add_request(o, "j", i) for i, o in enumerate(outputs)]
    t1.write()
    wall1 = json.loads((tmp_path / "run.json").read_text())["sessions"][0]["wall_s"]
    outputs2, steps2 = simulate(SHAPES[3:], t0=5000.0)
    t2 = RunTrace(tmp_path, MODEL_INFO, 0.5, start_time=5000.0, calibration={})
    t2.add_steps(steps2)
    [t2.add_request(o, "j", 10 + i) for i, o in enumerate(outputs2)]
    t2.write()
    meta = json.loads((tmp_path / "run.json").read_text())
    assert len(meta["sessions"]) == 2 and meta["phases"]["load_s"] == 1.0
    run = read_run(tmp_path)
    assert run.num_requests == len(SHAPES) and set(run.requests["session"]) == {0, 1}
    second = [a for a, s in zip(run.requests["arrival"], run.requests["session"]) if s == 1]
    assert all(a == pytest.approx(wall1) for a in second)
    assert check_trace(run) == []


def test_check_trace_flags_inconsistencies(tmp_path):
    _traced(tmp_path)
    run = read_run(tmp_path / "run")
    run.requests["output_tokens"][0] += 1
    run.requests["queue_s"][1] = run.requests["ttft_s"][1] + 1.0
    problems = check_trace(run)
    assert any("sampled" in p for p in problems) and any("TTFT" in p for p in problems)


def test_read_run_names_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="run.json"):
        read_run(tmp_path)


# ---- a real engine run on a tiny model ------------------------------
def _tiny_llm(tmp_path):
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    path = tmp_path / "tiny_llama"
    save_tiny(tiny_hf_model("llama"), path)
    return LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=4)


def test_real_engine_run_is_consistent(tmp_path):
    llm = _tiny_llm(tmp_path)
    from engine import SamplingParams
    shared = list(range(3, 43))
    prompts = [shared + list(range(50, 50 + n)) for n in (3, 20, 1, 9)] + [list(range(60, 120))]
    trace = RunTrace(tmp_path / "run", llm.info.to_dict(), llm.info.load_time_s, model_config=llm.model_config,
                     calibration={})
    for i, p in enumerate(prompts):
        llm.add_request(f"q{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), priority=i)
    while llm.has_unfinished_requests():
        outputs, stats = llm.step()
        for o in outputs:
            trace.add_request(o, "tiny", o.request_id)
        trace.add_steps([stats])
    trace.write()
    run = read_run(tmp_path / "run")
    assert run.num_requests == len(prompts)
    assert check_trace(run) == []
    assert sum(run.requests["cached_tokens"]) > 0           # the shared 40-token prefix was reused


def test_each_write_appends_a_part_and_never_rewrites_earlier_ones(tmp_path):
    """A long run flushes many times: each write costs only its new rows (earlier parts are untouched)."""
    trace, outputs, steps = _traced(tmp_path)
    first = tmp_path / "run" / "requests.parquet" / "part-00000.parquet"
    before = (first.stat().st_mtime_ns, first.read_bytes())
    trace.add_request(outputs[0], job="again", row_id="x")
    trace.write()
    trace.write()                                                   # nothing new: no empty part
    parts = sorted(p.name for p in (tmp_path / "run" / "requests.parquet").iterdir())
    assert parts == ["part-00000.parquet", "part-00001.parquet"]
    assert (first.stat().st_mtime_ns, first.read_bytes()) == before
    run = read_run(tmp_path / "run")
    assert run.num_requests == len(SHAPES) + 1 and run.requests["job"][-1] == "again"


def test_reads_and_extends_a_run_written_as_single_files(tmp_path):
    """Runs written before the dataset layout (one file per table) still read, and resume into parts."""
    from pipeline.run.trace import REQUEST_SCHEMA, STEP_SCHEMA, _append_parquet
    trace, outputs, steps = _traced(tmp_path)
    run_dir = tmp_path / "run"
    for name, schema in (("requests.parquet", REQUEST_SCHEMA), ("steps.parquet", STEP_SCHEMA)):
        table = pq.read_table(run_dir / name, schema=schema)
        for p in (run_dir / name).iterdir():
            p.unlink()
        (run_dir / name).rmdir()
        pq.write_table(table, run_dir / name)                       # the old layout: one file
    assert read_run(run_dir).num_requests == len(SHAPES)
    _append_parquet(run_dir / "requests.parquet", [], REQUEST_SCHEMA)   # a resumed session's first write
    assert (run_dir / "requests.parquet" / "part-00000.parquet").is_file()
    assert read_run(run_dir).num_requests == len(SHAPES)
