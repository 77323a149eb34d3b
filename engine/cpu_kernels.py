"""Native CPU kernels (plain C in ``csrc/``), built on first use with the system C compiler, called via ctypes.

Only what torch cannot do well on the CPU lives here:
- paged decode attention that reads keys and values in place from the paged cache (torch needs a gather
  copy first): ``paged_decode``;
- fused elementwise passes in bf16 and float32 (GeGLU/SwiGLU, RMSNorm with optional RoPE, RoPE, the prefill
  tile's masked softmax): ``glu``, ``rms_norm``, ``rope_``, ``masked_softmax_``; torch would make three to
  five passes over each activation.
Per-ISA code paths are chosen at compile time (``csrc/simd.h``): ``-march=native`` gives the AVX-512 path on
AVX-512 CPUs (AVX512-BF16 dot products where present), the AVX2 + FMA path on AVX2-only CPUs, and the portable
C loops anywhere else; the portable loops are the reference the tests hold the others to. ``isa(lib)`` says
which one a build has. The build takes a second or two, has no torch headers, and is cached per source + flags +
CPU under
``$BATCHGEN_CACHE_DIR`` (default ``~/.cache/batchgen/kernels``). Without a compiler, or with
``BATCHGEN_CPU_KERNELS=0``, every caller takes its pure-torch path: same results within float rounding, slower.
``BATCHGEN_KERNEL_FLAGS`` replaces ``-march=native`` (e.g. ``"-O3 -mavx2 -mfma -fopenmp"``: the AVX2 build on an
AVX-512 machine, to measure it, or one build for a mixed fleet).

The library links OpenMP (``-fopenmp``). torch's CPU wheels ship ``libgomp.so.1``; loading ours after torch
reuses that runtime (same soname), so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.cache_root import cache_root

log = logging.getLogger("batchgen.engine")

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],                                   # no OpenMP: single-threaded, still gather-free
)
# Every build: -fno-trapping-math lets GCC if-convert the float selects in exp's clamp and the softmax masks,
# without which it vectorizes none of the elementwise loops for AVX2 (AVX-512 masks hide the problem): GeGLU ran
# 8x slower in an AVX2 build. Values do not change (no rounding or NaN semantics are relaxed).
_COMMON_FLAGS = ("-fno-trapping-math", "-shared", "-fPIC", "-std=c11")
# (query/output dtype, cache dtype) -> decode kernel
_FUNCS = {(torch.bfloat16, torch.bfloat16): "paged_decode_bf16", (torch.float32, torch.float32): "paged_decode_f32",
          (torch.float32, torch.bfloat16): "paged_decode_bf16kv_f32"}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# query/output dtype -> decode kernel over an int8 cache (kv_cache_dtype: int8; engine.attention.int8_kv)
_I8_DECODE = {torch.float32: "paged_decode_i8kv_f32", torch.bfloat16: "paged_decode_i8kv_bf16"}
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_amx: bool | None = None


def enabled() -> bool:
    return os.environ.get("BATCHGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_signature() -> str:
    """Part of the cache key: -march=native output must not move to another CPU (shared home directories)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def default_flag_sets() -> tuple[list[str], ...]:
    """The compile flag sets tried in order. ``BATCHGEN_KERNEL_FLAGS`` (e.g. ``"-O3 -mavx2 -mfma -fopenmp"``)
    replaces ``-march=native``: a build for an older CPU kind than this one (one build for a mixed fleet, or
    measuring the AVX2 path on an AVX-512 machine); the portable fallbacks stay."""
    forced = os.environ.get("BATCHGEN_KERNEL_FLAGS", "").split()
    return (forced, *_FLAG_SETS[1:]) if forced else _FLAG_SETS


