"""llama.cpp's copy of a ``load_format: dummy`` model: the same made-up weights batchgen computes with
(``engine.loader.dummy``), written once as one GGUF file of one type (Q8_0, or a float type) for llama.cpp.

    python -m bench.dummy_gguf bench/models/qwen2.5-0.5b-instruct OUT.gguf [--type q8_0|f16|bf16|f32] [--seed 0]

The file is what llama.cpp's own converter would write from the dummy checkpoint: its tensor names, q/k rows of
the ``llama`` architecture permuted to interleaved rope pairs, llama3 rope scaling as a ``rope_freqs`` tensor,
1-D tensors (norms, biases) in F32. batchgen's GGUF loader (engine/loader/gguf_loader.py) reads it back to the
same weights. Tensors are made and written one at a time, so an 8B model needs one tensor's memory, not the
file's. Prompts go in as token ids, so the vocabulary is a placeholder of exactly ``vocab_size`` pieces (a
SentencePiece-type vocabulary, which needs no merges), with the config's BOS and EOS ids as control tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from engine.loader.dummy import dummy_tensor, hf_shapes
from engine.loader.gguf_loader import gguf_name
from engine.models.config import ModelConfig

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TYPES = ("q8_0", "f16", "bf16", "f32")
MARK_KEY = "batchgen.dummy"          # what the file was written from: config, type, seed (JSON)


def _ggml_types():
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F
    return {"q8_0": (Q.Q8_0, F.MOSTLY_Q8_0), "f16": (Q.F16, F.MOSTLY_F16), "bf16": (Q.BF16, F.MOSTLY_BF16),
            "f32": (Q.F32, F.ALL_F32)}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs, per head (the inverse of the loader's
    ``_unpermute``; llama.cpp's ``llama`` graph ropes adjacent pairs, qwen2/qwen3 rope halves as HF)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(config: ModelConfig) -> np.ndarray:
    """llama.cpp's ``rope_freqs``: per frequency, by how much llama3 scaling divides it (HF's rule)."""
    s = config.rope_scaling
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))
    return out.astype(np.float32)


def _check(config: ModelConfig) -> str:
    arch = ARCHS.get(config.architecture)
    if arch is None:
        raise ValueError(f"{config.architecture}: not written as GGUF here; supported: {', '.join(ARCHS)}")
    if config.sliding_window:
        raise ValueError(f"{config.architecture} with a sliding window: not written as GGUF here")
    kind = (config.rope_scaling or {}).get("rope_type", "default")
    if kind not in ("default", "linear", "llama3") or (kind == "llama3" and arch != "llama"):
        raise ValueError(f"rope scaling {kind!r} ({arch}): not written as GGUF here")
    return arch


def _metadata(w, config: ModelConfig, arch: str, file_type: int) -> None:
    from gguf import RopeScalingType, TokenType

    w.add_name(f"batchgen dummy {arch}")
    w.add_file_type(int(file_type))
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(float(config.rope_theta))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    if (config.rope_scaling or {}).get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(config.rope_scaling["factor"]))
    specials = {i for i in (config.bos_token_id, *config.eos_token_ids) if i is not None}
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<|special_{i}|>" if i in specials else f"<t{i}>" for i in range(config.vocab_size)])
    w.add_token_scores([0.0] * config.vocab_size)
    w.add_token_types([int(TokenType.CONTROL if i in specials else TokenType.NORMAL)
                       for i in range(config.vocab_size)])
    if config.bos_token_id is not None:
        w.add_bos_token_id(int(config.bos_token_id))
    # GGUF has one key for each of up to three end ids (llama 3: end of text, of message, of turn)
    for add, i in zip((w.add_eos_token_id, w.add_eot_token_id, w.add_eom_token_id), config.eos_token_ids):
        add(int(i))
    w.add_add_bos_token(False)


def _tensor(config: ModelConfig, arch: str, hf: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    t = dummy_tensor(config, hf, shape, seed)
    if arch == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
        t = permute_qk(t, config.num_attention_heads)
    elif arch == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
        t = permute_qk(t, config.num_key_value_heads)
    return t.contiguous()


def written_mark(path: str | Path) -> dict | None:
    """What a dummy GGUF file was written from (None: not one, or unreadable)."""
    from engine.errors import ModelLoadError
    from engine.loader.gguf_loader import GGUFFile
    try:
        raw = GGUFFile(path).get(MARK_KEY)
    except ModelLoadError:
        return None
    return json.loads(raw) if raw else None


def write_gguf(config_dir: str | Path, out: str | Path, type_: str = "q8_0", seed: int = 0) -> Path:
    """Write the file (idempotent: a file already written from the same config, type and seed is kept).
    Returns ``out``."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    config_dir, out = Path(config_dir), Path(out)
    raw = json.loads((config_dir / "config.json").read_text())
    mark = {"config": raw, "type": type_, "seed": seed}
    if out.is_file() and written_mark(out) == mark:
        return out
    config = ModelConfig.from_hf(raw, source=str(config_dir / "config.json"))
    arch = _check(config)
    qtype, file_type = _ggml_types()[type_]
    shapes = {gguf_name(hf, arch): (hf, shape) for hf, shape in hf_shapes(config).items()}
    rope_freqs = llama3_rope_factors(config) if (config.rope_scaling or {}).get("rope_type") == "llama3" else None

    def kind(shape: tuple[int, ...]):
        from gguf import GGMLQuantizationType as Q
        return qtype if len(shape) == 2 else Q.F32

    from gguf.constants import GGML_QUANT_SIZES
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, arch)
    _metadata(w, config, arch, file_type)
    w.add_string(MARK_KEY, json.dumps(mark))
    if rope_freqs is not None:
        w.add_tensor_info("rope_freqs.weight", rope_freqs.shape, np.dtype(np.float32), rope_freqs.nbytes)
    for name, (_, shape) in shapes.items():
        block, size = GGML_QUANT_SIZES[kind(shape)]
        w.add_tensor_info(name, shape, np.dtype(np.float32), math.prod(shape) // block * size, raw_dtype=kind(shape))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if rope_freqs is not None:
            w.write_tensor_data(rope_freqs)
        for name, (hf, shape) in shapes.items():
            data = _tensor(config, arch, hf, shape, seed).numpy()
            w.write_tensor_data(quantize(data, kind(shape)))
            del data
        w.close()
        os.replace(tmp, out)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir")
    ap.add_argument("out")
    ap.add_argument("--type", default="q8_0", choices=TYPES)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(write_gguf(a.config_dir, a.out, a.type, a.seed))


if __name__ == "__main__":
    main()
