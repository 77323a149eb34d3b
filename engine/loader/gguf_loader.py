"""GGUF files: a fast header reader, metadata -> ``ModelConfig``, and tensors -> HF-named weights.

llama.cpp's converter changes a checkpoint in three ways we undo here, so the models see exactly what a
Hugging Face checkpoint would give them:

* names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` (table below);
* Llama-family (``llama`` arch) q/k projection rows are permuted from HF's rotate-half layout to
  interleaved pairs; qwen2 / qwen3 / gemma3 are written as is;
* Gemma RMSNorm weights are stored as ``1 + w``; the engine applies ``(1 + w)`` itself, as HF does.

GGUF lists dimensions innermost first (``ne``); torch shapes are that reversed.
"""
from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loader.dequant import BLOCK_SIZES, SUPPORTED_TYPES, dequantize, type_name
from engine.loader.lazy_weights import LazyWeights
from engine.models.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}."). Norm names differ by family.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_NORMS_PRE_POST = {"ffn_norm": "post_attention_layernorm"}                  # llama / qwen
_NORMS_SANDWICH = {"post_attention_norm": "post_attention_layernorm",      # gemma3
                   "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs"}          # folded into ModelConfig.rope_scaling

# Tokens llama.cpp treats as end-of-generation besides tokenizer.ggml.eos_token_id (llama-vocab.cpp).
_EOG_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
              "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>")
_CONTROL = 3


# ---- the file ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (GGUF ne reversed)
    ggml_type: int
    offset: int              # absolute, in the file
    nbytes: int


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
              7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFile:
    """A GGUF file's metadata and tensor table, parsed once; tensor bytes are read through a memory map.

    Metadata values: scalars as Python values, strings as ``str``, numeric arrays as numpy arrays,
    string arrays as lists of ``str``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelLoadError(f"{self.path}: GGUF file not found") from None
        except (OSError, ValueError) as e:     # ValueError: mmap of an empty file
            raise ModelLoadError(f"{self.path}: cannot read GGUF file ({e})") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError, OverflowError, MemoryError) as e:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({e})") from None

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version} (supported: 2, 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        alignment = int(self.metadata.get("general.alignment", 32))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            ne = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(ne)), ggml_type, offset))
        data_start = (self._pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if ggml_type in BLOCK_SIZES:
                block_size, type_size = BLOCK_SIZES[ggml_type]
                nbytes = prod(shape) // block_size * type_size
            else:
                nbytes = -1      # unknown type: an error only if the tensor is loaded
            start = data_start + offset
            if start + max(nbytes, 0) > len(buf):
                raise ModelLoadError(f"{self.path}: tensor {name!r} extends past the end of the file "
                                     "(truncated download?)")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
        del self._pos

    def _unpack(self, fmt: str) -> tuple:
        vals = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return vals

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        if self._pos > len(self._buf):
            raise ValueError("string runs past the end of the file")
        return self._buf[start:self._pos].decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype == 8:
            return self._string()
        if vtype == 9:
            etype, count = self._unpack("<IQ")
            if etype in _NP_SCALAR:
                arr = np.frombuffer(self._buf, dtype=_NP_SCALAR[etype], count=count, offset=self._pos).copy()
                self._pos += arr.nbytes
                return arr
            if etype == 8:
                return [self._string() for _ in range(count)]
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    # ---- access ----
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (a read-only view of the mapped file)."""
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        info = self.tensors[name]
        return dequantize(self.raw(info), info.ggml_type, info.shape, name=f"{self.path.name}:{name}", dtype=dtype)


@lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed ``GGUFFile``; cached per (path, mtime, size) so config + weights parse the header once."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: GGUF file not found") from None
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read GGUF file ({e})") from None
    return _open_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