def build(cc: str, flag_sets=None) -> Path:
    """Compile the kernels with the first flag set that works (or reuse the cached build); the .so path."""
    flag_sets = flag_sets or default_flag_sets()
    src = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))   # headers are part of the key
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(src + repr((cc, flags, _COMMON_FLAGS, _cpu_signature())).encode()).hexdigest()[:16]
        out = cache_dir() / f"batchgen_kernels-{key}.so"
        if errors:   # the previous flags failed (e.g. BATCHGEN_KERNEL_FLAGS the compiler rejects): say so
            log.warning("CPU kernels: the build with %s; trying %s", errors[-1], " ".join(flags))
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *flags, *_COMMON_FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)           # atomic: concurrent builders never see a partial file
                return out
            errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(flags)}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("; ".join(errors))


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    sigs = {name: [P] * 4 + [I64, P] + [I32] * 6 + [F32, P, I32] for name in (*_FUNCS.values(), *_I8_DECODE.values())}
    for sfx in _SUFFIX.values():
        sigs.update({
            f"gelu_tanh_mul_{sfx}": [P, I64, I64, P, I32],
            f"silu_mul_{sfx}": [P, I64, I64, P, I32],
            f"rms_norm_rope_{sfx}": [P, I64, I64, I64, I64, P, F32, P, P, P, I32],
            f"rope_neox_{sfx}": [P, I64, I64, I64, I64, P, P, I32],
            f"add_rms_norm_{sfx}": [P, P, I64, I64, P, F32, P, F32, P, P, I32],
            **{f"kv_write_{sfx}_{dst}": [P, P, I64, I64, I64, I64, P, I64, P, P, I32] for dst in _SUFFIX.values()},
            f"kv_write_{sfx}_i8": [P, P, I64, I64, I64, I64, I64, P, I64, I64, P, P, I32],
            f"masked_softmax_{sfx}": [P] + [I64] * 7 + [I32],
            f"q8_quant_act_{sfx}": [P, I32, I32, I32, I32, P, P, P, I32],
            f"q8_gemm_{sfx}": [P, P, P, I32, I32, P, P, P, I32, I32, I32, P, I32, I32],
            f"q8_linear_{sfx}": [P, I32, I32, I32, P, P, P, I32, I32, I32, P, I32, I32],
            f"q8_linear_glu_{sfx}": [P, I32, I32, I32, P, P, P, I32, I32, I32, I32, P, I32, I32],
            f"q8_embed_{sfx}": [P, P, I32, P, I32, I32, P, I32],
            f"small_m_linear_{sfx}": [P, I32, I32, P, I64, P, I32],
            f"prefill_bf16kv_{sfx}": [P, P, I64, P] + [I32] * 5 + [I64] * 3 + [P, I32],
        })
    sigs["ngram_propose_batch"] = [P, P, I32, I32, I32, I32, P, P]
    sigs["bf16_gemm"] = [P, I64, P, I64, P, I64, I32, I32, I32, I32]
    sigs["prefill_f32"] = [P, P, I64, P] + [I32] * 5 + [I64] * 3 + [P, I32]
    sigs["pack_kv_bf16"] = [P, P, P, I32, I32, I32, I64, I64, P, P, I32]
    sigs["pack_kv_i8"] = [P, P, P, I32, I32, I32, I64, I64, P, P, I32]
    sigs["q8_gemm_argmax"] = [P, P, P, I32, I32, P, P, P, I32, I32, I32, P, P, I32]
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.restype = (ctypes.c_int if name in _FUNCS.values() or name in _I8_DECODE.values()
                      or name.startswith("kv_write_") else None)
        fn.argtypes = args
    for name in ("batchgen_kernel_isa", "batchgen_q8_isa"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_char_p, []
    for name in ("bf16_gemm_fast", "prefill_f32_cols"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_int, []
    return lib


def isa(lib: ctypes.CDLL) -> str:
    """The instruction set a build's fast paths use: avx512_bf16 | avx512 | avx2 | portable (see csrc/simd.h)."""
    return lib.batchgen_kernel_isa().decode()


def q8_isa(lib: ctypes.CDLL) -> str:
    """The integer dot-product path of a build's int8 linear: avx512_vnni | avx2 | portable (csrc/qlinear.c)."""
    return lib.batchgen_q8_isa().decode()


def describe() -> str:
    """One line for logs, manifests and the report: which kernel build runs here, or why none does."""
    lib = load()
    return f"{isa(lib)} build, int8 {q8_isa(lib)}" if lib is not None else f"unavailable ({_error}); torch path"


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (once logged) when disabled or no compiler can build it."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    _tried = True
    if not enabled():
        _error = "disabled by BATCHGEN_CPU_KERNELS=0"
        return None
    cc = _compiler()
    if cc is None:
        _error = "no C compiler (cc, gcc or clang) on PATH"
    else:
        try:
            _lib = open_library(build(cc))
        except OSError as e:
            _error = f"build failed: {e}"
    if _lib is None:
        log.warning("CPU attention kernel unavailable (%s); decode attention uses the slower torch path", _error)
    return _lib


def unavailable_reason() -> str | None:
    load()
    return _error


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode`` can run these tensors (CPU; bf16 or float32 cache, queries in its dtype or
    float32) and the library loaded."""
    return (q.device.type == "cpu" and (q.dtype, k_cache.dtype) in _FUNCS
            and k_cache.shape[1] <= 256 and q.shape[1] // k_cache.shape[2] <= 64 and load() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] (one query per sequence, at position seq_lens[i] - 1, its K/V already in the cache).

    block_tables: [B, max_blocks] int32 (rows may be padded); seq_lens: [B] int32. Returns [B, Hq, D].
    """
    return call(load(), q, k_cache, v_cache, block_tables, seq_lens, window, scale)


def masked_softmax_(scores: torch.Tensor, t: int, g: int, q_start: int, k_start: int,
                    window: int | None) -> torch.Tensor:
    """In place on dense bf16/fp32 scores [..., t, g, S] of a prefill tile: causal (and window) mask + softmax."""
    assert scores.is_contiguous() and scores.dtype in _SUFFIX
    S = scores.shape[-1]
    outer = scores.numel() // (t * g * S)
    getattr(load(), f"masked_softmax_{_SUFFIX[scores.dtype]}")(scores.data_ptr(), outer, t, g, S, q_start, k_start,
                                                               window or 0,
                               torch.get_num_threads())
    return scores


def call(lib: ctypes.CDLL, q, k_cache, v_cache, block_tables, seq_lens, window, scale) -> torch.Tensor:
    """``paged_decode`` on a given build of the library (tests run a portable build too)."""
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    b, hq, d = q.shape
    out = torch.empty_like(q)
    rc = getattr(lib, _FUNCS[q.dtype, k_cache.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), b, hq, k_cache.shape[2], d, k_cache.shape[1], window or 0, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape q={tuple(q.shape)} cache={tuple(k_cache.shape)}")
    return out


# ---- fused elementwise passes (bf16 and float32) -----------------------------------------------------------

_GLU = {"gelu_tanh": "gelu_tanh_mul", "silu": "silu_mul"}


def elementwise_ok(x: torch.Tensor) -> bool:
    """True when the fused elementwise kernels can take ``x`` (bf16 or float32 on the CPU) and the library loaded."""
    return x.dtype in _SUFFIX and x.device.type == "cpu" and load() is not None


def _fn(name: str, x: torch.Tensor):
    return getattr(load(), f"{name}_{_SUFFIX[x.dtype]}")


def glu(x: torch.Tensor, act: str) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up, [T, I]. act: gelu_tanh | silu."""
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    _fn(_GLU[act], x)(x.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, dim, token stride) of a [T, H, D] or [T, D] view whose rows are dense."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    t, h, d = x.shape
    if x.stride(2) != 1 or (h > 1 and x.stride(1) != d):
        raise ValueError("cpu_kernels: rows must be dense")
    return t, h, d, x.stride(0)


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (weight_f32 = offset + weight, float32), then RoPE when cos/sin are given
    ([T, 1, D] or [T, D], x's dtype). Returns a new dense tensor shaped like x."""
    t, h, d, stride = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    c = s = None
    if cos is not None:
        c, s = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    _fn("rms_norm_rope", x)(x.data_ptr(), t, h, d, stride, weight_f32.data_ptr(), eps,
                            c.data_ptr() if c is not None else None, s.data_ptr() if s is not None else None,
                            out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, wh: torch.Tensor | None, eps_h: float,
                 wo: torch.Tensor | None, eps_o: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual add with its norms, one pass: xo = x + (rms_norm(h, wh) if wh is given else h), then
    rms_norm(xo, wo) when wo is given (else None). x, h: [T, D] in the same dtype; wh/wo: offset + weight in
    float32. Equal bit for bit to ``rms_norm`` then torch's add then ``rms_norm``."""
    x, h = x.contiguous(), h.contiguous()
    t, d = x.shape
    xo = torch.empty_like(x)
    out = torch.empty_like(x) if wo is not None else None
    _fn("add_rms_norm", x)(x.data_ptr(), h.data_ptr(), t, d, wh.data_ptr() if wh is not None else None, eps_h,
                           wo.data_ptr() if wo is not None else None, eps_o, xo.data_ptr(),
                           out.data_ptr() if out is not None else None, torch.get_num_threads())
    return xo, out


def kv_write_ok(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """True when ``kv_write`` can store these rows (CPU, bf16/float32 on both sides, each token's heads dense, rows
    shaped like the cache's); anything else takes torch's path, which raises on a mismatch."""
    dense = all(x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) for x in (k, v))
    return (k.device.type == "cpu" and k.dtype in _SUFFIX and v.dtype == k.dtype and k_cache.dtype in _SUFFIX
            and dense and k.shape[1:] == v.shape[1:] == k_cache.shape[2:] and slot_mapping.dtype == torch.int64
            and load() is not None)


def kv_write(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (each token's heads dense) into their cache slots, converted to the cache dtype (float32 ->
    bf16 rounds to nearest even, as ``.to``): ``engine.attention.cache.write_kv``'s result in one C call."""
    k_cache, v_cache = kv_cache
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    slots = slot_mapping.contiguous()
    t, h, d = k.shape
    num_slots = k_cache.numel() // (h * d)
    rc = getattr(load(), f"kv_write_{_SUFFIX[k.dtype]}_{_SUFFIX[k_cache.dtype]}")(
        k.data_ptr(), v.data_ptr(), t, h * d, k.stride(0), v.stride(0), slots.data_ptr(), num_slots,
        k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads())
    if rc:
        raise IndexError(f"kv_write: a slot outside the cache's {num_slots} slots")


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE in place on a [T, H, D] view with dense rows (e.g. q inside the fused qkv output)."""
    t, h, d, stride = _rows(x)
    c, s = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    _fn("rope_neox", x)(x.data_ptr(), t, h, d, stride, c.data_ptr(), s.data_ptr(), torch.get_num_threads())
    return x


# ---- int8 linear (csrc/qlinear.c) ----------------------------------------------------------------------------

def _q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [M, K] as the int8 kernels read it (dense rows, any row stride): (x, M, K, K padded to the group of 32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    return x, m, k, -(-k // 32) * 32


def _q8_activations(lib: ctypes.CDLL, x: torch.Tensor):
    """x [M, K] quantized per token and group of 32 into the kernel's scratch: (q, sa, mn, K padded)."""
    x, m, k, kp = _q8_rows(x)
    g = kp // 32
    q = torch.empty(m * kp, dtype=torch.uint8)
    sa = torch.empty(m * g, dtype=torch.float32)
    mn = torch.empty(m * g, dtype=torch.float32)
    getattr(lib, f"q8_quant_act_{_SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), kp, q.data_ptr(),
                                                     sa.data_ptr(), mn.data_ptr(), torch.get_num_threads())
    return q, sa, mn, kp


def q8_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, cw: torch.Tensor, n: int, wmax: int = 127,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp32) @ W^T for packed int8 W (``engine.models.int8.pack``) -> [M, n] in x's dtype.

    x is quantized per token and group of 32 (asymmetric uint8) into a scratch buffer, then multiplied with
    integer dot products. wmax: a bound on max|w| (``Int8Linear.wmax``); the avx2 build has a faster path for
    wmax <= 64, and a smaller bound than the truth would saturate it. ``lib``: a specific build (tests); default
    the loaded one."""
    lib = lib or load()
    x, m, k, kp = _q8_rows(x)
    y = torch.empty(m, n, dtype=x.dtype)
    # one call: the kernel quantizes x into its own scratch (the same quants as _q8_activations), then multiplies
    getattr(lib, f"q8_linear_{_SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), w.data_ptr(), sw.data_ptr(),
                                                  cw.data_ptr(), w.numel() // kp, n, wmax, y.data_ptr(), n,
                                                  torch.get_num_threads())
    return y


_Q8_GLU_ACT = {"gelu_tanh": 1, "silu": 2}      # qlinear.c's GLU_GELU_TANH, GLU_SILU


def q8_linear_glu(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, cw: torch.Tensor, n: int, act: str,
                  wmax: int = 127, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """act(gate) * up from one int8 matmul: W packed from gate_up rows interleaved in blocks of 16
    (``engine.models.int8.glu_interleave``), n = 2I rows, I a multiple of 16 -> [M, I] in x's dtype. The same bits
    as ``glu`` of the un-interleaved ``q8_linear`` (tested), without its [M, 2I] intermediate."""
    if n % 32:
        raise ValueError(f"q8_linear_glu needs 2I a multiple of 32, got {n}")
    lib = lib or load()
    x, m, k, kp = _q8_rows(x)
    y = torch.empty(m, n // 2, dtype=x.dtype)
    getattr(lib, f"q8_linear_glu_{_SUFFIX[x.dtype]}")(x.data_ptr(), m, k, x.stride(0), w.data_ptr(), sw.data_ptr(),
                                                      cw.data_ptr(), w.numel() // kp, n, wmax, _Q8_GLU_ACT[act],
                                                      y.data_ptr(), n // 2, torch.get_num_threads())
    return y


def q8_argmax(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, cw: torch.Tensor, n: int, wmax: int = 127,
              lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax over n of ``q8_linear(x, ...)`` without materializing it: (indices int64 [M], values float32 [M]).
    The values compared are exactly q8_linear's (float32); ties go to the lower index."""
    lib = lib or load()
    m = x.shape[0]
    q, sa, mn, kp = _q8_activations(lib, x)
    idx = torch.empty(m, dtype=torch.int64)
    val = torch.empty(m, dtype=torch.float32)
    lib.q8_gemm_argmax(q.data_ptr(), sa.data_ptr(), mn.data_ptr(), m, kp, w.data_ptr(), sw.data_ptr(),
                       cw.data_ptr(), w.numel() // kp, n, wmax, idx.data_ptr(), val.data_ptr(),
                       torch.get_num_threads())
    return idx, val


def q8_embed(ids: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, k: int, dtype: torch.dtype,
             lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows ``ids`` of a packed int8 matrix, dequantized: [T] int64 -> [T, k] in ``dtype``."""
    lib = lib or load()
    ids = ids.to(torch.int64).contiguous()
    kp = -(-k // 32) * 32
    y = torch.empty(ids.numel(), k, dtype=dtype)
    getattr(lib, f"q8_embed_{_SUFFIX[dtype]}")(w.data_ptr(), sw.data_ptr(), kp, ids.data_ptr(), ids.numel(), k,
                                               y.data_ptr(), torch.get_num_threads())
    return y


# ---- bf16 x bf16 -> float32 matmul (csrc/bf16_gemm.c): bf16 prefill attention with float32 scores ------------

def has_amx() -> bool:
    """AMX-BF16 on this CPU (read once: every attention layer asks, every step). torch's bf16 matmul runs on AMX
    tiles there (oneDNN), several times faster than float32 and than our bf16 kernel."""
    global _amx
    if _amx is None:
        import engine.dtype_policy as dtype_policy
        _amx = "amx_bf16" in dtype_policy._cpuinfo_flags()
    return _amx


def bf16_gemm_ok() -> bool:
    """True when this build multiplies bf16 with AVX512-BF16 dot products into float32 (``bf16_gemm``), and the
    CPU has no AMX: there torch's bf16 matmul is faster, and stays."""
    lib = load()
    return lib is not None and bool(lib.bf16_gemm_fast()) and not has_amx()


def pack_pairs(b: torch.Tensor) -> torch.Tensor:
    """b [K, N] bf16 (any strides) -> the kernel's operand [ceil(K/2), N] int32: word (j, n) holds b[2j, n] and
    b[2j+1, n]. K is zero-padded to an even count."""
    k, n = b.shape
    kp = k + (k & 1)
    if kp != k:
        b = torch.cat([b, b.new_zeros(kp - k, n)])
    return b.reshape(kp // 2, 2, n).transpose(1, 2).reshape(kp // 2, 2 * n).view(torch.int32)


def prefill_attention(qs: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, q_start: int, k_start: int,
                      window: int | None, out_dtype: torch.dtype, lib: ctypes.CDLL | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill chunk over packed bf16 keys and values (csrc/prefill.c), every head in one call.

    qs [n, Hq, D] bf16 (already scaled); kp [Hkv, D/2, >= S] and vp [Hkv, S/2, D] int32 (``pack_pairs`` of
    each head's keys transposed and values; S even). Key j is at position k_start + j, query i at q_start + i.
    Returns [n, Hq, D] in ``out_dtype`` (float32 or bf16), the products and softmax in float32; ``out``: a
    contiguous tensor of that shape and dtype to write instead of a new one."""
    lib = lib or load()
    n, hq, d = qs.shape
    hkv, s = vp.shape[0], 2 * vp.shape[1]
    assert qs.dtype == torch.bfloat16 and qs.is_contiguous() and d % 2 == 0
    assert kp.dtype == vp.dtype == torch.int32 and kp.shape[:2] == (hkv, d // 2) and kp.shape[2] >= s
    assert kp.stride(2) == 1 and kp.stride(0) == kp.stride(1) * d // 2 and vp.is_contiguous()
    if out is None:
        out = torch.empty(n, hq, d, dtype=out_dtype)
    if out.shape != (n, hq, d) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"prefill_attention: out must be a contiguous {out_dtype} {(n, hq, d)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    getattr(lib, f"prefill_bf16kv_{_SUFFIX[out_dtype]}")(
        qs.data_ptr(), kp.data_ptr(), kp.stride(1), vp.data_ptr(), n, hq, hkv, d, s, q_start, k_start,
        window or 0, out.data_ptr(), torch.get_num_threads())
    return out


def pack_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int,
            lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [lo, hi) of one sequence from a paged bf16 cache ([blocks, bs, Hkv, D]; ``table`` its block
    table, int32) as ``prefill_attention``'s operands: (kp [Hkv, D/2, S], vp [Hkv, S/2, D]) int32, S = hi - lo
    rounded up to even (the extra key zero) — ``pack_pairs`` of each head's keys transposed and values."""
    lib = lib or load()
    _, bs, hkv, d = k_cache.shape
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16 and k_cache.is_contiguous() and v_cache.is_contiguous()
    table = table.to(torch.int32).contiguous()
    s = (hi - lo + 1) // 2 * 2
    kp = torch.empty(hkv, d // 2, s, dtype=torch.int32)
    vp = torch.empty(hkv, s // 2, d, dtype=torch.int32)
    lib.pack_kv_bf16(k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), bs, hkv, d, lo, hi, kp.data_ptr(),
                     vp.data_ptr(), torch.get_num_threads())
    return kp, vp


# ---- the int8 KV cache (kv_cache_dtype: int8; layout in engine.attention.int8_kv) --------------------------------

def int8_kv_ok(q: torch.Tensor) -> bool:
    """True when the int8-cache kernels (write, decode, pack) can serve queries like q [.., Hq, D] here."""
    return q.device.type == "cpu" and q.dtype in _I8_DECODE and load() is not None


def kv_write_i8(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                slot_mapping: torch.Tensor, block_size: int, lib: ctypes.CDLL | None = None) -> None:
    """k, v [T, Hkv, D] (bf16/float32; each token's heads dense) into their slots of an int8 cache pair,
    quantized per group of 32 (``int8_kv.quantize``'s bytes)."""
    lib = lib or load()
    k_cache, v_cache = kv_cache
    assert k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if k.stride(2) != 1 or (k.shape[1] > 1 and k.stride(1) != k.shape[2]):
        k = k.contiguous()
    if v.stride(2) != 1 or (v.shape[1] > 1 and v.stride(1) != v.shape[2]):
        v = v.contiguous()
    v = v.to(k.dtype)
    slots = slot_mapping.contiguous()
    t, h, d = k.shape
    rc = getattr(lib, f"kv_write_{_SUFFIX[k.dtype]}_i8")(
        k.data_ptr(), v.data_ptr(), t, h, d, k.stride(0), v.stride(0), slots.data_ptr(), k_cache.shape[0] * block_size,
        block_size, k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads())
    if rc == 2:
        raise ValueError(f"kv_write: an int8 cache needs head_dim a multiple of 32, got {d}")
    if rc:
        raise IndexError(f"kv_write: a slot outside the cache's {k_cache.shape[0] * block_size} slots")


def paged_decode_i8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, window: int | None, scale: float, num_kv_heads: int, block_size: int,
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``paged_decode`` over an int8 cache: q [B, Hq, D] float32 or bf16 -> [B, Hq, D] in q's dtype."""
    lib = lib or load()
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.is_contiguous() and v_cache.is_contiguous()
    b, hq, d = q.shape
    out = torch.empty_like(q)
    rc = getattr(lib, _I8_DECODE[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), b, hq, num_kv_heads, d, block_size, window or 0, scale, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported shape q={tuple(q.shape)} heads={num_kv_heads} bs={block_size}")
    return out


def pack_kv_i8(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int,
               block_size: int, num_kv_heads: int, head_dim: int,
               lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_kv`` from an int8 cache: positions [lo, hi) dequantized (q * scale, rounded to bf16 once) into
    ``prefill_attention``'s operands (kp [Hkv, D/2, S], vp [Hkv, S/2, D] int32 words of bf16 pairs)."""
    lib = lib or load()
    assert k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.is_contiguous() and v_cache.is_contiguous()
    table = table.to(torch.int32).contiguous()
    s = (hi - lo + 1) // 2 * 2
    kp = torch.empty(num_kv_heads, head_dim // 2, s, dtype=torch.int32)
    vp = torch.empty(num_kv_heads, s // 2, head_dim, dtype=torch.int32)
    lib.pack_kv_i8(k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), block_size, num_kv_heads, head_dim, lo,
                   hi, kp.data_ptr(), vp.data_ptr(), torch.get_num_threads())
    return kp, vp


def prefill_f32_ok(q: torch.Tensor) -> bool:
    """True when ``prefill_attention_f32`` serves float32 queries q [n, Hq, D] on this build: a vector build
    (AVX2 or AVX-512; the portable loops would be slower than torch) and D a multiple of its column tile."""
    lib = load()
    return (lib is not None and q.device.type == "cpu" and q.dtype == torch.float32 and isa(lib) != "portable"
            and q.shape[-1] % lib.prefill_f32_cols() == 0)


def prefill_attention_f32(qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_start: int, k_start: int,
                          window: int | None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``prefill_attention`` in float32 (csrc/prefill.c): qs [n, Hq, D] (already scaled), keys/vals [S, Hkv, D]
    float32 or bf16 at positions k_start.. (any strides). Keys are transposed and both padded with zeros to the
    kernel's column tile once per chunk, in the same copy that widens a bf16 cache. Returns [n, Hq, D] float32."""
    lib = lib or load()
    n, hq, d = qs.shape
    S, hkv = keys.shape[:2]
    cols = lib.prefill_f32_cols()
    sp = -(-S // cols) * cols
    kt = torch.empty(hkv, d, sp)
    kt[:, :, :S] = keys.permute(1, 2, 0)
    kt[:, :, S:] = 0
    vv = torch.empty(hkv, sp, d)
    vv[:, :S] = vals.transpose(0, 1)
    vv[:, S:] = 0
    qs = qs.contiguous()
    out = torch.empty(n, hq, d)
    lib.prefill_f32(qs.data_ptr(), kt.data_ptr(), sp, vv.data_ptr(), n, hq, hkv, d, sp, q_start, k_start,
                    window or 0, out.data_ptr(), torch.get_num_threads())
    return out


def bf16_gemm(a: torch.Tensor, bp: torch.Tensor, n: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """a [M, K] bf16 (rows dense, K even) @ the packed operand bp [K/2, >= n] -> float32 [M, n]; ``bp`` may be a
    column slice of a wider packed matrix (its row stride is kept)."""
    lib = lib or load()
    m, k = a.shape
    n = bp.shape[1] if n is None else n
    assert a.dtype == torch.bfloat16 and a.stride(1) == 1 and k % 2 == 0 and bp.shape[0] == k // 2
    assert bp.dtype == torch.int32 and bp.stride(1) == 1 and bp.shape[1] >= n
    c = torch.empty(m, n, dtype=torch.float32)
    lib.bf16_gemm(a.data_ptr(), a.stride(0), bp.data_ptr(), bp.stride(0), c.data_ptr(), n, m, n, k // 2,
                  torch.get_num_threads())
    return c


# ---- few-row matmul (csrc/small_m.c): the decode-time LM head -------------------------------------------------

# Rows up to which the kernel beats torch on the 262k x 640 head (Zen 4, 2 threads; noisy: bf16 2-2.8x at M=1,
# 1.5-1.7x at 4, 1.2-1.5x at 8, 0.9-1.1x at 13; float32 2.4-2.8x / 3.7-4.2x / 1.9-2.2x / 1.2-1.7x at 1 / 4 / 8 / 16).
SMALL_M_MAX = {torch.bfloat16: 12, torch.float32: 16}


def small_m_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``small_m_linear`` serves x [M, K] @ w[N, K]^T (CPU, bf16 or float32, few rows)."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and w.dtype == x.dtype and x.dim() == 2
            and 1 <= x.shape[0] <= SMALL_M_MAX[x.dtype] and w.is_contiguous() and load() is not None)


def small_m_linear(x: torch.Tensor, w: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, streaming w once (memory-bound at small M)."""
    lib = lib or load()
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, w.shape[0], dtype=x.dtype)
    getattr(lib, f"small_m_linear_{_SUFFIX[x.dtype]}")(x.data_ptr(), m, k, w.data_ptr(), w.shape[0], y.data_ptr(),
                                                      torch.get_num_threads())
    return y
