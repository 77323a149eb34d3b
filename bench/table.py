"""The bench's numbers across systems: output agreement, throughput ratios, the printed table and the JSON."""
from __future__ import annotations

import json
import re
from pathlib import Path

from bench.breakdown import format_bound, format_breakdown
from bench.plan_prediction import prediction_line
from bench.result import SystemResult
from bench.systems.registry import INT8_SYSTEMS, PEER_SYSTEMS, STRUCTURED_SYSTEMS


def agreement(results: list[SystemResult]) -> None:
    """match_rate: per system, fraction of requests whose greedy output equals batchgen-nocache's (or batchgen's)."""
    ref = next((r for r in results if r.system == "batchgen-nocache" and r.outputs), None) \
        or next((r for r in results if r.system == "batchgen" and r.outputs), None)
    if ref is None:
        return
    for r in results:
        if r.outputs is not None and len(r.outputs) == len(ref.outputs):
            r.match_rate = sum(a == b for a, b in zip(r.outputs, ref.outputs)) / len(ref.outputs)


def ratios(results: list[SystemResult]) -> dict:
    """Throughput ratios (same work, so wall-time ratios): batchgen (cache on/off) vs the best transformers."""
    # NOTE: a system that failed (errors, or fewer output tokens than the workload asks) did not do the same
    # work, so it is never "the best": its wall time would be meaningless.
    most = max((r.output_tokens for r in results if not r.skipped), default=0)
    ok = [r for r in results if r.wall_s and not r.skipped and not r.extra.get("errors")
          and r.output_tokens == most]
    by = {r.system: r for r in ok if r.system.startswith("batchgen")}
    hf = [r for r in ok if r.system.startswith("hf-")]
    best = min(hf, key=lambda r: r.wall_s) if hf else None
    out = {"best_transformers": best.label if best else None}
    on, off = by.get("batchgen"), by.get("batchgen-nocache")
    if on and best:
        out["batchgen_vs_best_transformers"] = best.wall_s / on.wall_s
    if off and best:
        out["batchgen_nocache_vs_best_transformers"] = best.wall_s / off.wall_s
    if on and off:
        out["batchgen_vs_batchgen_nocache"] = off.wall_s / on.wall_s
    for r in hf:
        if on:
            out[f"batchgen_vs_{r.label.replace(' ', '_')}"] = r.wall_s / on.wall_s
    sp = by.get("batchgen-spec")
    if sp and on:
        out["batchgen_spec_vs_batchgen"] = on.wall_s / sp.wall_s
        a, b = sp.extra.get("decode_tokens_per_s"), on.extra.get("decode_tokens_per_s")
        if a and b:
            out["spec_vs_nospec_decode_tokens_per_s"] = a / b
    peer = next((r for r in ok if r.system == "llama.cpp"), None)
    for q8 in filter(None, (by.get(n) for n in INT8_SYSTEMS)):
        key = q8.system.replace("batchgen-", "").replace("-", "_")           # int8, int8_bf16kv
        if on:
            out[f"batchgen_{key}_vs_batchgen"] = on.wall_s / q8.wall_s
            a, b = q8.extra.get("decode_step_ms_widest"), on.extra.get("decode_step_ms_widest")
            if a and b:
                out[f"{key}_vs_float_decode_step"] = b / a
    dflt = by.get("batchgen-default")
    if dflt and on:
        out["batchgen_default_vs_batchgen"] = on.wall_s / dflt.wall_s
    for free, st in STRUCTURED_SYSTEMS.items():     # constrained vs the same run unconstrained: >= 0.9 is the bar
        a, b = by.get(st), by.get(free)
        if a and b:
            key = st.replace("-", "_")
            out[f"{key}_vs_{free.replace('-', '_')}"] = b.wall_s / a.wall_s
            x, y = a.extra.get("decode_tokens_per_s"), b.extra.get("decode_tokens_per_s")
            if x and y:
                out[f"{key}_decode_tokens_per_s_ratio"] = x / y
    if peer:
        for r in filter(None, (on, *(by.get(n) for n in INT8_SYSTEMS), dflt)):
            out[f"{r.system.replace('-', '_')}_vs_llama_cpp"] = peer.wall_s / r.wall_s
    for name in PEER_SYSTEMS:            # generation time against generation time; the peers' load is apart
        other = next((r for r in ok if r.system == name), None)
        ours = (off, by.get("batchgen-default-nocache")) if name.endswith("-nocache") else (on, dflt)
        for r in filter(None, ours if other else ()):   # prefix caching on against on, off against off
            out[f"{r.system.replace('-', '_')}_vs_{name.replace('-', '_')}"] = other.wall_s / r.wall_s
    return out


