"""How close to the limit: byte counts per format (weights and KV apart), the format -> peak / bytes
mapping, the int8 peak as the best of two kernels, and the bench's fractions and table line. Hand-made numbers,
no timing."""
from __future__ import annotations

import pytest

from costmodel import flops
from costmodel.roofline import INT8_KV_BYTES, INT8_WEIGHT_BYTES, Roofline, RunFormat
from tests.test_flops import tiny

WINDOWED = ("sliding_attention", "full_attention")
PER_TOKEN_LAYER = 2 * 1 * 4                               # K+V elements: 1 kv head, head_dim 4
WEIGHT_PARAMS = 2 * 576 + 800                             # tiny's two layers and its LM head


def test_decode_bytes_split_weights_and_kv():
    """Weights at their element size, K/V at the cache's; the old call (one size) is unchanged."""
    cfg = tiny(window=4, layers=WINDOWED)
    kv_elems = PER_TOKEN_LAYER * (4 + 10) + PER_TOKEN_LAYER * 2      # context 10: reads 4 + 10, writes 1 per layer
    assert flops.decode_step_bytes(cfg, [10], 2) == WEIGHT_PARAMS * 2 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 2, None) == WEIGHT_PARAMS * 2 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 1.25, 2) == WEIGHT_PARAMS * 1.25 + kv_elems * 2
    assert flops.decode_step_bytes(cfg, [10], 4, 1.125) == WEIGHT_PARAMS * 4 + kv_elems * 1.125
    assert flops.decode_step_kv_bytes(cfg, [10, 3], 2) == 2 * (PER_TOKEN_LAYER * (4 + 10 + 3 + 3)
                                                               + 2 * PER_TOKEN_LAYER * 2)
    assert flops.decode_step_bytes(cfg, [], 1.25, 2) == 0
    assert isinstance(flops.kv_read_bytes(cfg, 10, 2), int)                 # whole-byte sizes stay ints


