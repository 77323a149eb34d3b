"""The job file: one YAML file per job, parsed into a frozen ``Job`` with every problem reported at once.

Paths in a job are relative to the current directory. Parsing (``load_job``) checks the file's shape: YAML syntax,
unknown keys (with a did-you-mean), missing keys, types and enums (``pipeline.job.job_schema``), and the generation /
engine sections (built into ``SamplingParams`` / ``EngineConfig``). Each
problem names the file, the dotted key and the YAML line. Checks that need the outside world (input files and
columns, output path, model, cron) live in ``pipeline.run.validate``.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import DEFAULT_MODEL, BatchgenError, EngineConfig, SamplingParams, StructuredOutputError, check_structured
from pipeline.io.paths import is_uri, local_output_path
from pipeline.job.job_schema import TOP, check_mapping, line_map
from pipeline.job.structured_output import (
    collisions,
    describe_error,
    error_key,
    file_error,
    resolve_job_spec,
    written_schema,
)
from pipeline.job.templates import Template, TemplateError, parse_template, template_fields
from pipeline.problems import JobError, Problem

DEFAULT_TEMPLATE = "{system}\n\nReference:\n{reference}\n\nDocument:\n{document}\n\nSummary:"
DEFAULT_REDUCE_TEMPLATE = "Summaries of the consecutive parts of one long document:\n\n{summaries}"
DEFAULT_CHAT_TEMPLATE = "Reference:\n{reference}\n\nDocument:\n{document}\n\nSummarize the document."
BUILTIN_PLACEHOLDERS = ("system", "reference", "document")
REDUCE_FIELDS = ("summaries",)


@dataclass(frozen=True)
class InputSpec:
    path: str
    format: str                     # "parquet" | "datasets" | "openai_batch" (pipeline.io.openai_batch)
    id_column: str | None = None    # None -> the row number is the id
    split: str | None = None        # for a saved DatasetDict
    limit: int | None = None        # only the first N rows
    batch_size: int = 1024
    allow_duplicate_ids: bool = False


@dataclass(frozen=True)
class PromptSpec:
    system: str | None = None
    system_column: str | None = None
    reference: str | None = None
    reference_column: str | None = None
    document_column: str = "document"
    template: str = DEFAULT_TEMPLATE
    chat_template: bool = False
    on_too_long: str = "error"      # or truncate_document, or map_reduce (pipeline.prepare.long_docs)
    reduce_template: str = DEFAULT_REDUCE_TEMPLATE   # map_reduce: the document of a reduce request
    kind: str = "template"          # "openai_batch": the prompt is each request's messages (pipeline.io.openai_batch)

    @property
    def placeholders(self) -> list[str]:
        return template_fields(self.template)

    @functools.cached_property
    def parsed(self) -> Template:
        """The template's pieces (``pipeline.job.templates``); ``load_job`` refused any that do not parse."""
        return parse_template(self.template)

    @functools.cached_property
    def parsed_reduce(self) -> Template:
        return parse_template(self.reduce_template, REDUCE_FIELDS)


@dataclass(frozen=True)
class OutputSpec:
    path: str
    format: str = "parquet"         # or "openai_batch": an OpenAI Batch output JSONL (pipeline.io.openai_batch)
    include_columns: tuple[str, ...] = ()
    rows_per_shard: int = 100_000   # a directory output is split into shards of this many rows
    keep_deleted_rows: bool = False  # rows that left the input: dropped (default) or kept at the output's end
    keep_runs: int = 20             # run traces kept under the job dir; older ones are deleted after a run

    @property
    def is_uri(self) -> bool:
        return is_uri(self.path)

    @property
    def local_path(self) -> str:
        """Where the output is assembled and its run state kept: the path itself, or for a URI (``s3://...``) a
        directory under the state dir, published to the URI after each run (``pipeline.io.publish``)."""
        if not self.is_uri:
            return self.path
        return str(local_output_path(self.path))


