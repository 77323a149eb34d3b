"""The attention backend interface: what the model runner and the attention layers may ask of a backend.

A backend owns everything specific to its kernels: the block sizes it can page with (``block_size_for``), the
extra tensors it wants in a step's metadata (``prepare``, called once per step for the step's metadata and for
its sampled-rows metadata), and ``forward`` over the paged cache. The runner never branches on a backend's name.
"""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    name = "base"

    def block_size_for(self, requested: int) -> int:
        """The KV block size to use when ``requested`` was asked for (some kernels page only in multiples)."""
        return requested

    def prepare(self, meta: AttentionMetadata) -> None:
        """Add this backend's per-step tensors to ``meta`` (shared by every layer of the step)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                window: int | None, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the step's new tokens. Writes k/v into the cache first, then
        attends each query to its sequence's visible keys (causal, ``window`` keys back when set)."""
        raise NotImplementedError