# ---- the table ---------------------------------------------------------------------------------------

def _f(v, fmt: str, scale: float = 1.0) -> str:
    """``v * scale`` formatted; "n/a" right-aligned to the same width when unknown."""
    width = int(re.match(r"\d*", fmt).group() or 0)
    return format("n/a", f">{width}") if v is None else format(v * scale, fmt)


def format_table(result: dict) -> str:
    """The printed table: one row per system configuration, then the ratios."""
    systems, r, env = result["systems"], result["ratios"], result["env"]
    lines = _system_rows(result)
    lines.append("")
    lines += _peer_load_lines(systems)
    lines += _cache_ratio_lines(r)
    lines += _variant_ratio_lines(r, systems, env["dtype"])
    lines += _structured_ratio_lines(r, systems)
    lines += _peer_ratio_lines(r)
    lines += _contention_lines(systems)
    lines += _prediction_lines(systems)
    lines += _breakdown_lines(systems)
    lines += _limit_lines(systems)
    lines += _calibration_lines(env)
    return "\n".join(lines)


def _system_rows(result: dict) -> list[str]:
    """The workload line, the header and one row per system (skipped and failed ones say so)."""
    w, env = result["workload"], result["env"]
    lines = [f"workload {w['shape']}: n={w['n']} groups={w['groups']} prefix={w['prefix_tokens']} "
             f"doc={w['doc_tokens']} out={w['output_tokens']} | model {env['model']} {env['dtype']} "
             f"threads={env['threads']} | load avg {env.get('loadavg_before')} -> {env.get('loadavg_after')}"]
    lw = max([20] + [len(s["label"]) for s in result["systems"]])     # the label column: the longest label
    head = (f"{'system':<{lw}} {'wall s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT50 s':>9} {'TTFT90 s':>9} "
            f"{'TPOT50ms':>9} {'TPOT90ms':>9} {'hit %':>6} {'MFU %':>6} {'preMFU%':>7} {'decMBU%':>7} {'match':>6}")
    lines += [head, "-" * len(head)]
    for s in result["systems"]:
        if s["skipped"]:
            lines.append(f"{s['label']:<{lw}} skipped: {s['skipped']}")
            continue
        if s["extra"].get("errors"):       # did not do the workload: its rates would be meaningless
            first = " ".join(str(s["extra"]["errors"][0]).split())
            lines.append(f"{s['label']:<{lw}} failed after {_f(s['wall_s'], '.1f')} s: {first[:100]}")
            continue
        tt, tp = s["ttft"] or {}, s["tpot"] or {}
        lines.append(
            f"{s['label']:<{lw}} {_f(s['wall_s'], '8.2f')} {_f(s['output_tokens_per_s'], '10.1f')} "
            f"{_f(s['total_tokens_per_s'], '10.1f')} {_f(tt.get('p50'), '9.2f')} {_f(tt.get('p90'), '9.2f')} "
            f"{_f(tp.get('p50'), '9.1f', 1e3)} {_f(tp.get('p90'), '9.1f', 1e3)} "
            f"{_f(s['hit_rate'], '6.1f', 100)} {_f(s['mfu'], '6.1f', 100)} {_f(s['prefill_mfu'], '7.1f', 100)} "
            f"{_f(s['decode_mbu'], '7.1f', 100)} {_f(s['match_rate'], '6.2f')}")
    return lines