@dataclass(frozen=True)
class Job:
    name: str
    file: str
    input: InputSpec
    prompt: PromptSpec
    output: OutputSpec
    model: str = DEFAULT_MODEL
    description: str | None = None
    generation: dict = field(default_factory=dict)   # SamplingParams fields, as written
    dedup: bool = True                               # generation.dedup: identical rows computed once
    engine: EngineConfig = field(default_factory=EngineConfig)   # the engine: section, validated and built
    engine_options: tuple[str, ...] = ()             # the engine: keys the job file wrote (jobs on one model merge
                                                     # these; the rest stay the engine's defaults)
    schedule: str | None = None
    lines: dict = field(default_factory=dict, compare=False, repr=False)  # dotted key -> YAML line

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation)

    @property
    def passthrough_columns(self) -> tuple[str, ...]:
        """Input columns copied into the output: the id column first (when the job names one), so every output
        row can be joined back to its input, then ``output.include_columns``."""
        head = (self.input.id_column,) if self.input.id_column else ()
        if self.input.format == "openai_batch" and self.output.format == "openai_batch":
            head += ("url",)                    # each line's endpoint: the shape of its response
        return tuple(dict.fromkeys(head + tuple(self.output.include_columns)))

    def line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def problem(self, key: str | None, message: str) -> Problem:
        return Problem(self.file, key, message, self.line(key) if key else None)


def load_job(path: str | Path) -> Job:
    """Parse and shape-check one job file. Raises ``JobError`` listing every problem found."""
    file = str(path)
    node, data = _read_yaml(path, file)
    lines = line_map(node) if node is not None else {}
    raw: list[tuple[str, str]] = []
    d = check_mapping(data if data is not None else {}, TOP, "", raw)
    problems = [Problem(file, k, m, _nearest_line(lines, k)) for k, m in raw]
    if problems:
        raise JobError(problems)

    inp, pr, out = d["input"], d.get("prompt"), d["output"]
    name = d["name"]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        problems.append(Problem(file, "name", f"must be letters, digits, '-', '_' or '.'; got {name!r}",
                                lines.get("name")))
    fmt = inp.get("format") or ("datasets" if _looks_like_saved_dataset(inp["path"]) else "parquet")
    inp, pr = _input_and_prompt(fmt, inp, pr, file, lines, problems)
    if out.get("format") == "openai_batch" and out.get("keep_deleted_rows"):
        problems.append(Problem(file, "output.keep_deleted_rows", "not supported with output.format openai_batch",
                                lines.get("output.keep_deleted_rows")))
    prompt = _prompt_spec(pr, file, lines, problems)
    _check_counts(inp, out, file, lines, problems)
    gen, eng = d.get("generation") or {}, d.get("engine") or {}
    dedup = gen.get("dedup", True)
    gen = {k: v for k, v in gen.items() if k != "dedup"}
    gen, files = _resolve_structured(gen, file, lines, problems, d.get("allow_outside_files", False))
    built = _build_sections(d.get("model", DEFAULT_MODEL), gen, eng, file, lines, problems, files)
    if "generation" in built:
        problems += _structured_problems(built["generation"], gen, file, lines, inp, out, files)
    if problems:
        raise JobError(problems)
    return Job(
        name=name, file=file, model=d.get("model", DEFAULT_MODEL),
        description=d.get("description"),
        input=InputSpec(path=inp["path"], format=fmt, id_column=inp.get("id_column"),
                        split=inp.get("split"), limit=inp.get("limit"), batch_size=inp.get("batch_size") or 1024,
                        allow_duplicate_ids=inp.get("allow_duplicate_ids", False)),
        prompt=prompt,
        output=OutputSpec(path=out["path"], format=out.get("format") or "parquet",
                          include_columns=tuple(out.get("include_columns") or ()),
                          rows_per_shard=out.get("rows_per_shard") or 100_000,
                          keep_deleted_rows=out.get("keep_deleted_rows", False),
                          keep_runs=out.get("keep_runs") or 20),
        generation=gen, dedup=dedup, engine=built["engine"], engine_options=tuple(sorted(eng)),
        schedule=d.get("schedule"), lines=lines,
    )


