"""``batchgen report``: turn a run's traces (pipeline.trace) into numbers, a diagnosis and a self-contained HTML page.

    summary = analyze(read_run(run_dir))          # plain dict of numbers; the HTML and the tests read it
    render_report([run_dir], "report.html")       # one run; two run dirs -> side-by-side comparison

Roofline accounting (MFU/MBU per stage, per step): ``costmodel.roofline``.
"""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from costmodel import flops as F
from costmodel.roofline import DTYPE_BYTES, column_array, stage_roofline
from costmodel.stats import percentiles
from pipeline.trace import TraceData, check_trace, read_run


# ---- the roofline of a recorded run: run.json's meta picks config, calibration, dtype, warm-up -------------
def model_config_of(run: TraceData):
    d = run.meta.get("model_config")
    if d:
        return F.from_dict(d)
    path = (run.meta.get("model_info") or {}).get("path")
    if not path:
        return None
    try:   # NOTE: older runs without a stored config: read it from the checkpoint if it is still there
        from engine import load_model_config, resolve_model
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
    r, s, meta = run.requests, run.steps, run.meta
    phases = meta.get("phases") or {}
    wall = float(phases.get("wall_s") or 0.0)
    n = run.num_requests
    prompt, cached = int(sum(r["prompt_tokens"])), int(sum(r["cached_tokens"]))
    out_tokens = int(sum(r["output_tokens"]))
    errors = sum(1 for e, f in zip(r["error"], r["finish_reason"]) if e or f == "error")
    totals = {"documents": n, "errors": errors, "prompt_tokens": prompt, "cached_tokens": cached,
              "computed_tokens": prompt - cached, "output_tokens": out_tokens, "wall_s": wall,
              "docs_per_s": n / wall if wall else None, "output_tokens_per_s": out_tokens / wall if wall else None,
              "tokens_per_s": (prompt + out_tokens) / wall if wall else None,
              "cache_hit_rate": cached / prompt if prompt else None,
              "preemptions": int(sum(s["num_preemptions"])) if run.num_steps else 0,
              "steps": run.num_steps}

    # Time split, request view: seconds each request spent waiting, in prefill and in decode.
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
    time_split = {"overall": split(np.ones(n, bool)), "per_job": {j: split(job_arr == j) for j in jobs}}

    # Engine view: wall time spent in prefill steps, decode-only steps, and outside steps.
    dur = column_array(s["duration_s"]) if run.num_steps else np.zeros(0)
    pre = column_array(s["num_prefill_tokens"]) if run.num_steps else np.zeros(0)
    dec = column_array(s["num_decode_tokens"]) if run.num_steps else np.zeros(0)
    warm = warmup_mask(run)
    engine = {"warmup_s": float(dur[warm].sum()),
              "prefill_steps_s": float(dur[~warm & (pre > 0)].sum()),
              "mixed_steps_s": float(dur[~warm & (pre > 0) & (dec > 0)].sum()),
              "decode_steps_s": float(dur[~warm & (pre == 0) & (dec > 0)].sum()),
              "load_s": float(phases.get("load_s") or 0.0), "setup_s": float(phases.get("setup_s") or 0.0)}
    engine["outside_steps_s"] = max(wall - float(dur.sum()) - engine["setup_s"], 0.0)

    latency = {"ttft_s": percentiles(r["ttft_s"]), "tpot_s": percentiles(r["tpot_s"]),
               "itl_s": percentiles([b - a for tt in r["token_times"] for a, b in zip(tt or [], (tt or [])[1:])]),
               "queue_s": percentiles(r["queue_s"]), "e2e_s": percentiles(r["e2e_s"])}

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

    steady = {}
    if run.num_steps:
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

    roof = roofline(run)
    summary = {"run": str(run.path), "model_info": meta.get("model_info") or {}, "phases": phases,
               "totals": totals, "time_split": time_split, "engine_time": engine, "latency": latency,
               "buckets": buckets, "steady": steady, "roofline": roof,
               "thresholds": {"prompt": prompt_threshold, "output": output_threshold},
               "checks": check_trace(run) if n or run.num_steps else []}
    summary["diagnosis"] = diagnose(summary)
    return summary


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
    stages = {"prefill (steps with prompt tokens)": eng["prefill_steps_s"],
              "decode (steps with only generated tokens)": eng["decode_steps_s"],
              "outside engine steps (tokenizing, planning, writing, Python overhead)": eng["outside_steps_s"]
              + eng["setup_s"],
              "model load and warm-up": eng["load_s"] + eng["warmup_s"]}
    total = sum(stages.values()) or 1.0
    top, top_s = max(stages.items(), key=lambda kv: kv[1])
    out.append(f"Time went mostly to {top}: {top_s:.2f} s of {total:.2f} s "
               f"({100 * top_s / total:.0f}%). Split: " + ", ".join(f"{k.split(' (')[0]} {100 * v / total:.0f}%"
                                                                  for k, v in stages.items()) + ".")
    if (eng["load_s"] + eng["warmup_s"]) > 0.3 * total:
        out.append("Start-up (model load + first step) is a large share of this run: it is short, so its "
                   "throughput understates a long job's. Compare steady-state numbers, or run more documents.")
    if (eng["outside_steps_s"] + eng["setup_s"]) > 0.2 * total:
        out.append("Much of the wall time is outside engine steps: the engine waits on the pipeline "
                   "(tokenization, prompt building, writing output). Profile the runner; feed requests earlier.")
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
    if roof:
        d, p = roof["stages"]["decode"], roof["stages"]["prefill"]
        dec_heavy = eng["decode_steps_s"] >= eng["prefill_steps_s"]
        if dec_heavy and d["mean_decode_seqs"] is not None and d["mean_decode_seqs"] < 16:
            if (st.get("waiting_during_decode") or 0) > 0.2:
                out.append(f"Decode-bound at a small batch ({d['mean_decode_seqs']:.1f} sequences per decode "
                           "step) while requests waited: raise max_num_seqs (weights are read once per step, "
                           "so more sequences per step are nearly free).")
            else:
                out.append(f"Decode-bound at a small batch ({d['mean_decode_seqs']:.1f} sequences per decode "
                           "step) and nothing was waiting: submit more documents at once so decode steps fill up.")
        if p["mfu"] is not None and p["time_s"] > 0:
            if p["mfu"] > 1.05:
                out.append(f"Prefill MFU above 100% ({100 * p['mfu']:.0f}%): the calibration was measured under "
                           "load or on other settings; run `batchgen calibrate` again on an idle machine.")
            elif p["mfu"] < 0.3:
                hint = (" Prefill chunks are small (mean {:.0f} tokens per step): raise max_num_batched_tokens."
                        .format(p["mean_prefill_tokens"]) if (p["mean_prefill_tokens"] or 0) < 512 else
                        " Check attention over long contexts and per-step overhead.")
                out.append(f"Prefill reaches {100 * p['mfu']:.0f}% of the calibrated matmul peak (MFU)." + hint)
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


