"""How a run that stops early is recorded and reported: what ``Runner`` does with the exception that ended it."""
from __future__ import annotations

import errno
from dataclasses import dataclass

from engine import BatchgenError
from pipeline.io.tables import InputError
from pipeline.problems import Interrupted, RunError


@dataclass(frozen=True)
class Failure:
    status: str                          # the run history's status: interrupted | failed
    message: str                         # ... and its error
    flush_trace: bool                    # write the trace (the engine may have steps to add)
    raise_instead: BaseException | None  # the user's error to raise in its place (None: re-raise it)


def failure_of(e: BaseException) -> Failure:
    if isinstance(e, Interrupted):
        return Failure("interrupted", str(e), True, None)
    if isinstance(e, BatchgenError):
        return Failure("failed", str(e), True, None)
    if isinstance(e, InputError):
        err = RunError(f"job input became unreadable during the run: {e}")
        return Failure("failed", str(err), False, err)
    if isinstance(e, OSError):
        # NOTE: part files and the output are written atomically (whole or not at all), so after any I/O fault
        # what was committed is intact and a rerun resumes from it.
        what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        err = RunError(f"cannot write {e.filename or 'the run state'}: {what}. Rows committed so far are kept; "
                       "fix that and run the same command again to resume.")
        return Failure("failed", str(err), False, err)
    if isinstance(e, KeyboardInterrupt):   # a second Ctrl-C: stopped at once; committed rows are kept
        return Failure("interrupted", "interrupted (Ctrl-C twice)", True, None)
    return Failure("failed", f"{type(e).__name__}: {e}", True, None)


__all__ = ["Failure", "failure_of"]
