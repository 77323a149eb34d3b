"""bench --contend: the busy loops run while the body runs and are gone after; a batchgen system run again beside
them reports the ratio and whether its tokens changed. No timing assertions: only that the numbers are recorded."""
from __future__ import annotations

import os

import pytest

from bench.contend import contended_ratio, contention
from bench.options import options_from
from bench.run import run_bench
from tests.model_utils import save_tiny, tiny_hf_model


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_busy_loops_live_only_inside_the_block():
    with contention(2) as pids:
        assert len(pids) == 2 and all(_alive(p) for p in pids) and os.getpid() not in pids
    assert not any(_alive(p) for p in pids)
    with contention(0) as none:
        assert none == []


def test_loops_are_killed_when_the_body_raises():
    with pytest.raises(RuntimeError):
        with contention(1) as pids:
            raise RuntimeError("system failed")
    assert not _alive(pids[0])


def test_ratio():
    assert contended_ratio(2.0, 3.0) == 1.5
    assert contended_ratio(None, 3.0) is None and contended_ratio(2.0, None) is None


def test_bench_reports_the_contended_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    save_tiny(tiny_hf_model("llama"), tmp_path / "tiny")
    opts = options_from("shared-prefix", quick=True, model=str(tmp_path / "tiny"), dtype="float32", log=False,
                        systems=("batchgen",), roofline=False, contend=1)
    [res] = run_bench(opts)["systems"]
    extra = res["extra"]
    assert extra["contend"] == 1 and extra["contended_wall_s"] > 0
    assert extra["contention_ratio"] == pytest.approx(extra["contended_wall_s"] / res["wall_s"])
    assert extra["contended_same_tokens"] is True      # greedy, float32, same engine build: contention changes no bit
