"""Writing a step's keys and values into the paged cache in one C pass (csrc/kv_write.c): float/bf16 caches, and
the int8 cache (quantized per group of 32, ``engine.quant.int8_kv``'s bytes)."""
from __future__ import annotations

import torch

import engine.kernels.library as library
from engine.kernels.binding import KernelLibrary
from engine.kernels.library import SUFFIX


def kv_write_ok(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """True when ``kv_write`` can store these rows (CPU, bf16/float32 on both sides, each token's heads dense, rows
    shaped like the cache's); anything else takes torch's path, which raises on a mismatch."""
    dense = all(x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) for x in (k, v))
    return (k.device.type == "cpu" and k.dtype in SUFFIX and v.dtype == k.dtype and k_cache.dtype in SUFFIX
            and dense and k.shape[1:] == v.shape[1:] == k_cache.shape[2:] and slot_mapping.dtype == torch.int64
            and library.load() is not None)


def kv_write(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (each token's heads dense) into their cache slots, converted to the cache dtype (float32 ->
    bf16 rounds to nearest even, as ``.to``): ``engine.attention.cache.write_kv``'s result in one C call."""
    k_cache, v_cache = kv_cache
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    slots = slot_mapping.contiguous()
    t, h, d = k.shape
    num_slots = k_cache.numel() // (h * d)
    rc = getattr(library.load(), f"kv_write_{SUFFIX[k.dtype]}_{SUFFIX[k_cache.dtype]}")(
        k.data_ptr(), v.data_ptr(), t, h * d, k.stride(0), v.stride(0), slots.data_ptr(), num_slots,
        k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads())
    if rc:
        raise IndexError(f"kv_write: a slot outside the cache's {num_slots} slots")


def kv_write_i8(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                slot_mapping: torch.Tensor, block_size: int, lib: KernelLibrary | None = None) -> None:
    """k, v [T, Hkv, D] (bf16/float32; each token's heads dense) into their slots of an int8 cache pair,
    quantized per group of 32 (``int8_kv.quantize``'s bytes)."""
    lib = lib or library.load()
    k_cache, v_cache = kv_cache
    assert k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if k.stride(2) != 1 or (k.shape[1] > 1 and k.stride(1) != k.shape[2]):
        k = k.contiguous()
    if v.stride(2) != 1 or (v.shape[1] > 1 and v.stride(1) != v.shape[2]):
        v = v.contiguous()
    v = v.to(k.dtype)
    slots = slot_mapping.contiguous()
    t, h, d = k.shape
    rc = getattr(lib, f"kv_write_{SUFFIX[k.dtype]}_i8")(
        k.data_ptr(), v.data_ptr(), t, h, d, k.stride(0), v.stride(0), slots.data_ptr(), k_cache.shape[0] * block_size,
        block_size, k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads())
    if rc == 2:
        raise ValueError(f"kv_write: an int8 cache needs head_dim a multiple of 32, got {d}")
    if rc:
        raise IndexError(f"kv_write: a slot outside the cache's {k_cache.shape[0] * block_size} slots")
