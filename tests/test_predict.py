"""costmodel.predict: the plan's time prediction replays the scheduler's step loop (steps, chunking, decode waves)
and prices steps on the calibrated roofline."""
import numpy as np
import pytest

from costmodel import predict as P
from tests.test_flops import gemma_270m, tiny

FAST = dict(matmul_flops=1e12, memory_bandwidth=1e18)          # compute-bound, known rate


def _run(prompt, cached, out, budget=4096, seqs=128, config=None, **kw):
    return P.predict(prompt, cached, out, config or tiny(), 4, budget, seqs, **{**FAST, **kw})


def test_one_request_steps_and_price():
    cfg = tiny()
    pr = _run([10], [0], [3])
    assert pr.steps == 3 and pr.output_tokens == 3          # prefill (samples token 1), then 2 decodes
    rate = 1e12 * P.ENGINE_EFFICIENCY
    from costmodel import flops as F
    lin, head = F.linear_flops(cfg, 1), F.lm_head_flops(cfg, 1)
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim
    # 10 tokens of M=10 rows run at the small-M rate (no small_m_flops given: the large rate)
    prefill = lin * 10 / rate + head / rate + per_key * F.attended_keys(cfg, 10, 0) / rate + P.STEP_OVERHEAD_S
    decode1 = lin / rate + head / rate + per_key * F.attended_keys(cfg, 1, 10) / rate + P.STEP_OVERHEAD_S
    decode2 = lin / rate + head / rate + per_key * F.attended_keys(cfg, 1, 11) / rate + P.STEP_OVERHEAD_S
    assert pr.prefill_s == pytest.approx(prefill) and pr.decode_s == pytest.approx(decode1 + decode2)


def test_budget_chunks_long_prompts_and_caps_running_sequences():
    assert _run([10_000], [0], [1], budget=4096).steps == 3            # 4096 + 4096 + 1808
    # 8 requests, 2 at a time, 4 tokens out each: 4 waves of (1 prefill step + 3 decode steps)
    assert _run([20] * 8, [0] * 8, [4] * 8, seqs=2).steps == 16


def test_prefix_hits_and_outputs_move_the_prediction_the_right_way():
    g = gemma_270m()
    base = _run([2000] * 8, [0] * 8, [16] * 8, config=g).engine_s
    assert _run([2000] * 8, [1500] * 8, [16] * 8, config=g).engine_s < 0.5 * base
    assert _run([2000] * 8, [0] * 8, [64] * 8, config=g).engine_s > base
    assert _run([2000] * 8, [0] * 8, [16] * 8, config=g, matmul_flops=1e11).engine_s > 5 * base


def test_small_batches_run_at_the_small_m_rate():
    fast = _run([20] * 4, [0] * 4, [32] * 4, config=gemma_270m())
    slow = _run([20] * 4, [0] * 4, [32] * 4, config=gemma_270m(), small_m_flops=1e11)
    assert slow.decode_s > 3 * fast.decode_s


def test_plan_subset_keeps_positions():
    from pipeline.plan.planner import make_plan
    plan = make_plan([(1, 2, 3), (4, 5, 6)], np.array([0, 1, 0, 1]), np.array([40, 40, 40, 40]), 2)
    sub = plan.subset(plan.group == 0)
    assert sub.num_requests == 2 and (sub.group == 0).all() and sub.prompt_tokens == 80


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_stretches_priced_together_equal_step_by_step(seed):
    """The fast-forward over decode-only stretches gives the step-by-step prediction to the last bit, on a
    windowed model, with full and part-full batches, uneven outputs and memory-bound steps."""
    rng = np.random.default_rng(seed)
    n = 300
    prompt = rng.integers(5, 3000, n)
    cached = (prompt * rng.random(n) * 0.8).astype(np.int64)
    out = rng.integers(1, 80, n)
    args = (prompt, cached, out, gemma_270m(), 2, int(rng.choice([512, 4096])), int(rng.choice([8, 64, 128])))
    kw = dict(matmul_flops=4e11, memory_bandwidth=3e10, small_m_flops=1e11)
    fast, slow = P.predict(*args, **kw), P.predict(*args, **kw, fast_forward=False)
    assert fast == slow and fast.steps > n


def test_kv_cache_dtype_bytes_price_the_kv_reads():
    """A bf16 KV cache under float32 activations (kv_cache_dtype) halves the K/V bytes of memory-bound steps."""
    args = ([2000] * 16, [0] * 16, [64] * 16, gemma_270m(), 4, 4096, 16)
    kw = dict(matmul_flops=1e15, memory_bandwidth=1e10)                 # memory-bound
    f32, bf16 = P.predict(*args, **kw), P.predict(*args, **kw, kv_dtype_bytes=2)
    assert P.predict(*args, **kw, kv_dtype_bytes=4) == f32
    assert bf16.decode_s < f32.decode_s and bf16.steps == f32.steps


def test_int8_weight_bytes_price_the_weight_reads():
    """int8 weights (1.0625 bytes per parameter with their scales) shorten memory-bound decode steps; the default
    is the activation dtype's bytes."""
    args = ([64] * 2, [0] * 2, [32] * 2, gemma_270m(), 4, 4096, 16)
    kw = dict(matmul_flops=1e15, memory_bandwidth=1e10)                 # memory-bound: weights dominate
    f32, int8 = P.predict(*args, **kw), P.predict(*args, **kw, weight_dtype_bytes=P.INT8_WEIGHT_BYTES)
    assert P.predict(*args, **kw, weight_dtype_bytes=4) == f32
    assert int8.steps == f32.steps and int8.decode_s < 0.4 * f32.decode_s


