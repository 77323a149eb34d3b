"""``batchgen bench --model NAME --size-sweep``: every shape of the sweep on one model, batchgen's defaults and each
peer at its best side by side in each, as one table of same-run ratios.

The shapes are sized for the model so that one system takes roughly one to three minutes on 2 cores: the
prefill-heavy shapes scale their document count with the model's parameters (``SWEEP_REFERENCE_PARAMS`` is the size
they are written for), the decode shapes keep theirs (a step's cost grows with the model, the step count does not).
The decode shapes are short (seconds), and a VM's memory bandwidth drifts by ±15-25 % over minutes: they run
``repeats`` rounds (every system once a round, so the systems interleave) and each system's median counts.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

from bench.options import BenchOptions, say
from bench.plan_prediction import percent_over
from bench.systems.registry import PEER_SYSTEMS
from bench.table import limit_line
from bench.workloads import make_workload

SWEEP_REFERENCE_PARAMS = 0.5e9


@dataclass(frozen=True)
class SweepShape:
    label: str
    shape: str                        # a bench.workloads shape
    sizes: dict                       # at SWEEP_REFERENCE_PARAMS
    systems: tuple[str, ...]          # batchgen's first: the ratios are against it
    scale_n: bool = True              # fewer documents for a larger model
    repeats: int = 1                  # rounds; each system's median round counts (median_result)


# llama.cpp runs in this process (a skipped row when llama-cpp-python is not installed); the venv peers are left
# out of the shapes when they are not set up (batchgen/bench_cmd.py says so)
_CACHE_ON = ("batchgen-default", "batchgen-int8", "vllm", "openvino", "llama.cpp")
_CACHE_OFF = ("batchgen-default-nocache", "vllm-nocache")
SWEEP = (
    SweepShape("shared-prefix", "shared-prefix",
               dict(n=8, groups=2, prefix_tokens=1500, doc_tokens=400, output_tokens=64), _CACHE_ON),
    SweepShape("shared-prefix cache off", "shared-prefix",
               dict(n=8, groups=2, prefix_tokens=1500, doc_tokens=400, output_tokens=64), _CACHE_OFF),
    SweepShape("long-prompt", "long-prompt",
               dict(n=4, groups=4, prefix_tokens=0, doc_tokens=2000, output_tokens=16), _CACHE_ON),
    SweepShape("long-output", "long-output",
               dict(n=4, groups=4, prefix_tokens=0, doc_tokens=300, output_tokens=256), _CACHE_ON, scale_n=False),
    SweepShape("decode 1 row", "short-prompt",
               dict(n=1, groups=1, prefix_tokens=0, doc_tokens=64, output_tokens=128), _CACHE_ON, scale_n=False,
               repeats=3),
    SweepShape("decode 8 rows", "short-prompt",
               dict(n=8, groups=8, prefix_tokens=0, doc_tokens=64, output_tokens=128), _CACHE_ON, scale_n=False,
               repeats=3),
    SweepShape("decode 48 rows", "short-prompt",
               dict(n=48, groups=48, prefix_tokens=0, doc_tokens=64, output_tokens=64), _CACHE_ON, scale_n=False,
               repeats=3),
)


def sized(s: SweepShape, params: float, quick: bool = False) -> dict:
    """The shape's sizes for a model of ``params`` parameters (``quick``: a smoke run of a few tokens)."""
    sizes = dict(s.sizes)
    if s.scale_n and sizes["groups"] < sizes["n"]:   # a shared prefix: some group keeps two documents (4B, 8B)
        sizes["n"] = max(2, round(sizes["n"] * SWEEP_REFERENCE_PARAMS / params))
        sizes["groups"] = max(1, min(sizes["groups"], sizes["n"] - 1))
    elif s.scale_n:
        sizes["n"] = max(sizes["groups"], round(sizes["n"] * SWEEP_REFERENCE_PARAMS / params))
    if quick:
        sizes.update(n=min(sizes["n"], 2), groups=min(sizes["groups"], 2), output_tokens=4,
                     prefix_tokens=min(sizes["prefix_tokens"], 64), doc_tokens=min(sizes["doc_tokens"], 32))
    return sizes


