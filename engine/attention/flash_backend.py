"""flash-attn backend (CUDA): one varlen call per layer over the paged cache, decode and prefill together.

flash_attn_varlen_func reads keys/values straight from the paged cache through ``block_table``; upstream
flash-attn 2 requires the page (block) size to be a multiple of 256, so the engine uses block_size 256 with
this backend. Sliding windows map to ``window_size=(window - 1, 0)``.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata

FLASH_BLOCK_SIZE = 256


class FlashAttentionBackend(AttentionBackend):
    """``varlen``: the ``flash_attn_varlen_func`` to call (default: flash-attn's own). Tests pass a plain-torch
    stand-in with the same contract, so the metadata this backend builds is checked on CPU."""

    name = "flash_attn"

    def __init__(self, varlen=None):
        if varlen is None:
            from flash_attn import flash_attn_varlen_func as varlen
        self._varlen = varlen

    def block_size_for(self, requested: int) -> int:
        return requested if requested % FLASH_BLOCK_SIZE == 0 else FLASH_BLOCK_SIZE

    def prepare(self, meta: AttentionMetadata) -> None:
        dev = meta.block_tables.device
        meta.query_start_loc_t = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=dev)
        meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32, device=dev)
        meta.cu_seqlens_k_t = torch.nn.functional.pad(meta.seq_lens_t.cumsum(0, dtype=torch.int32), (1, 0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                window: int | None, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache                                  # [N_blocks, bs, Hkv, D]
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc_t, cu_seqlens_k=meta.cu_seqlens_k_t,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
            block_table=meta.block_tables)
