"""How close to the limit (issue 39): byte counts per format (weights and KV apart), the format -> peak / bytes
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
    """int8 weights + bf16 KV: the int8 peak, 1.25 bytes per weight (int8 and its per-32 scales), 2 per KV element;
    a float format: its own dtype for all three; an int8 KV cache: 1.125 (int8 and a per-32 float32 scale)."""
    info = {"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "bfloat16"}}
    q8 = RunFormat.of(info)
    assert (q8.calibration_dtype, q8.weight_bytes_per_param, q8.kv_bytes) == ("int8", INT8_WEIGHT_BYTES, 2)
    assert q8.label == "int8/float32/kv-bfloat16" and INT8_WEIGHT_BYTES == 1.25
    bf = RunFormat.of({"quantization": "none", "dtype": "bfloat16", "config": {}})
    assert (bf.calibration_dtype, bf.weight_bytes_per_param, bf.kv_bytes, bf.label) == \
        ("bfloat16", 2, 2, "bfloat16/bfloat16/kv-bfloat16")
    f32 = RunFormat.of({"quantization": "none", "dtype": "float32", "config": {"kv_cache_dtype": "auto"}})
    assert (f32.calibration_dtype, f32.weight_bytes_per_param, f32.kv_bytes) == ("float32", 4, 4)
    q8kv = RunFormat.of({"quantization": "int8", "dtype": "float32", "config": {"kv_cache_dtype": "int8"}})
    assert q8kv.kv_bytes == INT8_KV_BYTES == 1.125

    cfg = tiny(window=4, layers=WINDOWED)
    roof = Roofline.for_format(cfg, q8, cal=None)
    assert (roof.dtype_bytes, roof.kv_bytes) == (1.25, 2)
    assert roof.decode_bytes([10]) == WEIGHT_PARAMS * 1.25 + 2 * (PER_TOKEN_LAYER * (4 + 10) + PER_TOKEN_LAYER * 2)
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
