"""load_format: dummy (engine/loader/dummy.py): a checkpoint's tensors made up from its config.json — the shapes the
checkpoint has for every shipped architecture (bench/models), the same values for a seed whatever else is asked,
other values for another seed, norms at their neutral value, and an unknown architecture refused by name."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine import ModelLoadError
from engine.loader.dummy import dummy_tensor, dummy_weights, hf_shapes, tensor_seed
from engine.models.config import ModelConfig

BENCH_MODELS = Path(__file__).resolve().parent.parent / "bench" / "models"
# The published parameter counts (embedding included once when tied).
PARAMS = {"qwen2.5-0.5b-instruct": 494_032_768, "llama-3.2-1b-instruct": 1_235_814_400,
          "qwen2.5-1.5b-instruct": 1_543_714_304, "qwen3-4b": 4_022_468_096, "llama-3.1-8b-instruct": 8_030_261_248}


def _tiny(arch: str, **extra) -> ModelConfig:
    cfg = {"architectures": [arch], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, **extra}
    return ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_shipped_configs_have_the_checkpoints_tensors(name):
    config = ModelConfig.from_hf_dir(BENCH_MODELS / name)
    shapes = hf_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == PARAMS[name]
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (q, h)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, h)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (h, config.intermediate_size)
    assert ("lm_head.weight" in shapes) == (not config.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == config.attention_bias     # Qwen2
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == config.qk_norm          # Qwen3
    raw = json.loads((BENCH_MODELS / name / "config.json").read_text())
    assert config.vocab_size == raw["vocab_size"] and config.bos_token_id == raw["bos_token_id"]


@pytest.mark.parametrize("arch,extra", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                        ("Qwen3ForCausalLM", {"head_dim": 8}),
                                        ("Gemma3ForCausalLM", {"head_dim": 8, "query_pre_attn_scalar": 8})])
def test_same_seed_same_weights_other_seed_other_weights(arch, extra):
    config = _tiny(arch, **extra)
    a, b, c = dummy_weights(config, seed=3), dummy_weights(config, seed=3), dummy_weights(config, seed=4)
    assert a.keys() == b.keys() == c.keys() == hf_shapes(config).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    # a tensor depends on (seed, name) only: made alone it is the same
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(dummy_tensor(config, name, a[name].shape, seed=3), a[name])
    assert tensor_seed(3, name) != tensor_seed(3, name.replace("1", "0"))


def test_scaled_like_an_initialisation():
    config = _tiny("LlamaForCausalLM")
    w = dummy_weights(config, seed=0)
    big = w["model.embed_tokens.weight"]
    assert abs(big.std().item() - 0.02) < 0.003 and abs(big.mean().item()) < 0.003
    norm = w["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.1                                  # y = x * w: neutral at 1
    gemma = _tiny("Gemma3ForCausalLM", head_dim=8, query_pre_attn_scalar=8)
    assert dummy_weights(gemma)["model.norm.weight"].abs().max() < 0.1   # y = x * (1 + w): neutral at 0
    bf16 = dummy_weights(config, torch.bfloat16, seed=0)
    assert bf16["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(bf16["model.norm.weight"], w["model.norm.weight"].to(torch.bfloat16))


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="unsupported architecture 'FalconForCausalLM'"):
        _tiny("FalconForCausalLM")


def test_values_are_the_checkpoint_dtypes():
    """A config that says bfloat16 gets bf16 values (as a downloaded checkpoint has), whatever dtype they load in."""
    import json
    from pathlib import Path

    from engine.models.config import ModelConfig
    cfg = json.loads((Path(__file__).parent.parent / "bench/models/qwen2.5-0.5b-instruct/config.json").read_text())
    cfg.update(num_hidden_layers=1, vocab_size=64)
    w = dummy_weights(ModelConfig.from_hf(cfg))["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)
    w32 = dummy_weights(ModelConfig.from_hf({**cfg, "torch_dtype": "float32"}))["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(w32.to(torch.bfloat16).float(), w32)
