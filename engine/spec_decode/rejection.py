"""Verifying a request's draft tokens against the target model's distributions at the k + 1 positions.

Greedy: accept drafts while each equals the target argmax; the first mismatch is replaced by the argmax, and
when every draft is accepted the argmax at the bonus position follows. The result is exactly what greedy
decoding without speculation produces.

Sampling (temperature > 0): the n-gram draft distribution is one-hot, so draft token d at position i is
accepted with probability p_i(d) (the standard min(1, p/q) with q(d) = 1); on rejection the token is drawn
from p_i with d zeroed and renormalised (the residual (p - q)+), and the run stops; if all k are accepted a
bonus token is drawn from p_k. Every emitted token is then distributed exactly as without speculation.
``probs`` must already be the processed distributions (temperature, top-k/top-p/min-p, penalties) at each
position. A seeded request passes its own generator, as the sampler does.
"""
from __future__ import annotations

from typing import Sequence

import torch


def verify_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """target[i]: the argmax at position i, for i in 0..len(draft). Returns the tokens to emit (1..k+1)."""
    assert len(target) == len(draft) + 1, (len(draft), len(target))
    out = []
    for d, t in zip(draft, target):
        out.append(int(t))
        if d != t:
            return out
    out.append(int(target[len(draft)]))
    return out


def rejection_sample(draft: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """probs: [len(draft) + 1, V] target probabilities. Returns the tokens to emit (1..k+1)."""
    k = len(draft)
    assert probs.shape[0] == k + 1, (k, tuple(probs.shape))
    probs = probs.float()
    u = torch.rand(k, generator=generator) if k else None
    out = []
    for i, d in enumerate(draft):
        p = probs[i]
        if u[i] < p[d]:
            out.append(int(d))
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:                    # p was (numerically) one-hot on d: the draw is d after all
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
