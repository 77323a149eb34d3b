"""``batchgen report``, the numbers: a run's traces (pipeline.run.trace) as a plain dict (``analyze``), its diagnosis
and the warnings when two runs' shapes differ. The HTML page is pipeline/report/html.py.

    summary = analyze(read_run(run_dir))          # plain dict of numbers; the HTML and the tests read it

Roofline accounting (MFU/MBU per stage, per step): ``costmodel.roofline``; this module picks the run's config,
calibration, dtype and warm-up steps from its run.json and hands the trace's columns there.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from costmodel import flops as F
from costmodel.roofline import DTYPE_BYTES, column_array, stage_roofline
from costmodel.stats import percentiles
from engine import load_model_config, resolve_model
from pipeline.run.trace import TraceData, check_trace


# ---- the roofline of a recorded run: run.json's meta picks config, calibration, dtype, warm-up -------------
def model_config_of(run: TraceData):
    d = run.meta.get("model_config")
    if d:
        return F.from_dict(d)
    path = (run.meta.get("model_info") or {}).get("path")
    if not path:
        return None
    try:   # NOTE: older runs without a stored config: read it from the checkpoint if it is still there
        return load_model_config(resolve_model(path))
    except Exception:
        return None


def warmup_mask(run: TraceData) -> np.ndarray:
    """True for warm-up steps: the first ``warmup_steps`` of each session."""
    sessions = column_array(run.steps["session"], int) if run.num_steps else np.zeros(0, int)
    sess_meta = run.meta.get("sessions") or [{}]
    k = int(sess_meta[0].get("warmup_steps", 1))
    mask = np.zeros(len(sessions), bool)
    for s in np.unique(sessions):
        idx = np.flatnonzero(sessions == s)[:k]
        mask[idx] = True
    return mask


def roofline(run: TraceData, config=None, calibration: dict | None = None, warmup_steps: bool = False) -> dict | None:
    """Prefill and decode stages of a recorded run (``costmodel.roofline.stage_roofline``): time, FLOPs, bytes,
    achieved FLOP/s and bytes/s, intensity, MFU, MBU.

    None when the model's config is unknown. MFU/MBU are None without a calibration.
    """
    config = config or model_config_of(run)
    if config is None or not run.num_steps:
        return None
    cal = calibration if calibration is not None else (run.meta.get("calibration") or None)
    dtype_bytes = DTYPE_BYTES.get((run.meta.get("model_info") or {}).get("dtype", "bfloat16"), 2)
    keep = np.ones(run.num_steps, bool) if warmup_steps else ~warmup_mask(run)
    return stage_roofline(run.steps, run.requests, config, dtype_bytes, cal, keep)

PROMPT_THRESHOLD = 512      # tokens: a "long" prompt
OUTPUT_THRESHOLD = 128      # tokens: a "long" output


def _bucket(prompt: int, output: int, pt: int, ot: int) -> str:
    return f"{'long' if prompt >= pt else 'short'} prompt / {'long' if output >= ot else 'short'} output"


def analyze(run: TraceData, prompt_threshold: int = PROMPT_THRESHOLD, output_threshold: int = OUTPUT_THRESHOLD) -> dict:
    """Every number the report shows, as a plain dict (no HTML)."""
    meta = run.meta
    phases = meta.get("phases") or {}
    wall = float(phases.get("wall_s") or 0.0)
    totals, time_split = _totals(run, wall), _time_split(run)
    steps = _StepColumns(run)
    engine = _engine_time(steps, phases, wall)
    latency = _latency(run.requests)
    buckets = _buckets(run.requests, prompt_threshold, output_threshold)
    steady = _steady(run, steps)
    roof = roofline(run)
    if roof is not None:
        roof["against_measured"] = against_measured(run)
    summary = {"run": str(run.path), "model_info": meta.get("model_info") or {}, "phases": phases,
               "totals": totals, "time_split": time_split, "engine_time": engine, "latency": latency,
               "buckets": buckets, "steady": steady, "roofline": roof,
               "thresholds": {"prompt": prompt_threshold, "output": output_threshold},
               "checks": check_trace(run) if run.num_requests or run.num_steps else []}
    summary["diagnosis"] = diagnose(summary)
    return summary


class _StepColumns:
    """The step columns the engine view reads (empty without steps), and which steps are warm-up."""

    def __init__(self, run: TraceData):
        s = run.steps
        self.dur = column_array(s["duration_s"]) if run.num_steps else np.zeros(0)
        self.pre = column_array(s["num_prefill_tokens"]) if run.num_steps else np.zeros(0)
        self.dec = column_array(s["num_decode_tokens"]) if run.num_steps else np.zeros(0)
        self.warm = warmup_mask(run)


def _totals(run: TraceData, wall: float) -> dict:
    r, s, n = run.requests, run.steps, run.num_requests
    prompt, cached = int(sum(r["prompt_tokens"])), int(sum(r["cached_tokens"]))
    out_tokens = int(sum(r["output_tokens"]))
    errors = sum(1 for e, f in zip(r["error"], r["finish_reason"]) if e or f == "error")
    return {"documents": n, "errors": errors, "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "output_tokens": out_tokens, "wall_s": wall,
            "docs_per_s": n / wall if wall else None, "output_tokens_per_s": out_tokens / wall if wall else None,
            "tokens_per_s": (prompt + out_tokens) / wall if wall else None,
            "cache_hit_rate": cached / prompt if prompt else None,
            "preemptions": int(sum(s["num_preemptions"])) if run.num_steps else 0,
            "steps": run.num_steps}


def _time_split(run: TraceData) -> dict:
    """Time split, request view: seconds each request spent waiting, in prefill and in decode (overall, per job)."""
    r, n = run.requests, run.num_requests
    queue = column_array(r["queue_s"])
    prefill = column_array(r["prefill_end"]) - column_array(r["first_scheduled"])
    decode = column_array(r["finish"]) - column_array(r["first_token"])
    jobs = sorted(set(r["job"]))

    def split(mask) -> dict:
        q, p, d = (float(np.nansum(x[mask])) for x in (queue, prefill, decode))
        tot = q + p + d
        return {"requests": int(mask.sum()), "queue_s": q, "prefill_s": p, "decode_s": d,
                "queue_share": q / tot if tot else None, "prefill_share": p / tot if tot else None,
                "decode_share": d / tot if tot else None,
                "prompt_tokens": int(np.asarray(r["prompt_tokens"])[mask].sum()) if n else 0,
                "cached_tokens": int(np.asarray(r["cached_tokens"])[mask].sum()) if n else 0,
                "output_tokens": int(np.asarray(r["output_tokens"])[mask].sum()) if n else 0}

    job_arr = np.asarray(r["job"], dtype=object)
    return {"overall": split(np.ones(n, bool)), "per_job": {j: split(job_arr == j) for j in jobs}}


def _engine_time(steps: _StepColumns, phases: dict, wall: float) -> dict:
    """Engine view: wall time spent in prefill steps, decode-only steps, and outside steps."""
    dur, pre, dec, warm = steps.dur, steps.pre, steps.dec, steps.warm
    engine = {"warmup_s": float(dur[warm].sum()),
              "prefill_steps_s": float(dur[~warm & (pre > 0)].sum()),
              "mixed_steps_s": float(dur[~warm & (pre > 0) & (dec > 0)].sum()),
              "decode_steps_s": float(dur[~warm & (pre == 0) & (dec > 0)].sum()),
              "load_s": float(phases.get("load_s") or 0.0), "setup_s": float(phases.get("setup_s") or 0.0)}
    engine["outside_steps_s"] = max(wall - float(dur.sum()) - engine["setup_s"], 0.0)
    return engine


def _latency(r: dict) -> dict:
    return {"ttft_s": percentiles(r["ttft_s"]), "tpot_s": percentiles(r["tpot_s"]),
            "itl_s": percentiles([b - a for tt in r["token_times"] for a, b in zip(tt or [], (tt or [])[1:])]),
            "queue_s": percentiles(r["queue_s"]), "e2e_s": percentiles(r["e2e_s"])}


def _buckets(r: dict, prompt_threshold: int, output_threshold: int) -> dict[str, Any]:
    """Requests by shape (short/long prompt, short/long output): share, means, hit rate and latencies."""
    buckets: dict[str, Any] = {}
    keys = [_bucket(p, o, prompt_threshold, output_threshold) for p, o in zip(r["prompt_tokens"], r["output_tokens"])]
    for b in sorted(set(keys)):
        m = np.asarray([k == b for k in keys])
        sel = lambda col: [x for x, k in zip(r[col], m) if k]   # noqa: E731
        p_sum = sum(sel("prompt_tokens"))
        buckets[b] = {"requests": int(m.sum()), "share": float(m.mean()),
                      "mean_prompt_tokens": float(np.mean(sel("prompt_tokens"))),
                      "mean_output_tokens": float(np.mean(sel("output_tokens"))),
                      "cache_hit_rate": sum(sel("cached_tokens")) / p_sum if p_sum else None,
                      "ttft_s": percentiles(sel("ttft_s")), "tpot_s": percentiles(sel("tpot_s")),
                      "e2e_s": percentiles(sel("e2e_s"))}
    return buckets


def _steady(run: TraceData, steps: _StepColumns) -> dict:
    """The steady state past warm-up: KV usage, queue lengths, decode batch and the steps' cache hit rate."""
    if not run.num_steps:
        return {}
    s, pre, dec, warm = run.steps, steps.pre, steps.dec, steps.warm
    decode_only = ~warm & (pre == 0) & (dec > 0)
    kv_total = column_array(s["kv_blocks_total"])
    kv_frac = np.divide(column_array(s["kv_blocks_used"]), kv_total, out=np.zeros(run.num_steps),
                        where=kv_total > 0)
    steady = {"peak_kv_usage": float(kv_frac.max()), "mean_kv_usage": float(kv_frac.mean()),
              "max_waiting": int(max(s["num_waiting"])), "max_running": int(max(s["num_running"])),
              "mean_decode_seqs": float(column_array(s["num_decode_seqs"])[~warm & (dec > 0)].mean())
              if (~warm & (dec > 0)).any() else None,
              "waiting_during_decode": float(np.mean(column_array(s["num_waiting"])[decode_only] > 0))
              if decode_only.any() else None}
    q = float(sum(s["prefix_cache_queries"]))
    steady["step_cache_hit_rate"] = float(sum(s["prefix_cache_hits"])) / q if q else None
    return steady


