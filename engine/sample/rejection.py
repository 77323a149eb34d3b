"""Verifying a request's draft tokens against the target model's distributions at the k + 1 positions.

Greedy: accept drafts while each equals the target argmax; the first mismatch is replaced by the argmax, and
when every draft is accepted the argmax at the bonus position follows. The result is exactly what greedy
decoding without speculation produces.

Sampling (temperature > 0): the target's own draw at each position decides. Position i draws its token from
p_i by the exponential race (``argmax(p_i / q_i)``, q_i ~ Exp(1): engine.sample.sampler.exponential_race, as the
sampler draws), with q_i from the request's draw for that output position (engine.sample.seeded_draws); the draft
is accepted while it equals that token, the first mismatch emits the target's token and stops, and when all k are
accepted the bonus token follows. A one-hot (n-gram) draft is accepted with probability p_i(d), the standard rule's
rate, every emitted token is exactly the target's sample, and a seeded request emits the same tokens with
speculation on or off.
``probs`` must already be the processed distributions (temperature, top-k/top-p/min-p, penalties).
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.sample.sampler import exponential_race


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


def rejection_sample(draft: Sequence[int], probs: torch.Tensor,
                     generators: torch.Generator | Sequence[torch.Generator | None] | None = None) -> list[int]:
    """probs: [len(draft) + 1, V] target probabilities; ``generators``: one per position (a seeded request's
    draws, engine.sample.seeded_draws), or one generator (None: torch's) drawn in turn. Returns the tokens to emit
    (1..k+1)."""
    k = len(draft)
    assert probs.shape[0] == k + 1, (k, tuple(probs.shape))
    if generators is None or isinstance(generators, torch.Generator):
        generators = [generators] * (k + 1)
    assert len(generators) == k + 1, (k, len(generators))
    probs = probs.float()
    out = []
    for i in range(k + 1):
        # NOTE: one position at a time: an unseeded request's stream is drawn only up to the first rejection
        t = int(exponential_race(probs[i:i + 1], [(0, generators[i])], draw_default=False)[0])
        out.append(t)
        if i < k and t != draft[i]:
            return out
    return out
