"""Whether speculation pays this step, and with how many draft tokens.

A decode step over n sequences costs ``cost(n)``; speculating k tokens for each makes it n * (k + 1) rows and
emits, per sequence, the accepted drafts plus one: with per-token acceptance a (i.i.d.), on average
``(1 - a^(k+1)) / (1 - a)`` tokens. Speculating with k pays when

    expected_tokens(a, k) / cost(n * (k + 1))  >  1 / cost(n)

Memory-bound steps (few sequences: reading the weights dominates, extra rows are nearly free) pass for any
useful a; compute-bound steps (many sequences) fail, so the engine switches speculation off by itself.
``StepCost`` learns cost(rows) = fixed + per_row * rows from the steps it observes (least squares over a
window), starting from a prior (e.g. from ``batchgen calibrate``); ``AcceptanceTracker`` keeps a running
acceptance rate so k shrinks when drafts stop being accepted.
"""
from __future__ import annotations

from collections import deque
from typing import Callable


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens emitted per sequence by a step speculating k tokens (accepted drafts + 1)."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(num_decodes: int, acceptance: float, cost: Callable[[int], float], k_max: int,
             margin: float = 0.05) -> int:
    """The k in 0..k_max with the most tokens per second; 0 (no speculation) unless one beats it by ``margin``."""
    if num_decodes <= 0 or k_max <= 0:
        return 0
    base = 1.0 / cost(num_decodes)
    best_k, best = 0, base * (1.0 + margin)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / cost(num_decodes * (k + 1))
        if rate > best:
            best_k, best = k, rate
    return best_k


class StepCost:
    """cost(rows) = fixed + per_row * rows, fitted to the last ``window`` observed decode steps."""

    def __init__(self, fixed_s: float, per_row_s: float, window: int = 64):
        self.fixed_s, self.per_row_s = fixed_s, per_row_s
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        self._obs.append((rows, seconds))
        xs = {r for r, _ in self._obs}
        if len(xs) < 2:                   # one batch width: the slope is unknown; keep the prior's
            return
        n = len(self._obs)
        mx = sum(r for r, _ in self._obs) / n
        my = sum(s for _, s in self._obs) / n
        var = sum((r - mx) ** 2 for r, _ in self._obs)
        slope = sum((r - mx) * (s - my) for r, s in self._obs) / var
        self.per_row_s = max(slope, 0.0)
        self.fixed_s = max(my - self.per_row_s * mx, 0.0)

    def __call__(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows


class AcceptanceTracker:
    """Running acceptance rate (accepted / proposed draft tokens), exponentially weighted."""

    def __init__(self, prior: float = 0.5, weight: float = 0.1):
        self.rate, self.weight = prior, weight
        self.proposed = self.accepted = 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rate += self.weight * (accepted / proposed - self.rate)
