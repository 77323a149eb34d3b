"""costmodel.calibrate: quick calibration gives positive, plausible numbers and round-trips through the cache."""
from __future__ import annotations

import json

from costmodel import calibrate as cal_mod
from engine.dtype_policy import choose_dtype


def test_quick_calibration_is_plausible_and_cached(tmp_path):
    """At the dtype the engine would choose here (bf16 is ~0.5 GFLOP/s on AVX2-only CPUs, never chosen there)."""
    dtype = choose_dtype("auto", "cpu").dtype
    cal = cal_mod.calibrate("cpu", dtype, quick=True, cache_dir=tmp_path)
    assert 1e9 < cal.matmul_flops < 1e16                # 1 GFLOP/s .. 10 PFLOP/s
    assert 1e8 < cal.memory_bandwidth < 1e13            # 100 MB/s .. 10 TB/s
    assert cal.copy_bandwidth > 0 and cal.small_m_flops > 0
    assert cal.matmul_flops == max(cal.matmul_by_shape.values())
    assert cal.ridge_point > 0
    assert cal.quick and cal.dtype == dtype and cal.device.startswith("cpu-")

    path = cal_mod.cache_path("cpu", dtype, tmp_path)
    assert path.is_file() and path.name == f"calibration-{cal.device}-{dtype}.json"
    assert cal_mod.load_calibration("cpu", dtype, tmp_path) == cal


def test_load_calibration_missing_or_corrupt(tmp_path):
    assert cal_mod.load_calibration("cpu", "float32", tmp_path) is None
    path = cal_mod.cache_path("cpu", "float32", tmp_path)
    path.write_text("{not json")
    assert cal_mod.load_calibration("cpu", "float32", tmp_path) is None
    path.write_text(json.dumps({"device": "cpu-2t"}))   # missing fields
    assert cal_mod.load_calibration("cpu", "float32", tmp_path) is None


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    assert cal_mod.cache_path("cpu", "bfloat16").parent == tmp_path


def test_a_quick_calibration_never_stands_in_for_a_full_one(tmp_path, monkeypatch):
    """get_calibration: a cached quick calibration serves quick callers; a full caller measures (and caches) the full
    one, which then serves both."""
    quick = cal_mod.calibrate("cpu", "float32", quick=True, cache_dir=tmp_path)
    assert cal_mod.get_calibration("cpu", "float32", tmp_path, quick=True) == quick
    calls = []
    full = cal_mod.Calibration.from_dict({**quick.to_dict(), "quick": False, "matmul_flops": 2 * quick.matmul_flops})
    monkeypatch.setattr(cal_mod, "calibrate",
                        lambda device, dtype, quick=False, cache_dir=None: calls.append(quick) or
                        (cal_mod.save_calibration(full, cache_dir), full)[1])
    assert cal_mod.get_calibration("cpu", "float32", tmp_path) == full and calls == [False]
    assert cal_mod.get_calibration("cpu", "float32", tmp_path) == full and calls == [False]
    assert cal_mod.get_calibration("cpu", "float32", tmp_path, quick=True) == full


def test_our_kernels_are_timed_again_when_their_build_changes(tmp_path, monkeypatch):
    """A cached calibration that timed our own kernels (the AMX prompt rows: ``SIDE_KERNELS``) in another build of the
    kernel library than the one that runs now is measured again (a faster kernel priced at its old rate mispredicts
    the plan); one from this build, or one that timed none of ours, is served as cached."""
    base = cal_mod.calibrate("cpu", "float32", quick=True, cache_dir=tmp_path, save=False).to_dict()
    ours = {cal_mod.AMX_PROMPT_KERNEL: {"matmul_flops": 1e12, "small_m_flops": 1e11, "by_shape": {}}}
    monkeypatch.setattr(cal_mod, "_kernel_build", lambda: "build-B")
    monkeypatch.setattr(cal_mod, "_amx_prompts", lambda dev: True)
    fresh = cal_mod.Calibration.from_dict({**base, "dtype": "bfloat16", "kernel_flops": ours,
                                           "kernel_build": "build-B"})
    calls = []
    monkeypatch.setattr(cal_mod, "calibrate",
                        lambda device, dtype, quick=False, cache_dir=None: calls.append(dtype) or
                        (cal_mod.save_calibration(fresh, cache_dir), fresh)[1])
    for build, remeasured in (("build-A", True), ("build-B", False)):
        calls.clear()
        old = cal_mod.Calibration.from_dict({**fresh.to_dict(), "kernel_build": build})
        cal_mod.save_calibration(old, tmp_path)
        assert cal_mod.get_calibration("cpu", "bfloat16", tmp_path, quick=True) == (fresh if remeasured else old)
        assert calls == (["bfloat16"] if remeasured else [])
    calls.clear()
    theirs = cal_mod.Calibration.from_dict({**base, "kernel_build": ""})      # torch's kernels only: no build
    cal_mod.save_calibration(theirs, tmp_path)
    assert cal_mod.get_calibration("cpu", "float32", tmp_path, quick=True) == theirs and calls == []
