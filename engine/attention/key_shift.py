"""Key shifts for the int8 KV cache: each layer's keys are stored minus a constant vector, its mean key.

Attention is unchanged by subtracting one vector m from every key: a query's scores q.(k_j - m) = q.k_j - q.m all
move by the same amount, which the softmax removes (exact in real arithmetic; float rounding aside). What changes
is what the int8 cache must hold: gemma-3-270m's keys carry large per-channel offsets shared by every token, and
with them removed each group of 32 values spans less, so its int8 steps are finer (``batchgen bench --quality``:
docs/perf/code-notes-engine.md). The text is read three times so RoPE's rotating components average out.

m is each layer's mean key over a fixed calibration text (``CALIBRATION_TEXT``: one paragraph of English prose,
three times), computed once when an engine with ``kv_cache_dtype: int8`` loads, by one prefill through float
caches of its own: the same model gives the same shifts in every run, so results
never depend on what was processed first.
Every key an int8 cache stores, prompt or decode, is shifted by its layer's m (``Attention.key_shift``).
"""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

_PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly report. Revenue grew by four percent, driven mostly by "
    "the new service contracts signed in the spring, while costs rose faster than planned because two suppliers "
    "raised their prices. The finance team proposed three measures: renegotiating the supply agreements, delaying "
    "the office move until next year, and reviewing every project that has not met its milestones. Several members "
    "asked for more detail on the risks of delay, and the chair agreed that a short written summary would be "
    "circulated before the next meeting. In other business, the board approved the hiring plan for the support "
    "team, noted the results of the customer survey, which rated response times as the main area to improve, and "
    "thanked the outgoing treasurer for six years of service. Questions about the pension scheme were referred to "
    "the legal department. The meeting closed at half past five, and the minutes will be published on the "
    "internal site within a week. Summary: revenue up, costs up faster, three cost measures proposed, hiring "
    "plan approved, survey results noted, treasurer thanked."
)
CALIBRATION_TEXT = " ".join([_PARAGRAPH] * 3)


class _MeanKeys(TorchAttentionBackend):
    """The torch backend, recording the mean of the keys it is given (one layer's)."""

    def __init__(self):
        super().__init__()
        self.mean: torch.Tensor | None = None

    def forward(self, q, k, v, kv_cache, meta, window, scale):
        if self.mean is None:
            self.mean = k.float().mean(dim=0)                         # [Hkv, D]
        return super().forward(q, k, v, kv_cache, meta, window, scale)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, token_ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Set every attention layer's ``key_shift`` to its mean key over ``token_ids`` (one prefill through float
    caches of ``dtype``); the layers' own caches and backends are restored. Returns the shifts."""
    attns = [layer.self_attn for layer in model.model.layers]
    saved = [(a.kv_cache, a.backend, a.key_shift) for a in attns]
    n, bs = len(token_ids), 16
    nb = -(-n // bs)
    cfg = model.config
    shape = (nb, bs, cfg.num_key_value_heads, cfg.head_dim)
    recorders = [_MeanKeys() for _ in attns]
    try:
        for a, rec in zip(attns, recorders):
            a.kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            a.backend, a.key_shift = rec, None
        meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
                                 block_tables=torch.arange(nb, dtype=torch.int32)[None], num_decode_seqs=0,
                                 block_size=bs)
        model(torch.tensor(token_ids), torch.arange(n), meta)
    finally:
        for a, (cache, backend, shift) in zip(attns, saved):
            a.kv_cache, a.backend, a.key_shift = cache, backend, shift
    shifts = [rec.mean.to(dtype) for rec in recorders]
    for a, m in zip(attns, shifts):
        a.key_shift = m
    return shifts


__all__ = ["CALIBRATION_TEXT", "calibrate"]
