"""Float linear layers whose rows do not depend on how many rows a step has (batch invariance, issue 33).

torch's CPU matmul picks its kernel by shape: with MKL here, one row goes through a matrix-vector kernel, and under
12 rows the rows past a multiple of 4 through other kernels; from 12 rows up each row's result is the same bits at
every row count and position (measured: docs/perf/zen5-epyc-determinism.md). So a step that decodes one sequence
used to give it other bits than a step that decodes it among others. ``Linear`` pads a call with fewer rows than
``min_rows`` with zero rows up to it; ``row_floor`` finds ``min_rows`` for a weight on this machine by probing
(once per shape, dtype and thread count): the smallest row count from which every probed count gives the same
bits as the largest. Where none does, ``tile`` rows: every call runs in fixed tiles of ``TILE`` rows (the last
padded), the same kernel for every row. The int8 path (engine.quant.int8) computes each row alone already.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = (*range(1, 33), 48, 64)
TILE = 64
_FLOORS: dict[tuple, int | None] = {}


class Linear(nn.Linear):
    """``nn.Linear`` over 2-D [rows, in] inputs, row-invariant once ``min_rows`` / ``tile`` are set (by
    ``engine.models.select_ops.bind_ops`` when the engine is deterministic); the defaults are plain nn.Linear."""

    min_rows: int = 1
    tile: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.tile and x.dim() == 2:
            pad = -m % self.tile
            xp = F.pad(x, (0, 0, 0, pad)) if pad else x
            return torch.cat([F.linear(t, self.weight, self.bias) for t in xp.split(self.tile)])[:m]
        if m >= self.min_rows or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return F.linear(F.pad(x, (0, 0, 0, self.min_rows - m)), self.weight, self.bias)[:m]


def row_floor(weight: torch.Tensor, probe_rows: tuple[int, ...] = PROBE_ROWS) -> int | None:
    """The smallest row count m such that x[:k] @ W^T gives the same bits as the rows of the largest probe for
    every probed k >= m (random x); None when even the second-largest probe differs. Cached per (shape, dtype,
    device, threads)."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads(), probe_rows)
    if key not in _FLOORS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(probe_rows[-1], weight.shape[1], generator=g).to(weight.dtype).to(weight.device)
        ref = F.linear(x, weight)
        floor = None
        for m in reversed(probe_rows[:-1]):
            if not torch.equal(F.linear(x[:m], weight), ref[:m]):
                break
            floor = m
        _FLOORS[key] = floor
    return _FLOORS[key]


def make_row_invariant(model: nn.Module) -> None:
    """Set ``min_rows`` (or ``tile``) on every float ``Linear`` of ``model`` from this machine's probe."""
    for mod in model.modules():
        if type(mod) is Linear and mod.weight.dtype.is_floating_point and mod.weight.device.type == "cpu":
            floor = row_floor(mod.weight.detach())
            mod.min_rows, mod.tile = (floor, 0) if floor is not None else (1, TILE)


__all__ = ["Linear", "row_floor", "make_row_invariant", "TILE"]
