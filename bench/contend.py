"""Competing load for ``batchgen bench --contend N``: N busy-loop processes while a system runs.

A cron job shares its machine; 2-thread CPU inference that loses far more than its fair share to one competing
process (a fair share makes a run ~1.5x slower on 2 cores) is a bug of ours. Each loop is a separate process
spinning in pure Python (CPU only, no memory traffic), started before the system runs and killed after it.
"""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

BUSY_LOOP = "while True:\n    pass\n"


@contextmanager
def contention(n: int) -> Iterator[list[int]]:
    """``n`` busy loops for the body of the ``with``; yields their pids. ``n`` 0: no load."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(max(0, n))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def contended_ratio(quiet_s: float | None, contended_s: float | None) -> float | None:
    """How many times longer the contended run took (1.5 is a fair share of 2 cores with one competitor)."""
    return contended_s / quiet_s if quiet_s and contended_s else None


__all__ = ["BUSY_LOOP", "contention", "contended_ratio"]
