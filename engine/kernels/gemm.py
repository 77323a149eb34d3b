"""Matmuls torch does slowly on some CPUs: bf16 x bf16 -> float32 with AVX512-BF16 dot products (csrc/bf16_gemm/,
bf16 prefill attention with float32 scores) and few-row x @ W^T streaming W once (csrc/small_m/, the decode-time
LM head)."""
from __future__ import annotations

import torch

import engine.kernels.library as library
from engine.kernels.binding import KernelLibrary
from engine.kernels.library import SUFFIX


def bf16_gemm_ok() -> bool:
    """True when this build multiplies bf16 with bf16 dot products into float32 (``bf16_gemm``). Whether attention
    uses it is the ``attention`` kernel family's choice (engine.kernels.families), measured by engine.tuning."""
    lib = library.load()
    return lib is not None and bool(lib.bf16_gemm_fast())


def pack_pairs(b: torch.Tensor) -> torch.Tensor:
    """b [K, N] bf16 (any strides) -> the kernel's operand [ceil(K/2), N] int32: word (j, n) holds b[2j, n] and
    b[2j+1, n]. K is zero-padded to an even count."""
    k, n = b.shape
    kp = k + (k & 1)
    if kp != k:
        b = torch.cat([b, b.new_zeros(kp - k, n)])
    return b.reshape(kp // 2, 2, n).transpose(1, 2).reshape(kp // 2, 2 * n).view(torch.int32)


def bf16_gemm(a: torch.Tensor, bp: torch.Tensor, n: int | None = None,
              lib: KernelLibrary | None = None) -> torch.Tensor:
    """a [M, K] bf16 (rows dense, K even) @ the packed operand bp [K/2, >= n] -> float32 [M, n]; ``bp`` may be a
    column slice of a wider packed matrix (its row stride is kept)."""
    lib = lib or library.load()
    m, k = a.shape
    n = bp.shape[1] if n is None else n
    assert a.dtype == torch.bfloat16 and a.stride(1) == 1 and k % 2 == 0 and bp.shape[0] == k // 2
    assert bp.dtype == torch.int32 and bp.stride(1) == 1 and bp.shape[1] >= n
    c = torch.empty(m, n, dtype=torch.float32)
    lib.bf16_gemm(a.data_ptr(), a.stride(0), bp.data_ptr(), bp.stride(0), c.data_ptr(), n, m, n, k // 2,
                  torch.get_num_threads())
    return c


# Rows up to which the kernel beats torch on the 262k x 640 head (measured: docs/perf/code-notes-kernels.md).
SMALL_M_MAX = {torch.bfloat16: 12, torch.float32: 16}


def small_m_ok(x: torch.Tensor, w: torch.Tensor, any_rows: bool = False) -> bool:
    """True when ``small_m_linear`` serves x [M, K] @ w[N, K]^T (CPU, bf16 or float32, w in x's dtype or bf16; few
    rows; ``any_rows``: at every row count, as one choice for all of them)."""
    return (x.device.type == "cpu" and x.dtype in SUFFIX and w.dtype in (x.dtype, torch.bfloat16) and x.dim() == 2
            and 1 <= x.shape[0] and (any_rows or x.shape[0] <= SMALL_M_MAX[x.dtype]) and w.is_contiguous()
            and library.load() is not None)


def small_m_linear(x: torch.Tensor, w: torch.Tensor, lib: KernelLibrary | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, streaming w once (memory-bound at small M). float32 x over bf16
    w: w read as float32 (the bits of its float32 copy)."""
    lib = lib or library.load()
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, w.shape[0], dtype=x.dtype)
    name = "small_m_linear_f32_bf16w" if (x.dtype, w.dtype) == (torch.float32, torch.bfloat16) else \
        f"small_m_linear_{SUFFIX[x.dtype]}"
    getattr(lib, name)(x.data_ptr(), m, k, w.data_ptr(), w.shape[0], y.data_ptr(), torch.get_num_threads())
    return y


# Float32 linears over panel-packed weights (csrc/panel/): the ``linears`` family's decode rows when activations
# are float32. A packed weight is [ceil(N/16), K, 16], float32 or bf16 (a bf16-exact weight: the same bits).
PANEL_NR = 16
# the row of each slot of a bf16 panel's 16 values (csrc/panel/driver.h PANEL_SLOT; it is its own inverse)
PANEL_SLOT = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def panel_pack(w: torch.Tensor, as_bf16: bool, lib: KernelLibrary | None = None) -> torch.Tensor:
    """w [N, K] (float32 or bf16) -> its panels [ceil(N/16), K, 16] in bf16 (``as_bf16``; only for weights whose
    values are bf16's) or float32."""
    lib = lib or library.load()
    w = w.contiguous()
    n, k = w.shape
    out = torch.empty((n + PANEL_NR - 1) // PANEL_NR, k, PANEL_NR,
                      dtype=torch.bfloat16 if as_bf16 else torch.float32)
    lib.panel_pack(w.data_ptr(), int(w.dtype == torch.bfloat16), n, k, out.data_ptr(), int(as_bf16))
    return out


def panel_unpack(panels: torch.Tensor, n: int, out: torch.Tensor | None = None,
                 lib: KernelLibrary | None = None) -> torch.Tensor:
    """The panels' weight as float32 [n, K] into ``out`` (contiguous, n * K float32 at least; None: a fresh one)."""
    lib = lib or library.load()
    k = panels.shape[1]
    out = torch.empty(n * k) if out is None else out
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() >= n * k
    lib.panel_unpack_f32(panels.data_ptr(), int(panels.dtype == torch.bfloat16), n, k, out.data_ptr())
    return out[:n * k].view(n, k)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, lib: KernelLibrary | None = None) -> torch.Tensor:
    """x [M, K] float32 @ the panels' weight [n, K]^T -> float32 [M, n]: each output one fused multiply-add chain
    over K in order (row-invariant at every M and thread count)."""
    lib = lib or library.load()
    x = x.contiguous()
    m, k = x.shape
    assert x.dtype == torch.float32 and panels.shape[1] == k and panels.is_contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    lib.panel_linear_f32(x.data_ptr(), m, k, panels.data_ptr(), int(panels.dtype == torch.bfloat16), n, y.data_ptr(),
                         torch.get_num_threads())
    return y


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the panels' weight, [*ids.shape, K] in the panels' dtype (an embedding lookup)."""
    row = ids % PANEL_NR
    if panels.dtype == torch.bfloat16:
        row = torch.tensor(PANEL_SLOT, device=ids.device)[row]
    return panels[ids // PANEL_NR, :, row]