def test_measured_steps_scale_the_roofline_to_this_machine():
    """With the tuner's timed steps (engine.tuning) the prediction of a run shaped like the probe's prefill equals
    the measured time; decode steps scale by the measured ratio at their row count, log-interpolated between the
    timed row counts and held beyond them; prefill steps by the chunk's ratio up to its rows, going to 1 at the
    calibration's row count."""
    g = gemma_270m()
    c = P._Costs(g, 4, None, None, 1e12, None, 1e11)
    measured = {"shapes": {"prefill 1024": 3 * c.prefill_chunk(1024), "decode 8": 2 * c.decode(8, 512),
                           "decode 48": 4 * c.decode(48, 512)}, "context": 512, "source": "decision.json"}
    kw = dict(memory_bandwidth=1e11, config=g)
    one = _run([1024], [0], [1], measured=measured, **kw)
    assert one.steps == 1 and one.engine_s == pytest.approx(measured["shapes"]["prefill 1024"])
    assert one.basis == "measured steps (decision.json)" and _run([1024], [0], [1], **kw).basis == "roofline"
    pre, dec = P._scales(c, measured)
    assert pre(1024) == pre(64) == pytest.approx(3) and dec(8) == pytest.approx(2) and dec(48) == pytest.approx(4)
    # prefill steps larger than the probe's chunk: toward the calibrated rate (1x) at CALIBRATED_ROWS, held beyond
    assert pre(P.CALIBRATED_ROWS) == pre(8192) == pytest.approx(1)
    assert pre(1448) == pytest.approx(3 - 2 * (np.log(1448) - np.log(1024)) / (np.log(2048) - np.log(1024)))
    assert dec(1) == pytest.approx(2) and dec(128) == pytest.approx(4)               # held at the ends
    mid = 2 + 2 * (np.log(20) - np.log(8)) / (np.log(48) - np.log(8))
    assert dec(20) == pytest.approx(mid)
    # a probe chunk faster than priced (the calibration's rate too low for this model): its factor holds for all rows
    faster = {**measured, "shapes": {**measured["shapes"], "prefill 1024": 0.5 * c.prefill_chunk(1024)}}
    pre_fast, _ = P._scales(c, faster)
    assert pre_fast(64) == pre_fast(1024) == pre_fast(P.CALIBRATED_ROWS) == pre_fast(8192) == pytest.approx(0.5)
    # a whole run's decode-only steps are scaled too: more than the roofline, less than 4x it
    base = _run([512] * 48, [0] * 48, [32] * 48, **kw)
    scaled = _run([512] * 48, [0] * 48, [32] * 48, measured=measured, **kw)
    # 4,096-row steps at the calibrated rate; the smaller last one toward the chunk's 3x
    assert base.prefill_s < scaled.prefill_s < 1.1 * base.prefill_s
    small = dict(budget=1024)
    assert (_run([512] * 48, [0] * 48, [32] * 48, measured=measured, **small, **kw).prefill_s
            == pytest.approx(3 * _run([512] * 48, [0] * 48, [32] * 48, **small, **kw).prefill_s))
    assert 2 * base.decode_s <= scaled.decode_s <= 4 * base.decode_s


@pytest.mark.parametrize("prompts, amx, large", [("bf16", None, 3e12), ("bf16", 2e12, 2e12), ("int8", 2e12, 5e11)])
def test_int8_prompt_rows_on_amx_are_priced_at_their_kernels_rate(monkeypatch, prompts, amx, large):
    """An int8 engine whose prompt rows run bf16 on AMX tiles: large steps at our tile kernel's rate as the bf16
    calibration timed it (q8_linear_amx; torch's bf16 peak where it was not timed), decode-sized rows at the int8
    kernel's; with the int8 dot products both come from the int8 kernel's calibration."""
    from types import SimpleNamespace

    import costmodel.calibrate as calibrate
    rates = {"int8": SimpleNamespace(matmul_flops=4e11, small_m_flops=1e11, memory_bandwidth=2e10,
                                     kernel_flops={"q8_linear": {"matmul_flops": 5e11, "small_m_flops": 2e11}}),
             "bfloat16": SimpleNamespace(matmul_flops=3e12, small_m_flops=3e11, memory_bandwidth=2e10,
                                         kernel_flops={"torch.matmul": {"matmul_flops": 3e12}} if amx is None else
                                         {"torch.matmul": {"matmul_flops": 3e12},
                                          "q8_linear_amx": {"matmul_flops": amx, "small_m_flops": 1e11}})}
    monkeypatch.setattr(calibrate, "get_calibration", lambda device, dtype, quick=False: rates[dtype])
    monkeypatch.setattr(P, "measured_steps", lambda info: None)
    seen = {}
    monkeypatch.setattr(P, "predict", lambda *a, **kw: seen.update(large=a[7], small=a[9]))
    cfg = SimpleNamespace(quantization="int8", device="cpu", dtype="float32", kv_cache_dtype="bfloat16",
                          kernels={"int8_prompts": prompts}, max_num_batched_tokens=4096, max_num_seqs=128)
    info = SimpleNamespace(config=cfg, to_dict=lambda: {"quantization": "int8", "dtype": "float32", "config": {
        "kv_cache_dtype": "bfloat16", "kernels": {"int8_prompts": prompts}}})
    P.plan_pricer(info, tiny())(SimpleNamespace(num_requests=1, prompt_len=[8], cached=[0]), [4])
    assert seen == {"large": large, "small": 2e11}