def _peer_load_lines(systems: list[dict]) -> list[str]:
    """The peers in their venvs: load (weights, compile, KV) apart from wall; the dtype each ran in and what its
    probes took (it runs at its best here); vLLM's platform and zentorch."""
    lines = []
    for s in systems:
        x = s["extra"]
        if s["skipped"] or x.get("load_s") is None:
            continue
        line = (f"{s['label']} {x.get('version') or ''}: load {x['load_s']:.1f} s, "
                f"warm-up {x.get('warmup_s') or 0:.1f} s (not in wall)")
        probes = {d: v for d, v in (x.get("dtype_probes") or {}).items() if d != "kept"}
        if probes:
            shown = ", ".join(f"{d} {v:.2f} s" if isinstance(v, float) else
                              f"{d} not probed: too big for the memory" if str(v).startswith("not probed")
                              else f"{d} failed" for d, v in probes.items())
            line += f"; fastest of its dtypes: {x['dtype']} (probes: {shown}"
            line += ", kept from an earlier run)" if "kept" in x["dtype_probes"] else ")"
        if x.get("platform"):
            line += f"; platform {x['platform']}"
        if x.get("zentorch"):
            line += f"; zentorch {x['zentorch']}"
        lines.append(line)
    return lines


def _cache_ratio_lines(r: dict) -> list[str]:
    """batchgen, prefix cache on and off, against the best transformers and each other."""
    lines = []
    best = r.get("best_transformers")
    if "batchgen_vs_best_transformers" in r:
        lines.append(f"batchgen (prefix cache on) vs best transformers ({best}): "
                     f"{r['batchgen_vs_best_transformers']:.2f}x")
    if "batchgen_nocache_vs_best_transformers" in r:
        lines.append(f"batchgen (prefix cache off) vs best transformers ({best}): "
                     f"{r['batchgen_nocache_vs_best_transformers']:.2f}x")
    if "batchgen_vs_batchgen_nocache" in r:
        lines.append(f"batchgen cache on vs cache off: {r['batchgen_vs_batchgen_nocache']:.2f}x")
    return lines


def _variant_ratio_lines(r: dict, systems: list[dict], dtype: str) -> list[str]:
    """The int8, defaults and speculation variants against plain batchgen."""
    lines = []
    for key, label in (("int8", "int8"), ("int8_bf16kv", "int8 (bf16 KV)"), ("int8_int8kv", "int8 (int8 KV)")):
        if f"batchgen_{key}_vs_batchgen" in r:
            lines.append(f"batchgen {label} vs batchgen {dtype}: {r[f'batchgen_{key}_vs_batchgen']:.2f}x wall"
                         + (f", {r[f'{key}_vs_float_decode_step']:.2f}x per decode-only step at the widest batch"
                            if f"{key}_vs_float_decode_step" in r else ""))
    if "batchgen_default_vs_batchgen" in r:
        dl = next((x for x in systems if x["system"] == "batchgen-default"), {})
        q = (dl.get("extra") or {}).get("quantization")
        lines.append(f"batchgen defaults{f' (quantization {q})' if q else ''} vs batchgen {dtype}: "
                     f"{r['batchgen_default_vs_batchgen']:.2f}x wall")
    if "batchgen_spec_vs_batchgen" in r:
        sp = next((x for x in systems if x["system"] == "batchgen-spec"), {})
        rate = sp.get("extra", {}).get("acceptance_rate")
        lines.append(f"batchgen speculation (auto) vs off: {r['batchgen_spec_vs_batchgen']:.2f}x wall"
                     + (f", {r['spec_vs_nospec_decode_tokens_per_s']:.2f}x decode tokens/s"
                        if "spec_vs_nospec_decode_tokens_per_s" in r else "")
                     + (f"; acceptance {rate:.0%} of {sp['extra']['draft_tokens']} drafts" if rate is not None
                        else "; gating kept it off"))
    return lines