# ---- config --------------------------------------------------------------------------------------------
def gguf_model_config(path: str | Path) -> ModelConfig:
    """Normalize a GGUF file's metadata into a ``ModelConfig`` (HF conventions)."""
    g = open_gguf(path)
    arch = g.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{g.path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in g.metadata:
            if required:
                raise ModelLoadError(f"{g.path}: GGUF metadata lacks required key {full!r}")
            return default
        return g.metadata[full]

    hidden = int(key("embedding_length", required=True))
    n_layers = int(key("block_count", required=True))
    n_heads = int(_first(key("attention.head_count", required=True)))
    n_kv = int(_first(key("attention.head_count_kv", n_heads)))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size")
    if vocab is None:
        if tokens is None:
            if "token_embd.weight" not in g.tensors:
                raise ModelLoadError(f"{g.path}: cannot tell the vocabulary size (no tokens, no token_embd)")
            vocab = g.tensors["token_embd.weight"].shape[0]
        else:
            vocab = len(tokens)
    bos = g.get("tokenizer.ggml.bos_token_id")
    common = dict(
        architecture=SUPPORTED_GGUF_ARCHITECTURES[arch], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_first(key("feed_forward_length", required=True))),
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(g, arch, head_dim),
        tie_word_embeddings="output.weight" not in g.tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_eos_ids(g),
        torch_dtype=None,
    )
    window = key("attention.sliding_window")
    if arch == "gemma3":
        # Gemma3 interleaves 5 sliding-window layers with 1 global one (llama.cpp: n_swa_pattern = 6).
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, np.ndarray) and pattern.size == n_layers:   # per-layer: True = sliding
            layer_types = tuple("sliding_attention" if s else "full_attention" for s in pattern.tolist())
        else:
            p = int(pattern) if isinstance(pattern, (int, np.integer)) and pattern else 6
            layer_types = tuple("full_attention" if i % p == p - 1 else "sliding_attention" for i in range(n_layers))
        scale = key("attention.scale")
        if scale is None:
            # NOTE: llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): 1/sqrt(hidden/heads) for the 27B model
            # (62 layers; HF query_pre_attn_scalar = 168), else 1/sqrt(key_length) (HF: query_pre_attn_scalar =
            # head_dim = 256, which is also transformers' GGUF default).
            scale = (hidden / n_heads) ** -0.5 if n_layers == 62 else head_dim ** -0.5
        return ModelConfig(**common, hidden_act="gelu_pytorch_tanh", qk_norm=True, norm_offset=1.0,
                           embed_scale=math.sqrt(hidden), sandwich_norm=True, attention_scale=float(scale),
                           sliding_window=int(window) if window else None, layer_types=layer_types,
                           rope_local_theta=10000.0,
                           final_logit_softcapping=_opt_float(key("final_logit_softcapping")),
                           attn_logit_softcapping=_opt_float(key("attn_logit_softcapping")))
    layer_types: tuple[str, ...] = ("sliding_attention",) * n_layers if window else ()
    return ModelConfig(**common, attention_bias="blk.0.attn_q.bias" in g.tensors,
                       qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
                       sliding_window=int(window) if window else None, layer_types=layer_types)


def _first(v: Any) -> Any:
    """Per-layer arrays (some files store head counts per layer) -> their max."""
    if isinstance(v, np.ndarray):
        return v.max()
    return v


def _opt_float(v: Any) -> float | None:
    return float(v) if v is not None and float(v) != 0.0 else None


def _eos_ids(g: GGUFFile) -> tuple[int, ...]:
    ids: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = g.get(k)
        if v is not None and int(v) not in ids and int(v) >= 0:
            ids.append(int(v))
    tokens, types = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        # NOTE: llama.cpp ends generation on these control tokens too (e.g. Gemma's <end_of_turn>, which HF
        # lists in generation_config.eos_token_id); we follow it so chat output stops at the turn end.
        index = {t: i for i, t in enumerate(tokens[:1024])}      # control tokens sit at the front
        for text in _EOG_TEXTS:
            i = index.get(text)
            if i is not None and int(types[i]) == _CONTROL and i not in ids:
                ids.append(i)
    return tuple(ids)


def _rope_scaling(g: GGUFFile, arch: str, head_dim: int) -> dict | None:
    kind = g.get(f"{arch}.rope.scaling.type")
    factor = g.get(f"{arch}.rope.scaling.factor")
    if "rope_freqs.weight" in g.tensors:
        return _llama3_rope_from_freqs(g, arch, head_dim)
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        orig = g.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise ModelLoadError(f"{g.path}: unsupported rope scaling type {kind!r} (supported: linear, yarn, llama3)")


