"""Checks on a parsed job that need the outside world, without running the model.

Input files readable and their columns present with the right types, template placeholders that are
columns, output path writable, model resolvable, cron expression valid. Every problem names the job file,
the key and its YAML line (see ``Job.problem``).
"""
from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path

import pyarrow as pa

from engine import BatchgenError, ConfigError, EngineConfig
from pipeline.io.tables import InputError, count_rows, input_schema
from pipeline.job.job_file import BUILTIN_PLACEHOLDERS, Job, cross_job_problems, load_job
from pipeline.job.prompts import template_columns
from pipeline.job.rows import RESULT_COLUMNS
from pipeline.problems import JobError, Problem
from pipeline.run.overlap import overlap_problems


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t) or pa.types.is_null(t)


def _column_problem(job: Job, key: str, col: str, schema: pa.Schema) -> Problem:
    hint = difflib.get_close_matches(col, schema.names, n=1)
    return job.problem(key, f"column {col!r} is not in the input {job.input.path}"
                       + (f" (did you mean {hint[0]!r}?)" if hint else f"; columns are {', '.join(schema.names)}"))


def check_job(job: Job) -> list[Problem]:
    problems: list[Problem] = []
    try:
        schema = input_schema(job.input.path, job.input.format, job.input.split)
        count_rows(job.input.path, job.input.format, job.input.split)   # every Parquet footer readable
    except InputError as e:
        problems.append(job.problem("input.path", str(e)))
        schema = None
    if schema is not None:
        p = job.prompt
        text_cols = [("prompt.document_column", p.document_column),
                     ("prompt.system_column", p.system_column), ("prompt.reference_column", p.reference_column)]
        for key, col in text_cols:
            if col is None:
                continue
            if col not in schema.names:
                problems.append(_column_problem(job, key, col, schema))
            elif not _is_text(schema.field(col).type):
                problems.append(job.problem(key, f"column {col!r} must hold text (string), but its type is "
                                                 f"{schema.field(col).type}"))
        if job.input.id_column and job.input.id_column not in schema.names:
            problems.append(_column_problem(job, "input.id_column", job.input.id_column, schema))
        problems.extend(_template_problems(job, schema))
        for col in job.passthrough_columns:
            key = "input.id_column" if col == job.input.id_column else "output.include_columns"
            if col not in schema.names:
                if key == "output.include_columns":     # a missing id column is reported above
                    problems.append(_column_problem(job, key, col, schema))
            elif col in RESULT_COLUMNS:
                problems.append(job.problem(key, f"column {col!r} clashes with an output column of the same "
                                                 f"name ({', '.join(RESULT_COLUMNS)}); it is copied into the "
                                                 "output"))
    if "system" in job.prompt.placeholders and job.prompt.system is None and job.prompt.system_column is None:
        problems.append(job.problem("prompt", "the template uses {system} but neither prompt.system nor "
                                              "prompt.system_column is set"))
    if "reference" in job.prompt.placeholders and job.prompt.reference is None \
            and job.prompt.reference_column is None:
        problems.append(job.problem("prompt", "the template uses {reference} but neither prompt.reference nor "
                                              "prompt.reference_column is set"))
    problems.extend(_output_problems(job))
    problems.extend(_model_problems(job))
    if job.schedule is not None:
        from pipeline.schedule.cron import CronError, validate_schedule
        try:
            validate_schedule(job.schedule)
        except CronError as e:
            problems.append(job.problem("schedule", str(e)))
    return problems


def _template_problems(job: Job, schema: pa.Schema) -> list[Problem]:
    """A template field that is neither a built-in placeholder nor an input column: its position, a did-you-mean,
    else the names the template may use."""
    known = list(BUILTIN_PLACEHOLDERS) + schema.names
    problems, unknown = [], set(template_columns(job.prompt)) - set(schema.names)
    for _, f in job.prompt.parsed.pieces:
        if f is None or f.name not in unknown:
            continue
        unknown.discard(f.name)                 # once per name, at its first use
        hint = difflib.get_close_matches(f.name, known, n=1)
        names = ", ".join(f"{{{n}}}" for n in known[:30]) + (", ..." if len(known) > 30 else "")
        problems.append(job.problem("prompt.template", f"placeholder {f.raw} at character {f.at} is neither "
                                    "system, reference, document nor an input column"
                                    + (f" (did you mean {{{hint[0]}}}?)" if hint else f"; known names: {names}")))
    return problems


