"""Step 4 of a run: assemble a job's output and manifest.

The row keys (input order) are joined with the committed results; the passthrough columns (the id column
first, then ``output.include_columns``) are streamed from the input again beside them. Rows that left the input
are dropped or kept at the end (``output.keep_deleted_rows``). Output and manifest are written atomically.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine import EngineInfo
from pipeline.assemble.join import JOINED_SCHEMA, JoinCounts, KeyedResults
from pipeline.io.openai_batch import write_output as write_jsonl
from pipeline.io.publish import publish_output, remote_exists
from pipeline.io.tables import iter_batches, iter_output_batches, resized, write_bytes_atomic, write_output
from pipeline.job.rows import RESULT_COLUMNS, hit_rate
from pipeline.job.state import manifest_path_for
from pipeline.job.structured_output import JSON_KINDS, typed_columns
from pipeline.prepare.job_run import JobRun
from pipeline.prepare.key_set import KeySet, digests
from pipeline.prepare.spool import Partitions
from pipeline.problems import RunError

RESULTS_OUT = [c for c in RESULT_COLUMNS if c != "row_key"] + ["row_key"]     # the output's result columns


def assemble(jr: JobRun, info: EngineInfo, wall_s: float, engine_s: float, trace_dir: Path | None = None,
             prediction: dict | None = None, distributed: dict | None = None) -> None:
    """Write the job's output (one row per current input row, input order) and its manifest, atomically.

    Skipped when nothing changed since the last run (same keys digest and layout): ``jr.up_to_date``."""
    job = jr.job
    out_path = Path(job.output.local_path)
    mpath = manifest_path_for(out_path)
    uri = job.output.path if job.output.is_uri else None
    layout = {"include_columns": list(job.passthrough_columns), "rows_per_shard": job.output.rows_per_shard,
              "keep_deleted_rows": job.output.keep_deleted_rows}
    if _up_to_date(jr, out_path, mpath, uri, layout):
        return
    keyed = KeyedResults(jr.state.scratch("keys.arrow"), jr.state.done_parts(), jr.state.scratch("assemble"),
                         jr.num_rows)
    try:
        counts = _write_job_output(jr, info, out_path, keyed)
        jr.state.compact(keyed.results())
    finally:
        keyed.close()
    for name in ("spill.arrow", "keys.arrow"):
        jr.state.scratch(name).unlink(missing_ok=True)
    manifest = {
        "job": job.name, "job_file": job.file, "output": uri or str(out_path),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": info.to_dict(),      # the engine: identity, resolved dtype/device/blocks, config, load
        "generation": dataclasses.asdict(jr.prompts.params), "versions": _versions(),
        **_row_counts(jr, counts),
        "this_run": _this_run(jr, info, wall_s, engine_s, prediction, distributed),
        "structured": _structured(jr, counts),
        "totals": _totals(counts),
        "keys_digest": jr.keys_digest, "layout": layout,
        "trace": None if trace_dir is None else str(trace_dir),
    }
    manifest["invariance"] = _invariance(job.name, info, mpath, jr.reused)
    write_bytes_atomic(json.dumps(manifest, indent=2, default=str).encode(), manifest_path_for(out_path))
    jr.manifest = manifest
    if uri:
        publish_output(out_path, uri, mpath)


def _up_to_date(jr: JobRun, out_path: Path, mpath: Path, uri: str | None, layout: dict) -> bool:
    """Nothing computed or failed, and the manifest has the same keys digest and layout: the output stands (and
    is published again if its remote copy is gone); ``jr.up_to_date`` and ``jr.manifest`` say so."""
    if not (jr.computed == 0 and jr.row_errors == 0 and out_path.exists() and mpath.exists()):
        return False
    try:
        old = json.loads(mpath.read_text())
    except (OSError, ValueError):
        old = {}
    if not (old.get("keys_digest") == jr.keys_digest and old.get("layout", layout) == layout):
        return False
    jr.up_to_date = True
    jr.manifest = old
    if uri and not remote_exists(uri):          # assembled before, but the copy is gone (or failed)
        publish_output(out_path, uri, mpath)
    return True


def _write_job_output(jr: JobRun, info: EngineInfo, out_path: Path, keyed: KeyedResults) -> JoinCounts:
    """Join the row keys with the committed results (``join``: in bounded memory) and write the output; returns the
    counts over its rows."""
    job = jr.job
    openai = job.output.format == "openai_batch"
    kept = None if openai else _deleted_rows(jr, out_path, keyed.keys_path)
    counts = keyed.prepare()
    if counts.rows != jr.num_rows:
        raise RunError(f"job {job.name!r}: internal error assembling output ({counts.rows} rows for "
                       f"{jr.num_rows} inputs)")
    if counts.missing > 0 and jr.num_rows:
        raise RunError(f"job {job.name!r}: {counts.missing} rows have no result; run again to resume")
    fields = [] if openai else jr.prompts.fields
    directory = not str(out_path).endswith(".parquet")
    results = (t.select(RESULTS_OUT) for t in keyed.rows_in_order())
    if openai:
        write_jsonl(_output_tables(jr, results, fields, kept), out_path, job.input.id_column or "", info.name)
    elif jr.num_rows == 0:
        empty = _with_typed(JOINED_SCHEMA.empty_table().select(RESULTS_OUT), fields)
        write_output(iter([kept if kept is not None and kept.num_rows else empty]), out_path, directory)
    else:
        write_output(_output_tables(jr, results, fields, kept), out_path, directory)
    return counts


def _with_typed(part: pa.Table, fields: list) -> pa.Table:
    """An object schema's properties as typed columns, first among the results (``job.structured_output``)."""
    if not fields:
        return part
    typed = typed_columns(part.column("summary").to_pylist(), part.column("json_error").to_pylist(), fields)
    order = ["summary", "json_error"] + [c for c in part.column_names if c not in ("summary", "json_error")]
    part = part.select(order)
    return pa.Table.from_arrays(typed + part.columns, schema=pa.schema(fields + list(part.schema)))


