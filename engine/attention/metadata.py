"""AttentionMetadata: what one step's flat batch looks like to attention.

Tokens of all sequences are concatenated (no padding). Decode sequences (one query token each) come first,
then prefill chunks. For sequence i:

    context (already in the KV cache)      | this step's new tokens
    positions 0 .. seq_lens[i]-q_len[i]-1  | seq_lens[i]-q_len[i] .. seq_lens[i]-1
                                           ^ query rows query_start_loc[i] .. query_start_loc[i+1]-1

The KV cache of each layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; position p of
sequence i lives in slot block_tables[i][p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: cache slot of each new token
    query_start_loc: list[int]        # [B+1] host cumulative query lengths
    seq_lens: list[int]               # [B] host: context + new tokens
    block_tables: torch.Tensor        # [B, max_blocks] int32, padded with 0
    num_decode_seqs: int              # the first num_decode_seqs sequences have exactly one query token
    block_size: int
    # Device copies for kernels that want them (set by the backend's ``prepare``; flash-attn).
    query_start_loc_t: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    cu_seqlens_k_t: torch.Tensor | None = None
    # Rows whose final hidden states the caller needs (the sampled ones). When set, the last layer writes every
    # token's K/V but computes attention and its MLP only for these rows, via ``sample_meta``: the same rows
    # as one-query sequences over the cache. None: every row (tests comparing full logits).
    sample_rows: torch.Tensor | None = None
    sample_meta: "AttentionMetadata | None" = None
    # The rows of output positions (engine.model_runner; the float linears' C rows, engine.models.linear): the first
    # output_rows rows of a step, or (sample_meta) a bool mask over the sampled rows.
    output_rows: "int | torch.Tensor" = 0
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc
        return max((b - a for a, b in zip(q, q[1:])), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    def rope_cache(self, rotary, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, computed once per distinct RoPE base."""
        key = ("rope", rotary.key, dtype)
        if key not in self._cache:
            self._cache[key] = rotary.cos_sin(positions, dtype)
        return self._cache[key]

    def memo(self, key, fn):
        """Per-step memo shared by all layers (e.g. decode gather indices per window size)."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]
