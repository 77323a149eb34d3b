"""Model architectures, resolved lazily by the name in the checkpoint's config."""
import importlib

from engine.models.config import ModelConfig

_REGISTRY = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma3", "Gemma3ForCausalLM"),
}


def model_class(config: ModelConfig):
    module, name = _REGISTRY[config.architecture]
    return getattr(importlib.import_module(module), name)


__all__ = ["ModelConfig", "model_class", "build_model"]


def build_model(config: ModelConfig, weights: dict, dtype, device, source: str = "checkpoint"):
    """Build on the meta device (no random init of a 262k x 640 embedding), then load HF-named weights."""
    import torch

    from engine.models.layers import RotaryEmbedding, load_hf_weights

    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(dtype).to_empty(device=device)
    for mod in model.modules():           # non-persistent float32 buffers are lost by to_empty: rebuild them
        if isinstance(mod, RotaryEmbedding):
            mod.reset_buffers(device)
    load_hf_weights(model, weights, source=source)
    return model.eval()
