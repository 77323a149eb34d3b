"""``load_format: dummy`` (vLLM's name): a model's weights made up from its ``config.json``, for measuring speed at
real model sizes without downloading a checkpoint.

The tensors are the checkpoint's, by their Hugging Face names and shapes (q/k/v and gate/up unfused), so the same
weights can be written as safetensors or GGUF for the peer engines (``bench/peers``). Each tensor comes from its own
generator, seeded by ``(seed, name)``: it depends on nothing else (not the other tensors, not the order they are
made in, not the dtype asked for beyond the final cast). Values are scaled like a real initialisation so
activations stay finite and attention is not degenerate: matrices ~ N(0, std) (``initializer_range``, 0.02 in
every supported architecture), biases N(0, std), RMSNorm weights at their neutral value (1, or 0 where the norm
multiplies by ``1 + w``) plus N(0, std) jitter. They are values of the checkpoint's own dtype (``torch_dtype`` in
config.json: bf16 for every model in bench/models), as a downloaded checkpoint's are, whatever dtype they are
loaded in.
"""
from __future__ import annotations

import hashlib
import math

import torch

from engine.loader.lazy_weights import LazyWeights
from engine.models.config import ModelConfig

DEFAULT_STD = 0.02


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors for ``config``: HF name -> shape, in the model's parameter order.

    Read off the model built on the meta device (no memory), with each fused q/k/v and gate/up parameter split
    into the shards ``engine.models.layers.STACKED_PARAMS`` declares."""
    from engine.models import _on_meta
    from engine.models.layers import STACKED_PARAMS, stacked_rows

    rows = stacked_rows(config)
    shards: dict[str, list[str]] = {}
    for fused, hf, idx in sorted(STACKED_PARAMS, key=lambda t: t[2]):
        shards.setdefault(fused, []).append(hf)
    out: dict[str, tuple[int, ...]] = {}
    for name, p in _on_meta(config).named_parameters():
        fused = next((f for f in shards if f".{f}." in name), None)
        if fused is None:
            out[name] = tuple(p.shape)
            continue
        for hf in shards[fused]:
            out[name.replace(f".{fused}.", f".{hf}.")] = (rows[hf], *p.shape[1:])
    return out


def param_count(config: ModelConfig) -> int:
    """The checkpoint's parameters (``hf_shapes``: a tied head once)."""
    return sum(math.prod(s) for s in hf_shapes(config).values())


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under ``seed`` (stable across processes and machines)."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()[:8], "little") >> 1


def dummy_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int = 0,
                 std: float = DEFAULT_STD) -> torch.Tensor:
    """One tensor, in float32, of values of the checkpoint's dtype (see the module docstring)."""
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)
    if name.endswith("norm.weight"):
        t.add_(1.0 - config.norm_offset)
    stored = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.torch_dtype or "")
    return t.to(stored).float() if stored is not None else t


def dummy_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                  std: float = DEFAULT_STD) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``config`` describes, HF-named, in ``dtype`` (each made in float32 and cast
    at once, so the peak is one float32 tensor above the result)."""
    return {name: dummy_tensor(config, name, shape, seed, std).to(dtype)
            for name, shape in hf_shapes(config).items()}


def lazy_dummy_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                       std: float = DEFAULT_STD) -> LazyWeights:
    """``dummy_weights``, each tensor made when asked for (the same values: each tensor has its own generator)."""
    shapes = hf_shapes(config)
    return LazyWeights(shapes, lambda name: dummy_tensor(config, name, shapes[name], seed, std).to(dtype))


__all__ = ["DEFAULT_STD", "hf_shapes", "param_count", "tensor_seed", "dummy_tensor", "dummy_weights",
           "lazy_dummy_weights"]
