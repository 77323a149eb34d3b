"""The closing paragraph of ``batchgen submit``: per job what was computed, reused, dropped or failed, and the
model's throughput and predicted vs achieved cache hit rate."""
from __future__ import annotations


def summarize(report) -> str:
    """The one-paragraph account of a run that ``batchgen submit`` prints (a ``RunReport``)."""
    lines = []
    plan = report.plan
    computed = sum(jr.computed for jr in report.jobs)
    prompt = sum(jr.prompt_tokens for jr in report.jobs)
    cached = sum(jr.cached_tokens for jr in report.jobs)
    out_toks = sum(jr.output_tokens for jr in report.jobs)
    for jr in report.jobs:
        if jr.up_to_date:
            lines.append(f"{jr.job.name}: up to date, nothing to do ({jr.num_rows} rows in {jr.job.output.path}).")
            continue
        bits = [f"{jr.num_rows} rows -> {jr.job.output.path}", f"{jr.computed} computed"]
        if jr.reused:
            bits.append(f"{jr.reused} reused from earlier runs")
        if jr.changed:
            bits.append(f"{jr.changed} recomputed because their prompt, model or parameters changed")
        if jr.dedup_rows:
            bits.append(f"{jr.dedup_rows} identical to another row's request (computed once, "
                        f"{jr.dedup_prompt_tokens + jr.dedup_output_tokens:,} tokens saved)")
        if jr.deleted_kept:
            bits.append(f"{jr.deleted_kept} no longer in the input kept (output.keep_deleted_rows)")
        if jr.deleted_dropped:
            bits.append(f"{jr.deleted_dropped} no longer in the input dropped")
        errs = (jr.manifest or {}).get("rows_with_error", jr.row_errors)
        bits.append(f"{errs} with errors" if errs else "no errors")
        st = (jr.manifest or {}).get("structured") or {}
        if "valid_rows" in st:                      # structured outputs: rows whose JSON matches the schema
            bad = st["invalid_rows"]
            bits.append(f"{st['valid_rows']} valid JSON" + (f", {bad} not (json_error says why)" if bad else ""))
        lines.append(f"{jr.job.name}: " + ", ".join(bits) + ".")
    if computed:
        lines.append(
            f"Model {report.engine_info.name}: {computed} documents in {report.wall_s:.1f}s, "
            f"{(prompt - cached + out_toks) / max(report.wall_s, 1e-9):,.0f} computed tokens/s "
            f"({prompt:,} prompt tokens, {cached:,} from cache, {out_toks:,} generated); cache hit rate "
            f"{_pct(cached, prompt)} achieved vs {_pct(plan.cached_tokens, plan.prompt_tokens)} predicted"
            + (f"; engine time {report.engine_s:.1f}s vs {report.prediction.engine_s:.1f}s predicted."
               if report.prediction is not None and report.engine_s is not None else "."))
    if report.trace_dir is not None:
        lines.append(f"Trace: {report.trace_dir} (batchgen report {report.trace_dir}).")
    return " ".join(lines)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "n/a"