def _read_yaml(path: str | Path, file: str) -> tuple[Any, Any]:
    """The job file's YAML node tree (for line numbers) and data; JobError when unreadable or not YAML."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobError([Problem(file, None, f"cannot read job file ({e})")]) from None
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        detail = " ".join(str(x) for x in (getattr(e, "problem", None), getattr(e, "context", None)) if x)
        raise JobError([Problem(file, None, f"YAML syntax error: {detail or e}",
                                mark.line + 1 if mark else None)]) from None


def _input_and_prompt(fmt: str, inp: dict, pr: dict | None, file: str, lines: dict,
                      problems: list[Problem]) -> tuple[dict, dict]:
    """The input and prompt sections as the job uses them: an openai_batch input's prompt is fixed."""
    if fmt == "openai_batch":
        # NOTE: each request's messages are its prompt, through the model's chat template; only on_too_long
        # may be set (pipeline.io.openai_batch).
        for k in pr or {}:
            if k not in ("on_too_long", "reduce_template"):
                problems.append(Problem(file, f"prompt.{k}", "not used with input.format openai_batch: each "
                                        "request's messages are its prompt (only prompt.on_too_long applies)",
                                        lines.get(f"prompt.{k}")))
        pr = {**(pr or {}), "kind": "openai_batch", "chat_template": True, "document_column": "body",
              "template": "{document}"}
        inp = {"id_column": "custom_id", **inp}
    elif pr is None:
        problems.append(Problem(file, "prompt", "missing required key"))
        pr = {}
    return inp, pr


def _prompt_spec(pr: dict, file: str, lines: dict, problems: list[Problem]) -> PromptSpec:
    """The prompt section as a ``PromptSpec``; its templates checked."""
    for a, b in (("system", "system_column"), ("reference", "reference_column")):
        if a in pr and b in pr:
            problems.append(Problem(file, f"prompt.{b}", f"give either prompt.{a} or prompt.{b}, not both",
                                    lines.get(f"prompt.{b}")))
    prompt = PromptSpec(**{k: v for k, v in pr.items()})
    if "template" not in pr and pr.get("chat_template"):
        prompt = dataclasses.replace(prompt, template=DEFAULT_CHAT_TEMPLATE)
    for key, text, allowed, needed in (("prompt.template", prompt.template, None, "document"),
                                       ("prompt.reduce_template", prompt.reduce_template, REDUCE_FIELDS, "summaries")):
        try:
            fields = parse_template(text, allowed).fields
        except TemplateError as e:
            problems.append(Problem(file, key, str(e), lines.get(key)))
            continue
        if needed not in fields:
            problems.append(Problem(file, key, f"must contain the {{{needed}}} placeholder", lines.get(key)))
    return prompt


def _check_counts(inp: dict, out: dict, file: str, lines: dict, problems: list[Problem]) -> None:
    for key in ("limit", "batch_size"):
        if inp.get(key) is not None and inp[key] < 1:
            problems.append(Problem(file, f"input.{key}", f"must be >= 1, got {inp[key]}",
                                    lines.get(f"input.{key}")))
    for key in ("rows_per_shard", "keep_runs"):
        if out.get(key) is not None and out[key] < 1:
            problems.append(Problem(file, f"output.{key}", "must be >= 1", lines.get(f"output.{key}")))


