"""``batchgen report``, the page: a self-contained HTML report of one run, or two side by side, from the numbers
of pipeline/report/analysis.py (plots inline as PNG).

    render_report([run_dir], "report.html")       # one run; two run dirs -> side-by-side comparison
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import math
from pathlib import Path

import numpy as np

from costmodel.roofline import column_array
from pipeline.report.analysis import OUTPUT_THRESHOLD, PROMPT_THRESHOLD, analyze, shape_warnings
from pipeline.run.trace import TraceData, read_run

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
    if not unix:
        return "at an unknown time"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M")


def _table(headers: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _img(fig) -> str:
    import matplotlib.pyplot as plt  # NOTE: lazy, as in _plt: matplotlib only when a page is drawn
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=72)   # NOTE: not bbox_inches="tight": that draws the figure twice
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _plt():
    import matplotlib  # NOTE: lazy: matplotlib is slow to import; only `batchgen report` draws
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
    """A Ray run (pipeline.execute.ray.driver): one row per replica actor (a replacement is a row of its own)."""
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
    parts = _run_notes(run, sm)
    parts.append("<h2>Diagnosis</h2><ul class='diag'>" + "".join(f"<li>{html.escape(d)}</li>"
                                                                for d in sm["diagnosis"]) + "</ul>")
    dist = run.meta.get("distributed")
    if dist:
        parts.append(_replicas_html(dist))
    parts.append(_totals_html(sm["totals"]))
    parts.append(_phases_html(sm["phases"], sm["engine_time"]))
    parts.append(_time_split_html(sm["time_split"]))
    parts.append(_latency_html(sm["latency"]))
    if run.num_requests:
        parts.append(_latency_plot(run, sm))
    if run.num_steps:
        parts.append("<h2>Over time: throughput, batch composition, KV usage, cache hits</h2>" + _timeline_plot(run))
    parts.append(_buckets_html(sm["thresholds"], sm["buckets"]))
    parts.append("<h2>Roofline</h2>")
    parts += _roofline_html(sm["roofline"])
    parts.append("<h2>Data checks</h2>" + ("<p>Trace is consistent: output tokens = sampled tokens, "
                                          "cached + computed = prompt tokens, TTFT ≥ queue wait.</p>"
                                          if not sm["checks"] else
                                          "<ul>" + "".join(f"<li>{html.escape(c)}</li>" for c in sm["checks"][:50])
                                          + "</ul>"))
    return "\n".join(parts)


def _run_notes(run: TraceData, sm: dict) -> list[str]:
    """The small print under the title: run and model; predicted engine time, weights, speculation, structure."""
    mi = sm["model_info"]
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
    forced = sum(v or 0 for v in run.requests.get("forced_tokens") or [])
    masks = sum(v or 0 for v in run.requests.get("masks_applied") or [])
    if forced or masks:
        out_tokens = sum(v or 0 for v in run.requests.get("output_tokens") or []) or 1
        mask_s = sum(v or 0 for v in run.requests.get("mask_s") or [])
        parts.append(f"<p class='small'>structured outputs: {forced} forced tokens ({forced / out_tokens:.0%} of the "
                     f"output, entered as prefill chunks), {masks} full masks applied, {mask_s:.3f} s masking</p>")
    return parts


def _totals_html(t: dict) -> str:
    return "<h2>Totals</h2>" + _table(["", "value"], [
        ["documents", _fmt(t["documents"])], ["errors", _fmt(t["errors"])],
        ["prompt tokens", _fmt(t["prompt_tokens"])],
        ["&nbsp; cached (prefix hits)", f"{_fmt(t['cached_tokens'])} ({_fmt(t['cache_hit_rate'], '%')})"],
        ["&nbsp; computed", _fmt(t["computed_tokens"])], ["output tokens", _fmt(t["output_tokens"])],
        ["wall time", _fmt(t["wall_s"], "s")], ["documents/s", _fmt(t["docs_per_s"])],
        ["output tokens/s", _fmt(t["output_tokens_per_s"])],
        ["all tokens/s (prompt + output)", _fmt(t["tokens_per_s"])],
        ["engine steps", _fmt(t["steps"])], ["preemptions", _fmt(t["preemptions"])]])


def _phases_html(ph: dict, e: dict) -> str:
    return "<h2>Phases and engine time</h2>" + _table(["phase", "seconds"], [
        ["model load", _fmt(ph.get("load_s"), "s")], ["setup (run start → first step)", _fmt(ph.get("setup_s"), "s")],
        ["warm-up (first step)", _fmt(ph.get("warmup_s"), "s")],
        ["steady state (after warm-up)", _fmt(ph.get("steady_s"), "s")],
        ["&nbsp; steps with prefill tokens", _fmt(e["prefill_steps_s"], "s")],
        ["&nbsp;&nbsp; of which mixed prefill + decode", _fmt(e["mixed_steps_s"], "s")],
        ["&nbsp; decode-only steps", _fmt(e["decode_steps_s"], "s")],
        ["&nbsp; outside engine steps", _fmt(e["outside_steps_s"], "s")],
        ["wall (excluding load)", _fmt(ph.get("wall_s"), "s")]])


def _time_split_html(ts: dict) -> str:
    rows = [["all", ts["overall"]]] + [[j or "(no job)", v] for j, v in ts["per_job"].items()]
    return ("<h2>Time split per request (queue / prefill / decode)</h2>"
            "<p class='small'>Request-seconds summed over requests: queue = arrival → first scheduled; "
            "prefill = first scheduled → prompt done; decode = first token → finish.</p>" + _table(
                ["group", "requests", "queue", "prefill", "decode", "queue %", "prefill %", "decode %",
                 "prompt tok", "cache hit", "output tok"],
                [[html.escape(str(g)), _fmt(v["requests"]), _fmt(v["queue_s"], "s"), _fmt(v["prefill_s"], "s"),
                  _fmt(v["decode_s"], "s"), _fmt(v["queue_share"], "%"), _fmt(v["prefill_share"], "%"),
                  _fmt(v["decode_share"], "%"), _fmt(v["prompt_tokens"]),
                  _fmt(v["cached_tokens"] / v["prompt_tokens"] if v["prompt_tokens"] else None, "%"),
                  _fmt(v["output_tokens"])] for g, v in rows]))


def _latency_html(lat: dict) -> str:
    return "<h2>Latency distributions</h2>" + _table(
        ["metric", "n", "mean", "p50", "p90", "p99", "max"],
        [[name, _fmt(lat[k]["n"])] + [_fmt(lat[k][p], "ms") for p in ("mean", "p50", "p90", "p99", "max")]
         for name, k in (("TTFT", "ttft_s"), ("TPOT (per request mean)", "tpot_s"), ("inter-token", "itl_s"),
                         ("queue wait", "queue_s"), ("end to end", "e2e_s"))])


def _buckets_html(th: dict, buckets: dict) -> str:
    return (f"<h2>Per shape bucket</h2><p class='small'>long prompt ≥ {th['prompt']} tokens, "
            f"long output ≥ {th['output']} tokens.</p>" + _table(
                ["bucket", "requests", "mean prompt", "mean output", "cache hit", "TTFT p50", "TTFT p90",
                 "TPOT p50", "TPOT p90", "e2e p50"],
                [[b, _fmt(v["requests"]), _fmt(v["mean_prompt_tokens"]), _fmt(v["mean_output_tokens"]),
                  _fmt(v["cache_hit_rate"], "%"), _fmt(v["ttft_s"]["p50"], "ms"), _fmt(v["ttft_s"]["p90"], "ms"),
                  _fmt(v["tpot_s"]["p50"], "ms"), _fmt(v["tpot_s"]["p90"], "ms"), _fmt(v["e2e_s"]["p50"], "ms")]
                 for b, v in buckets.items()]))


def _roofline_html(roof: dict | None) -> list[str]:
    """The roofline section under its heading: calibration, per-stage table, the tuner's steps, the plot."""
    if roof is None:
        return ["<p class='warn'>No model config in this trace: FLOP and byte counts are unavailable.</p>"]
    cal = roof["calibration"]
    parts = ["<p class='small'>" + (
        f"Calibration: {html.escape(str(cal.get('device_name')))} {cal.get('dtype')}: matmul peak "
        f"{_fmt(cal['matmul_flops'], 'FLOP/s')}, memory bandwidth {_fmt(cal['memory_bandwidth'], 'B/s')} "
        f"(ridge {cal['matmul_flops'] / cal['memory_bandwidth']:.0f} FLOP/B), measured "
        f"{_when(cal.get('measured_at'))}{' in quick mode' if cal.get('quick') else ''}; a calibration "
        "taken while other work ran understates the device." if cal else
        "No calibration: run <code>batchgen calibrate</code>.") +
        " MFU = achieved FLOP/s ÷ calibrated peak (prefill); MBU = achieved bytes/s ÷ calibrated bandwidth "
        "(decode). Warm-up steps excluded.</p>"]
    parts.append(_table(["stage", "steps", "time", "FLOPs", "bytes", "FLOP/s", "bytes/s", "FLOP/byte",
                         "MFU", "MBU", "mean decode seqs", "mean prefill tok"],
                        [[name, _fmt(v["steps"]), _fmt(v["time_s"], "s"), _fmt(v["flops"], "FLOP"),
                          _fmt(v["bytes"], "B"), _fmt(v["flops_per_s"], "FLOP/s"), _fmt(v["bytes_per_s"], "B/s"),
                          _fmt(v["intensity"]), _fmt(v["mfu"], "%"), _fmt(v["mbu"], "%"),
                          _fmt(v["mean_decode_seqs"]), _fmt(v["mean_prefill_tokens"])]
                         for name, v in roof["stages"].items()]))
    if roof.get("against_measured"):
        parts.append("<p class='small'>Decode-only steps against this format's steps as the tuner timed them on "
                     "this machine (engine.tuning; each row over 512 cached tokens):</p>")
        parts.append(_table(["shape", "steps here", "median here", "tuner", "ratio"],
                            [[m["shape"], _fmt(m["steps"]), _fmt(m["run_s"], "s"), _fmt(m["measured_s"], "s"),
                              f"{m['ratio']:.2f}x" if m["ratio"] else "—"] for m in roof["against_measured"]]))
    parts.append(_roofline_plot(roof))
    return parts


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