def _llama3_rope_from_freqs(g: GGUFFile, arch: str, head_dim: int) -> dict:
    """Recover HF's llama3 rope-scaling parameters from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors f_i = inv_freq_i / scaled_inv_freq_i. In HF's llama3 rule,
    f = 1 for short wavelengths, f = factor for long ones, and in between 1/f = (1 - s)/factor + s with
    s = orig / (wavelen * (high - low)) - low / (high - low), linear in 1/wavelen. Any (orig, low, high)
    with the same line gives the same frequencies, so we keep the file's context length as ``orig``.
    """
    f = g.tensor("rope_freqs.weight").double().reshape(-1)
    base = float(g.get(f"{arch}.rope.freq_base", 10000.0))
    dim = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if f.numel() != inv_freq.numel():
        raise ModelLoadError(f"{g.path}: rope_freqs has {f.numel()} entries, expected {inv_freq.numel()}")
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return None  # type: ignore[return-value]
    mid = (f > 1.0 + 1e-6) & (f < factor - 1e-6)
    if int(mid.sum()) < 2:
        raise ModelLoadError(f"{g.path}: cannot recover llama3 rope scaling from rope_freqs "
                             "(fewer than two interpolated frequencies)")
    s = (1.0 / f[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    x = inv_freq[mid] / (2 * math.pi)                        # 1 / wavelen
    a, b = np.polyfit(x.numpy(), s.numpy(), 1)               # s = a * x + b
    orig = float(g.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    span = orig / a                                          # high - low
    low = -b * span
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
            "high_freq_factor": float(low + span), "original_max_position_embeddings": int(orig)}


# ---- weights -------------------------------------------------------------------------------------------
def hf_name(gguf_name: str, arch: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors the models do not take."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _SKIPPED:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if not m:
        return None
    layer, part = m.groups()
    norms = _NORMS_SANDWICH if arch == "gemma3" else _NORMS_PRE_POST
    target = _LAYER_NAMES.get(part) or norms.get(part)
    return f"model.layers.{layer}.{target}.{suffix}" if target else None


def gguf_name(hf: str, arch: str) -> str:
    """The GGUF tensor name of HF parameter ``hf`` (the inverse of ``hf_name``), for writing GGUF files."""
    stem, _, suffix = hf.rpartition(".")
    for g, h in _GLOBAL_NAMES.items():
        if stem == h:
            return f"{g}.{suffix}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m:
        layer, part = m.groups()
        norms = _NORMS_SANDWICH if arch == "gemma3" else _NORMS_PRE_POST
        for g, h in {**_LAYER_NAMES, **norms}.items():
            if part == h:
                return f"blk.{layer}.{g}.{suffix}"
    raise ValueError(f"no GGUF name for {hf!r} ({arch})")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    llama.cpp:  w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)   (rotate-half -> interleaved)
    inverse:    w.reshape(n_head, d // 2, 2, *rest).swapaxes(1, 2)
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> LazyWeights:
    """Every tensor of a GGUF file as HF-named weights of ``dtype`` on ``device``, each dequantized when asked for
    (an 8B file's weights dequantized at once would take 30 GB in float32). The file's architecture, tensor types
    and the tensors a model needs are checked here, before any is read."""
    g = open_gguf(path)
    arch = g.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{g.path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    unsupported = sorted({(n, type_name(t.ggml_type)) for n, t in g.tensors.items()
                          if t.ggml_type not in BLOCK_SIZES and hf_name(n, arch)})
    if unsupported:
        name, tname = unsupported[0]
        raise ModelLoadError(f"{g.path}: tensor {name!r} has unsupported type {tname} "
                             f"({len(unsupported)} such tensors); supported: {', '.join(SUPPORTED_TYPES)}")
    names = {target: name for name in g.tensors if (target := hf_name(name, arch)) is not None}
    if "model.embed_tokens.weight" not in names:
        raise ModelLoadError(f"{g.path}: no token_embd.weight tensor")
    if not config.tie_word_embeddings and "lm_head.weight" not in names:
        raise ModelLoadError(f"{g.path}: config is untied but the file has no output.weight tensor")

    def get(target: str) -> torch.Tensor:
        # NOTE: norms are offset in float32 before rounding; everything else is rounded once, chunk-wise
        offset_norm = arch == "gemma3" and target.endswith("norm.weight")
        w = g.tensor(names[target], torch.float32 if offset_norm else dtype)
        if arch == "llama" and target.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif arch == "llama" and target.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        if offset_norm:
            w = w - 1.0
        return w.to(device=device, dtype=dtype)
    return LazyWeights(names, get)


def gguf_int8_weights(path: str | Path, config: ModelConfig) -> LazyWeights:
    """The file's Q8_0 / Q5_0 / Q4_0 weight matrices as int8, by HF name: (int8 [rows, K], scales [rows, K // 32]),
    each read when asked for.

    ``quantization: int8`` takes these as they are: our int8 format is their grouping (32 values, one scale), so
    they load exactly, with no float round trip and no requantization error. llama q/k rows get the same
    un-permutation as their float values."""
    from engine.loader.dequant import EXACT_INT8_TYPES, int8_blocks

    g = open_gguf(path)
    arch = g.get("general.architecture")
    names = {target: name for name, info in g.tensors.items()
             if (target := hf_name(name, arch)) is not None and info.ggml_type in EXACT_INT8_TYPES
             and len(info.shape) == 2}

    def get(target: str) -> tuple[torch.Tensor, torch.Tensor]:     # read when the int8 build reaches it
        info = g.tensors[names[target]]
        q, s = int8_blocks(info.ggml_type, g.raw(info), info.shape)
        for suffix, heads in (("q_proj.weight", config.num_attention_heads),
                              ("k_proj.weight", config.num_key_value_heads)):
            if arch == "llama" and target.endswith(suffix):
                q, s = _unpermute(q, heads), _unpermute(s, heads)
        return q.contiguous(), s.contiguous()
    return LazyWeights(names, get)


__all__ = ["GGUFFile", "open_gguf", "gguf_model_config", "load_gguf_weights", "gguf_int8_weights", "hf_name",
           "gguf_name", "SUPPORTED_GGUF_ARCHITECTURES"]
