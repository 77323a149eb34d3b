"""pipeline.report: MFU/MBU from costmodel.flops counts (hand-checked), the diagnosis, the HTML and the CLI."""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from batchgen.report_cmd import calibrate_cmd, commands, report_cmd
from costmodel import flops
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from pipeline.report import analyze, diagnose, render_report, roofline, shape_warnings
from pipeline.run.trace import RunTrace, read_run
from tests.test_flops import gemma_270m, tiny
from tests.test_trace import MODEL_INFO, SHAPES, simulate

CAL = {"device": "cpu-2t", "device_name": "cpu (2 threads)", "dtype": "bfloat16",
       "matmul_flops": 1e6, "memory_bandwidth": 1e5}


def _step(i, start, dur, pre=0, dec=0, sampled=0, **kw):
    base = dict(num_prefill_seqs=int(pre > 0), num_decode_seqs=dec, num_running=1, num_waiting=0, kv_blocks_used=1,
                kv_blocks_total=10, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    base.update(kw)
    return StepStats(step=i, start_time=start, end_time=start + dur, num_prefill_tokens=pre, num_decode_tokens=dec,
                     num_sampled=sampled, **base)


def test_mfu_mbu_hand_computed(tmp_path):
    """One 10-token prompt (no cache) -> 3 tokens, on a 1-layer full-attention tiny config at bf16.

    step 0 (1.0 s): prefill 10 tokens, sample 1;  steps 1, 2 (0.5 s each): decode at contexts 11 and 12.
    """
    cfg = tiny()
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0, prefill_start_time=100.0,
                       prefill_end_time=101.0, first_token_time=101.0, token_times=[101.0, 101.5, 102.0],
                       finish_time=102.0)
    out = RequestOutput("r0", None, list(range(10)), "", [5, 6, 7], "length", 0, m)
    steps = [_step(0, 100.0, 1.0, pre=10, sampled=1), _step(1, 101.0, 0.5, dec=1, sampled=1),
             _step(2, 101.5, 0.5, dec=1, sampled=1)]
    trace = RunTrace(tmp_path, {**MODEL_INFO, "dtype": "bfloat16"}, 0.0, model_config=cfg, calibration=CAL,
                     start_time=100.0)
    trace.add_request(out, "j", 0)
    trace.add_steps(steps)
    trace.write(now=102.0)
    roof = roofline(read_run(tmp_path), warmup_steps=True)
    pre, dec = roof["stages"]["prefill"], roof["stages"]["decode"]
    # prefill: matmuls 2*576*10 + attention 32 FLOP/key * (1+..+10) keys + LM head 2*8*100
    assert pre["flops"] == 11_520 + 32 * 55 + 1_600 == flops.prefill_flops(cfg, 10, 0)
    assert pre["mfu"] == pytest.approx(14_880 / 1.0 / 1e6)
    # prefill bytes: weights (576 + 800 params) * 2 B + 10 tokens of K/V written (16 B each)
    assert pre["bytes"] == 1376 * 2 + 10 * 16
    # decode: weights 2752 B + K/V read (11 and 12 tokens * 16 B) + one token written per step
    want_bytes = (2752 + 11 * 16 + 16) + (2752 + 12 * 16 + 16)
    assert dec["bytes"] == want_bytes == flops.decode_step_bytes(cfg, [11], 2) + flops.decode_step_bytes(cfg, [12], 2)
    assert dec["mbu"] == pytest.approx(want_bytes / 1.0 / 1e5)
    assert dec["flops"] == flops.decode_step_flops(cfg, [11]) + flops.decode_step_flops(cfg, [12])
    assert dec["intensity"] == pytest.approx(dec["flops"] / dec["bytes"])
    # warm-up excluded by default: the first step (the prefill) drops out
    assert roofline(read_run(tmp_path))["stages"]["prefill"]["steps"] == 0


def test_sliding_window_limits_decode_bytes(tmp_path):
    cfg = tiny(window=4, layers=("sliding_attention",))
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, prefill_start_time=0.0, prefill_end_time=1.0,
                       first_token_time=1.0, token_times=[1.0, 2.0], finish_time=2.0)
    trace = RunTrace(tmp_path, MODEL_INFO, 0.0, model_config=cfg, calibration=CAL, start_time=0.0)
    trace.add_request(RequestOutput("r", None, [1] * 20, "", [1, 2], "length", 0, m), "j", 0)
    trace.add_steps([_step(0, 0.0, 1.0, pre=20, sampled=1), _step(1, 1.0, 1.0, dec=1, sampled=1)])
    trace.write(now=2.0)
    dec = roofline(read_run(tmp_path), warmup_steps=True)["stages"]["decode"]
    assert dec["bytes"] == 2752 + 4 * 16 + 16          # context 21, but the window reads 4 tokens


def _sim_run(path, shapes=SHAPES, model_info=MODEL_INFO, **kw):
    outputs, steps = simulate(shapes, **kw)
    trace = RunTrace(path, model_info, 0.8, model_config=gemma_270m(), calibration=CAL, start_time=1000.0)
    for i, o in enumerate(outputs):
        trace.add_request(o, "even" if i % 2 == 0 else "odd", i)
    trace.add_steps(steps)
    trace.write(now=steps[-1].end_time + 0.1)
    return path


