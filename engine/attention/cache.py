"""Writing a step's keys/values into the paged KV cache: what every backend does before it attends."""
from __future__ import annotations

import torch

import engine.kernels.kv_write as kv_kernels
import engine.quant.int8_kv as int8_kv


def write_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at their cache slots (cache: two [num_blocks, block_size, Hkv, D] tensors)."""
    k_cache, v_cache = kv_cache
    if k_cache.dtype == torch.int8:              # kv_cache_dtype: int8 (engine.quant.int8_kv)
        int8_kv.store(kv_cache, k, v, slot_mapping)
        return
    if kv_kernels.kv_write_ok(k, v, k_cache, slot_mapping):
        kv_kernels.kv_write(kv_cache, k, v, slot_mapping)       # one C pass (CPU): no converted copies
        return
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