def _resolve_structured(gen: dict, file: str, lines: dict, problems: list[Problem],
                        allow_outside: bool) -> tuple[dict, dict]:
    """``generation.structured_outputs`` resolved (schema files read) and the files read (kind -> path); dropped,
    with a problem, when it cannot be."""
    if gen.get("structured_outputs"):
        try:
            spec, files = resolve_job_spec(gen["structured_outputs"], file, allow_outside)
            return {**gen, "structured_outputs": spec}, files
        except ValueError as e:
            sub, message = e.args
            key = f"generation.structured_outputs.{sub}"
            problems.append(Problem(file, key, message, _nearest_line(lines, key)))
            gen = {k: v for k, v in gen.items() if k != "structured_outputs"}
    return gen, {}


def _build_sections(model: str, gen: dict, eng: dict, file: str, lines: dict, problems: list[Problem],
                    files: dict) -> dict:
    """The generation and engine sections built (``SamplingParams``, ``EngineConfig``): section -> the built one,
    for those that build; a problem naming the key for those that do not."""
    built = {}
    for section, options in (("generation", gen), ("engine", eng)):
        try:
            built[section] = (SamplingParams(**gen) if section == "generation"
                              else EngineConfig.from_options(model, **eng))
        except (BatchgenError, TypeError, ValueError) as e:
            key = next((f"{section}.{k}" for k in options if k in str(e)), section)
            if isinstance(e, StructuredOutputError):
                sub = next(iter(files), None) or error_key(e, None)       # one kind; a file's is never quoted
                key = ".".join(filter(None, ("generation.structured_outputs", sub)))
                e = file_error(sub, files[sub], e) if sub in files else describe_error(e)
            problems.append(Problem(file, key, str(e), _nearest_line(lines, key)))
    return built


def _structured_problems(params: SamplingParams, gen: dict, file: str, lines: dict, inp: dict, out: dict,
                         files: dict) -> list[Problem]:
    """A schema the engine cannot honour, or an object schema whose property is named like an output column:
    refused before any compute (validate, plan, submit), naming the key and the schema keyword."""
    so = params.structured_outputs
    if so is None:
        return []
    key = f"generation.structured_outputs.{so.kind}"
    try:
        check_structured(so)
    except StructuredOutputError as e:
        message = file_error(so.kind, files[so.kind], e) if so.kind in files else describe_error(e)
        return [Problem(file, key, message, _nearest_line(lines, key))]
    passthrough = tuple(c for c in [inp.get("id_column")] + list(out.get("include_columns") or ()) if c)
    return [Problem(file, key, f"property {name!r} is also the name of an output column; rename it in the "
                               "schema (each top-level property becomes a column named after it)",
                    _nearest_line(lines, key)) for name in collisions(written_schema(gen), passthrough)]


def _nearest_line(lines: dict, key: str) -> int | None:
    while key:
        if key in lines:
            return lines[key]
        key = key.rpartition(".")[0]
    return None


def _looks_like_saved_dataset(p: str) -> bool:
    cand = Path(p)
    return (cand / "dataset_info.json").is_file() or (cand / "dataset_dict.json").is_file()


def load_jobs(paths: list[str | Path]) -> list[Job]:
    """Parse several job files; collect every file's problems plus cross-job ones (names, output paths)."""
    jobs, problems = [], []
    for p in paths:
        try:
            jobs.append(load_job(p))
        except JobError as e:
            problems.extend(e.problems)
    problems.extend(cross_job_problems(jobs))
    if problems:
        raise JobError(problems)
    return jobs


def cross_job_problems(jobs: list[Job]) -> list[Problem]:
    problems, names, outputs = [], {}, {}
    for job in jobs:
        if job.name in names:
            problems.append(job.problem("name", f"job name {job.name!r} is also used by {names[job.name]}; "
                                                "names must be unique among jobs submitted together"))
        names.setdefault(job.name, job.file)
        out = job.output.path if job.output.is_uri else str(Path(job.output.path).resolve())
        if out in outputs:
            problems.append(job.problem("output.path", f"{job.output.path} is also the output of "
                                                       f"{outputs[out]}; each job needs its own output path"))
        outputs.setdefault(out, job.file)
    return problems
