"""flash-attn backend (CUDA): one varlen call per layer over the paged cache, decode and prefill together.

flash_attn_varlen_func reads keys/values straight from the paged cache through ``block_table``; upstream
flash-attn 2 requires the page (block) size to be a multiple of 256, so the engine uses block_size 256 with
this backend. Sliding windows map to ``window_size=(window - 1, 0)``.
"""
from __future__ import annotations

import torch

from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata

FLASH_BLOCK_SIZE = 256


class FlashAttentionBackend:
    name = "flash_attn"
    required_block_multiple = FLASH_BLOCK_SIZE

    def __init__(self):
        from flash_attn import flash_attn_varlen_func
        self._varlen = flash_attn_varlen_func

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                window: int | None, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache                                  # [N_blocks, bs, Hkv, D]
        cu_k = meta.memo("cu_seqlens_k", lambda: torch.nn.functional.pad(
            meta.seq_lens_t.cumsum(0, dtype=torch.int32), (1, 0)))
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc_t, cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
            block_table=meta.block_tables)
