"""Errors the pipeline shows the user as one clear message (no traceback): each names file, key/line or row."""
from __future__ import annotations

from dataclasses import dataclass

from engine import BatchgenError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job file: where (file, dotted key, YAML line) and what is expected."""
    file: str
    key: str | None
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = self.file + (f":{self.line}" if self.line else "")
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class JobError(BatchgenError):
    """One or more problems with job files, reported all at once."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class RunError(BatchgenError):
    """A run cannot go on (lock held, disk full, fail-fast row error); what is committed stays valid."""


class Interrupted(RunError):
    """SIGTERM / Ctrl-C: committed work is kept; running the same command again resumes."""