def _output_tables(jr: JobRun, results: Iterator[pa.Table], fields: list, kept: pa.Table | None):
    """The output's shards in input order: the results (``results``: consecutive chunks of rows) with the
    passthrough columns streamed from the input again beside them, then the deleted rows kept (conformed to the
    output's schema)."""
    job = jr.job
    include = list(job.passthrough_columns)
    rows_per = job.output.rows_per_shard
    source = iter_batches(job.input.path, job.input.format, include, job.input.batch_size,
                          job.input.split, job.input.limit) if include else None
    passthrough = resized((pa.Table.from_batches([b]) for b in source), rows_per) if source is not None else None
    schema = None
    for part in resized(results, rows_per):
        part = _with_typed(part, fields)
        if passthrough is not None:
            through = next(passthrough)
            part = pa.Table.from_arrays(through.columns + part.columns,     # (field metadata kept)
                                        schema=pa.schema(list(through.schema) + list(part.schema)))
        yield part.combine_chunks()
        schema = part.schema
    if kept is not None and kept.num_rows and schema is not None:
        kept_rows = _conform(kept, schema)
        for start in range(0, kept_rows.num_rows, rows_per):
            yield kept_rows.slice(start, rows_per).combine_chunks()


def _row_counts(jr: JobRun, counts: JoinCounts) -> dict:
    """The manifest's rows, rows_with_error and deleted_rows."""
    return {"rows": jr.num_rows + jr.deleted_kept, "rows_with_error": counts.rows_with_error,
            "deleted_rows": {"kept": jr.deleted_kept, "dropped": jr.deleted_dropped}}


def _this_run(jr: JobRun, info: EngineInfo, wall_s: float, engine_s: float, prediction: dict | None,
              distributed: dict | None) -> dict:
    """The manifest's ``this_run``: rows, tokens, hit rates, times and speculation of this run."""
    return {"computed": jr.computed, "reused": jr.reused, "changed": jr.changed,
            "row_errors": jr.row_errors, "prompt_tokens": jr.prompt_tokens,
            # rows equal to another request of the run (pipeline.prepare.dedup): its result, tokens not computed
            "deduplicated": {"rows": jr.dedup_rows, "prompt_tokens_saved": jr.dedup_prompt_tokens,
                             "output_tokens_saved": jr.dedup_output_tokens},
            "cached_tokens": jr.cached_tokens, "output_tokens": jr.output_tokens,
            "predicted_hit_rate": hit_rate(jr.predicted_cached, jr.planned_prompt_tokens),
            "achieved_hit_rate": hit_rate(jr.cached_tokens, jr.prompt_tokens),
            "wall_s": round(wall_s, 3),
            "engine_s": round(engine_s, 3),   # after model load
            "predicted_engine_s": prediction["engine_s"] if prediction else None,   # the whole plan
            "predicted_job_engine_s": (round(jr.predicted_engine_s, 2)
                                       if jr.predicted_engine_s is not None else None),
            "load_s": info.load_time_s, "load_breakdown_s": dict(info.load_breakdown),
            "tokens_per_s": round((jr.prompt_tokens + jr.output_tokens) / wall_s, 1) if wall_s else None,
            "speculation": {"draft_tokens": jr.draft_tokens, "accepted_tokens": jr.accepted_tokens,
                            "acceptance_rate": (round(jr.accepted_tokens / jr.draft_tokens, 4)
                                                if jr.draft_tokens else None),
                            "mean_accepted_length": (round(jr.accepted_tokens / jr.spec_steps, 3)
                                                     if jr.spec_steps else None)},
            "distributed": distributed}     # a Ray run (pipeline.execute.ray.driver): replicas, prefills


def _totals(counts: JoinCounts) -> dict:
    """The manifest's ``totals``: prompt and cached tokens over every row of the output."""
    return {"prompt_tokens": counts.prompt_tokens, "cached_tokens": counts.cached_tokens,
            "hit_rate": hit_rate(counts.cached_tokens, counts.prompt_tokens)}


