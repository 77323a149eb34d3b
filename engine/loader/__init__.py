"""Loading a model: resolve what the user named, read its config, weights and tokenizer.

Weights come back as a dict of Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)
to tensors in the engine dtype, whatever the file format; the models keep HF names.
"""
from __future__ import annotations

import logging

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


def load_model(source: ModelSource, config: ModelConfig, dtype, device="cpu", identity: str | None = None):
    """The model with its weights, and how it got them: ``(model, "converted" | "cached" | "direct")``.

    GGUF files go through the converted-weights cache (``weights_cache``): the first load dequantizes and
    stores the final tensors, later loads map them. Checkpoint directories are already safetensors and load
    directly.
    """
    from engine.loader import weights_cache
    from engine.loader.resolve import model_identity
    from engine.models import build_model, build_model_from_state

    if source.kind != "gguf" or not weights_cache.enabled():
        return build_model(config, load_weights(source, config, dtype, device),
                           dtype, device, source=str(source.path)), "direct"
    path = weights_cache.cache_path(identity or model_identity(source), dtype)
    state = weights_cache.load(path)
    if state is not None:
        try:
            return build_model_from_state(config, state, device), "cached"
        except (RuntimeError, ValueError) as e:   # names/shapes no longer match: rebuild
            path.unlink(missing_ok=True)
            logging.getLogger("batchgen.engine").warning("weights cache %s does not fit the model (%s); "
                                                         "rebuilding it", path, str(e)[:200])
    model = build_model(config, load_weights(source, config, dtype, "cpu"), dtype, "cpu", source=str(source.path))
    weights_cache.store(path, model.state_dict())
    if str(device) != "cpu":
        model = model.to(device)
    return model, "converted"


__all__ = ["ModelSource", "resolve_model", "load_model_config", "load_weights", "load_model"]
