"""FLOP and byte counts of a decoder-only model, from its ModelConfig: the roofline's numerator.

Conventions (all counts are exact closed forms, no sampling):

- A matmul of [M, K] x [K, N] costs 2*M*K*N FLOPs. The layers' matmuls (q/k/v/o, gate/up/down) cost
  ``2 * layer_params`` FLOPs per token; norms, rotary and activations are ignored (well under 1 %).
- Attention of one query over ``k`` keys costs ``4 * num_heads * head_dim * k`` FLOPs (QK^T and PV).
  A query at position ``p`` (0-based) sees ``p + 1`` keys; a sliding layer sees at most ``window`` of them
  (the window counts the query itself, as in ``ModelConfig.layer_window``).
- The LM head runs only on sampled rows: ``2 * hidden * vocab`` FLOPs per sampled token.
- These are model FLOPs (what MFU divides by): every layer counts for every token, although the engine's last
  layer skips attention, o_proj and MLP for rows that do not sample (about 5 % of a prefill step's FLOPs).
- A decode step reads every weight once (the LM head only if something is sampled) plus, per sequence,
  the K and V it attends to (window-limited on sliding layers) and writes one token of K/V.
- Byte counts take an element size per kind: the weights' (``dtype_bytes``; int8 weights with their per-group
  scales: ``costmodel.roofline.INT8_WEIGHT_BYTES``) and the KV cache's (``kv_dtype_bytes``, ``kv_cache_dtype``;
  default: the weights'). Sizes may be fractional (1.0625, 1.125): the counts are then floats.

        context_len          num_new_tokens
    [ cached / computed | q q q q q q q q q ]   query i (0-based) sits at position context_len + i
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from engine.models.config import ModelConfig


# ---- parameter counts -------------------------------------------------------------------------------
def layer_params(config: ModelConfig) -> int:
    """Matmul weights (and biases) of one transformer layer: q/k/v/o projections and the gated MLP."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    attn = h * q_out + 2 * h * kv_out + q_out * h
    if config.attention_bias:
        attn += q_out + 2 * kv_out
    mlp = 3 * h * config.intermediate_size
    return attn + mlp


def layers_params(config: ModelConfig) -> int:
    return config.num_hidden_layers * layer_params(config)


def lm_head_params(config: ModelConfig) -> int:
    return config.hidden_size * config.vocab_size


def num_params(config: ModelConfig) -> int:
    """All parameters: layers, norms, embedding and (if untied) the LM head."""
    h = config.hidden_size
    norms_per_layer = (4 if config.sandwich_norm else 2) * h + (2 * config.head_dim if config.qk_norm else 0)
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else lm_head_params(config)
    return layers_params(config) + config.num_hidden_layers * norms_per_layer + h + embed + head


# ---- FLOPs --------------------------------------------------------------------------------------------
def _sum_min(lo: int, hi: int, cap: int | None) -> int:
    """sum_{k=lo}^{hi} min(k, cap) for 0 <= lo <= hi (cap None = no cap)."""
    if hi < lo:
        return 0
    if cap is None or hi <= cap:
        return (lo + hi) * (hi - lo + 1) // 2
    if lo >= cap:
        return cap * (hi - lo + 1)
    return (lo + cap) * (cap - lo + 1) // 2 + cap * (hi - cap)


def attended_keys(config: ModelConfig, num_new_tokens: int, context_len: int = 0) -> int:
    """Keys attended, summed over the new queries and over all layers."""
    lo, hi = context_len + 1, context_len + num_new_tokens
    return sum(_sum_min(lo, hi, config.layer_window(i)) for i in range(config.num_hidden_layers))


def attention_flops(config: ModelConfig, num_new_tokens: int, context_len: int = 0) -> int:
    """QK^T + PV FLOPs of ``num_new_tokens`` queries placed after ``context_len`` tokens, all layers."""
    return 4 * config.num_attention_heads * config.head_dim * attended_keys(config, num_new_tokens, context_len)


def linear_flops(config: ModelConfig, num_tokens: int) -> int:
    """Matmul FLOPs in the layers (not attention, not the LM head) for ``num_tokens`` tokens."""
    return 2 * layers_params(config) * num_tokens


def lm_head_flops(config: ModelConfig, n: int = 1) -> int:
    """LM head FLOPs for ``n`` sampled rows (logits are computed only where a token is sampled)."""
    return 2 * lm_head_params(config) * n


def prefill_flops(config: ModelConfig, num_new_tokens: int, context_len: int = 0, num_sampled: int = 1) -> int:
    """FLOPs to compute ``num_new_tokens`` prompt tokens after ``context_len`` cached/computed ones.

    ``num_sampled`` rows go through the LM head (1 when the chunk ends the prompt, 0 for a middle chunk).
    """
    return (linear_flops(config, num_new_tokens) + attention_flops(config, num_new_tokens, context_len)
            + lm_head_flops(config, num_sampled))