def run_sweep(opts: BenchOptions, params: float, shapes=SWEEP, peers: tuple[str, ...] = PEER_SYSTEMS,
              on_result=None, only: tuple[str, ...] | None = None) -> list[dict]:
    """Each shape through ``bench.run.run_bench`` with its systems (venv peers not in ``peers`` left out; with
    ``only``, the systems not named there too, except the shape's own batchgen system, which the ratios are
    against); one row per shape: its sizes, each system's seconds (or why it was skipped), and batchgen's ratio
    against each peer."""
    from bench.rounds import run_rounds
    from bench.run import run_bench

    rows = []
    for s in shapes:
        sizes = sized(s, params, opts.quick)
        systems = tuple(n for i, n in enumerate(s.systems) if (n not in PEER_SYSTEMS or n in peers)
                        and (only is None or i == 0 or n in only))
        o = dataclasses.replace(opts, workload=make_workload(s.shape, **sizes), systems=systems)
        say(opts, f"sweep: {s.label} {sizes} -> {', '.join(systems)}")
        t = time.monotonic()
        count = 1 if opts.quick else s.repeats
        # each system loaded once, a warm round, then the rounds interleaved (bench.rounds); --contend reloads
        held = not opts.quick and not opts.contend
        results = run_rounds(o, count) if held else [run_bench(o) for _ in range(count)]
        rows.append(sweep_row(s, sizes, median_result(results), time.monotonic() - t))
        if on_result is not None:
            on_result(rows)
    return rows


