"""bench/dummy_gguf.py: a dummy model written as GGUF reads back, through batchgen's own GGUF loader, to the
weights ``load_format: dummy`` makes (float types exactly, Q8_0 within its rounding), with the metadata llama.cpp
needs. Tiny configs, no llama.cpp."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.dummy_gguf import MARK_KEY, llama3_rope_factors, permute_qk, write_gguf
from engine.loader.dummy import dummy_weights
from engine.loader.gguf_loader import _unpermute, gguf_model_config, gguf_name, hf_name, load_gguf_weights, open_gguf
from engine.models.config import ModelConfig
from engine.models.layers import rope_inv_freq

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16"}
CONFIGS = {
    "qwen2": {**TINY, "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, "tie_word_embeddings": True,
              "bos_token_id": 3, "eos_token_id": 5, "sliding_window": 4096, "use_sliding_window": False},
    "llama": {**TINY, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": [2, 7], "head_dim": 64, "rms_norm_eps": 1e-5,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}},
    "qwen3": {**TINY, "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1e6, "tie_word_embeddings": True,
              "head_dim": 32, "bos_token_id": 3, "eos_token_id": 5},
}


def _config_dir(tmp_path, arch):
    d = tmp_path / f"tiny-{arch}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIGS[arch]))
    return d


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("type_", ["f16", "q8_0"])
def test_the_file_loads_back_to_the_dummy_weights(tmp_path, arch, type_):
    path = write_gguf(_config_dir(tmp_path, arch), tmp_path / f"{arch}-{type_}.gguf", type_)
    want = ModelConfig.from_hf(CONFIGS[arch])
    got = gguf_model_config(path)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id", "eos_token_ids",
                  "sliding_window", "max_position_embeddings"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    if want.rope_scaling:            # recovered from rope_freqs: the same frequencies
        torch.testing.assert_close(rope_inv_freq(got.head_dim, got.rope_theta, got.rope_scaling),
                                   rope_inv_freq(want.head_dim, want.rope_theta, want.rope_scaling))
    weights = load_gguf_weights(path, got)
    ref = dummy_weights(want)
    assert set(weights) == set(ref)
    for name, w in ref.items():
        if type_ == "q8_0" and w.dim() == 2:
            # per 32 values: half a step of amax / 127, plus the step's own f16 rounding times up to 127 steps
            step = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
            err = (weights[name] - w).reshape(step.shape[0], -1, 32).abs()
            assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all(), name
            assert err.max() > 0, name                              # it is quantized
        else:                                    # bf16 values: exact in F16 (and F32 for 1-D tensors)
            torch.testing.assert_close(weights[name], w, rtol=0, atol=1e-7, msg=name)
    g = open_gguf(path)
    assert g.get("general.architecture") == arch and g.get("tokenizer.ggml.model") == "llama"
    assert len(g.get("tokenizer.ggml.tokens")) == want.vocab_size
    assert len(set(g.get("tokenizer.ggml.tokens"))) == want.vocab_size          # llama.cpp maps piece -> id
    types = g.get("tokenizer.ggml.token_type")
    assert {int(i) for i in np.flatnonzero(types == 3)} == {want.bos_token_id, *want.eos_token_ids}
    matrix = g.tensors[gguf_name("model.layers.0.mlp.up_proj.weight", arch)].ggml_type
    assert matrix == {"f16": 1, "q8_0": 8}[type_]
    assert g.tensors[gguf_name("model.norm.weight", arch)].ggml_type == 0          # 1-D: F32


def test_written_once_per_config_type_and_seed(tmp_path):
    cfg = _config_dir(tmp_path, "qwen2")
    path = write_gguf(cfg, tmp_path / "m.gguf", "f16")
    mtime = path.stat().st_mtime_ns
    assert write_gguf(cfg, path, "f16").stat().st_mtime_ns == mtime
    assert json.loads(open_gguf(path).get(MARK_KEY))["type"] == "f16"
    write_gguf(cfg, path, "f16", seed=1)
    assert json.loads(open_gguf(path).get(MARK_KEY))["seed"] == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_names_and_permutation_invert_the_loaders():
    for hf in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
               "model.layers.3.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight",
               "model.layers.1.post_attention_layernorm.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert hf_name(gguf_name(hf, "llama"), "llama") == hf
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    p = permute_qk(w, 8)
    assert not torch.equal(p, w) and torch.equal(_unpermute(p, 8), w)
    # a head's rows (r0 .. r15, rotate-half: r_i pairs with r_{i+8}) become interleaved pairs r0 r8 r1 r9 ...
    assert p[:4, 0].tolist() == [w[0, 0], w[8, 0], w[1, 0], w[9, 0]]


def test_llama3_rope_factors_are_the_scaling_hf_applies():
    cfg = ModelConfig.from_hf(CONFIGS["llama"])
    f = torch.from_numpy(llama3_rope_factors(cfg)).double()
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None).double()
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).double()
    torch.testing.assert_close(plain / f, scaled, rtol=1e-6, atol=0)
    assert f.min() == 1.0 and f.max() == 32.0 and ((f > 1) & (f < 32)).any()


def test_unsupported_models_are_refused(tmp_path):
    d = tmp_path / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, "architectures": ["Gemma3ForCausalLM"]}))
    with pytest.raises(ValueError, match="not written as GGUF"):
        write_gguf(d, tmp_path / "g.gguf", "f16")
    assert not (tmp_path / "g.gguf").exists()
