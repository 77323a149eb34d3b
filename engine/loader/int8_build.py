"""An int8 model (``quantization: int8``) built from a checkpoint one weight at a time.

Each linear's float weight is read (its q/k/v or gate/up shards put together), quantized and packed before the next
one is read, so a load never holds the float model: Llama-3.1-8B's float32 model is 30 GB, and building it before
quantizing (with the checkpoint read beside it) needed ~60 GB on a 24 GB machine; this way the peak is the int8
model plus one float weight. The state is the one ``engine.quant.int8.quantize_model`` makes of the whole float
model, tensor for tensor (tests/test_int8_build.py). GGUF Q8_0 / Q5_0 / Q4_0 tensors keep their quants; the rest
(Q4_K, Q6_K, float) are quantized from their float values.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.loader.resolve import ModelSource
from engine.models.config import ModelConfig


def fused_shards(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our fused weights (``layers.STACKED_PARAMS``) -> [(HF name, rows), ...] in row order (``layers.shard_names``)."""
    from engine.models.layers import STACKED_PARAMS, shard_names, stacked_rows

    rows = stacked_rows(config)
    block = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
    shards: dict[str, list[tuple[str, int]]] = {}
    for i in range(config.num_hidden_layers):
        for fused in dict.fromkeys(f for f, _, _ in STACKED_PARAMS):
            target = f"model.layers.{i}.{block[fused]}.{fused}.weight"
            shards[target] = [(hf, rows[hf.rsplit(".", 2)[-2]]) for hf in shard_names(target)]
    return shards


def direct_quants(source: ModelSource, config: ModelConfig) -> Mapping:
    """A GGUF file's tensors already in an int8 block format, by HF name ({} for other sources)."""
    if source.kind != "gguf":
        return {}
    from engine.loader.gguf_loader import gguf_int8_weights
    return gguf_int8_weights(source.path, config)


def build_int8(config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, source: ModelSource
               ) -> nn.Module:
    """The int8 model of ``weights`` (HF names; a lazy mapping is read one tensor at a time) with activations in
    ``dtype``. ModelLoadError names a missing, unexpected or mis-shaped tensor before any weight is read."""
    from engine.models import _on_meta, build_model_from_state
    from engine.models.layers import shard_names
    from engine.quant.int8 import _linears, quantize_model

    where = str(source.path)
    model = _on_meta(config).to(dtype)
    params = dict(model.named_parameters())
    _check_names(params, weights, where)
    quantized = {f"{name}.weight" for name, *_ in _linears(model)} | {"model.embed_tokens.weight"}

    def assemble(our: str) -> torch.Tensor:
        parts = [weights[hf] for hf in shard_names(our)]
        if len({tuple(p.shape[1:]) for p in parts}) > 1:
            raise ModelLoadError(f"{where}: the shards of {our!r} differ in shape: "
                                 + ", ".join(f"{hf} {tuple(p.shape)}" for hf, p in zip(shard_names(our), parts)))
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(t.shape) != tuple(params[our].shape):
            raise ModelLoadError(f"{where}: tensor {our!r} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(params[our].shape)}")
        return t.to(dtype)
    small = {our: assemble(our) for our in params if our not in quantized}      # norms and biases
    model.load_state_dict(small, strict=False, assign=True)
    quantize_model(model, direct_quants(source, config), fused_shards(config), weight_of=assemble)
    return build_model_from_state(config, model.state_dict(), "cpu", int8_dtype=dtype)


def _check_names(params: dict, weights: Mapping, where: str) -> None:
    from engine.models.layers import shard_names

    wanted = {hf for our in params for hf in shard_names(our)}
    missing = sorted(wanted - set(weights))
    if missing:
        raise ModelLoadError(f"{where}: missing tensors: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    for name in weights:
        if name not in wanted and "rotary_emb" not in name and name != "lm_head.weight":
            raise ModelLoadError(f"{where}: unexpected tensor {name!r}")


__all__ = ["build_int8", "fused_shards", "direct_quants"]
