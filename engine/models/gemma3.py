"""Gemma 3 (text): offset RMSNorm, scaled embeddings, GeGLU, q/k norm, sandwich norms,
interleaved sliding-window and global layers with their own RoPE bases, query_pre_attn_scalar."""
from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.models.layers import Attention, CausalLM, Embedding, GatedMLP, OpsModule, RMSNorm, run_layers, with_pending


class Gemma3DecoderLayer(OpsModule):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        eps, off, h = config.rms_norm_eps, config.norm_offset, config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(h, eps, off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
        self.post_feedforward_layernorm = RMSNorm(h, eps, off)

    def forward(self, positions, x, meta, rows=None, pending=None):
        """-> (residual stream, the MLP's output still to add after its post-feedforward norm: layers.Pending)"""
        x, normed = with_pending(self.ops, x, pending, self.input_layernorm)
        h = self.self_attn(positions, normed, meta, rows)
        x, y = self.ops.residual_norm(x if rows is None else x[rows], h, self.post_attention_layernorm,
                                      self.pre_feedforward_layernorm)
        return x, (self.mlp(y), self.post_feedforward_layernorm)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.embed_scale = config.embed_scale

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        # NOTE: HF multiplies by the scale cast to the embedding dtype; do the same for bit-parity.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return run_layers(self.layers, positions, x, meta, self.norm)


class Gemma3ForCausalLM(CausalLM):
    model_cls = Gemma3Model

    def __init__(self, config: ModelConfig):
        if config.attn_logit_softcapping:
            raise ModelLoadError("Gemma3 with attn_logit_softcapping is not supported")
        super().__init__(config)
