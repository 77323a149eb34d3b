"""Time left in a run, from the plan's prediction (``costmodel.predict``) corrected by the pace achieved so far.

Each plan position gets its share of the predicted engine time: of the prefill seconds by the prompt tokens it
computes (not cached), of the decode seconds by the tokens it may generate (``max_tokens``). As positions finish,
the predicted seconds done so far against the seconds taken give the pace; the time left is the predicted
seconds not done at that pace. Before anything finishes it is the prediction less the time since the start. A
row-count ETA (tqdm's) misleads when rows differ in size — a long document in a batch of short ones, a shared
prefix computed once for thousands of rows — which the plan knows. Memory: one float64 per position.
"""
from __future__ import annotations

import numpy as np


class PlanEta:
    def __init__(self, seconds: np.ndarray, t_start: float):
        self.seconds = np.asarray(seconds, dtype=np.float64)      # predicted seconds, by plan position
        self.total = float(self.seconds.sum())
        self.done_s = 0.0
        self.t_start = t_start

    @classmethod
    def of(cls, plan, prediction, max_tokens: np.ndarray, t_start: float) -> PlanEta | None:
        """From ``plan`` (prompt_len, cached by position), its ``prediction`` (prefill_s, decode_s) and each
        position's ``max_tokens``; None without a prediction."""
        if prediction is None or plan.num_requests == 0:
            return None
        computed = np.maximum(plan.prompt_len - plan.cached, 0).astype(np.float64)
        out = np.asarray(max_tokens, dtype=np.float64)
        sec = np.zeros(plan.num_requests)
        if computed.sum() > 0:
            sec += prediction.prefill_s * computed / computed.sum()
        if out.sum() > 0:
            sec += prediction.decode_s * out / out.sum()
        return cls(sec, t_start)

    def finished(self, position: int) -> None:
        self.done_s += float(self.seconds[position])

    def left_s(self, now: float) -> float:
        elapsed = max(now - self.t_start, 0.0)
        if self.done_s <= 0:
            return max(self.total - elapsed, 0.0)
        return max(self.total - self.done_s, 0.0) * elapsed / self.done_s

    def text(self, now: float) -> str:
        s = int(round(self.left_s(now)))
        h, m = divmod(s // 60, 60)
        return f"ETA {h}h{m:02d}m" if h else f"ETA {m}m{s % 60:02d}s"


__all__ = ["PlanEta"]