def _structured_ratio_lines(r: dict, systems: list[dict]) -> list[str]:
    """Constrained (JSON schema) runs against the same run unconstrained."""
    lines = []
    for free, st in STRUCTURED_SYSTEMS.items():
        key = f"{st.replace('-', '_')}_vs_{free.replace('-', '_')}"
        if key in r:
            sx = next((x for x in systems if x["system"] == st), {}).get("extra", {}).get("structured", {})
            share = sx.get("forced_share")
            lines.append(f"{st} (JSON schema) vs {free} (same output tokens): {r[key]:.2f}x throughput"
                         + (f", {r[st.replace('-', '_') + '_decode_tokens_per_s_ratio']:.2f}x decode tokens/s"
                            if st.replace('-', '_') + '_decode_tokens_per_s_ratio' in r else "")
                         + (f"; {sx['forced_tokens']} forced tokens ({share:.0%} of the output), "
                            f"{sx['masks_applied']} masks, {sx['mask_time_s']:.3f} s masking" if share is not None
                            else ""))
    return lines


def _peer_ratio_lines(r: dict) -> list[str]:
    """batchgen against llama.cpp, then against the peers (generation time against generation time)."""
    lines = []
    for key, label in (("batchgen_vs_llama_cpp", "batchgen"), ("batchgen_int8_vs_llama_cpp", "batchgen int8"),
                       ("batchgen_int8_bf16kv_vs_llama_cpp", "batchgen int8 (bf16 KV)"),
                       ("batchgen_int8_int8kv_vs_llama_cpp", "batchgen int8 (int8 KV)"),
                       ("batchgen_default_vs_llama_cpp", "batchgen defaults")):
        if key in r:
            lines.append(f"{label} vs llama.cpp: {r[key]:.2f}x")
    for name in PEER_SYSTEMS:
        for ours in ("batchgen", "batchgen-default", "batchgen-nocache", "batchgen-default-nocache"):
            key = f"{ours.replace('-', '_')}_vs_{name.replace('-', '_')}"
            if key in r:
                lines.append(f"{ours} vs {name}: {r[key]:.2f}x (generation time)")
    return lines


def _contention_lines(systems: list[dict]) -> list[str]:
    """bench --contend: the same system beside busy loops."""
    lines = []
    for s in systems:
        e = s["extra"]
        if e.get("contention_ratio"):
            lines.append(f"{s['label']} beside {e['contend']} busy loop(s): {e['contended_wall_s']:.1f} s, "
                         f"{e['contention_ratio']:.2f}x its quiet time; tokens "
                         f"{'identical' if e['contended_same_tokens'] else 'CHANGED'}")
    return lines


def _prediction_lines(systems: list[dict]) -> list[str]:
    """Each batchgen system: what ``batchgen plan`` predicts for its work against its wall (bench.plan_prediction)."""
    ran = [s for s in systems if not s["skipped"] and s["wall_s"] and s["extra"].get("predicted_engine_s")]
    return [f"{s['label']}: {prediction_line(s['extra']['predicted_engine_s'], s['wall_s'])}" for s in ran]


def _breakdown_lines(systems: list[dict]) -> list[str]:
    """Each system's time breakdown, then int8's matmul bound against the float run."""
    lines = []
    for s in systems:
        if s["extra"].get("breakdown"):
            lines += ["", *format_breakdown(s["label"], s["extra"]["breakdown"])]
    float_sys = next((s for s in systems if s["system"] == "batchgen" and not s["skipped"]
                      and s["extra"].get("breakdown")), None)
    bounds = [line for s in systems if float_sys and s["system"] in INT8_SYSTEMS and not s["skipped"]
              and s["extra"].get("breakdown")
              for line in format_bound(s["label"], float_sys["label"], float_sys["extra"]["breakdown"],
                                       s["extra"]["breakdown"])]
    if bounds:
        lines += ["", "int8's matmul bound (bench.breakdown.matmul_bound):", *bounds]
    return lines


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _giga(v) -> str:
    """A rate in giga-units, three significant digits."""
    return "n/a" if v is None else f"{v / 1e9:.3g}"