def median_result(results: list[dict]) -> dict:
    """Rounds of one shape as one result: per system, its median round (the lower of the middle two for an even
    count; that round's entry whole, so its format and limits stay its own) with every round's seconds in
    ``runs_s``. Skipped rounds do not count; a system skipped in every round keeps its first round's entry."""
    if len(results) == 1:
        return results[0]
    by: dict[str, list[dict]] = {}
    for res in results:
        for r in res["systems"]:
            by.setdefault(r["system"], []).append(r)
    systems = []
    for rounds in by.values():
        ran = sorted((r for r in rounds if not r["skipped"] and r["wall_s"]), key=lambda r: r["wall_s"])
        if not ran:
            systems.append(rounds[0])
            continue
        systems.append({**ran[(len(ran) - 1) // 2], "runs_s": [round(r["wall_s"], 2) for r in ran],
                        "rounds_s": [None if r["skipped"] or not r["wall_s"] else round(r["wall_s"], 3)
                                     for r in rounds],
                        "rounds_machine_gflops": [r["extra"].get("machine_gflops_before") for r in rounds]})
    return {**results[0], "systems": systems}


def sweep_row(s: SweepShape, sizes: dict, result: dict, elapsed_s: float) -> dict:
    by = {r["system"]: r for r in result["systems"]}
    ours = by.get(s.systems[0])
    row = {"label": s.label, "sizes": sizes, "elapsed_s": round(elapsed_s, 1), "ours": s.systems[0], "systems": {},
           "ratios": {}}
    for name, r in by.items():
        row["systems"][name] = {"wall_s": r["wall_s"], "label": r["label"], "skipped": r["skipped"],
                                "dtype": r["extra"].get("dtype"), "platform": r["extra"].get("platform"),
                                "load_s": r["extra"].get("load_s"), "match_rate": r.get("match_rate"),
                                "runs_s": r.get("runs_s"), "rounds_s": r.get("rounds_s"),
                                # held rounds: bench.rounds.machine_speed just before each (a VM's speed drifts)
                                "rounds_machine_gflops": r.get("rounds_machine_gflops"),
                                "limit": limit_line(r) if not r["skipped"] and r.get("limits") else None,
                                "predicted_engine_s": r["extra"].get("predicted_engine_s"),
                                # roofline, or scaled to the tuner's timed steps of this format (costmodel.predict)
                                "prediction_basis": (r["extra"].get("prediction") or {}).get("basis")}
    if ours and not ours["skipped"]:
        row["round_pairs"] = _round_pairs(ours, by)
        row["round_ratios"] = _ratios(row["round_pairs"])
        for name, r in by.items():
            if name != s.systems[0] and not r["skipped"] and r["wall_s"]:
                # rounds paired in the same minutes: the median of their ratios; else the medians' ratio
                pairs = row["round_ratios"].get(name, [])
                row["ratios"][name] = (round(statistics.median(pairs), 3) if len(pairs) > 1
                                       else round(r["wall_s"] / ours["wall_s"], 3))
    return row


def round_ratios(ours: dict, by: dict) -> dict:
    """Each peer's seconds over ours round by round (the rounds both ran), in round order: with the systems held
    loaded and interleaved (bench.rounds) each pair ran in the same minutes."""
    return _ratios(_round_pairs(ours, by))


def _ratios(round_pairs: dict) -> dict:
    """``_round_pairs``' ratios alone, per peer."""
    return {name: [p for p, _ in pairs] for name, pairs in round_pairs.items()}


# A pair of rounds whose machine probes (bench.rounds.machine_speed) differ by more than this ran in different
# conditions: marked * under the table.
PROBE_SPREAD = 0.25


def _round_pairs(ours: dict, by: dict) -> dict:
    """Per peer, (ratio, whether the machine probes before the two runs differ by more than PROBE_SPREAD) for each
    round both ran."""
    mine = ours.get("rounds_s") or []
    my_speed = ours.get("rounds_machine_gflops") or [None] * len(mine)
    out = {}
    for name, r in by.items():
        theirs = r.get("rounds_s") or []
        if r is ours or not theirs:
            continue
        speed = r.get("rounds_machine_gflops") or [None] * len(theirs)
        pairs = [(round(t / m, 3), bool(a and b and abs(a - b) > PROBE_SPREAD * min(a, b)))
                 for m, t, a, b in zip(mine, theirs, my_speed, speed) if m and t]
        if pairs:
            out[name] = pairs
    return out


def format_sweep(model: str, cpu: str, rows: list[dict]) -> str:
    """The sweep as a markdown table: per shape, each system's seconds and how many times batchgen's defaults are
    faster (peer seconds / ours)."""
    names = list(dict.fromkeys(n for r in rows for n in r["systems"]))
    compared = [n for n in names if any(n in r["ratios"] for r in rows)]
    head = (["shape", "sizes (n, groups, prefix, doc, out)"] + names + [f"{n} / ours" for n in compared]
            + ["plan / achieved"])
    out = [f"Model {model}; CPU {cpu}; {time.strftime('%Y-%m-%d')}", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        z = r["sizes"]
        cells = [r["label"], f"{z['n']}, {z['groups']}, {z['prefix_tokens']}, {z['doc_tokens']}, {z['output_tokens']}"]
        for n in names:
            s = r["systems"].get(n)
            cells.append("–" if s is None else "skipped" if s["skipped"] else _seconds_cell(s))
        cells += [f"{r['ratios'][n]:.2f}×" if n in r["ratios"] else "–" for n in compared]
        cells.append(_plan_cell(r["systems"].get(r.get("ours"))))
        out.append("| " + " | ".join(cells) + " |")
    skipped = [f"- {r['label']}, {n}: {s['skipped']}" for r in rows for n, s in r["systems"].items() if s["skipped"]]
    by_round = []
    for r in rows:
        lines = [f"- {r['label']}, {n} / ours: " + ", ".join(f"{x:.2f}" + "*" * apart for x, apart in xs)
                 for n, xs in (r.get("round_pairs") or {}).items() if len(xs) > 1]
        speeds = (r["systems"].get(r.get("ours")) or {}).get("rounds_machine_gflops") or []
        if lines and any(speeds):
            lines.append(f"- {r['label']}, the machine just before ours (bf16 matmul GFLOP/s): "
                         + ", ".join(f"{x:.0f}" if x else "-" for x in speeds)
                         + f" (* a pair whose probes differ by over {PROBE_SPREAD:.0%})")
        by_round += lines
    limits = [f"- {r['label']}: {s['limit']}" for r in rows for s in r["systems"].values() if s.get("limit")]
    return "\n".join(out + ([""] + skipped if skipped else [])
                     + (["", "Round by round (each system loaded once, the rounds interleaved):"] + by_round
                        if by_round else [])
                     + (["", "How close to the limit (docs/guide/reports.md):"] + limits if limits else []))


def _seconds_cell(s: dict) -> str:
    """``8.4 s (q8_0)``; for repeated rounds the median with the spread: ``8.4 s (q8_0; 3 runs 7.1-9.3)``."""
    notes = [s["dtype"]] if s["dtype"] else []
    runs = s.get("runs_s") or []
    if len(runs) > 1:
        notes.append(f"{len(runs)} runs {min(runs):.1f}-{max(runs):.1f}")
    return f"{s['wall_s']:.1f} s" + (f" ({'; '.join(notes)})" if notes else "")


def _plan_cell(ours: dict | None) -> str:
    """Batchgen's system: what ``batchgen plan`` predicted against the seconds the run took (issue 39's ±25 %)."""
    if not ours or ours["skipped"] or not ours.get("predicted_engine_s") or not ours["wall_s"]:
        return "–"
    pred, wall = ours["predicted_engine_s"], ours["wall_s"]
    return f"{pred:.2f} s / {wall:.2f} s ({percent_over(pred, wall):+.0f} %)"


__all__ = ["SWEEP", "SweepShape", "sized", "run_sweep", "median_result", "sweep_row", "round_ratios", "format_sweep"]