def test_analyze_totals_and_buckets(tmp_path):
    sm = analyze(read_run(_sim_run(tmp_path / "a")), prompt_threshold=256, output_threshold=16)
    t = sm["totals"]
    assert t["documents"] == len(SHAPES)
    assert t["prompt_tokens"] == sum(p for p, _, _ in SHAPES)
    assert t["cached_tokens"] == sum(c for _, c, _ in SHAPES)
    assert t["output_tokens"] == sum(o for _, _, o in SHAPES)
    assert sum(b["requests"] for b in sm["buckets"].values()) == len(SHAPES)
    assert sm["buckets"]["long prompt / short output"]["requests"] == 2          # 300 and 600 tokens
    assert sm["buckets"]["short prompt / long output"]["requests"] == 2          # 40 and 20 outputs
    assert set(sm["time_split"]["per_job"]) == {"even", "odd"}
    lat = sm["latency"]["ttft_s"]
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert sm["checks"] == []


def test_diagnosis_rules(tmp_path):
    no_cache = [(p, 0, o) for p, _, o in SHAPES]
    sm = analyze(read_run(_sim_run(tmp_path / "a", no_cache)))
    assert any("prefix-cache hit rate" in d for d in sm["diagnosis"])
    sm["totals"]["preemptions"] = 3
    assert any("preemption" in d and "KV memory" in d for d in diagnose(sm))
    assert sm["diagnosis"][0].startswith("Time went mostly to")


def test_report_html_renders_sections_and_images(tmp_path):
    run_dir = _sim_run(tmp_path / "a")
    out = render_report([run_dir])
    assert out == run_dir / "report.html"
    doc = out.read_text()
    for section in ("Diagnosis", "Totals", "Time split", "Latency distributions", "Over time", "Per shape bucket",
                    "Roofline", "MFU", "MBU", "Data checks", "p99"):
        assert section in doc, section
    assert len(re.findall(r"src=\"data:image/png;base64,", doc)) >= 3
    assert "http://" not in doc and "https://" not in doc          # readable offline


def test_report_header_says_why_this_dtype(tmp_path):
    reason = "float32 chosen: this CPU has no bf16 matmul units (no AMX-BF16 or AVX512-BF16)"
    info = {**MODEL_INFO, "dtype": "float32", "dtype_reason": reason, "cpu_kernels": "avx2 build"}
    doc = render_report([_sim_run(tmp_path / "a", model_info=info)]).read_text()
    assert reason in doc and "CPU kernels: avx2 build" in doc


def test_compare_two_runs_warns_on_shape_difference(tmp_path):
    a = _sim_run(tmp_path / "a")
    b = _sim_run(tmp_path / "b", [(p * 4, c, o * 4) for p, c, o in SHAPES])
    assert shape_warnings(analyze(read_run(a)), analyze(read_run(a))) == []
    warns = shape_warnings(analyze(read_run(a)), analyze(read_run(b)))
    assert any("prompt length" in w for w in warns)
    res = CliRunner().invoke(report_cmd, [str(a), str(b), "-o", str(tmp_path / "cmp.html")])
    assert res.exit_code == 0, res.output
    doc = (tmp_path / "cmp.html").read_text()
    assert "Comparison" in doc and "differ" in doc and "B / A" in doc
    assert "warning:" in res.output


def test_cli_report_missing_run(tmp_path):
    res = CliRunner().invoke(report_cmd, [str(tmp_path)])
    assert res.exit_code != 0 and "run.json" in res.output


def test_cli_calibrate_quick(tmp_path):
    assert [c.name for c in commands] == ["report", "calibrate"]
    res = CliRunner().invoke(calibrate_cmd, ["--quick", "--device", "cpu", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "GFLOP/s" in res.output and "GB/s" in res.output
    from engine.dtype_policy import choose_dtype
    auto = choose_dtype("auto", "cpu")
    assert f"dtype:             {auto.dtype} ({auto.reason})" in res.output     # the engine's own choice
    shown = CliRunner().invoke(calibrate_cmd, ["--show", "--device", "cpu", "--cache-dir", str(tmp_path)])
    assert shown.exit_code == 0 and "matmul peak" in shown.output


def test_decode_steps_are_held_against_the_tuners_measured_steps(tmp_path):
    """A run whose decode steps at 8 rows take 3x what the tuner measured for this format says so (the cores were
    shared, ...); one at the measured speed does not."""
    cfg = tiny()

    def run(dur, name):
        trace = RunTrace(tmp_path / name, {**MODEL_INFO, "dtype": "bfloat16"}, 0.0, model_config=cfg, calibration=CAL,
                         start_time=100.0)
        trace.prediction = {"engine_s": 1.0, "measured_steps": {"decode 8": 0.010, "decode 48": 0.020,
                                                                "prefill 1024": 0.5}}
        m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0, prefill_start_time=100.0,
                           prefill_end_time=100.2, first_token_time=100.2, token_times=[100.2], finish_time=101.0)
        trace.add_request(RequestOutput("r0", None, list(range(8)), "", [5], "length", 0, m), "j", 0)
        trace.add_steps([_step(0, 100.0, 0.2, pre=64, sampled=8)] +
                        [_step(i, 100.2 + i * dur, dur, dec=8, sampled=8) for i in range(1, 7)])
        trace.write(now=101.0)
        return analyze(read_run(tmp_path / name))

    slow = run(0.030, "slow")
    assert slow["roofline"]["against_measured"] == [
        {"shape": "decode 8", "steps": 6, "run_s": pytest.approx(0.030), "measured_s": 0.010,
         "ratio": pytest.approx(3.0)}]
    assert any("Decode steps at 8 rows took 30 ms" in d and "(3.0x)" in d for d in slow["diagnosis"])
    quiet = run(0.011, "quiet")
    assert not any("when the tuner timed" in d for d in quiet["diagnosis"])
    assert "tuner" in (render_report([tmp_path / "slow"])).read_text()
