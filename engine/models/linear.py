"""Float linear layers whose rows do not depend on how many rows a step has (batch invariance).

torch's CPU matmul picks its kernel by shape: with MKL here, one row goes through a matrix-vector kernel, and under
12 rows the rows past a multiple of 4 through other kernels; from 12 rows up each row's result is the same bits at
every row count and position (measured: docs/perf/zen5-epyc-determinism.md). Unpadded, a step that decodes one
sequence would give it other bits than a step that decodes it among others. ``Linear`` pads a call to the next row count
that is invariant, with zero rows; ``pad_targets`` finds those for a weight on this machine by probing (once per
K, dtype and thread count): none from the smallest row count from which every probed count gives the same bits
as the largest (the floor); under it, the next probed count that does too. Where no floor exists, every call runs
in fixed tiles of ``TILE`` rows (the last padded). The int8 path (engine.quant.int8) computes each row alone.

Output positions (a generated token's row, engine.model_runner) can instead go through a C few-row kernel
(row-invariant at every row count, and on CPUs where torch's few-row matmul streams weights slowly several times
faster): the ``linears`` kernel family, "c" or "torch" (engine.kernels.families). With "c" a step's output rows take
the kernel and its prompt rows torch's padded matmul; which rows are which the layers set per forward on the
model's ``StepRows`` (the ``prefill_linears`` family's "c": every row of a packed weight through the panel
kernel). Under "c" a float32 weight is held in the panel kernel's layout (``engine.kernels.gemm
.panel_linear``: 16 output rows k-major, bf16 when every value is a bf16 value), and torch's rows get it unpacked
into a reused float32 buffer; a bf16 weight (bf16 activations) stays [N, K] for the dot-product kernel
(``small_m_linear``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.gemm import panel_linear, panel_pack, panel_unpack, small_m_linear, small_m_ok
from engine.quant.int8 import split_rows

PROBE_ROWS = (*range(1, 33), 48, 64)
TILE = 64
PROBE_COLS = 512
_FLOORS: dict[tuple, int | None] = {}


class StepRows:
    """Which rows of the model's current input are output positions: the first ``spec`` rows (an int: a step's
    rows, output positions first), or the rows where ``spec`` (a bool tensor: the last layer's sampled rows). One
    per model, shared by its ``Linear`` modules and set by its layers from the step's metadata."""

    def __init__(self):
        self.spec: int | torch.Tensor = 0
        self.prompts_too = False        # the ``prefill_linears`` family's "c": every row of a packed weight's call

    def use(self, spec: int | torch.Tensor) -> None:
        self.spec = spec


class Linear(nn.Linear):
    """``nn.Linear`` over 2-D [rows, in] inputs, row-invariant once ``pad_to`` / ``tile`` are set (by
    ``engine.models.select_ops.bind_ops`` when the engine is deterministic); the defaults are plain nn.Linear.
    ``pad_to[m]``: the row count a call with m rows is padded to (m < len(pad_to); larger calls run as they are).
    ``step_rows`` (the ``linears`` family "c"): output rows through the C few-row kernel."""

    pad_to: tuple[int, ...] = ()
    tile: int = 0
    step_rows: StepRows | None = None
    packed = False            # the weight held as panels (use_c_linears): float32, or bf16 when its values are bf16's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step_rows is None or x.dim() != 2:
            return invariant_linear(x, self.compute_weight(), self.bias, self.pad_to, self.tile)
        rows = self.step_rows
        spec = x.shape[0] if rows.prompts_too and self.packed else rows.spec
        return split_linear(x, self.weight, self.bias, spec, self.pad_to, self.tile, self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """A packed weight is saved as [out, in] float32 (what a fresh model loads; the weights cache stores it)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:
            destination[prefix + "weight"] = self.compute_weight()

    def compute_weight(self) -> torch.Tensor:
        """The weight [out, in] in the activations' dtype (a packed one unpacked into a fresh float32 tensor)."""
        if not self.packed:
            return self.weight
        return panel_unpack(self.weight.detach(), self.out_features)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_rows: int | torch.Tensor,
                 pad_to: tuple[int, ...] = (), tile: int = 0, out_features: int | None = None) -> torch.Tensor:
    """``invariant_linear`` with the output rows (``StepRows.spec``) through a C few-row kernel instead: the panel
    kernel for a packed ``weight`` (panels: ``out_features`` says N), else the dot-product one. Torch's rows get a
    packed weight unpacked (or a bf16 one under float32 ``x`` widened) into a reused buffer."""
    n_out = out_features if out_features is not None else weight.shape[0]

    def kernel(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        y = panel_linear(rows, weight, n_out) if weight.dim() == 3 else small_m_linear(rows, weight)
        y = y.add_(bias) if bias is not None else y
        return y if out is None else out.copy_(y)

    def torch_rows(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        w = weight if weight.dim() == 2 and weight.dtype == rows.dtype else widened(weight, rows.dtype, n_out)
        y = invariant_linear(rows, w, bias, pad_to, tile)
        return y if out is None else out.copy_(y)

    return split_rows(x, out_rows, n_out, kernel, torch_rows)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     pad_to: tuple[int, ...] = (), tile: int = 0) -> torch.Tensor:
    """``F.linear`` with the rows padded to ``pad_to[rows]`` (or run in fixed tiles of ``tile`` rows)."""
    m = x.shape[0]
    if tile and x.dim() == 2:
        pad = -m % tile
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        return torch.cat([F.linear(t, weight, bias) for t in xp.split(tile)])[:m]
    if m >= len(pad_to) or x.dim() != 2 or pad_to[m] == m:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, pad_to[m] - m)), weight, bias)[:m]


