"""How long OpenMP threads spin at a barrier before they sleep: set before torch (and its libgomp) loads.

torch's CPU wheels run their parallel regions, and ours (engine/kernels), on GNU OpenMP, whose threads spin
~300,000 iterations at every barrier before sleeping. On a quiet machine that hides the wake-up latency of many
short regions. When another process competes for the cores it is the collapse: the thread that finished first
spins on its core while the team member it waits for is descheduled with nowhere to run, and every short region
of a decode step waits out a time slice. A short spin (``SPIN_COUNT`` iterations, a few microseconds) keeps the
quiet case's speed and lets a waiting thread give its core back. A spin of 0 (passive waiting) is steadier still
under load but slows decode with few sequences (every region pays a futex wake-up); measured side by side with
``batchgen bench --contend 1``: docs/perf/zen5-epyc.md.

libgomp reads its settings once, when it loads, so this applies only where engine/ is imported before torch (the
CLI, the pipeline, Ray replicas); a user's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` always wins. Spinning
changes when a thread waits, never what it computes: tokens are identical (tests/test_omp_wait.py).
"""
from __future__ import annotations

import os
import sys

SPIN_COUNT = "1000"
_USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

# "batchgen" (we set it), "user" (the environment had a setting), "late" (torch was loaded before engine/)
applied_by: str = ""


def apply() -> str:
    """Set ``GOMP_SPINCOUNT`` for this process (and its children) unless the user set a wait policy or torch's
    OpenMP is already loaded; returns who decided (``applied_by``)."""
    global applied_by
    if any(k in os.environ for k in _USER_KNOBS):
        applied_by = "user"
    elif "torch" in sys.modules:
        applied_by = "late"
    else:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        applied_by = "batchgen"
    return applied_by


def describe() -> str:
    """One line for the manifest (``EngineInfo.omp_wait``)."""
    if applied_by == "batchgen":
        return f"GOMP_SPINCOUNT={SPIN_COUNT} (batchgen's default: short spin, then sleep)"
    if applied_by == "user":
        return ", ".join(f"{k}={os.environ[k]}" for k in _USER_KNOBS if k in os.environ) + " (from the environment)"
    return "OpenMP's default spin (torch was imported before engine/, so batchgen's setting could not apply)"


def peer_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for another engine's process (the bench's peers), without the setting batchgen added itself."""
    if applied_by == "batchgen" and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        env = {k: v for k, v in env.items() if k != "GOMP_SPINCOUNT"}
    return env


__all__ = ["SPIN_COUNT", "apply", "describe", "peer_environment"]
