"""Time left in a run, from the plan's prediction (``costmodel.predict``) corrected by the pace achieved so far.

Each plan position gets its share of the predicted engine time: of the prefill seconds by the prompt tokens it
computes (not cached), of the decode seconds by the tokens it may generate (``max_tokens``). As positions finish,
the predicted seconds done so far against the seconds taken give the pace; the time left is the predicted
seconds not done at that pace. Before anything finishes it is the prediction less the time since the start. A
row-count ETA (tqdm's) misleads when rows differ in size — a long document in a batch of short ones, a shared
prefix computed once for thousands of rows — which the plan knows. Memory: nothing per position beyond the
plan's own arrays.
"""
from __future__ import annotations

import numpy as np


class PlanEta:
    """``prompt_len`` and ``cached`` by plan position (the plan's own arrays, not copied), ``max_tokens`` by
    position; a position's predicted seconds are ``prefill_rate`` per prompt token it computes plus
    ``decode_rate`` per token it may generate, worked out when it finishes (no array of its own)."""

    def __init__(self, prompt_len: np.ndarray, cached: np.ndarray, max_tokens: np.ndarray, prefill_rate: float,
                 decode_rate: float, t_start: float):
        self.prompt_len, self.cached, self.max_tokens = prompt_len, cached, max_tokens
        self.prefill_rate, self.decode_rate = prefill_rate, decode_rate
        self.total = prefill_rate * _computed_sum(prompt_len, cached) + decode_rate * float(np.sum(max_tokens))
        self.done_s = 0.0
        self.t_start = t_start

    @classmethod
    def of(cls, plan, prediction, max_tokens: np.ndarray, t_start: float) -> PlanEta | None:
        """From ``plan`` (prompt_len, cached by position), its ``prediction`` (prefill_s, decode_s) and each
        position's ``max_tokens``; None without a prediction."""
        if prediction is None or plan.num_requests == 0:
            return None
        computed, out = _computed_sum(plan.prompt_len, plan.cached), float(np.sum(max_tokens))
        return cls(plan.prompt_len, plan.cached, max_tokens, prediction.prefill_s / computed if computed else 0.0,
                   prediction.decode_s / out if out else 0.0, t_start)

    def seconds_at(self, position: int) -> float:
        """The predicted seconds of plan position ``position``."""
        computed = max(int(self.prompt_len[position]) - int(self.cached[position]), 0)
        return self.prefill_rate * computed + self.decode_rate * float(self.max_tokens[position])

    def finished(self, position: int) -> None:
        self.done_s += self.seconds_at(position)

    def left_s(self, now: float) -> float:
        elapsed = max(now - self.t_start, 0.0)
        if self.done_s <= 0:
            return max(self.total - elapsed, 0.0)
        return max(self.total - self.done_s, 0.0) * elapsed / self.done_s

    def text(self, now: float) -> str:
        s = int(round(self.left_s(now)))
        h, m = divmod(s // 60, 60)
        return f"ETA {h}h{m:02d}m" if h else f"ETA {m}m{s % 60:02d}s"


def _computed_sum(prompt_len: np.ndarray, cached: np.ndarray) -> float:
    """Prompt tokens to compute over all positions, a slice at a time (no temporary the size of the plan)."""
    step = 1 << 20
    return float(sum(int(np.maximum(prompt_len[a:a + step] - cached[a:a + step], 0).sum())
                     for a in range(0, len(prompt_len), step)))


__all__ = ["PlanEta"]