def _invariance(job_name: str, info: EngineInfo, mpath: Path, reused: int) -> dict:
    """The manifest's ``invariance``: this engine's fingerprint (engine.invariance) and every fingerprint whose rows
    the output holds. Rows kept from a run under another fingerprint (another weights format, kernel build, thread
    count, CPU ...) may differ from what this engine would compute for them: logged and recorded."""
    now = info.invariance.get("fingerprint")
    try:
        old = json.loads(mpath.read_text()).get("invariance") or {}
    except (OSError, ValueError):
        old = {}
    before = old.get("output_fingerprints") or []
    held = sorted(set(before) | {now}) if reused and before else [now]
    out = {"fingerprint": now, "output_fingerprints": held}
    if reused and before and before != [now]:
        out["changed"] = {"previous": old.get("fingerprint"), "reused_rows": reused,
                          "differs_in": sorted(k for k, v in info.invariance.items()
                                               if k != "fingerprint" and (old.get("parts") or {}).get(k) != v)}
        print(f"batchgen: warning: job {job_name}: {reused} rows were kept from a run under another invariance "
              f"fingerprint ({old.get('fingerprint')}, now {now}: {', '.join(out['changed']['differs_in']) or '?'} "
              "changed); they may differ from what this engine would compute (docs/guide/determinism.md)",
              file=sys.stderr)
    out["parts"] = {k: v for k, v in info.invariance.items() if k != "fingerprint"}
    return out


def _structured(jr: JobRun, counts: JoinCounts) -> dict | None:
    """The manifest's count of structured results: rows valid against the schema (the whole output), and this
    run's forced tokens and grammar masks (None when the job asks for no structure)."""
    so = jr.prompts.params.structured_outputs
    if so is None and not jr.json_rows and not jr.forced_tokens:
        return None
    out = {"kind": so.kind if so else "per request", "columns": [f.name for f in jr.prompts.fields]}
    if so is not None and so.kind in JSON_KINDS:          # per-request schemas (OpenAI lines): this run only
        out.update(valid_rows=counts.json_valid, invalid_rows=counts.json_invalid)
    out["this_run"] = {"rows_checked": jr.json_rows, "valid_rows": jr.json_valid, "forced_tokens": jr.forced_tokens,
                       "masks_applied": jr.masks_applied, "mask_time_s": round(jr.mask_s, 4)}
    return out


def _deleted_rows(jr: JobRun, out_path: Path, keys_path: Path) -> pa.Table | None:
    """Rows of the previous output whose id is no longer in the input (its row keys: ``keys_path``): counted,
    and returned when the job keeps them (``output.keep_deleted_rows``); None when there are none or they are
    dropped. Memory: the ids of both sides go to disk as 16-byte digests in parts by hash (``spool.Partitions``),
    compared a part at a time; only the deleted ids' digests are held."""
    if not out_path.exists():
        return None
    with pa.OSFile(str(keys_path)) as f:
        current = _id_parts(b.column("row_key") for b in _ipc_batches(pa.ipc.open_file(f)))
    try:
        prev = _id_parts(b.column("row_key") for b in iter_output_batches(out_path, columns=["row_key"]))
    except (pa.ArrowException, OSError, KeyError):
        current.close()
        return None                  # not an output of ours (or unreadable): nothing to carry over
    try:
        gone_parts, n = [], 0
        for cur, old in zip(current.parts(), prev.parts()):
            if len(old):
                old = old.view(np.uint64).reshape(-1, 2)          # the [n, 2] digests of key_set.digests
                out = ~KeySet([cur.view(np.uint64).reshape(-1, 2)]).contains(old)
                n += int(out.sum())
                gone_parts.append(old[out])
    finally:
        current.close()
        prev.close()
    if not n:
        return None
    if not jr.job.output.keep_deleted_rows:
        jr.deleted_dropped = n
        return None
    jr.deleted_kept = n
    gone = KeySet(gone_parts)
    # Batch by batch: only the kept rows are held, not the whole previous output.
    kept = [pa.Table.from_batches([b]).filter(pa.array(gone.contains(_id_digests(b.column("row_key")))))
            for b in iter_output_batches(out_path)]
    return pa.concat_tables([t for t in kept if t.num_rows] or kept[:1])


_DIGEST = np.dtype([("hi", np.uint64), ("lo", np.uint64)])     # a row of key_set.digests, as one record


def _ipc_batches(reader) -> Iterator[pa.RecordBatch]:
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def _id_digests(keys: pa.Array) -> np.ndarray:
    """The row ids' digests (``key_set.digests``) of row keys (``<id>#<20 hex digits>``)."""
    return digests(pc.replace_substring_regex(keys, pattern="#[0-9a-f]{20}$", replacement="").to_pylist())


def _id_parts(columns) -> Partitions:
    """Every row id's digest, on disk in parts by digest."""
    parts = Partitions(_DIGEST)
    for keys in columns:
        d = _id_digests(keys)
        parts.add(np.ascontiguousarray(d).view(_DIGEST).reshape(-1), d[:, 1])
    return parts


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, others cast (null where they cannot be)."""
    cols = []
    for f in schema:
        if f.name in table.column_names:
            try:
                cols.append(table.column(f.name).cast(f.type))
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        cols.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("batchgen", "torch", "transformers", "pyarrow", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
