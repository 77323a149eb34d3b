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


__all__ = ["ModelConfig", "model_class"]
