"""Inputs and outputs never overlap: what a job writes (its output, the manifest and job dir beside it) may not be
an input, lie inside an input directory or match an input glob, and no input may lie inside what a job writes, for
every job submitted together. Paths are compared as real paths (symlinks resolved), so a link cannot hide an
overlap. Without this check a run writes into its own input and every later run reads its output back.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.io.paths import is_uri
from pipeline.job.job_file import Job
from pipeline.job.state import job_dir_for, manifest_path_for
from pipeline.problems import Problem

_MAGIC = "*?["


@dataclass(frozen=True)
class _Input:
    job: Job
    real: Path                      # the input (a glob: its pattern, the fixed part resolved)
    kind: str                       # "dir" | "file" | "glob"


def _local(path: str) -> str | None:
    """A local path for ``path``: itself, or a ``file://`` URI's path; None for a remote URI."""
    if path.startswith("file://"):
        return path[len("file://"):] or "/"
    return None if is_uri(path) else path


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _input_of(job: Job) -> _Input | None:
    path = _local(job.input.path)
    if path is None:
        return None
    if job.input.format == "parquet" and any(c in path for c in _MAGIC):
        parts = Path(path).parts
        fixed = next(i for i, p in enumerate(parts) if any(c in p for c in _MAGIC))
        base = _real(Path(*parts[:fixed])) if fixed else _real(".")
        return _Input(job, base.joinpath(*parts[fixed:]), "glob")
    real = _real(path)
    return _Input(job, real, "dir" if real.is_dir() else "file")


def _glob_match(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """``parts`` (a path's components) matches ``pattern`` as ``glob.glob(recursive=True)`` would."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def _under(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies below it."""
    return a == b or b in a.parents


def _clash(out: Path, written: list[Path], inp: _Input) -> str | None:
    """How what a job writes (``written``: output, manifest, job dir) overlaps ``inp``; None when it does not."""
    if inp.kind == "glob":
        pattern = inp.real.parts
        probes = [out, out / "part-00000.parquet", written[1]]
        hit = next((p for p in probes if _glob_match(p.parts, pattern)), None)
        return None if hit is None else f"the input glob would match {hit}"
    for w in written:
        if w == inp.real:
            return "it would overwrite the input" if w == out else f"{w} would overwrite the input"
        if inp.kind == "dir" and _under(w, inp.real):
            return f"{w} is inside the input directory"
        if _under(inp.real, w):
            return f"the input lies inside {w}, which the run writes"
    return None


def _named(written: str, real: Path) -> str:
    """A path as the job file writes it, and its real path when that differs."""
    return written if os.path.abspath(written) == str(real) else f"{written} ({real})"


def overlap_problems(jobs: list[Job]) -> list[Problem]:
    """A problem on ``output.path`` for each job whose writes overlap the input of any job submitted with it."""
    inputs = [i for i in map(_input_of, jobs) if i is not None]
    problems = []
    for job in jobs:
        out = _real(job.output.local_path)
        written = [out, _real(manifest_path_for(out)), _real(job_dir_for(out))]
        for inp in inputs:
            why = _clash(out, written, inp)
            if why is None:
                continue
            whose = "" if inp.job is job else f" of {inp.job.file}"
            problems.append(job.problem("output.path", f"the output {_named(job.output.path, out)} overlaps the "
                                        f"input {_named(inp.job.input.path, inp.real)}{whose}: {why}; each run would "
                                        "read its own output back. Write the output outside the input"))
            break
    return problems


__all__ = ["overlap_problems"]
