"""Attention kernels: paged decode over float, bf16 and int8 caches (csrc/paged_decode/), prefill over packed
bf16 operands or float32 (csrc/prefill/), and the packing of a paged cache into those operands."""
from __future__ import annotations

import torch

import engine.kernels.library as library
from engine.kernels.binding import KernelLibrary
from engine.kernels.library import SUFFIX

# (query/output dtype, cache dtype) -> decode kernel
_FUNCS = {(torch.bfloat16, torch.bfloat16): "paged_decode_bf16", (torch.float32, torch.float32): "paged_decode_f32",
          (torch.float32, torch.bfloat16): "paged_decode_bf16kv_f32"}


# query/output dtype -> decode kernel over an int8 cache (kv_cache_dtype: int8; engine.quant.int8_kv)
_I8_DECODE = {torch.float32: "paged_decode_i8kv_f32", torch.bfloat16: "paged_decode_i8kv_bf16"}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode`` can run these tensors (CPU; bf16 or float32 cache, queries in its dtype or
    float32) and the library loaded."""
    return (q.device.type == "cpu" and (q.dtype, k_cache.dtype) in _FUNCS
            and k_cache.shape[1] <= 256 and q.shape[1] // k_cache.shape[2] <= 64 and library.load() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] (one query per sequence, at position seq_lens[i] - 1, its K/V already in the cache).

    block_tables: [B, max_blocks] int32 (rows may be padded); seq_lens: [B] int32. Returns [B, Hq, D].
    """
    return call(library.load(), q, k_cache, v_cache, block_tables, seq_lens, window, scale)


def call(lib: KernelLibrary, q, k_cache, v_cache, block_tables, seq_lens, window, scale) -> torch.Tensor:
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


def paged_decode_i8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, window: int | None, scale: float, num_kv_heads: int, block_size: int,
                    lib: KernelLibrary | None = None) -> torch.Tensor:
    """``paged_decode`` over an int8 cache: q [B, Hq, D] float32 or bf16 -> [B, Hq, D] in q's dtype."""
    lib = lib or library.load()
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


def int8_kv_ok(q: torch.Tensor) -> bool:
    """True when the int8-cache kernels (write, decode, pack) can serve queries like q [.., Hq, D] here."""
    return q.device.type == "cpu" and q.dtype in _I8_DECODE and library.load() is not None


def prefill_attention(qs: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, q_start: int, k_start: int,
                      window: int | None, out_dtype: torch.dtype, lib: KernelLibrary | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill chunk over packed bf16 keys and values (csrc/prefill/), every head in one call.

    qs [n, Hq, D] bf16 (already scaled); kp [Hkv, D/2, >= S] and vp [Hkv, S/2, D] int32 (``pack_pairs`` of
    each head's keys transposed and values; S even). Key j is at position k_start + j, query i at q_start + i.
    Returns [n, Hq, D] in ``out_dtype`` (float32 or bf16), the products and softmax in float32; ``out``: a
    contiguous tensor of that shape and dtype to write instead of a new one."""
    lib = lib or library.load()
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
    getattr(lib, f"prefill_bf16kv_{SUFFIX[out_dtype]}")(
        qs.data_ptr(), kp.data_ptr(), kp.stride(1), vp.data_ptr(), n, hq, hkv, d, s, q_start, k_start,
        window or 0, out.data_ptr(), torch.get_num_threads())
    return out


def prefill_online_softmax(head_dim: int, lib: KernelLibrary | None = None) -> bool:
    """True where ``prefill_attention`` runs its items on AMX tiles with the softmax online over blocks of 32 keys
    (csrc/bf16_gemm/amx_flash.h: head_dim 64, 128 or 256 where the tiles are on); elsewhere the two-product form
    (scores, ``masked_softmax_``, probabilities rounded to bf16, P.V), another arithmetic of the same attention."""
    lib = lib or library.load()
    return lib is not None and bool(lib.prefill_online_softmax(head_dim))


def pack_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int,
            lib: KernelLibrary | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [lo, hi) of one sequence from a paged bf16 cache ([blocks, bs, Hkv, D]; ``table`` its block
    table, int32) as ``prefill_attention``'s operands: (kp [Hkv, D/2, S], vp [Hkv, S/2, D]) int32, S = hi - lo
    rounded up to even (the extra key zero) — ``pack_pairs`` of each head's keys transposed and values."""
    lib = lib or library.load()
    _, bs, hkv, d = k_cache.shape
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16 and k_cache.is_contiguous() and v_cache.is_contiguous()
    table = table.to(torch.int32).contiguous()
    s = (hi - lo + 1) // 2 * 2
    kp = torch.empty(hkv, d // 2, s, dtype=torch.int32)
    vp = torch.empty(hkv, s // 2, d, dtype=torch.int32)
    lib.pack_kv_bf16(k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), bs, hkv, d, lo, hi, kp.data_ptr(),
                     vp.data_ptr(), torch.get_num_threads())
    return kp, vp


def pack_kv_i8(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int,
               block_size: int, num_kv_heads: int, head_dim: int,
               lib: KernelLibrary | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_kv`` from an int8 cache: positions [lo, hi) dequantized (q * scale, rounded to bf16 once) into
    ``prefill_attention``'s operands (kp [Hkv, D/2, S], vp [Hkv, S/2, D] int32 words of bf16 pairs)."""
    lib = lib or library.load()
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
    lib = library.load()
    return (lib is not None and q.device.type == "cpu" and q.dtype == torch.float32 and library.isa(lib) != "portable"
            and q.shape[-1] % lib.prefill_f32_cols() == 0)


def prefill_f32_cols() -> int:
    """The float32 prefill kernel's column tile (its key columns are grouped in multiples of it)."""
    return library.load().prefill_f32_cols()


def prefill_attention_f32(qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_start: int, k_start: int,
                          window: int | None, lib: KernelLibrary | None = None) -> torch.Tensor:
    """``prefill_attention`` in float32 (csrc/prefill/): qs [n, Hq, D] (already scaled), keys/vals [S, Hkv, D]
    float32 or bf16 at positions k_start.. (any strides). Keys are transposed and both padded with zeros to the
    kernel's column tile once per chunk, in the same copy that widens a bf16 cache. Returns [n, Hq, D] float32."""
    lib = lib or library.load()
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
