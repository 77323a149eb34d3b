"""Llama family: Llama 2/3, Mistral-style, SmolLM, TinyLlama; Qwen2 (qkv bias) and Qwen3 (q/k norm) by flags."""
from __future__ import annotations

from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers import Attention, CausalLM, Embedding, GatedMLP, OpsModule, RMSNorm, run_layers, with_pending


class LlamaDecoderLayer(OpsModule):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, meta, rows=None, pending=None):
        """-> (residual stream, the MLP's output still to add: layers.Pending)"""
        x, normed = with_pending(self.ops, x, pending, self.input_layernorm)
        h = self.self_attn(positions, normed, meta, rows)
        x, y = self.ops.residual_norm(x if rows is None else x[rows], h, None, self.post_attention_layernorm)
        return x, (self.mlp(y), None)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        return run_layers(self.layers, positions, self.embed_tokens(input_ids), meta, self.norm)


class LlamaForCausalLM(CausalLM):
    model_cls = LlamaModel
