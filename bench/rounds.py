"""Rounds of one workload with each system loaded once (``batchgen bench --size-sweep --sweep-rounds R``).

A VM's speed can move 2-4x within minutes. Run one system after another, each loading first, and a peer's rounds
land minutes from ours (vLLM reloads for 50-90 s), so a round's ratio says as much about the minutes as about the
engines. Here every batchgen variant is loaded and warmed once in this process and every venv peer once in its held
runner (``bench.systems.held_peer``); then a warm round runs every system once untimed (vLLM's first run at a
workload's shapes took up to 2x its later ones; batchgen's first does not differ), and each round after times each
system back to back, ours first in even rounds and the peers first (in reverse order, so the first peer always runs
next to ours) in odd ones, each from an empty prefix cache, the machine's speed measured just before each timed run
(``machine_speed``). Systems that cannot be held (transformers, llama.cpp) load inside each round as in a single
run. Each round is a result dict as ``bench.run.run_bench`` returns, so ``bench.sweep.median_result`` takes them as
they are.
"""
from __future__ import annotations

import gc
import time

import torch

from bench.options import BenchOptions, say
from bench.plan_prediction import prediction_line
from bench.result import SystemResult
from bench.run import BenchRun, check_systems, environment
from bench.systems.batchgen import BATCHGEN_VARIANTS, load_batchgen, time_batchgen
from bench.systems.held_peer import HeldPeer
from bench.systems.registry import PEER_SYSTEMS
from bench.workloads import warmup_prompts
from engine.errors import ConfigError
from engine.malloc import release_freed_memory


def run_rounds(opts: BenchOptions, rounds: int) -> list[dict]:
    """``rounds`` interleaved rounds of the workload, each system loaded once; one result dict per round."""
    check_systems(opts)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    base = BenchRun(opts, environment(opts))
    prompts = base.ensure_prompts()
    threads = torch.get_num_threads()
    held = [HeldPeer(n, opts, prompts, warmup_prompts(base.tokenizer), threads)
            for n in PEER_SYSTEMS if n in opts.systems]
    ours: dict[str, tuple | SystemResult] = {}
    try:
        # ours first: loading (and a first-time tuning's candidate formats) peaks well above what an engine keeps, and
        # beside two held 1.5B peers that peak was killed for memory; its freed heap goes back before the peers load
        for name in BATCHGEN_VARIANTS:
            if name in opts.systems:
                try:
                    ours[name] = load_batchgen(opts, name)
                except ConfigError as e:         # a setting this model cannot take
                    ours[name] = SystemResult(system=name, label=name, skipped=str(e))
        gc.collect()
        release_freed_memory()
        for peer in held:                # loaded one at a time, before anything is timed
            peer.start()
        results, warm = [], {}
        for r in range(-1, rounds):         # round -1: every system warm at the workload's shapes, not counted
            run = base.fork(round=r, rounds=rounds, held=True)
            order = [_ours_round, _peers_round] if r % 2 == 0 else [_peers_round, _ours_round]
            for part in order:
                part(run, ours, held)
            if r < 0:
                warm = {res.system: None if res.skipped else round(res.wall_s, 3) for res in run.results}
                continue
            run.env["warm_round_s"] = warm
            run.transformers()
            run.llama_cpp()
            base.model_info = base.model_info or run.model_info
            results.append(run.finish())
        return results
    finally:
        for peer in held:
            peer.close()
        ours.clear()
        gc.collect()
        release_freed_memory()


def _ours_round(run: BenchRun, ours: dict, held: list[HeldPeer]) -> None:
    opts = run.opts
    for name, loaded in ours.items():
        if isinstance(loaded, SystemResult):
            run.add(loaded)
            continue
        llm, warmup_s = loaded
        if not llm.reset_prefix_cache():
            raise RuntimeError(f"{name}: blocks still held after a finished round; its prefix cache cannot be reset")
        speed = machine_speed()
        res = time_batchgen(opts, llm, run.prompts, name, run.roof_for, warmup_s)
        res.extra["machine_gflops_before"] = speed
        run.model_info = run.model_info or llm.info.to_dict()
        say(opts, f"{name}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s ({_label(run)}; machine "
                  f"{speed:.0f} GFLOP/s before)")
        if res.extra.get("predicted_engine_s"):
            say(opts, f"{name}: {prediction_line(res.extra['predicted_engine_s'], res.wall_s)}")
        run.add(res)


def _peers_round(run: BenchRun, ours: dict, held: list[HeldPeer]) -> None:
    # the first peer (vLLM) always next to ours: after it when ours goes first, else last of the peers
    for peer in held if run.env["round"] % 2 == 0 else held[::-1]:
        speed = machine_speed()
        res = peer.run_round(f"{_label(run)}; machine {speed:.0f} GFLOP/s before")
        res.extra["machine_gflops_before"] = speed
        run.add(res)


def machine_speed(n: int = 1024, reps: int = 4) -> float:
    """This machine's speed just before a timed run, in GFLOP/s of a small matmul in the bench's default dtype (bf16;
    ~20 ms): a VM's speed moves within minutes (the AMX units' rate 4x on the Xeon), and a pair of rounds whose probes
    differ widely ran in different conditions. Recorded with each held round's result, never used in a ratio."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def _label(run: BenchRun) -> str:
    r = run.env["round"]
    return "warm round, not counted" if r < 0 else f"round {r + 1} of {run.env['rounds']}, loaded once"


__all__ = ["run_rounds", "machine_speed"]