def _probe(weight: torch.Tensor, probe_rows: tuple[int, ...]) -> tuple[int | None, tuple[int, ...]]:
    """(floor, good): the smallest row count from which every probed count gives the largest probe's bits (None:
    even the second-largest differs), and every probed count under it that does too. Cached per (shape, dtype,
    device, threads)."""
    # on the first PROBE_COLS output columns only: the kernel choice follows the row count and K (the same pattern
    # at every N measured, 64 to 262,144), and the probe's calls stream the weight once each
    weight = weight[:PROBE_COLS]
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads(), probe_rows)
    if key not in _FLOORS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(probe_rows[-1], weight.shape[1], generator=g).to(weight.dtype).to(weight.device)
        ref = F.linear(x, weight)
        # every probed count over all the probe's rows (whole calls of m rows): a kernel that sums otherwise may
        # round to the same bf16 value in all but a few of 10,000 outputs (bf16 here: one row at K = 2,048)
        same = {m: all(torch.equal(F.linear(c, weight), r)
                       for c, r in zip(x[:len(x) // m * m].split(m), ref[:len(x) // m * m].split(m)))
                for m in probe_rows[:-1]}
        floor = None
        for m in reversed(probe_rows[:-1]):
            if not same[m]:
                break
            floor = m
        _FLOORS[key] = (floor, tuple(m for m, ok in same.items() if ok and floor is not None and m < floor))
    return _FLOORS[key]


def pad_targets(weight: torch.Tensor, probe_rows: tuple[int, ...] = PROBE_ROWS) -> tuple[int, ...] | None:
    """``Linear.pad_to`` for ``weight``: for each m under the floor, the smallest invariant row count >= m (with
    MKL here 4, 8 or 12: counts under 12 that are multiples of 4 are invariant too); None: no floor (tiles)."""
    floor, good = _probe(weight, probe_rows)
    if floor is None:
        return None
    return tuple(min([k for k in good if k >= m] + [floor]) for m in range(floor))


def make_row_invariant(model: nn.Module, enabled: bool = True) -> None:
    """Set ``pad_to`` (or ``tile``) on every float CPU ``Linear`` of ``model`` from this machine's probe; ``enabled``
    False: back to plain calls (a model bound twice, the second time not deterministic)."""
    for mod in model.modules():
        if type(mod) is not Linear:
            continue
        targets, mod.pad_to, mod.tile = None, (), 0
        if enabled and mod.weight.dtype.is_floating_point and mod.weight.device.type == "cpu":
            targets = pad_targets(mod.compute_weight().detach())
            mod.pad_to, mod.tile = (targets, 0) if targets is not None else ((), TILE)


def use_c_linears(model: nn.Module, enabled: bool) -> StepRows | None:
    """Give every float CPU ``Linear`` of ``model`` that the C few-row kernel serves one shared ``StepRows``
    (``enabled`` False: none, every row through torch); returns it, or None when no Linear took it.

    A float32 weight is then held as the panel kernel's panels (``packed``), in bf16 when every value is a bf16
    value (a bf16 checkpoint's, widened): the kernel reads it as float32 and torch's rows get its float32 copy, so
    every result is the same bits while decode, which streams the weights, reads half the bytes. ``enabled`` False
    unpacks again."""
    rows = StepRows() if enabled else None
    taken = False
    for mod in model.modules():
        if type(mod) is not Linear:
            continue
        if mod.packed:                                   # back to [out, in] before anything else looks at it
            mod.weight = nn.Parameter(mod.compute_weight(), requires_grad=False)
            mod.packed = False
        w = mod.weight.detach()
        ok = rows is not None and small_m_ok(w[:1], w, any_rows=True)
        mod.step_rows = rows if ok else None
        taken |= ok
        if ok and w.dtype == torch.float32:
            mod.weight, mod.packed = nn.Parameter(kernel_weight(w), requires_grad=False), True
    return rows if taken else None


def kernel_weight(w: torch.Tensor) -> torch.Tensor:
    """How the ``linears`` family's "c" holds a weight [out, in]: a float32 one as panels (bf16 ones when every value
    survives the round trip: ``bf16_exact``), a bf16 one as it is."""
    if w.dtype != torch.float32:
        return w
    return panel_pack(w, as_bf16=bf16_exact(w) is not None)


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def widened(w: torch.Tensor, dtype: torch.dtype, out_features: int | None = None) -> torch.Tensor:
    """``w`` in ``dtype``, in a buffer reused by the next call (a packed weight's float32 copy for one matmul: a
    fresh tensor each time costs page faults, about seven times the copy on two cores). Panels (3-D: ``use_c_linears``)
    come out unpacked, [out_features, in]."""
    panels = w.dim() == 3
    shape = (out_features, w.shape[1]) if panels else w.shape
    numel = shape[0] * shape[1] if panels else w.numel()
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):        # a normal tensor: written in and out of inference mode
            buf = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    if panels:
        return panel_unpack(w, out_features, buf)
    return buf[:numel].view(shape).copy_(w)


def bf16_exact(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` as bf16 when it is float32 and every value survives the round trip; else None."""
    if w.dtype != torch.float32:
        return None
    packed = w.to(torch.bfloat16)
    return packed if torch.equal(packed.float(), w) else None


__all__ = ["Linear", "StepRows", "invariant_linear", "split_linear", "use_c_linears", "kernel_weight", "bf16_exact",
           "pad_targets", "make_row_invariant", "TILE"]
