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


__all__ = ["ModelConfig", "model_class", "build_model", "build_model_from_state", "weight_bytes"]


def _on_meta(config: ModelConfig):
    """The model's modules on the meta device: no memory, no random init of a 262k x 640 embedding."""
    import torch

    with torch.device("meta"):
        return model_class(config)(config)


def _reset_buffers(model, device):
    """Rebuild the buffers to_empty/assign lose and choose the model's ops (``engine.models.select_ops``)."""
    from engine.models.layers import RotaryEmbedding
    from engine.models.select_ops import bind_ops

    for mod in model.modules():           # non-persistent float32 buffers are lost by to_empty/assign: rebuild
        if isinstance(mod, RotaryEmbedding):
            mod.reset_buffers(device)
    return bind_ops(model.eval(), device)


def build_model(config: ModelConfig, weights: dict, dtype, device, source: str = "checkpoint"):
    """Build on the meta device, then copy in HF-named weights (fusing q/k/v and gate/up)."""
    from engine.models.layers import load_hf_weights

    model = _on_meta(config).to(dtype).to_empty(device=device)
    load_hf_weights(model, weights, source=source)
    return _reset_buffers(model, device)


def build_model_from_state(config: ModelConfig, state: dict, device, int8_dtype=None):
    """Build around an existing ``state_dict`` (our names, final layout), using its tensors as they are
    (memory-mapped ones stay mapped on the CPU). ``int8_dtype``: the state is an int8 model
    (``engine.quant.int8``) whose activations run in that dtype."""
    model = _on_meta(config)
    if int8_dtype is not None:
        from engine.quant.int8 import int8_structure
        model = int8_structure(model, int8_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if str(device) != "cpu":
        model = model.to(device)
    return _reset_buffers(model, device)


def weight_bytes(model) -> int:
    """Resident bytes of the model's parameters and buffers (int8 packs included)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
