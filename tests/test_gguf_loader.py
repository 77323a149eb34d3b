"""GGUF loading: config from metadata, HF-named weights, parity with transformers' own GGUF loading."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.errors import ModelLoadError
from engine.loader.gguf_loader import GGUFFile, gguf_model_config, load_gguf_weights
from engine.loader.resolve import resolve_model


# ---- tiny checkpoints written with gguf.GGUFWriter, the way convert_hf_to_gguf does ----------------------
def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(path: Path, arch: str, hf_model, tokens: list[str]) -> None:
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf_model.state_dict().items():
        t = t.detach().float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = name.split(".")                      # model.layers.{i}.<module...>.{weight|bias}
            module, suffix = ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{parts[2]}.{_LAYER[module]}.{suffix}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = _llama_permute(t, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = _llama_permute(t, cfg.num_key_value_heads)
        w.add_tensor(gname, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str, tie: bool):
    import transformers
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=tie)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=50000.0)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, rope_theta=50000.0)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():                  # random norms, so a wrong name/offset cannot hide behind ones
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_()
    return model


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_tiny_roundtrip_equals_hf(tmp_path: Path, arch: str, tie: bool):
    model = _tiny(arch, tie)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)]
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, model, tokens)

    cfg = gguf_model_config(path)
    hf = model.config
    assert cfg.architecture == type(model).__name__
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 64, 96, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 50000.0 and cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings == tie
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.sliding_window is None and cfg.norm_offset == 0.0

    weights = load_gguf_weights(path, cfg, torch.float32)
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(weights) == set(expected)
    for k, v in expected.items():
        assert weights[k].shape == v.shape, k
        assert torch.equal(weights[k], v.float()), k
    assert hf.tie_word_embeddings == tie

    bf16 = load_gguf_weights(path, cfg, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


# ---- errors ---------------------------------------------------------------------------------------------
def test_missing_and_corrupt_files(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="not found"):
        gguf_model_config(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=str(bad)):
        gguf_model_config(bad)
    # a real header cut short
    src = resolve_model("gemma-3-270m").path
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        gguf_model_config(cut)


def test_unsupported_architecture(tmp_path: Path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as ei:
        gguf_model_config(path)
    msg = str(ei.value)
    assert "falcon" in msg and str(path) in msg and "gemma3" in msg and "llama" in msg


# ---- the default model vs transformers' GGUF loading -----------------------------------------------------
_VOCAB_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}


def _copy_without_vocab(src: Path, dst: Path) -> None:
    """Byte-level copy of a GGUF minus the tokenizer arrays, plus ``{arch}.vocab_size``; tensors untouched."""
    g = GGUFFile(src)
    buf, arch = g._buf, g.get("general.architecture")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    g._pos, kept = 24, []
    for _ in range(n_kv):
        start = g._pos
        key = g._string()
        g._value(g._unpack("<I")[0])
        if key not in _VOCAB_ARRAYS:
            kept.append(bytes(buf[start:g._pos]))
    key = f"{arch}.vocab_size".encode()
    kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, len(g.get("tokenizer.ggml.tokens"))))
    infos_start = g._pos
    for _ in range(n_tensors):
        g._string()
        (n_dims,) = g._unpack("<I")
        g._unpack(f"<{n_dims}QIQ")
    infos = bytes(buf[infos_start:g._pos])
    alignment = int(g.get("general.alignment", 32))
    data_start = (g._pos + alignment - 1) // alignment * alignment
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + infos
    with dst.open("wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        f.write(buf[data_start:])


@pytest.fixture(scope="module")
def default_model():
    return resolve_model("gemma-3-270m")


def test_default_model_config(default_model):
    cfg = gguf_model_config(default_model.path)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (640, 18, 4, 1)
    assert cfg.head_dim == 256 and cfg.vocab_size == 262144 and cfg.intermediate_size == 2048
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norm and cfg.norm_offset == 1.0
    assert cfg.embed_scale == pytest.approx(640 ** 0.5)
    assert cfg.attention_scale == 256 ** -0.5           # query_pre_attn_scalar = 256
    assert cfg.sliding_window == 512 and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.rope_scaling is None
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids[0] == 1 and 106 in cfg.eos_token_ids   # <end_of_turn>


@pytest.mark.slow
def test_default_model_matches_transformers(default_model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = gguf_model_config(default_model.path)
    t = time.perf_counter()
    ours = load_gguf_weights(default_model.path, cfg, torch.float32)
    load_s = time.perf_counter() - t
    # ~0.5-1 s on an idle 2-core machine; the bound only catches gross regressions on a busy shared one
    assert load_s < 30, f"loading the 270M model took {load_s:.1f}s"

    # transformers' own GGUF path (what from_pretrained(..., gguf_file=...) runs, minus accelerate).
    # NOTE: gguf.GGUFReader walks the 262k-entry vocabulary arrays in Python (10-25 s per parse here), so the
    # reference reads a copy of the file without them: same tensor bytes and model metadata, vocab size as a key.
    slim = tmp_path / "slim.gguf"
    _copy_without_vocab(default_model.path, slim)
    parsed = load_gguf_checkpoint(str(slim), return_tensors=False)
    hf_cfg = AutoConfig.for_model(**parsed["config"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_cfg)
    theirs = load_gguf_checkpoint(str(slim), return_tensors=True, model_to_load=skeleton)["tensors"]

    assert set(ours) == set(theirs)
    for name, w in ours.items():
        ref = theirs[name].float()
        assert w.shape == ref.shape, name
        torch.testing.assert_close(w, ref, rtol=0, atol=1e-6, msg=name)

    # config fields agree with transformers' reading of the same metadata
    assert cfg.hidden_size == hf_cfg.hidden_size and cfg.head_dim == hf_cfg.head_dim
    assert cfg.num_key_value_heads == hf_cfg.num_key_value_heads and cfg.vocab_size == hf_cfg.vocab_size
    assert cfg.sliding_window == hf_cfg.sliding_window and cfg.rms_norm_eps == hf_cfg.rms_norm_eps
    assert cfg.attention_scale == hf_cfg.query_pre_attn_scalar ** -0.5
    assert list(cfg.layer_types) == list(hf_cfg.layer_types)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path):
    """llama.cpp stores Llama-3.1 rope scaling as a rope_freqs tensor; we recover HF's llama3 parameters."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                                      max_position_embeddings=131072, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    path = tmp_path / "rope.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_embedding_length, 512), (w.add_block_count, 1), (w.add_feed_forward_length, 64),
                   (w.add_head_count, 4), (w.add_head_count_kv, 4), (w.add_context_length, 131072),
                   (w.add_rope_freq_base, 500000.0), (w.add_rope_dimension_count, 128), (w.add_vocab_size, 8)]:
        add(v)
    w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))   # as convert_hf_to_gguf
    w.add_tensor("token_embd.weight", np.zeros((8, 512), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cfg = gguf_model_config(path)
    rs = cfg.rope_scaling
    assert rs["rope_type"] == "llama3" and rs["factor"] == pytest.approx(8.0)
    ours = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                                    max_position_embeddings=131072,
                                    rope_parameters={**rs, "rope_theta": cfg.rope_theta})
    recovered, _ = ROPE_INIT_FUNCTIONS["llama3"](ours, "cpu")
    torch.testing.assert_close(recovered, scaled, rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in load_gguf_weights(path, cfg)