# ---- HTML ----------------------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}h2{border-bottom:2px solid #ddd;margin-top:2em}
.warn{background:#fff4e0;border-left:4px solid #f0a000;padding:.5em 1em}.diag li{margin:.3em 0}
.cols{display:flex;gap:2em;flex-wrap:wrap}.small{color:#666;font-size:90%}img{max-width:100%}"""


def _fmt(x, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if unit == "%":
        return f"{100 * x:.1f}%"
    if unit == "ms":
        return f"{1e3 * x:.1f} ms"
    if unit == "s":
        return f"{x:.2f} s"
    if unit in ("FLOP/s", "B/s", "FLOP", "B"):
        for p, k in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(x) >= p:
                return f"{x / p:.2f} {k}{unit}"
        return f"{x:.0f} {unit}"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 100):
        return f"{int(x):,}"
    return f"{x:.3g}" if isinstance(x, float) else html.escape(str(x))


def _when(unix: float | None) -> str:
    import datetime
    if not unix:
        return "at an unknown time"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M")


def _table(headers: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _img(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=72)   # NOTE: not bbox_inches="tight": that draws the figure twice
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _latency_plot(run: TraceData, sm: dict) -> str:
    plt = _plt()
    r = run.requests
    series = {"TTFT": [x for x in r["ttft_s"] if x is not None], "TPOT": [x for x in r["tpot_s"] if x is not None],
              "inter-token": [b - a for tt in r["token_times"] for a, b in zip(tt or [], (tt or [])[1:])]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for ax, (name, vals), key in zip(axes, series.items(), ("ttft_s", "tpot_s", "itl_s")):
        ax.set_title(name)
        ax.set_xlabel("ms")
        if vals:
            ax.hist(np.asarray(vals) * 1e3, bins=40, color="#4878a8")
            for p, c in (("p50", "g"), ("p90", "orange"), ("p99", "r")):
                v = sm["latency"][key][p]
                ax.axvline(v * 1e3, color=c, ls="--", lw=1, label=f"{p} {v * 1e3:.1f}")
            ax.legend(fontsize=8)
    return _img(fig)


def _timeline_plot(run: TraceData) -> str:
    plt = _plt()
    s = run.steps
    t = column_array(s["end"])
    fig, axes = plt.subplots(4, 1, figsize=(13, 10), sharex=True)
    nb = max(1, min(60, run.num_steps // 3))
    edges = np.linspace(float(np.nanmin(column_array(s["start"]))), float(np.nanmax(t)), nb + 1)
    width = np.diff(edges)
    mid = (edges[:-1] + edges[1:]) / 2
    order = np.argsort(t)
    knots = np.concatenate([[float(np.nanmin(column_array(s["start"])))], t[order]])

    def rate(col: str) -> np.ndarray:   # tokens spread evenly over each step's span, then per bin
        cum = np.concatenate([[0.0], np.cumsum(column_array(s[col])[order])])
        return np.diff(np.interp(edges, knots, cum)) / width

    ax = axes[0]
    ax.plot(mid, rate("num_prefill_tokens"), label="prompt tokens/s (computed)")
    emitted = s.get("num_emitted_tokens")
    out_col = "num_emitted_tokens" if emitted is not None and any(v for v in emitted if v) else "num_sampled"
    ax.plot(mid, rate(out_col), label="output tokens/s")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.step(t, column_array(s["num_prefill_tokens"]), where="post", label="prefill tokens/step", lw=.8)
    ax.step(t, column_array(s["num_decode_tokens"]), where="post", label="decode tokens/step", lw=.8)
    ax.set_ylabel("tokens per step")
    ax.set_title("batch composition")
    ax.legend(fontsize=8)
    ax = axes[2]
    total = column_array(s["kv_blocks_total"])
    ax.plot(t, np.divide(column_array(s["kv_blocks_used"]), total, out=np.zeros_like(t), where=total > 0) * 100,
            label="KV blocks used %")
    ax.set_ylabel("KV used %")
    ax2 = ax.twinx()
    ax2.plot(t, column_array(s["num_running"]), color="g", lw=.8, label="running")
    ax2.plot(t, column_array(s["num_waiting"]), color="r", lw=.8, label="waiting")
    ax2.set_ylabel("requests")
    ax.set_title("KV usage and queue")
    ax2.legend(fontsize=8, loc="upper right")
    ax = axes[3]
    q, _ = np.histogram(t, edges, weights=column_array(s["prefix_cache_queries"]))
    h, _ = np.histogram(t, edges, weights=column_array(s["prefix_cache_hits"]))
    ok = q > 0
    ax.plot(mid[ok], 100 * h[ok] / q[ok], "o-", ms=3, label="hit rate per interval")
    cq, ch = np.cumsum(column_array(s["prefix_cache_queries"])), np.cumsum(column_array(s["prefix_cache_hits"]))
    ax.plot(t, 100 * np.divide(ch, cq, out=np.zeros_like(t), where=cq > 0), label="cumulative")
    ax.set_ylabel("prefix cache hit %")
    ax.set_xlabel("seconds since run start")
    ax.set_title("prefix-cache hits")
    ax.legend(fontsize=8)
    return _img(fig)


def _roofline_plot(roof: dict) -> str:
    plt = _plt()
    cal = roof["calibration"]
    ps = roof["per_step"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keep = ps["keep"] & (ps["duration"] > 0) & (ps["bytes"] > 0)
    for stage, color in (("prefill", "#d62728"), ("decode", "#1f77b4")):
        m = keep & (ps["stage"] == stage)
        if m.any():
            ax.scatter(ps["flops"][m] / ps["bytes"][m], ps["flops"][m] / ps["duration"][m], s=6, alpha=.4,
                       color=color, label=f"{stage} steps")
        st = roof["stages"][stage]
        if st["time_s"] and st["intensity"]:
            ax.scatter([st["intensity"]], [st["flops_per_s"]], s=120, marker="*", color=color,
                       edgecolor="k", zorder=5, label=f"{stage} (all steps)")
    xs = np.logspace(-1, 4, 200)
    if cal:
        ax.plot(xs, np.minimum(cal["matmul_flops"], cal["memory_bandwidth"] * xs), "k-", lw=1.5,
                label="calibrated roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=.3)
    return _img(fig)


def _replicas_html(dist: dict) -> str:
    """A Ray run (pipeline.ray_exec): one row per replica actor (a replacement is a row of its own)."""
    pre = dist.get("prefix_prefills") or {}
    head = (f"<h2>Ray replicas</h2><p class='small'>{dist.get('replicas')} replicas at "
            f"{html.escape(str(dist.get('address')))}, {dist.get('threads_per_replica')} thread(s) each; "
            f"{len(pre)} prefix groups, {sum(pre.values())} prefills ({dist.get('groups_on_more_than_one_replica', 0)}"
            f" groups on more than one replica); {dist.get('restarts', 0)} replacement actors</p>")
    rows = [[f"{r['replica']}.{r['incarnation']}", html.escape(f"{r['host']} pid {r['pid']}"), r["dtype"],
             _fmt(r["load_s"], "s"), _fmt(r["rows"]), _fmt(r["groups"]),
             _fmt(r["hit_rate"], "%"), _fmt(r["step_s"], "s"),
             _fmt(r["tokens_per_s"]), html.escape(r["died"] or "")] for r in dist.get("per_replica", [])]
    return head + _table(["replica", "where", "dtype", "load", "rows", "groups", "hit rate", "in steps",
                          "tokens/s", "died"], rows)


def _single_html(run: TraceData, sm: dict) -> str:
    t, mi, ph = sm["totals"], sm["model_info"], sm["phases"]
    parts = [f"<p class='small'>run: {html.escape(sm['run'])} · model: {html.escape(str(mi.get('name')))} "
             f"({html.escape(str(mi.get('architecture')))}, {mi.get('dtype')}, {mi.get('device')}, "
             f"backend {mi.get('attention_backend', '–')})</p>"]
    pred = (run.meta.get("prediction") or {}).get("engine_s")
    if pred is not None:
        steps_s = float(np.nansum(column_array(run.steps["duration_s"]))) if run.num_steps else 0.0
        parts.append(f"<p class='small'>engine time: predicted {pred:.1f} s (batchgen plan), achieved "
                     f"{steps_s:.1f} s in steps ({(steps_s / pred - 1) * 100:+.0f} %)</p>")
    if mi.get("dtype_reason"):
        kernels = f" · CPU kernels: {mi['cpu_kernels']}" if mi.get("cpu_kernels") else ""
        resident = f", {mi['weight_bytes'] / 1e6:.0f} MB resident" if mi.get("weight_bytes") else ""
        weights = f" · weights: quantization {mi.get('quantization', 'none')}{resident}"
        parts.append(f"<p class='small'>{html.escape(str(mi['dtype_reason']) + kernels + weights)}</p>")
    drafts = sum(v or 0 for v in run.steps.get("num_draft_tokens") or [])
    if drafts:
        acc = sum(v or 0 for v in run.steps.get("num_accepted_tokens") or [])
        spec_steps = sum(1 for v in run.steps["num_draft_tokens"] if v)
        parts.append(f"<p class='small'>speculative decoding: {drafts} draft tokens verified in {spec_steps} steps, "
                     f"{acc} accepted ({acc / drafts:.0%})</p>")
    parts.append("<h2>Diagnosis</h2><ul class='diag'>" + "".join(f"<li>{html.escape(d)}</li>"
                                                                for d in sm["diagnosis"]) + "</ul>")
    dist = run.meta.get("distributed")
    if dist:
        parts.append(_replicas_html(dist))
    parts.append("<h2>Totals</h2>" + _table(["", "value"], [
        ["documents", _fmt(t["documents"])], ["errors", _fmt(t["errors"])],
        ["prompt tokens", _fmt(t["prompt_tokens"])],
        ["&nbsp; cached (prefix hits)", f"{_fmt(t['cached_tokens'])} ({_fmt(t['cache_hit_rate'], '%')})"],
        ["&nbsp; computed", _fmt(t["computed_tokens"])], ["output tokens", _fmt(t["output_tokens"])],
        ["wall time", _fmt(t["wall_s"], "s")], ["documents/s", _fmt(t["docs_per_s"])],
        ["output tokens/s", _fmt(t["output_tokens_per_s"])],
        ["all tokens/s (prompt + output)", _fmt(t["tokens_per_s"])],
        ["engine steps", _fmt(t["steps"])], ["preemptions", _fmt(t["preemptions"])]]))
    e = sm["engine_time"]
    parts.append("<h2>Phases and engine time</h2>" + _table(["phase", "seconds"], [
        ["model load", _fmt(ph.get("load_s"), "s")], ["setup (run start → first step)", _fmt(ph.get("setup_s"), "s")],
        ["warm-up (first step)", _fmt(ph.get("warmup_s"), "s")],
        ["steady state (after warm-up)", _fmt(ph.get("steady_s"), "s")],
        ["&nbsp; steps with prefill tokens", _fmt(e["prefill_steps_s"], "s")],
        ["&nbsp;&nbsp; of which mixed prefill + decode", _fmt(e["mixed_steps_s"], "s")],
        ["&nbsp; decode-only steps", _fmt(e["decode_steps_s"], "s")],
        ["&nbsp; outside engine steps", _fmt(e["outside_steps_s"], "s")],
        ["wall (excluding load)", _fmt(ph.get("wall_s"), "s")]]))
    ts = sm["time_split"]
    rows = [["all", ts["overall"]]] + [[j or "(no job)", v] for j, v in ts["per_job"].items()]
    parts.append("<h2>Time split per request (queue / prefill / decode)</h2>"
                 "<p class='small'>Request-seconds summed over requests: queue = arrival → first scheduled; "
                 "prefill = first scheduled → prompt done; decode = first token → finish.</p>" + _table(
                     ["group", "requests", "queue", "prefill", "decode", "queue %", "prefill %", "decode %",
                      "prompt tok", "cache hit", "output tok"],
                     [[html.escape(str(g)), _fmt(v["requests"]), _fmt(v["queue_s"], "s"), _fmt(v["prefill_s"], "s"),
                       _fmt(v["decode_s"], "s"), _fmt(v["queue_share"], "%"), _fmt(v["prefill_share"], "%"),
                       _fmt(v["decode_share"], "%"), _fmt(v["prompt_tokens"]),
                       _fmt(v["cached_tokens"] / v["prompt_tokens"] if v["prompt_tokens"] else None, "%"),
                       _fmt(v["output_tokens"])] for g, v in rows]))
    lat = sm["latency"]
    parts.append("<h2>Latency distributions</h2>" + _table(
        ["metric", "n", "mean", "p50", "p90", "p99", "max"],
        [[name, _fmt(lat[k]["n"])] + [_fmt(lat[k][p], "ms") for p in ("mean", "p50", "p90", "p99", "max")]
         for name, k in (("TTFT", "ttft_s"), ("TPOT (per request mean)", "tpot_s"), ("inter-token", "itl_s"),
                         ("queue wait", "queue_s"), ("end to end", "e2e_s"))]))
    if run.num_requests:
        parts.append(_latency_plot(run, sm))
    if run.num_steps:
        parts.append("<h2>Over time: throughput, batch composition, KV usage, cache hits</h2>" + _timeline_plot(run))
    th = sm["thresholds"]
    parts.append(f"<h2>Per shape bucket</h2><p class='small'>long prompt ≥ {th['prompt']} tokens, "
                 f"long output ≥ {th['output']} tokens.</p>" + _table(
                     ["bucket", "requests", "mean prompt", "mean output", "cache hit", "TTFT p50", "TTFT p90",
                      "TPOT p50", "TPOT p90", "e2e p50"],
                     [[b, _fmt(v["requests"]), _fmt(v["mean_prompt_tokens"]), _fmt(v["mean_output_tokens"]),
                       _fmt(v["cache_hit_rate"], "%"), _fmt(v["ttft_s"]["p50"], "ms"), _fmt(v["ttft_s"]["p90"], "ms"),
                       _fmt(v["tpot_s"]["p50"], "ms"), _fmt(v["tpot_s"]["p90"], "ms"), _fmt(v["e2e_s"]["p50"], "ms")]
                      for b, v in sm["buckets"].items()]))
    parts.append("<h2>Roofline</h2>")
    roof = sm["roofline"]
    if roof is None:
        parts.append("<p class='warn'>No model config in this trace: FLOP and byte counts are unavailable.</p>")
    else:
        cal = roof["calibration"]
        parts.append("<p class='small'>" + (
            f"Calibration: {html.escape(str(cal.get('device_name')))} {cal.get('dtype')}: matmul peak "
            f"{_fmt(cal['matmul_flops'], 'FLOP/s')}, memory bandwidth {_fmt(cal['memory_bandwidth'], 'B/s')} "
            f"(ridge {cal['matmul_flops'] / cal['memory_bandwidth']:.0f} FLOP/B), measured "
            f"{_when(cal.get('measured_at'))}{' in quick mode' if cal.get('quick') else ''}; a calibration "
            "taken while other work ran understates the device." if cal else
            "No calibration: run <code>batchgen calibrate</code>.") +
            " MFU = achieved FLOP/s ÷ calibrated peak (prefill); MBU = achieved bytes/s ÷ calibrated bandwidth "
            "(decode). Warm-up steps excluded.</p>")
        parts.append(_table(["stage", "steps", "time", "FLOPs", "bytes", "FLOP/s", "bytes/s", "FLOP/byte",
                             "MFU", "MBU", "mean decode seqs", "mean prefill tok"],
                            [[name, _fmt(v["steps"]), _fmt(v["time_s"], "s"), _fmt(v["flops"], "FLOP"),
                              _fmt(v["bytes"], "B"), _fmt(v["flops_per_s"], "FLOP/s"), _fmt(v["bytes_per_s"], "B/s"),
                              _fmt(v["intensity"]), _fmt(v["mfu"], "%"), _fmt(v["mbu"], "%"),
                              _fmt(v["mean_decode_seqs"]), _fmt(v["mean_prefill_tokens"])]
                             for name, v in roof["stages"].items()]))
        parts.append(_roofline_plot(roof))
    parts.append("<h2>Data checks</h2>" + ("<p>Trace is consistent: output tokens = sampled tokens, "
                                          "cached + computed = prompt tokens, TTFT ≥ queue wait.</p>"
                                          if not sm["checks"] else
                                          "<ul>" + "".join(f"<li>{html.escape(c)}</li>" for c in sm["checks"][:50])
                                          + "</ul>"))
    return "\n".join(parts)


def _compare_html(sms: list[dict]) -> str:
    a, b = sms
    warn = shape_warnings(a, b)
    parts = []
    if warn:
        parts.append("<div class='warn'><b>These runs' workloads differ; compare with care:</b><ul>"
                     + "".join(f"<li>{html.escape(w)}</li>" for w in warn) + "</ul></div>")

    def g(sm, path):
        x = sm
        for k in path:
            x = x.get(k) if isinstance(x, dict) else None
            if x is None:
                return None
        return x

    metrics = [("documents", ("totals", "documents"), ""), ("prompt tokens", ("totals", "prompt_tokens"), ""),
               ("cache hit rate", ("totals", "cache_hit_rate"), "%"),
               ("output tokens", ("totals", "output_tokens"), ""),
               ("wall time", ("totals", "wall_s"), "s"), ("documents/s", ("totals", "docs_per_s"), ""),
               ("output tokens/s", ("totals", "output_tokens_per_s"), ""),
               ("all tokens/s", ("totals", "tokens_per_s"), ""),
               ("model load", ("phases", "load_s"), "s"),
               ("prefill steps time", ("engine_time", "prefill_steps_s"), "s"),
               ("decode-only steps time", ("engine_time", "decode_steps_s"), "s"),
               ("TTFT p50", ("latency", "ttft_s", "p50"), "ms"), ("TTFT p99", ("latency", "ttft_s", "p99"), "ms"),
               ("TPOT p50", ("latency", "tpot_s", "p50"), "ms"), ("TPOT p99", ("latency", "tpot_s", "p99"), "ms"),
               ("ITL p99", ("latency", "itl_s", "p99"), "ms"), ("preemptions", ("totals", "preemptions"), ""),
               ("prefill MFU", ("roofline", "stages", "prefill", "mfu"), "%"),
               ("decode MBU", ("roofline", "stages", "decode", "mbu"), "%")]
    rows = []
    for name, path, unit in metrics:
        va, vb = g(a, path), g(b, path)
        ratio = f"{vb / va:.2f}×" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "–"
        rows.append([name, _fmt(va, unit), _fmt(vb, unit), ratio])
    parts.append(_table(["metric", "A", "B", "B / A"], rows))
    return "\n".join(parts)


def render_report(run_dirs: list[str | Path], output: str | Path | None = None,
                  prompt_threshold: int = PROMPT_THRESHOLD, output_threshold: int = OUTPUT_THRESHOLD) -> Path:
    """Write the HTML report of one run (or a comparison of two) and return its path.

    Default output: ``<first run dir>/report.html``.
    """
    if not 1 <= len(run_dirs) <= 2:
        raise ValueError("report takes one run directory, or two to compare")
    runs = [read_run(d) for d in run_dirs]
    sms = [analyze(r, prompt_threshold, output_threshold) for r in runs]
    title = "batchgen report: " + " vs ".join(Path(d).name for d in run_dirs)
    body = [f"<h1>{html.escape(title)}</h1>"]
    if len(runs) == 2:
        body.append("<h2>Comparison</h2>" + "<p class='small'>A = " + html.escape(str(run_dirs[0])) + ", B = "
                    + html.escape(str(run_dirs[1])) + "</p>" + _compare_html(sms))
        body.append("<div class='cols'>" + "".join(f"<div style='flex:1;min-width:500px'><h1>{lab}</h1>"
                                                  f"{_single_html(r, sm)}</div>"
                                                  for lab, r, sm in zip("AB", runs, sms)) + "</div>")
    else:
        body.append(_single_html(runs[0], sms[0]))
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")
    out = Path(output) if output else Path(run_dirs[0]) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out