def limit_line(s: dict) -> str:
    """One system's 'how close to the limit' line: prefill against the matmul peak of the format that
    ran, decode at 1 row (and all decode-only steps) against the bandwidth bound; n/a where unknown."""
    lim = s.get("limits")
    fmt = (lim or {}).get("format") or s["extra"].get("format")
    head = f"{s['label']}{f' ({fmt})' if fmt else ''}"
    if not fmt:
        return f"{head}: n/a (no step stats)"
    if not lim or not lim.get("matmul_flops"):
        return f"{head}: n/a (no calibration)"
    cd = lim["calibration_dtype"]
    kernel = lim.get("peak_kernel") or ("q8_linear only: recalibrate with `batchgen calibrate --dtype int8`"
                                        if cd == "int8" else "")
    pre = (f"prefill {_pct(s.get('prefill_peak_fraction'))} of the {cd} peak ({_giga(lim['prefill_flops_per_s'])} of "
           f"{_giga(lim['matmul_flops'])} {'GOP/s' if cd == 'int8' else 'GFLOP/s'}{f', {kernel}' if kernel else ''})")
    bw = _giga(lim["memory_bandwidth"])
    if lim.get("decode1_steps"):
        dec1 = (f"decode at 1 row {_pct(s.get('decode1_bound_fraction'))} of the bandwidth bound "
                f"({_giga(lim['decode1_bytes_per_s'])} of {bw} GB/s, {lim['decode1_steps']} steps)")
    else:
        dec1 = "decode at 1 row n/a (no 1-row decode-only steps)"
    return f"{head}: {pre}; {dec1}; all decode-only steps {_pct(s.get('decode_bound_fraction'))}"


def _limit_lines(systems: list[dict]) -> list[str]:
    """Every system that ran, how close to this machine's limits (batchgen systems: step stats; others n/a)."""
    ran = [s for s in systems if not s["skipped"]]
    if not any(s.get("limits") or s["extra"].get("format") for s in ran):
        return []
    return ["", "how close to the limit (prefill FLOP/s / the format's matmul peak; decode-only bytes/s / read "
                "bandwidth: docs/guide/reports.md):", *(limit_line(s) for s in ran)]


def _calibration_lines(env: dict) -> list[str]:
    if not env.get("calibration"):
        return []
    c = env["calibration"]
    lines = [f"roofline: calibrated peak {c['matmul_flops'] / 1e9:.0f} GFLOP/s, "
             f"{c['memory_bandwidth'] / 1e9:.1f} GB/s{' (quick)' if c['quick'] else ''}; "
             "MFU counts model FLOPs each system computed (no padding, window-limited attention)"]
    per = env.get("calibrations") or {}
    if set(per) - {env.get("dtype")}:          # batchgen systems ran in other formats: their peaks too
        lines.append("peaks per format: " + "; ".join(_peak_text(d, x) for d, x in per.items()))
    return lines


def _peak_text(dtype: str, c: dict) -> str:
    """e.g. ``int8 517 GOP/s (torch._int_mm; q8_linear 300)``."""
    unit = "GOP/s" if dtype == "int8" else "GFLOP/s"
    others = [f"{k} {_giga(v)}" for k, v in (c.get("kernel_flops") or {}).items() if k != c.get("peak_kernel")]
    kernel = "; ".join(([c["peak_kernel"]] if c.get("peak_kernel") else []) + others)
    return (f"{dtype} {_giga(c['matmul_flops'])} {unit}" + (f" ({kernel})" if kernel else "")
            + (" (quick)" if c.get("quick") else ""))


def save_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
