"""A seeded request's random draws as a function of (seed, output position), not of a stream.

A ``torch.Generator`` kept for a request's life would make its n-th draw depend on how many draws came before:
speculation's verification draws differently from plain steps, and whether a request speculates depends on the
batch (the gate), so the same seed would give other tokens in another batch. Here the draw for output position ``p``
comes from a fresh generator seeded by ``mix(seed, p)`` (a counter-based scheme): plain sampling and
verification make the same draw for the same position, whatever else the step held.
"""
from __future__ import annotations

import torch

from engine.sample.sampler import make_generator

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for the draw at output ``position`` of a request seeded with ``seed`` (well mixed: nearby
    seeds and positions give unrelated streams)."""
    return _splitmix64(_splitmix64(int(seed) & _MASK) ^ (int(position) & _MASK))


def position_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream is the request's draw at ``position``."""
    return make_generator(position_seed(seed, position), device)


__all__ = ["position_seed", "position_generator"]
