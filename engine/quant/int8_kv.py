"""The int8 KV cache (``kv_cache_dtype: int8``): layout, and the torch reference of what the C kernels do.

Each (token, KV head) row of ``head_dim`` values (a multiple of 32) is stored as int8 quants and one float32
scale per group of 32 (llama.cpp's q8_0 grouping), symmetric: ``scale = max|x| / 127`` and
``q = round_half_even(x * (127 / max|x|))`` (an all-zero group: zeros, scale 0); the group stands for
``q * scale``. Groups, not one scale per row: gemma-3-270m's keys have channels far larger than the rest, and one
scale per 256-value row tripled the model's KL against float32 (``batchgen bench --quality``; figures in
docs/perf/code-notes-engine.md). Keys are stored minus their layer's mean key (engine.attention.key_shift). 288 bytes
per row of 256 where bf16 takes 512: decode attention reads 0.56x the bytes.

Layout: one int8 tensor per layer for K and one for V, ``[num_blocks, block_bytes]``; a block holds its
``block_size x Hkv`` rows of ``head_dim`` bytes (slot-major, then head), then their ``block_size x Hkv x
head_dim/32`` float32 scales. With head_dim a multiple of 64 every row starts on a cache line. Writing:
``csrc/kv_write.c`` (``kv_write_*_i8``); decode: ``csrc/paged_decode/`` (``paged_decode_i8kv_*``: on AVX512-BF16 each
group dequantized and rounded to bf16 into the bf16 dot products, elsewhere widened to float32); prefill:
``csrc/prefill/`` (``pack_kv_i8``: the same bf16 values into the bf16 kernel's operands) or the float32 gather
below.
"""
from __future__ import annotations

import torch

import engine.kernels.attention as kernel_attention
import engine.kernels.kv_write as kv_kernels

SCALE_BYTES = 4
GROUP = 32          # values per scale along a row


def supported(head_dim: int) -> bool:
    return head_dim % GROUP == 0


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's K (or V): the rows, then their float32 scales."""
    return block_size * num_kv_heads * (head_dim + SCALE_BYTES * head_dim // GROUP)


def pool_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    return num_blocks, block_bytes(block_size, num_kv_heads, head_dim)


def views(cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int):
    """(quants [N, bs, Hkv, D] int8, scales [N, bs, Hkv, D/32] float32): views of one int8 pool (no copies)."""
    n = cache.shape[0]
    rows = block_size * num_kv_heads * head_dim
    quants = cache[:, :rows].view(n, block_size, num_kv_heads, head_dim)
    scales = cache[:, rows:].view(torch.float32).view(n, block_size, num_kv_heads, head_dim // GROUP)
    return quants, scales


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (bf16 / float32) -> (int8 quants [..., D], float32 scales [..., D/32]): kv_write_*_i8's bytes."""
    shape = x.shape
    x = x.float().reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    amax = x.abs().amax(dim=-1)
    # NOTE: a Python scalar over a tensor (127.0 / amax) is computed as amax.reciprocal() * 127, which rounds
    # differently from the kernel's one float32 division
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[..., None]).clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    return q.reshape(shape), amax / torch.full_like(amax, 127.0)


def block_size_of(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """The block size of an int8 pool [num_blocks, block bytes]."""
    return cache.shape[1] // block_bytes(1, num_kv_heads, head_dim)


def store(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into their slots, quantized: one C pass (``engine.kernels.kv_write.kv_write_i8``) where
    the kernels load, else ``write`` (the same bytes)."""
    bs = block_size_of(kv_cache[0], k.shape[1], k.shape[2])
    if kernel_attention.int8_kv_ok(k):
        kv_kernels.kv_write_i8(kv_cache, k, v, slot_mapping, bs)
    else:
        write(kv_cache, k, v, slot_mapping, bs)


def write(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
          block_size: int) -> None:
    """k, v [T, Hkv, D] into their slots of an int8 pair, quantized (the torch path of kv_write_*_i8)."""
    hkv, d = k.shape[1], k.shape[2]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    for cache, x in zip(kv_cache, (k, v)):
        quants, scales = views(cache, block_size, hkv, d)
        q, s = quantize(x)
        quants[blk, off] = q
        scales[blk, off] = s


def dequantize_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Whole blocks [len(blocks), bs, Hkv, D] of one int8 pool as ``dtype`` (q * scale in float32, then cast)."""
    quants, scales = views(cache, block_size, num_kv_heads, head_dim)
    idx = blocks.long()
    q = quants.index_select(0, idx).float()
    s = scales.index_select(0, idx).repeat_interleave(GROUP, dim=-1)
    return (q * s).to(dtype)


def gather_range(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int, block_size: int, num_kv_heads: int,
                 head_dim: int) -> torch.Tensor:
    """Positions [lo, hi) of one sequence, dequantized to float32: [hi - lo, Hkv, D]."""
    b0, b1 = lo // block_size, (hi - 1) // block_size + 1
    rows = dequantize_blocks(cache, table[b0:b1], block_size, num_kv_heads, head_dim)
    flat = rows.reshape(-1, num_kv_heads, head_dim)
    off = lo - b0 * block_size
    return flat[off:off + hi - lo]


__all__ = ["GROUP", "SCALE_BYTES", "block_bytes", "block_size_of", "dequantize_blocks", "gather_range", "pool_shape",
           "quantize", "store", "supported", "views", "write"]