def _output_problems(job: Job) -> list[Problem]:
    if job.output.is_uri:
        from pipeline.io.publish import output_filesystem
        from pipeline.problems import RunError
        try:
            output_filesystem(job.output.path)
        except RunError as e:
            return [job.problem("output.path", str(e))]
        return []
    out = Path(job.output.path)
    is_file = str(out).endswith(".parquet") or job.output.format == "openai_batch"     # the latter: one JSONL
    if out.exists() and is_file and out.is_dir():
        return [job.problem("output.path", f"{out} is a directory; name a .parquet file or a directory path "
                                           "without the .parquet suffix")]
    if out.exists() and not is_file and out.is_file():
        return [job.problem("output.path", f"{out} is an existing file; a path without .parquet is written as "
                                           "a directory of shards")]
    anc = out.parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
        return [job.problem("output.path", f"cannot write under {anc} (not a writable directory)")]
    if out.exists() and not os.access(out, os.W_OK):
        return [job.problem("output.path", f"{out} exists and is not writable")]
    return []


def _model_problems(job: Job) -> list[Problem]:
    """The model spec (the engine's resolver is the one source of truth for what it may be) and the engine
    settings as the engine would resolve them (dtype, backend, KV pool), without loading weights."""
    try:
        setup = engine_setup(job.engine)
    except ConfigError as e:
        return [job.problem("engine", str(e))]
    except BatchgenError as e:
        return [job.problem("model", str(e))]
    cfg = setup.config
    problem = kv_pool_problem(setup.num_kv_blocks, cfg.block_size, cfg.max_num_seqs)
    return [job.problem("engine", problem)] if problem else []


def kv_pool_problem(num_blocks: int | None, block_size: int, max_num_seqs: int) -> str | None:
    """A KV pool with fewer blocks than ``max_num_seqs`` (less than one block per sequence) cannot run the batch
    it is configured for: the message saying so, or None."""
    if num_blocks is None or num_blocks >= max_num_seqs:
        return None
    return (f"impossible settings: the KV cache pool has {num_blocks} block{'s' * (num_blocks != 1)} of "
            f"{block_size} tokens, less than one block per sequence for max_num_seqs {max_num_seqs}; raise "
            "engine.kv_cache_memory (or num_gpu_blocks_override) or lower engine.max_num_seqs")


@functools.lru_cache(maxsize=16)
def engine_setup(config: EngineConfig):
    """Jobs on one model with the same engine settings resolve once per process (validation and the plan)."""
    from engine import setup_engine  # NOTE: here, not at the top: resolving imports torch
    return setup_engine(config)


def validate_files(paths: list[str]) -> tuple[list[Job], list[Problem]]:
    """Parse and check every job file; return the jobs that parsed and every problem found."""
    jobs, problems = [], []
    for p in paths:
        try:
            job = load_job(p)
        except JobError as e:
            problems.extend(e.problems)
            continue
        jobs.append(job)
        problems.extend(check_job(job))
    problems.extend(cross_job_problems(jobs))
    problems.extend(overlap_problems(jobs))
    return jobs, problems


def load_valid_jobs(paths: list[str]) -> list[Job]:
    jobs, problems = validate_files(paths)
    if problems:
        raise JobError(problems)
    return jobs


def load_valid_jobs_recorded(paths: list[str]) -> list[Job]:
    """``load_valid_jobs`` for runs: when a job file has problems, each submitted job gets a failed run in the
    run history with them (so a scheduled run that never started shows in ``batchgen status``)."""
    jobs, problems = validate_files(paths)
    if not problems:
        return jobs
    from pipeline.run import history
    parsed = {job.file: job.name for job in jobs}
    bad_files = list(dict.fromkeys(p.file for p in problems))
    for path in paths:
        mine = [str(p) for p in problems if p.file == path]
        error = "\n".join(mine) if mine else \
            f"not run: other job files submitted with it have problems ({', '.join(bad_files)})"
        name = parsed.get(path) or _name_in(path)
        try:
            history.finish_run(history.start_run(name, {"job_file": path}), "failed", error=error)
        except history.HistoryError:
            pass                     # NOTE: the problems themselves are what the user must see
    raise JobError(problems)


def _name_in(path: str) -> str:
    """The job's ``name`` as written in a file that did not parse as a job (else the file's stem)."""
    try:
        import yaml
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"].strip():
            return data["name"]
    except Exception:       # NOTE: unreadable or not YAML: the problems say so; here only a name is wanted
        pass
    return Path(path).stem
