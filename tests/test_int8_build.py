"""quantization: int8 built one weight at a time (engine/loader/int8_build.py): the same state, tensor for tensor, as
quantizing the whole float model; at most one fused weight's float shards alive at once (an 8B model's float32
copy would not fit beside the checkpoint on a 24 GB machine); the float path's fused shards released as soon as
their weight is complete; bad checkpoints named before any weight is read."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from engine import ModelLoadError
from engine.loader.dummy import dummy_weights, lazy_dummy_weights
from engine.loader.int8_build import build_int8, direct_quants, fused_shards
from engine.loader.lazy_weights import LazyWeights
from engine.loader.resolve import ModelSource
from engine.models import build_model
from engine.models.config import ModelConfig
from engine.quant.int8 import quantize_model

SOURCE = ModelSource(kind="dummy", path=Path("tiny"), name="tiny")


def _tiny(arch: str, tie: bool, **extra) -> ModelConfig:
    cfg = {"architectures": [arch], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": tie, "torch_dtype": "bfloat16", **extra}
    return ModelConfig.from_hf(cfg)


CONFIGS = {"qwen2 (biases, tied head)": ("Qwen2ForCausalLM", True), "llama (own head)": ("LlamaForCausalLM", False),
           "gemma3": ("Gemma3ForCausalLM", True), "qwen3": ("Qwen3ForCausalLM", False)}


def _is_matrix(name: str) -> bool:
    return name.endswith("proj.weight") or name.startswith(("model.embed_tokens", "lm_head"))


class Tracked(LazyWeights):
    """A lazy mapping that counts the weight matrices it handed out that are still alive, and the most at once
    (norms and biases stay in the model as they are read)."""

    def __init__(self, inner):
        self.alive = self.most = self.reads = 0
        self.names_read: list[str] = []
        super().__init__(inner, self._read)
        self._inner = inner

    def _read(self, name: str) -> torch.Tensor:
        t = self._inner[name].clone()
        self.reads += 1
        self.names_read.append(name)
        if not _is_matrix(name):
            return t
        self.alive += 1
        self.most = max(self.most, self.alive)
        weakref.finalize(t, self._gone)
        return t

    def _gone(self) -> None:
        self.alive -= 1


@pytest.mark.parametrize("which", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_int8_state_is_the_whole_float_models_quantized(which, dtype):
    config = _tiny(*CONFIGS[which])
    whole = quantize_model(build_model(config, dummy_weights(config, dtype), dtype, "cpu"),
                           direct_quants(SOURCE, config), fused_shards(config)).state_dict()
    streamed = build_int8(config, lazy_dummy_weights(config, dtype), dtype, SOURCE).state_dict()
    assert list(streamed) == list(whole)
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name


def test_at_most_one_fused_weight_is_held_in_float():
    config = _tiny("Qwen2ForCausalLM", False, num_hidden_layers=4)
    weights = Tracked(lazy_dummy_weights(config, torch.float32))
    build_int8(config, weights, torch.float32, SOURCE)
    assert weights.reads == len(weights)          # every tensor read once
    assert weights.most <= 3                      # q, k and v of one layer at most


def test_the_float_path_releases_a_fused_weights_shards_when_it_is_complete():
    config = _tiny("LlamaForCausalLM", False, num_hidden_layers=4)
    weights = Tracked(lazy_dummy_weights(config, torch.float32))
    model = build_model(config, weights, torch.float32, "cpu")
    assert weights.most <= 3
    ref = build_model(config, dummy_weights(config), torch.float32, "cpu")
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def _edited(config, drop=(), add=None, reshape=None):
    base = lazy_dummy_weights(config, torch.float32)
    names = [n for n in base if n not in drop] + ([add] if add else [])
    read = []

    def get(name):
        read.append(name)
        t = base[name] if name in base else torch.zeros(4)
        return t[:-1] if name == reshape else t
    return LazyWeights(names, get), read


def test_a_bad_checkpoint_is_named_before_any_weight_is_read():
    config = _tiny("LlamaForCausalLM", False)
    k = "model.layers.1.self_attn.k_proj.weight"
    weights, read = _edited(config, drop=[k])
    with pytest.raises(ModelLoadError, match=f"missing tensors: {k}"):
        build_int8(config, weights, torch.float32, SOURCE)
    weights, read2 = _edited(config, add="model.layers.0.mlp.extra.weight")
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        build_int8(config, weights, torch.float32, SOURCE)
    assert read == read2 == []
    weights, _ = _edited(config, reshape=k)
    with pytest.raises(ModelLoadError, match="qkv_proj.weight"):
        build_int8(config, weights, torch.float32, SOURCE)


def test_large_weights_are_quantized_in_slices_of_rows_with_the_same_bits(monkeypatch):
    import engine.quant.int8 as int8
    w = torch.randn(1000, 100, generator=torch.Generator().manual_seed(5))
    whole = int8.quantize_rows(w)
    monkeypatch.setattr(int8, "QUANT_ROWS", 96)
    sliced = int8.quantize_rows(w)
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])


def test_a_gguf_int8_model_takes_its_int8_blocks_without_dequantizing_them():
    """The default GGUF: the same state as quantizing the whole float model with its Q8_0 / Q5_0 blocks taken as they
    are, and a weight whose every shard is such a block (the Q8_0 embedding) never read as floats."""
    from engine.loader import load_model_config, load_weights, resolve_model
    src = resolve_model("gemma-3-270m")
    config = load_model_config(src)
    floats = Tracked(load_weights(src, config, torch.float32))
    streamed = build_int8(config, floats, torch.float32, src).state_dict()
    whole = quantize_model(build_model(config, dict(load_weights(src, config, torch.float32)), torch.float32, "cpu"),
                           dict(direct_quants(src, config)), fused_shards(config)).state_dict()
    assert list(streamed) == list(whole)
    assert all(torch.equal(streamed[n], t) for n, t in whole.items())
    assert "model.embed_tokens.weight" not in floats.names_read and floats.names_read
