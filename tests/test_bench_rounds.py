"""Interleaved rounds with every system loaded once (bench/rounds.py, bench/systems/held_peer.py, the runners' held
mode in bench/peers/held.py), through the fake peer venvs of test_bench_peers: one load per system however many
rounds, ours and the peers alternating first, each round from an empty prefix cache, a peer that fails reported
in every round it missed, and the round-by-round ratios. No timing assertions."""
from __future__ import annotations

import json

import pytest

from bench.rounds import run_rounds
from bench.sweep import SweepShape, format_sweep, median_result, round_ratios, run_sweep, sweep_row
from tests.test_bench_peers import _calls, _opts, peers  # noqa: F401  (peers: the fake venvs' fixture)


def _rows(result: dict) -> dict:
    return {s["system"]: s for s in result["systems"]}


def test_each_system_loads_once_and_the_rounds_interleave(peers, tiny_llama_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_PEER_ROUNDS", json.dumps([9.0, 3.0, 1.0, 2.0]))     # a warm round first
    opts = _opts(tiny_llama_dir, ("batchgen", "vllm", "openvino"))
    results = run_rounds(opts, 3)
    assert len(results) == 3
    # one runner process per peer (its dtype probes aside), answering the warm round and three more, then ended
    for venv in ("vllm", "openvino"):
        assert len([c for c in _calls(peers, venv) if not c["probe"]]) == 1
        assert (peers / venv / "held_rounds.txt").read_text().split() == ["4"]
    # ours first in even rounds, the peers first in odd ones, in reverse
    assert [s["system"] for s in results[0]["systems"]] == ["batchgen", "vllm", "openvino"]
    assert [s["system"] for s in results[1]["systems"]] == ["openvino", "vllm", "batchgen"]   # vllm next to ours
    assert [_rows(r)["vllm"]["wall_s"] for r in results] == [3.0, 1.0, 2.0]
    assert [_rows(r)["vllm"]["extra"]["held_round"] for r in results] == [1, 2, 3]
    assert [r["env"]["round"] for r in results] == [0, 1, 2] and all(r["env"]["held"] for r in results)
    assert results[0]["env"]["warm_round_s"]["vllm"] == 9.0 and results[0]["env"]["warm_round_s"]["batchgen"] > 0
    # the machine's speed just before each timed run, kept with it
    assert all(s["extra"]["machine_gflops_before"] > 0 for r in results for s in r["systems"])
    ours = [_rows(r)["batchgen"] for r in results]
    assert all(not s["skipped"] for r in results for s in r["systems"])
    # the same prefix hits every round: the cache emptied before each, not carried over
    assert ours[0]["cached_tokens"] > 0
    assert [s["cached_tokens"] for s in ours] == [ours[0]["cached_tokens"]] * 3


def test_a_held_peer_that_fails_is_a_skipped_row_in_every_round_it_missed(peers, tiny_llama_dir,  # noqa: F811
                                                                          monkeypatch):
    monkeypatch.setenv("FAKE_PEER_DIE_AT", "2")         # the warm round and the first counted one, then gone
    results = run_rounds(_opts(tiny_llama_dir, ("batchgen", "vllm")), 3)
    vllm = [_rows(r)["vllm"] for r in results]
    assert not vllm[0]["skipped"] and vllm[0]["wall_s"] == 2.0
    assert all(v["skipped"].startswith("failed (exit 5, log ") for v in vllm[1:])
    assert all(not _rows(r)["batchgen"]["skipped"] for r in results)      # ours goes on

    monkeypatch.setenv("FAKE_PEER_FAIL", "1")           # fails before it is ready: every round says so
    results = run_rounds(_opts(tiny_llama_dir, ("batchgen", "vllm")), 2)
    assert all("no kernel for this CPU" in _rows(r)["vllm"]["skipped"] for r in results)


def test_a_peer_that_would_not_fit_beside_the_systems_loaded_is_not_held(peers, tiny_llama_dir,  # noqa: F811
                                                                          monkeypatch):
    """Its weights and 4 GiB of KV cache beyond 90 % of the memory left: no runner started, a skipped row saying
    why in every round; ours goes on (Llama-3.1-8B: ours 9 GB beside vLLM's 16 GB of bf16 on a 24 GB machine)."""
    import engine.memory
    monkeypatch.setattr(engine.memory, "available_memory_bytes", lambda: 3 << 30)
    results = run_rounds(_opts(tiny_llama_dir, ("batchgen", "vllm")), 2)
    vllm = [_rows(r)["vllm"] for r in results]
    assert all(v["skipped"].startswith("not held: its weights in ") and "4 GiB KV cache" in v["skipped"]
               and "3.0 GiB available" in v["skipped"] and "--systems vllm" in v["skipped"] for v in vllm)
    assert [c for c in _calls(peers, "vllm") if not c["probe"]] == []
    assert all(not _rows(r)["batchgen"]["skipped"] for r in results)


def test_round_ratios_pair_the_rounds_in_order():
    def result(ours, vllm, probes=(900.0, 900.0)):
        return {"systems": [{"system": "batchgen", "wall_s": ours, "skipped": None, "label": "batchgen",
                             "extra": {"machine_gflops_before": probes[0]}},
                            {"system": "vllm", "wall_s": vllm, "skipped": None if vllm else "failed",
                             "label": "vllm", "extra": {"machine_gflops_before": probes[1]}}]}

    # the second round's two runs saw the machine at 900 and 600 GFLOP/s: marked
    merged = median_result([result(4.0, 6.0), result(2.0, 5.0, (900.0, 600.0)), result(5.0, None)])
    by = {s["system"]: s for s in merged["systems"]}
    assert by["batchgen"]["wall_s"] == 4.0 and by["batchgen"]["rounds_s"] == [4.0, 2.0, 5.0]
    assert by["vllm"]["wall_s"] == 5.0 and by["vllm"]["rounds_s"] == [6.0, 5.0, None]
    assert round_ratios(by["batchgen"], by) == {"vllm": [1.5, 2.5]}
    shape = SweepShape("s", "shared-prefix", dict(n=2, groups=1, prefix_tokens=8, doc_tokens=8, output_tokens=2),
                       ("batchgen", "vllm"))
    row = sweep_row(shape, shape.sizes, merged, 1.0)
    # the headline ratio: the median of the paired rounds' (not the medians' ratio, 5.0 / 4.0)
    assert row["ratios"] == {"vllm": 2.0} and row["round_ratios"] == {"vllm": [1.5, 2.5]}
    table = format_sweep("m", "cpu", [row])
    assert "- s, vllm / ours: 1.50, 2.50*\n" in table
    assert "- s, the machine just before ours (bf16 matmul GFLOP/s): 900, 900, 900 (* a pair whose" in table


def test_a_sweep_with_rounds_holds_its_systems(peers, tiny_llama_dir, monkeypatch):  # noqa: F811
    import dataclasses
    shape = SweepShape("cache off", "shared-prefix", dict(n=4, groups=2, prefix_tokens=32, doc_tokens=8,
                                                          output_tokens=3), ("batchgen-nocache", "vllm-nocache"),
                       repeats=2)
    opts = dataclasses.replace(_opts(tiny_llama_dir, ()), quick=False)
    rows = run_sweep(opts, 0.5e9, shapes=(shape,), peers=("vllm-nocache",))
    row = rows[0]
    assert row["systems"]["vllm-nocache"]["runs_s"] == [2.0, 2.0]
    assert len(row["systems"]["vllm-nocache"]["rounds_machine_gflops"]) == 2
    assert "- cache off, the machine just before ours (bf16 matmul GFLOP/s): " in format_sweep("m", "cpu", rows)
    assert len(row["round_ratios"]["vllm-nocache"]) == 2
    assert (peers / "vllm" / "held_rounds.txt").read_text().split() == ["3"]       # vllm-nocache: vLLM's venv
    assert len([c for c in _calls(peers) if not c["probe"]]) == 1


@pytest.mark.parametrize("bad", ["stop", ""])
def test_the_held_protocol_stops_on_anything_but_go(tmp_path, monkeypatch, bad):
    import io
    import sys

    sys.path.insert(0, str(__import__("bench.systems.peer", fromlist=["RUNNERS"]).RUNNERS))
    try:
        from held import serve_rounds
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"go\ngo\n{bad}\ngo\n"))
    seen = []
    n = serve_rounds(str(tmp_path / "r.json"), {"load_s": 1}, lambda: seen.append(1) or {"k": len(seen)})
    assert n == 2 and json.loads((tmp_path / "r.json.1").read_text()) == {"k": 2}
    assert json.loads((tmp_path / "r.json.ready").read_text()) == {"load_s": 1}
    assert not (tmp_path / "r.json.2").exists() and not list(tmp_path.glob("*.tmp"))


def test_a_single_run_warms_the_workload_first(tmp_path):
    """The runners' one-shot answer: with warm_workload, one untimed run before the timed one (its seconds kept)."""
    import sys
    sys.path.insert(0, str(__import__("bench.systems.peer", fromlist=["RUNNERS"]).RUNNERS))
    try:
        from held import answer
    finally:
        sys.path.pop(0)
    runs = []
    answer({"warm_workload": True}, str(tmp_path / "r.json"), {}, lambda: runs.append(1) or {"n": len(runs)})
    out = json.loads((tmp_path / "r.json").read_text())
    assert len(runs) == 2 and out["n"] == 2 and out["warm_workload_s"] >= 0
    answer({}, str(tmp_path / "s.json"), {}, lambda: runs.append(1) or {"n": len(runs)})
    assert json.loads((tmp_path / "s.json").read_text()) == {"n": 3, "warm_workload_s": None}
