"""Loading a model: resolve what the user named, read its config, weights and tokenizer.

Weights come back as a dict of Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)
to tensors in the engine dtype, whatever the file format; the models keep HF names.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.loader.resolve import ModelSource, resolve_model
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    import torch


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        from engine.loader.gguf_loader import gguf_model_config
        return gguf_model_config(source.path)
    return ModelConfig.from_hf_dir(source.path)


def load_weights(source: ModelSource, config: ModelConfig, dtype, device="cpu") -> Mapping[str, torch.Tensor]:
    """HF-named tensors in ``dtype``, each read (dummy: made; GGUF: dequantized) when it is asked for
    (``engine.loader.lazy_weights``)."""
    if source.kind == "dummy":
        from engine.loader.dummy import lazy_dummy_weights
        from engine.loader.lazy_weights import LazyWeights
        made = lazy_dummy_weights(config, dtype)
        return made if str(device) == "cpu" else LazyWeights(made, lambda name: made[name].to(device))
    if source.kind == "gguf":
        from engine.loader.gguf_loader import load_gguf_weights
        return load_gguf_weights(source.path, config, dtype, device)
    from engine.loader.safetensors_loader import lazy_safetensors_weights
    return lazy_safetensors_weights(source.path, dtype, device)


def load_model(source: ModelSource, config: ModelConfig, dtype, device="cpu", identity: str | None = None,
               quantization: str = "none", kernels: dict[str, str] | None = None, deterministic: bool = True):
    """The model with its weights, and how it got them: ``(model, "converted" | "cached" | "direct")``.

    The finished model's ops (``engine.models.select_ops``) are chosen here, once, after any int8 swap;
    ``kernels``: C or torch per kernel family (engine.tuning's choice; None: the table's); ``deterministic``:
    batch-invariant ops (``engine.models.select_ops.bind_ops``).
    """
    from engine.models.select_ops import bind_ops

    model, how = _load_model(source, config, dtype, device, identity, quantization)
    return bind_ops(model, device, kernels=kernels, deterministic=deterministic), how


def _load_model(source: ModelSource, config: ModelConfig, dtype, device, identity: str | None, quantization: str):
    """``load_model`` before the ops are chosen.

    GGUF files go through the converted-weights cache (``weights_cache``): the first load dequantizes and
    stores the final tensors, later loads map them. Checkpoint directories are already safetensors and load
    directly. ``quantization="int8"``: linears and the embedding become int8 (``engine.quant.int8``), the model
    built one weight at a time (``int8_build``); GGUF Q8_0/Q5_0/Q4_0 tensors keep their quants, the others are
    quantized from their float values; the int8 model is cached like the float one (its own cache entry), for GGUF
    and checkpoint directories alike.
    """
    from engine.loader import weights_cache
    from engine.loader.int8_build import build_int8
    from engine.loader.resolve import model_identity
    from engine.models import build_model, build_model_from_state

    int8 = quantization == "int8"
    cached = weights_cache.enabled() and (source.kind == "gguf" or int8)
    if not cached:
        if int8:
            return _to(build_int8(config, load_weights(source, config, dtype, "cpu"), dtype, source), device), "direct"
        return build_model(config, load_weights(source, config, dtype, device), dtype, device,
                           source=str(source.path)), "direct"
    ident, variant = identity or model_identity(source), "int8" if int8 else ""
    path = weights_cache.cache_path(ident, dtype, variant)
    state = weights_cache.load(path)
    if state is not None:
        try:
            return build_model_from_state(config, state, device, int8_dtype=dtype if int8 else None), "cached"
        except (RuntimeError, ValueError) as e:   # names/shapes no longer match: rebuild
            path.unlink(missing_ok=True)
            logging.getLogger("batchgen.engine").warning("weights cache %s does not fit the model (%s); "
                                                         "rebuilding it", path, str(e)[:200])
    weights = load_weights(source, config, dtype, "cpu")
    model = (build_int8(config, weights, dtype, source) if int8
             else build_model(config, weights, dtype, "cpu", source=str(source.path)))
    del weights
    weights_cache.store(path, model.state_dict(), entry=weights_cache.entry_key(ident, dtype, variant))
    return _to(model, device), "converted"


def _to(model, device):
    return model if str(device) == "cpu" else model.to(device)


__all__ = ["ModelSource", "resolve_model", "load_model_config", "load_weights", "load_model"]