def against_measured(run: TraceData) -> list[dict]:
    """The run's decode-only steps at the row counts the tuner timed this format at (engine.tuning, recorded in the
    run's prediction): median step time here vs there, per row count. A run much slower than its own machine's
    measured steps shared the cores, or its contexts were much longer than the probe's."""
    measured = ((run.meta.get("prediction") or {}).get("measured_steps")) or {}
    if not measured or not run.num_steps:
        return []
    s = run.steps
    dur, dec = column_array(s["duration_s"]), column_array(s["num_decode_seqs"], int)
    only = (column_array(s["num_prefill_tokens"], int) == 0) & ~warmup_mask(run)
    out = []
    for name, secs in measured.items():
        kind, _, n = name.partition(" ")
        if kind != "decode":
            continue
        rows = int(n)
        near = only & (np.abs(dec - rows) <= max(1, rows // 10))
        if near.sum() >= 3:
            here = float(np.median(dur[near]))
            out.append({"shape": name, "steps": int(near.sum()), "run_s": here, "measured_s": float(secs),
                        "ratio": here / secs if secs else None})
    return out


# ---- diagnosis -----------------------------------------------------------------------------------------
def diagnose(sm: dict) -> list[str]:
    """Plain-language findings, most important first: which stage dominated and what to try."""
    t, eng, lat, st, roof = sm["totals"], sm["engine_time"], sm["latency"], sm["steady"], sm["roofline"]
    out: list[str] = []
    if not t["documents"]:
        return ["No finished requests in this trace; nothing to diagnose."]
    if t["errors"]:
        out.append(f"{t['errors']} of {t['documents']} requests ended in an error; see the requests table "
                   "(error column) before trusting any speed numbers.")
    out += _stage_findings(eng)
    out += _cache_findings(t, st)
    if roof:
        d, p = roof["stages"]["decode"], roof["stages"]["prefill"]
        out += _decode_batch_findings(d, eng, st)
        out += _prefill_mfu_findings(p)
        out += _decode_speed_findings(d, roof)
        if roof["calibration"] is None:
            out.append("No calibration for this device/dtype was found: run `batchgen calibrate` to get MFU/MBU.")
    else:
        out.append("The model config is unknown to this trace, so no roofline (FLOP/byte counts) is shown.")
    itl = lat["itl_s"]
    if itl["n"] >= 20 and itl["p50"] and itl["p99"] > 5 * itl["p50"]:
        out.append(f"Token stalls: inter-token p99 {1e3 * itl['p99']:.0f} ms vs p50 {1e3 * itl['p50']:.0f} ms — "
                   "long prefill chunks share steps with decode. Lower max_num_batched_tokens for steadier "
                   "decode, or accept it for throughput (offline batch jobs usually should).")
    if sm["checks"]:
        out.append(f"{len(sm['checks'])} trace consistency problem(s) — see 'Data checks'.")
    return out


def _stage_findings(eng: dict) -> list[str]:
    """Which stage the time went to; start-up or the pipeline outside engine steps when they weigh much."""
    stages = {"prefill (steps with prompt tokens)": eng["prefill_steps_s"],
              "decode (steps with only generated tokens)": eng["decode_steps_s"],
              "outside engine steps (tokenizing, planning, writing, Python overhead)": eng["outside_steps_s"]
              + eng["setup_s"],
              "model load and warm-up": eng["load_s"] + eng["warmup_s"]}
    total = sum(stages.values()) or 1.0
    top, top_s = max(stages.items(), key=lambda kv: kv[1])
    out = [f"Time went mostly to {top}: {top_s:.2f} s of {total:.2f} s "
           f"({100 * top_s / total:.0f}%). Split: " + ", ".join(f"{k.split(' (')[0]} {100 * v / total:.0f}%"
                                                              for k, v in stages.items()) + "."]
    if (eng["load_s"] + eng["warmup_s"]) > 0.3 * total:
        out.append("Start-up (model load + first step) is a large share of this run: it is short, so its "
                   "throughput understates a long job's. Compare steady-state numbers, or run more documents.")
    if (eng["outside_steps_s"] + eng["setup_s"]) > 0.2 * total:
        out.append("Much of the wall time is outside engine steps: the engine waits on the pipeline "
                   "(tokenization, prompt building, writing output). Profile the runner; feed requests earlier.")
    return out


def _cache_findings(t: dict, st: dict) -> list[str]:
    """A low prefix-cache hit rate; preemptions, or a KV cache close to full."""
    out = []
    hit = t["cache_hit_rate"]
    if hit is not None and t["documents"] > 1 and hit < 0.2:
        out.append(f"Low prefix-cache hit rate ({100 * hit:.0f}% of prompt tokens). If prompts share an "
                   "instruction or template, check that the shared text comes first and is byte-identical "
                   "(prompt order / template), and that documents sharing it are scheduled together.")
    if t["preemptions"]:
        out.append(f"{t['preemptions']} preemption(s): the KV cache ran out and work was recomputed. "
                   "Give the engine more KV memory (kv_cache_memory) or lower max_num_seqs.")
    elif st.get("peak_kv_usage", 0) > 0.95:
        out.append(f"KV cache peaked at {100 * st['peak_kv_usage']:.0f}% full: close to preempting; more KV "
                   "memory would allow larger batches.")
    return out


def _decode_batch_findings(d: dict, eng: dict, st: dict) -> list[str]:
    """A decode-bound run at a small batch: more sequences per step, or more documents at once."""
    dec_heavy = eng["decode_steps_s"] >= eng["prefill_steps_s"]
    if not (dec_heavy and d["mean_decode_seqs"] is not None and d["mean_decode_seqs"] < 16):
        return []
    if (st.get("waiting_during_decode") or 0) > 0.2:
        return [f"Decode-bound at a small batch ({d['mean_decode_seqs']:.1f} sequences per decode "
                "step) while requests waited: raise max_num_seqs (weights are read once per step, "
                "so more sequences per step are nearly free)."]
    return [f"Decode-bound at a small batch ({d['mean_decode_seqs']:.1f} sequences per decode "
            "step) and nothing was waiting: submit more documents at once so decode steps fill up."]


def _prefill_mfu_findings(p: dict) -> list[str]:
    """Prefill MFU over 100% (a calibration off) or low (small chunks, long contexts, overhead)."""
    if not (p["mfu"] is not None and p["time_s"] > 0):
        return []
    if p["mfu"] > 1.05:
        return [f"Prefill MFU above 100% ({100 * p['mfu']:.0f}%): the calibration was measured under "
                "load or on other settings; run `batchgen calibrate` again on an idle machine."]
    if p["mfu"] < 0.3:
        hint = (" Prefill chunks are small (mean {:.0f} tokens per step): raise max_num_batched_tokens."
                .format(p["mean_prefill_tokens"]) if (p["mean_prefill_tokens"] or 512) < 512 else
                " Check attention over long contexts and per-step overhead.")
        return [f"Prefill reaches {100 * p['mfu']:.0f}% of the calibrated matmul peak (MFU)." + hint]
    return []


def _decode_speed_findings(d: dict, roof: dict) -> list[str]:
    """Decode steps far slower than their memory traffic, or a low MBU; steps slower than the tuner measured."""
    out = []
    slow = (d["time_s"] / (d["bytes"] / roof["calibration"]["memory_bandwidth"])
            if roof["calibration"] and d["bytes"] and d["time_s"] else None)
    if slow is not None and slow > 10 and (d["mean_decode_seqs"] or 0) >= 8:
        out.append(f"Decode steps take {slow:.0f}x longer than reading their weights and K/V at the calibrated "
                   f"bandwidth, even at {d['mean_decode_seqs']:.0f} sequences per step: the step time is not "
                   "memory traffic. Profile the model runner (weight dequantization, attention over the paged "
                   "cache, per-sequence Python loops, LM head over more rows than sampled).")
    elif d["mbu"] is not None and d["time_s"] > 0 and d["mbu"] < 0.3:
        out.append(f"Decode moves {100 * d['mbu']:.0f}% of the calibrated memory bandwidth (MBU): per-step "
                   "overhead (Python, scheduling, small kernels) dominates the weight reads; larger decode "
                   "batches amortize it.")
    slowest = max(roof.get("against_measured") or [], key=lambda m: m["ratio"] or 0, default=None)
    if slowest and (slowest["ratio"] or 0) > 1.5:
        out.append(f"Decode steps at {slowest['shape'].split()[1]} rows took {1e3 * slowest['run_s']:.0f} ms here "
                   f"(median of {slowest['steps']}) against {1e3 * slowest['measured_s']:.0f} ms when the tuner "
                   f"timed this format on this machine ({slowest['ratio']:.1f}x): other work shared the cores "
                   "during the run, or its contexts were far longer than the probe's 512 tokens.")
    return out


# ---- comparison --------------------------------------------------------------------------------------
def shape_warnings(a: dict, b: dict) -> list[str]:
    """Why two runs' numbers may not be comparable."""
    w = []
    ma, mb = a["model_info"], b["model_info"]
    for key in ("identity", "dtype", "device"):
        if ma.get(key) != mb.get(key):
            w.append(f"different {key}: {ma.get(key)} vs {mb.get(key)}")
    ta, tb = a["totals"], b["totals"]
    for key, label in (("documents", "documents"),):
        if ta[key] and tb[key] and abs(ta[key] - tb[key]) > 0.1 * max(ta[key], tb[key]):
            w.append(f"different number of {label}: {ta[key]} vs {tb[key]}")
    for key, label in (("prompt_tokens", "mean prompt length"), ("output_tokens", "mean output length")):
        xa = ta[key] / ta["documents"] if ta["documents"] else 0
        xb = tb[key] / tb["documents"] if tb["documents"] else 0
        if max(xa, xb) and abs(xa - xb) > 0.2 * max(xa, xb):
            w.append(f"different {label}: {xa:.0f} vs {xb:.0f} tokens")
    keys = set(a["buckets"]) | set(b["buckets"])
    tv = 0.5 * sum(abs(a["buckets"].get(k, {}).get("share", 0) - b["buckets"].get(k, {}).get("share", 0))
                   for k in keys)
    if tv > 0.2:
        w.append(f"different mix of shape buckets ({100 * tv:.0f}% of requests in a different bucket)")
    return w
