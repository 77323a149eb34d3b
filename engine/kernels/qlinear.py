"""int8 linear layers with integer dot products (csrc/qlinear/) and int8 embedding rows (csrc/q8_embed.c); the
weight format is ``engine.quant.int8``'s."""
from __future__ import annotations

import torch

import engine.kernels.library as library
from engine.kernels.binding import KernelLibrary
from engine.kernels.library import SUFFIX


def _q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [M, K] as the int8 kernels read it (dense rows, any row stride): (x, M, K, K padded to the group of 32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    return x, m, k, -(-k // 32) * 32


def _fp16(sw: torch.Tensor) -> int:
    """The packed scales' address; they must be the format's fp16 (a float32 tensor here would be read as garbage)."""
    if sw.dtype != torch.float16 or not sw.is_contiguous():
        raise TypeError(f"int8 kernels take the packed fp16 scales (engine.quant.int8.pack), got {sw.dtype}")
    return sw.data_ptr()


def _int16(ws: torch.Tensor) -> int:
    """The packed group sums' address (int16, ``engine.quant.int8.pack``)."""
    if ws.dtype != torch.int16 or not ws.is_contiguous():
        raise TypeError(f"int8 kernels take the packed int16 group sums (engine.quant.int8.pack), got {ws.dtype}")
    return ws.data_ptr()


def _q8_activations(lib: KernelLibrary, x: torch.Tensor):
    """x [M, K] quantized per token and group of 32 into the kernel's scratch: (q, sa, mn, K padded)."""
    x, m, k, kp = _q8_rows(x)
    g = kp // 32
    q = torch.empty(m * kp, dtype=torch.uint8)
    sa = torch.empty(m * g, dtype=torch.float32)
    mn = torch.empty(m * g, dtype=torch.float32)
    getattr(lib, f"q8_quant_act_{SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), kp, q.data_ptr(),
                                                     sa.data_ptr(), mn.data_ptr(), torch.get_num_threads())
    return q, sa, mn, kp


def _output(m: int, n: int, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """The [m, n] result a kernel writes: ``out`` where given (checked: the kernels write dense rows of x's dtype),
    else a new tensor."""
    if out is None:
        return torch.empty(m, n, dtype=dtype)
    if out.shape != (m, n) or out.dtype != dtype or out.stride() != (n, 1):
        raise ValueError(f"out must be a dense [{m}, {n}] {dtype} tensor, got {tuple(out.shape)} {out.dtype} "
                         f"strides {out.stride()}")
    return out


def q8_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, ws: torch.Tensor, n: int, wmax: int = 127,
              lib: KernelLibrary | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp32) @ W^T for packed int8 W, its fp16 scales and int16 group sums (``engine.quant.int8.pack``)
    -> [M, n] in x's dtype.

    x is quantized per token and group of 32 (asymmetric uint8) into a scratch buffer, then multiplied with
    integer dot products. wmax: a bound on max|w| (``Int8Linear.wmax``); the avx2 build has a faster path for
    wmax <= 64, and a smaller bound than the truth would saturate it. ``lib``: a specific build (tests); default
    the loaded one. ``out``: where to write (dense rows: a row range of a bigger result), else a new tensor."""
    lib = lib or library.load()
    x, m, k, kp = _q8_rows(x)
    y = _output(m, n, x.dtype, out)
    # one call: the kernel quantizes x into its own scratch (the same quants as _q8_activations), then multiplies
    getattr(lib, f"q8_linear_{SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), w.data_ptr(), _fp16(sw),
                                                  _int16(ws), w.numel() // kp, n, wmax, y.data_ptr(), n,
                                                  torch.get_num_threads())
    return y


_Q8_GLU_ACT = {"gelu_tanh": 1, "silu": 2}      # csrc/qlinear/driver.h's GLU_GELU_TANH, GLU_SILU


def prompt_amx_ok() -> bool:
    """True where ``q8_linear_amx`` runs and may: a build with AMX-BF16 on a CPU and kernel that grant the tiles, and
    no ``BATCHGEN_AMX=0``."""
    lib = library.load()
    return lib is not None and library.amx_wanted() and bool(lib.q8_prompt_amx())


def q8_linear_amx(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, n: int, act: str | None = None,
                  lib: KernelLibrary | None = None, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Prompt rows of an int8 linear on AMX-BF16 tiles (csrc/qlinear/amx_prompt.h): bf16(x) @ bf16(W)^T with float32
    sums, W's values dequantized (quant x scale, rounded once to bf16) as the call runs -> [M, n] in x's dtype (with
    ``act``, a ``glu_interleave``d gate_up weight: act(gate) * up, [M, n / 2]). Another arithmetic than
    ``q8_linear``'s: each row's bits depend on the row alone. RuntimeError where ``prompt_amx_ok()`` is False.
    ``out`` as ``q8_linear``'s.

    ``out_dtype`` other than x's (float32 activations with one side in bf16): a bf16 x holding float32 values rounded
    to bf16 gives the float32 x's bits (the tiles round x so anyway), and a bf16 result is the float32 one rounded
    once (a GLU's gate and up stay float32, unlike an all-bf16 call's)."""
    lib = lib or library.load()
    x, m, k, kp = _q8_rows(x)
    out_dtype = out_dtype or x.dtype
    y = _output(m, n // 2 if act else n, out_dtype, out)
    glu = _Q8_GLU_ACT[act] if act else 0
    if out_dtype == x.dtype:
        done = getattr(lib, f"q8_linear_amx_{SUFFIX[x.dtype]}")(
            x.data_ptr(), m, k, x.stride(0), w.data_ptr(), _fp16(sw), w.numel() // kp, n, glu, y.data_ptr(),
            y.shape[1], torch.get_num_threads())
    else:
        done = lib.q8_linear_amx_mixed(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, x.stride(0), w.data_ptr(),
                                       _fp16(sw), w.numel() // kp, n, glu, y.data_ptr(),
                                       int(out_dtype == torch.bfloat16), y.shape[1], torch.get_num_threads())
    if not done:
        raise RuntimeError("q8_linear_amx: no AMX-BF16 tiles here (the build, the CPU or the kernel)")
    return y


def q8_linear_glu(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, ws: torch.Tensor, n: int, act: str,
                  wmax: int = 127, lib: KernelLibrary | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up from one int8 matmul: W packed from gate_up rows interleaved in blocks of 16
    (``engine.quant.int8.glu_interleave``), n = 2I rows, I a multiple of 16 -> [M, I] in x's dtype. The same bits
    as ``glu`` of the un-interleaved ``q8_linear`` (tested), without its [M, 2I] intermediate. ``out`` as
    ``q8_linear``'s."""
    if n % 32:
        raise ValueError(f"q8_linear_glu needs 2I a multiple of 32, got {n}")
    lib = lib or library.load()
    x, m, k, kp = _q8_rows(x)
    y = _output(m, n // 2, x.dtype, out)
    getattr(lib, f"q8_linear_glu_{SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), w.data_ptr(), _fp16(sw),
                                                      _int16(ws), w.numel() // kp, n, wmax, _Q8_GLU_ACT[act],
                                                      y.data_ptr(), n // 2, torch.get_num_threads())
    return y


def q8_argmax(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, ws: torch.Tensor, n: int, wmax: int = 127,
              lib: KernelLibrary | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax over n of ``q8_linear(x, ...)`` without materializing it: (indices int64 [M], values float32 [M]).
    The values compared are exactly q8_linear's (float32); ties go to the lower index."""
    lib = lib or library.load()
    m = x.shape[0]
    q, sa, mn, kp = _q8_activations(lib, x)
    idx = torch.empty(m, dtype=torch.int64)
    val = torch.empty(m, dtype=torch.float32)
    lib.q8_gemm_argmax(q.data_ptr(), sa.data_ptr(), mn.data_ptr(), m, kp, w.data_ptr(), _fp16(sw), _int16(ws),
                       w.numel() // kp, n, wmax, idx.data_ptr(), val.data_ptr(), torch.get_num_threads())
    return idx, val


def q8_embed(ids: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, k: int, dtype: torch.dtype,
             lib: KernelLibrary | None = None) -> torch.Tensor:
    """Rows ``ids`` of a packed int8 matrix, dequantized: [T] int64 -> [T, k] in ``dtype``."""
    lib = lib or library.load()
    ids = ids.to(torch.int64).contiguous()
    kp = -(-k // 32) * 32
    y = torch.empty(ids.numel(), k, dtype=dtype)
    getattr(lib, f"q8_embed_{SUFFIX[dtype]}")(w.data_ptr(), _fp16(sw), kp, ids.data_ptr(), ids.numel(), k,
                                               y.data_ptr(), torch.get_num_threads())
    return y