def decode_step_flops(config: ModelConfig, seq_context_lens: Iterable[int]) -> int:
    """FLOPs of one decode step; ``seq_context_lens[i]`` = tokens sequence i attends to (its new one included)."""
    lens = list(seq_context_lens)
    attn = sum(attention_flops(config, 1, c - 1) for c in lens)
    return linear_flops(config, len(lens)) + attn + lm_head_flops(config, len(lens))


# ---- bytes --------------------------------------------------------------------------------------------
def kv_bytes_per_token_layer(config: ModelConfig, dtype_bytes: float) -> float:
    """K + V bytes of one token in one layer (``dtype_bytes``: the KV cache's element size)."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


def window_counts(config: ModelConfig) -> tuple[tuple[int | None, int], ...]:
    """(attention window or None, number of layers with it): layers grouped by what they attend to."""
    counts: dict[int | None, int] = {}
    for i in range(config.num_hidden_layers):
        counts[config.layer_window(i)] = counts.get(config.layer_window(i), 0) + 1
    return tuple(counts.items())


def keys_read(windows: tuple[tuple[int | None, int], ...], context_len):
    """Keys one query at context ``context_len`` (itself included) attends to, summed over all layers,
    window-limited; elementwise for a numpy array of contexts. ``windows``: ``window_counts(config)``."""
    return sum(k * (context_len if w is None else np.minimum(context_len, w)) for w, k in windows)


def keys_read_range(windows: tuple[tuple[int | None, int], ...], lo: int, hi: int) -> int:
    """``sum(keys_read(windows, c) for c in range(lo, hi + 1))`` in closed form (a prefill chunk's queries)."""
    if hi < lo:
        return 0

    def upto(n: int, w: int | None) -> int:         # sum of min(c, w) for c = 1..n
        if w is None or n <= w:
            return n * (n + 1) // 2
        return w * (w + 1) // 2 + w * (n - w)
    return sum(k * (upto(hi, w) - upto(lo - 1, w)) for w, k in windows)


def kv_read_bytes(config: ModelConfig, context_len: int, dtype_bytes: float) -> float:
    """K/V bytes one query at context ``context_len`` (itself included) reads, all layers, window-limited
    (``dtype_bytes``: the KV cache's element size; an int for whole-byte sizes, as before)."""
    n = kv_bytes_per_token_layer(config, dtype_bytes) * keys_read(window_counts(config), context_len)
    return int(n) if isinstance(dtype_bytes, int) else float(n)


def weight_bytes(config: ModelConfig, dtype_bytes: float, with_lm_head: bool = True) -> float:
    """Bytes of the weights one forward pass streams: the layers' matmuls (+ the LM head); ``dtype_bytes`` per
    parameter (int8 weights: their scales included, ``costmodel.roofline.INT8_WEIGHT_BYTES``)."""
    return (layers_params(config) + (lm_head_params(config) if with_lm_head else 0)) * dtype_bytes


def decode_step_kv_bytes(config: ModelConfig, seq_context_lens: Iterable[int], kv_dtype_bytes: float) -> float:
    """K/V bytes one decode step moves: each sequence's K/V reads and its new token's K/V write, all layers."""
    lens = list(seq_context_lens)
    kv_write = len(lens) * config.num_hidden_layers * kv_bytes_per_token_layer(config, kv_dtype_bytes)
    return sum(kv_read_bytes(config, c, kv_dtype_bytes) for c in lens) + kv_write


def decode_step_bytes(config: ModelConfig, seq_context_lens: Iterable[int], dtype_bytes: float,
                      kv_dtype_bytes: float | None = None) -> float:
    """Bytes moved by one decode step: weights once (``dtype_bytes`` per parameter), plus each sequence's K/V reads
    and its new K/V write (``kv_dtype_bytes`` per element; default ``dtype_bytes``).

    ``seq_context_lens[i]`` = the tokens sequence i attends to, its new token included.
    """
    lens = list(seq_context_lens)
    if not lens:
        return 0
    kv = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    return weight_bytes(config, dtype_bytes) + decode_step_kv_bytes(config, lens, kv)


def to_dict(config: ModelConfig) -> dict:
    """The fields of a ModelConfig as plain JSON values (for run.json)."""
    return {f.name: (list(v) if isinstance(v := getattr(config, f.name), tuple) else v)
            for f in dataclasses.fields(config)}


def from_dict(d: dict) -> ModelConfig:
    """Inverse of ``to_dict``."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
    return ModelConfig(**kw)
