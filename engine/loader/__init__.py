"""Loading a model: resolve what the user named, read its config, weights and tokenizer.

Weights come back as a dict of Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)
to tensors in the engine dtype, whatever the file format; the models keep HF names.
"""
from __future__ import annotations

from engine.loader.resolve import ModelSource, resolve_model
from engine.models.config import ModelConfig


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        from engine.loader.gguf_loader import gguf_model_config
        return gguf_model_config(source.path)
    return ModelConfig.from_hf_dir(source.path)


def load_weights(source: ModelSource, config: ModelConfig, dtype, device="cpu") -> dict:
    if source.kind == "gguf":
        from engine.loader.gguf_loader import load_gguf_weights
        return load_gguf_weights(source.path, config, dtype, device)
    from engine.loader.safetensors_loader import load_safetensors_weights
    return load_safetensors_weights(source.path, dtype, device)


__all__ = ["ModelSource", "resolve_model", "load_model_config", "load_weights"]