def test_format_maps_to_its_peak_and_bytes():
    """int8 weights + bf16 KV: the int8 peak, 1.0625 bytes per weight (int8, its per-32 fp16 scale), 2 per KV element;
    a float format: its own dtype for all three; an int8 KV cache: 1.125 (int8 and a per-32 float32 scale)."""
    info = {"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "bfloat16"}}
    q8 = RunFormat.of(info)
    assert (q8.calibration_dtype, q8.weight_bytes_per_param, q8.kv_bytes) == ("int8", INT8_WEIGHT_BYTES, 2)
    assert q8.label == "int8/float32/kv-bfloat16" and INT8_WEIGHT_BYTES == 1.0625
    bf = RunFormat.of({"quantization": "none", "dtype": "bfloat16", "config": {}})
    assert (bf.calibration_dtype, bf.weight_bytes_per_param, bf.kv_bytes, bf.label) == \
        ("bfloat16", 2, 2, "bfloat16/bfloat16/kv-bfloat16")
    f32 = RunFormat.of({"quantization": "none", "dtype": "float32", "config": {"kv_cache_dtype": "auto"}})
    assert (f32.calibration_dtype, f32.weight_bytes_per_param, f32.kv_bytes) == ("float32", 4, 4)
    held = RunFormat.of({"quantization": "none", "dtype": "float32", "config": {"kv_cache_dtype": "float32"},
                         "bf16_held_weights": True})         # float32 math over weights held as bf16: 2 bytes each
    assert (held.calibration_dtype, held.weight_bytes_per_param, held.kv_bytes, held.label) == \
        ("float32", 2, 4, "bf16-held/float32/kv-float32")
    q8kv = RunFormat.of({"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "int8"}})
    assert q8kv.kv_bytes == INT8_KV_BYTES == 1.125
    amx = RunFormat.of({**info, "config": {"kv_cache_dtype": "bfloat16", "kernels": {"int8_prompts": "bf16"}}})
    assert (amx.calibration_dtype, amx.weight_bytes_per_param) == ("bfloat16", INT8_WEIGHT_BYTES)  # prompts on AMX bf16

    cfg = tiny(window=4, layers=WINDOWED)
    roof = Roofline.for_format(cfg, q8, cal=None)
    assert (roof.dtype_bytes, roof.kv_bytes) == (1.0625, 2)
    assert roof.decode_bytes([10]) == WEIGHT_PARAMS * 1.0625 + 2 * (PER_TOKEN_LAYER * (4 + 10) + PER_TOKEN_LAYER * 2)
    assert Roofline.of_format(cfg, 4, 1.125, None).decode_bytes([10]) == flops.decode_step_bytes(cfg, [10], 4, 1.125)
    assert Roofline(cfg, 2, None).kv_bytes == 2                           # the old constructor: KV as the weights


# ---- the int8 peak: the best of our kernel and torch._int_mm -------------------------------------------------
def _fake_measures(monkeypatch, ours, int_mm):
    """The two int8 measurements and the bandwidth replaced by fixed numbers (FLOP/s by M; None: unsupported)."""
    from costmodel import calibrate as C
    monkeypatch.setattr(C, "_int8_flops", lambda dev, m, k, n, reps: ours(m))
    monkeypatch.setattr(C, "_int_mm_flops", lambda dev, m, k, n, reps: int_mm(m))
    monkeypatch.setattr(C, "_bandwidth", lambda dev, nbytes, reps: (20e9, 30e9))
    return C


def test_int8_peak_is_the_best_of_both_kernels(monkeypatch):
    C = _fake_measures(monkeypatch, ours=lambda m: 300e9 if m > 16 else 40e9, int_mm=lambda m: 500e9 if m > 16
                       else 30e9)
    cal = C.calibrate("cpu", "int8", quick=True, save=False)
    assert cal.matmul_flops == 500e9 and cal.peak_kernel == "torch._int_mm"
    assert cal.small_m_flops == 40e9                                      # per measurement, the better kernel
    assert cal.matmul_by_shape == {"512x640x2048": 500e9} and cal.memory_bandwidth == 20e9
    assert cal.kernel_flops == {"q8_linear": {"matmul_flops": 300e9, "small_m_flops": 40e9,
                                              "by_shape": {"512x640x2048": 300e9}},
                                "torch._int_mm": {"matmul_flops": 500e9, "small_m_flops": 30e9,
                                                  "by_shape": {"512x640x2048": 500e9}}}
    assert C.Calibration.from_dict(cal.to_dict()) == cal


def test_int8_peak_without_int_mm_is_our_kernels(monkeypatch):
    C = _fake_measures(monkeypatch, ours=lambda m: 300e9, int_mm=lambda m: None)     # torch._int_mm unsupported
    cal = C.calibrate("cpu", "int8", quick=True, save=False)
    assert (cal.matmul_flops, cal.peak_kernel, list(cal.kernel_flops)) == (300e9, "q8_linear", ["q8_linear"])


def test_bf16_records_the_amx_prompt_kernel_beside_torchs_peak(monkeypatch, tmp_path):
    """The bfloat16 calibration times q8_linear_amx where it runs and records it, but the peak stays torch's (even
    where ours is faster); a cached bfloat16 calibration without it is measured again where it runs, as quick or
    full as it was; where it cannot run, a cached one is kept."""
    from costmodel import calibrate as C
    monkeypatch.setattr(C, "_matmul_flops", lambda dev, m, k, n, reps, dtype: 2e12 if m > 16 else 3e11)
    monkeypatch.setattr(C, "_bandwidth", lambda dev, nbytes, reps: (20e9, 30e9))
    amx_ok = {"on": True}
    monkeypatch.setattr(C, "_amx_prompts", lambda dev: amx_ok["on"])
    monkeypatch.setattr(C, "_amx_prompt_flops", lambda dev, m, k, n, reps: (2.5e12 if m > 16 else 4e11)
                        if amx_ok["on"] else None)
    cal = C.calibrate("cpu", "bfloat16", quick=True, save=False)
    assert (cal.matmul_flops, cal.peak_kernel, cal.small_m_flops) == (2e12, "torch.matmul", 3e11)
    assert cal.matmul_by_shape == {"512x640x2048": 2e12}
    assert cal.kernel_flops["q8_linear_amx"] == {"matmul_flops": 2.5e12, "small_m_flops": 4e11,
                                                 "by_shape": {"512x640x2048": 2.5e12}}
    old = C.Calibration(**{**C.Calibration.from_dict(cal.to_dict()).__dict__,
                           "kernel_flops": {"torch.matmul": cal.kernel_flops["torch.matmul"]}})
    C.save_calibration(old, tmp_path)
    amx_ok["on"] = False                                    # not here: the cached one is used as it is
    assert C.get_calibration("cpu", "bfloat16", cache_dir=tmp_path, quick=True) == old
    amx_ok["on"] = True                                     # here: measured again, quick as the cached one was
    again = C.get_calibration("cpu", "bfloat16", cache_dir=tmp_path, quick=True)
    assert "q8_linear_amx" in again.kernel_flops and again.quick
    assert C.load_calibration("cpu", "bfloat16", tmp_path) == again


def test_old_cached_calibrations_still_load():
    from costmodel.calibrate import Calibration
    old = {"device": "cpu-2t", "device_name": "cpu", "dtype": "int8", "matmul_flops": 1e11, "memory_bandwidth": 2e10,
           "copy_bandwidth": 3e10, "small_m_flops": 1e10, "matmul_by_shape": {"512x640x2048": 1e11}}
    cal = Calibration.from_dict(old)
    assert cal.kernel_flops == {} and cal.peak_kernel == ""


def test_cli_calibrate_all_formats(monkeypatch, tmp_path):
    """--all-formats measures int8, bfloat16 and float32 (here: fake calibrations); --dtype with it is an error."""
    from click.testing import CliRunner

    from batchgen.report_cmd import calibrate_cmd
    from costmodel import calibrate as C
    asked = []

    def fake(device, dtype, quick=False, cache_dir=None, save=True):
        asked.append(dtype)
        kernels = {"q8_linear": {"matmul_flops": 3e11, "small_m_flops": 4e10, "by_shape": {}},
                   "torch._int_mm": {"matmul_flops": 5e11, "small_m_flops": 3e10, "by_shape": {}}}
        return C.Calibration("cpu-2t", "cpu (2 threads)", dtype, 5e11, 2e10, 3e10, 4e10, {"512x640x2048": 5e11},
                             kernels if dtype == "int8" else {}, "torch._int_mm" if dtype == "int8" else "")
    monkeypatch.setattr(C, "calibrate", fake)
    res = CliRunner().invoke(calibrate_cmd, ["--all-formats", "--quick", "--device", "cpu", "--cache-dir",
                                             str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert asked == ["int8", "bfloat16", "float32"]
    assert "matmul peak:       500.0 GOP/s (torch._int_mm)" in res.output
    assert "         q8_linear: 300.0 GOP/s, 40.0 at M=16" in res.output
    assert "matmul peak:       500.0 GFLOP/s\n" in res.output                 # the float formats: one kernel
    bad = CliRunner().invoke(calibrate_cmd, ["--all-formats", "--dtype", "int8", "--device", "cpu"])
    assert bad.exit_code == 2 and "--all-formats" in bad.output


# ---- the bench's fractions -------------------------------------------------------------------------------------
def _request(prompt_len: int, cached: int, token_times: list[float]):
    from types import SimpleNamespace
    return SimpleNamespace(prompt_token_ids=[1] * prompt_len, num_cached_tokens=cached,
                           metrics=SimpleNamespace(token_times=token_times))


def _step(i: int, start: float, end: float, prefill: int, decode_seqs: int):
    from engine.outputs import StepStats
    return StepStats(step=i, start_time=start, end_time=end, num_prefill_tokens=prefill, num_decode_tokens=decode_seqs,
                     num_prefill_seqs=2 if prefill else 0, num_decode_seqs=decode_seqs, num_running=2, num_waiting=0,
                     kv_blocks_used=1, kv_blocks_total=8, prefix_cache_queries=0, prefix_cache_hits=0,
                     num_preemptions=0, num_sampled=max(decode_seqs, 2 if prefill else 0))


def _hand_run():
    """Two prompts of 6 tokens (the second with 2 cached) prefilled in 1 s; a 2-row decode step (0.5 s), then two
    1-row ones (0.25 s each), on the windowed tiny model in int8 weights + bf16 KV."""
    outs = [_request(6, 0, [0.9, 1.2, 1.6, 1.9]), _request(6, 2, [0.9, 1.2])]
    steps = [_step(0, 0.0, 1.0, 10, 0), _step(1, 1.0, 1.5, 0, 2), _step(2, 1.5, 1.75, 0, 1),
             _step(3, 1.75, 2.0, 0, 1)]
    fmt = RunFormat.of({"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "bfloat16"}})
    cal = {"matmul_flops": 57088.0, "memory_bandwidth": 14204.0, "peak_kernel": "torch._int_mm", "quick": False}
    return outs, steps, fmt, Roofline.for_format(tiny(window=4, layers=WINDOWED), fmt, cal)


def test_fractions_arithmetic_on_hand_made_steps():
    """Prefill FLOPs (per token 2 x 1152 linear + 32 per attended key; LM head 1600 per sampled row):
    16672 + 11872 = 28544 in 1 s, of a 57088 peak: 50 %. Decode-only bytes (weights 1952 x 1.0625 = 2074; a context
    c reads min(c, 4) + c bf16 tokens of 16 bytes and writes 2 x 16): 2490 + 2298 + 2314 = 7102 in 1 s of 14204
    B/s: 50 %; 1-row steps 4612 in 0.5 s: 9224 B/s, 9224 / 14204."""
    from bench.result import SystemResult
    from bench.systems.batchgen import _batchgen_roofline, stage_sums, step_contexts
    outs, steps, fmt, roof = _hand_run()
    assert step_contexts(outs, steps) == {1: [7, 7], 2: [8], 3: [9]}
    sums = stage_sums(outs, steps, roof)
    assert sums == {"prefill_flops": 28544, "prefill_s": 1.0, "decode_bytes": 7102.0, "decode_s": 1.0,
                    "decode1_bytes": 4612.0, "decode1_s": 0.5, "decode1_steps": 2,
                    "flops": 28544 + 8512 + 4288 + 4320}
    res = SystemResult("batchgen-int8-bf16kv", "batchgen-int8-bf16kv", wall_s=2.0)
    _batchgen_roofline(res, outs, steps, roof, fmt)
    assert res.prefill_peak_fraction == res.prefill_mfu == 0.5
    assert res.decode_bound_fraction == res.decode_mbu == 0.5
    assert res.decode1_bound_fraction == pytest.approx(9224 / 14204, rel=1e-12)
    assert res.mfu == pytest.approx(45664 / 2.0 / 57088, rel=1e-12)
    assert res.limits == {"format": "int8/float32/kv-bfloat16", "calibration_dtype": "int8", "matmul_flops": 57088.0,
                          "memory_bandwidth": 14204.0, "peak_kernel": "torch._int_mm", "quick": False,
                          "prefill_flops_per_s": 28544.0, "decode_bytes_per_s": 7102.0,
                          "decode1_bytes_per_s": 9224.0, "decode1_steps": 2}


def test_fractions_are_none_without_a_calibration_or_steps():
    from bench.result import SystemResult
    from bench.systems.batchgen import _batchgen_roofline
    outs, steps, fmt, roof = _hand_run()
    res = SystemResult("batchgen", "batchgen", wall_s=2.0)
    _batchgen_roofline(res, outs, steps, Roofline.for_format(roof.mcfg, fmt, None), fmt)
    assert (res.prefill_peak_fraction, res.decode_bound_fraction, res.decode1_bound_fraction) == (None, None, None)
    assert res.limits["matmul_flops"] is None and res.limits["prefill_flops_per_s"] == 28544.0
    res = SystemResult("batchgen", "batchgen", wall_s=2.0)
    _batchgen_roofline(res, outs, steps[:2], roof, fmt)                    # no 1-row decode-only step
    assert res.decode1_bound_fraction is None and res.limits["decode1_steps"] == 0


def _system(label: str, limits=None, fractions=(None, None, None), fmt=None) -> dict:
    return {"label": label, "system": label, "skipped": None, "extra": {"format": fmt} if fmt else {},
            "limits": limits, "prefill_peak_fraction": fractions[0], "decode_bound_fraction": fractions[1],
            "decode1_bound_fraction": fractions[2]}


def test_table_line():
    from bench.table import _limit_lines, limit_line
    lim = {"format": "int8/float32/kv-bfloat16", "calibration_dtype": "int8", "matmul_flops": 517e9,
           "memory_bandwidth": 20e9, "peak_kernel": "torch._int_mm", "quick": False, "prefill_flops_per_s": 212e9,
           "decode_bytes_per_s": 11e9, "decode1_bytes_per_s": 12.6e9, "decode1_steps": 40}
    q8 = _system("batchgen-default", lim, (0.41, 0.55, 0.63))
    assert limit_line(q8) == ("batchgen-default (int8/float32/kv-bfloat16): prefill 41% of the int8 peak (212 of 517 "
                              "GOP/s, torch._int_mm); decode at 1 row 63% of the bandwidth bound (12.6 of 20 GB/s, "
                              "40 steps); all decode-only steps 55%")
    f32 = _system("batchgen", {**lim, "format": "float32/float32/kv-float32", "calibration_dtype": "float32",
                               "peak_kernel": "torch.matmul", "decode1_steps": 0}, (0.3, 0.5, None))
    assert limit_line(f32) == ("batchgen (float32/float32/kv-float32): prefill 30% of the float32 peak (212 of 517 "
                               "GFLOP/s, torch.matmul); decode at 1 row n/a (no 1-row decode-only steps); all "
                               "decode-only steps 50%")
    nocal = _system("batchgen-int8", {**lim, "matmul_flops": None})
    assert limit_line(nocal) == "batchgen-int8 (int8/float32/kv-bfloat16): n/a (no calibration)"
    noroof = _system("batchgen-nocache", fmt="float32/float32/kv-float32")          # --no-roofline
    assert limit_line(noroof) == "batchgen-nocache (float32/float32/kv-float32): n/a (no calibration)"
    old = _system("batchgen-int8", {**lim, "peak_kernel": None}, (0.41, 0.55, 0.63))   # cached before _int_mm
    assert "(212 of 517 GOP/s, q8_linear only: recalibrate with `batchgen calibrate --dtype int8`)" in limit_line(old)
    lines = _limit_lines([q8, _system("vllm"), {**_system("openvino"), "skipped": "not set up"}])
    assert lines[2:] == [limit_line(q8), "vllm: n/a (no step stats)"]
    assert _limit_lines([_system("vllm")]) == []                   # no batchgen system: no section


def test_calibration_lines_name_each_formats_peak():
    from bench.table import _calibration_lines
    f32 = {"device": "cpu-2t", "matmul_flops": 100e9, "memory_bandwidth": 20e9, "quick": True,
           "peak_kernel": "torch.matmul", "kernel_flops": {"torch.matmul": 100e9}}
    q8 = {**f32, "matmul_flops": 517e9, "peak_kernel": "torch._int_mm",
          "kernel_flops": {"q8_linear": 300e9, "torch._int_mm": 517e9}}
    env = {"dtype": "float32", "calibration": f32, "calibrations": {"float32": f32}}
    assert len(_calibration_lines(env)) == 1                          # only the bench's dtype: as before
    lines = _calibration_lines({**env, "calibrations": {"float32": f32, "int8": q8}})
    assert lines[1] == ("peaks per format: float32 100 GFLOP/s (torch.matmul) (quick); "
                        "int8 517 GOP/s (torch._int_mm; q8_linear 300) (quick)")
