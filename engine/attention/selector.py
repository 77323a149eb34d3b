"""Pick the attention backend: flash-attn on CUDA when importable, the torch backend everywhere else."""
from __future__ import annotations

import importlib.util

from engine.errors import ConfigError


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_backend(name: str, device, kernels: dict | None = None):
    """``kernels``: the kernel families' choice (engine.kernels.families); the torch backend takes ``attention``."""
    import torch

    dev = torch.device(device)
    if name == "auto":
        name = "flash_attn" if dev.type == "cuda" and flash_attn_available() else "torch"
    if name == "flash_attn":
        if dev.type != "cuda":
            raise ConfigError(f"attention_backend 'flash_attn' needs a CUDA device; this engine runs on {dev}. "
                              "Use attention_backend: torch (or auto).")
        if not flash_attn_available():
            raise ConfigError("attention_backend 'flash_attn' needs the flash-attn package "
                              "(pip install 'batchgen[cuda]'); use attention_backend: torch (or auto).")
        from engine.attention.flash_backend import FlashAttentionBackend
        return FlashAttentionBackend()
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(prefill=(kernels or {}).get("attention", "c"))
    raise ConfigError(f"unknown attention backend {name!r}; use auto, torch or flash_attn")
