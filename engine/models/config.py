"""ModelConfig: one frozen, normalized description of a decoder-only checkpoint.

Whatever the checkpoint says (a Hugging Face ``config.json`` or GGUF metadata) is turned into this once;
model code never reads raw HF dicts. ``from_hf_dir`` lives here; GGUF metadata is normalized by
``engine.loader.gguf_loader.gguf_model_config``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None. Not hashed.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"                 # "silu" | "gelu_pytorch_tanh"
    attention_bias: bool = False             # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                    # Qwen3 / Gemma3: RMSNorm over head_dim on q and k
    norm_offset: float = 0.0                 # Gemma: RMSNorm weight is (1 + w)
    embed_scale: float = 1.0                 # Gemma: embeddings scaled by sqrt(hidden_size)
    sandwich_norm: bool = False              # Gemma3: post-attention and post-ffn norms too
    attention_scale: float | None = None     # None -> head_dim ** -0.5 (Gemma3: query_pre_attn_scalar ** -0.5)
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention". Empty -> all full.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None    # Gemma3: rope base of sliding layers
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError("layer_types must have one entry per layer")

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding window (in tokens, the query included) of a layer, or None for full attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope_theta(self, layer_idx: int) -> float:
        if self.layer_window(layer_idx) is not None and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer_idx: int) -> dict | None:
        # Gemma3 applies rope scaling to global layers only; local layers use the plain local base.
        if self.architecture == "Gemma3ForCausalLM" and self.layer_window(layer_idx) is not None:
            return None
        return self.rope_scaling

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes per token for all layers at 2 bytes/element (bf16)."""
        return 2 * 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    # ---- constructors --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Normalize a Hugging Face config dict (as in ``config.json``)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:
            mt = cfg.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}.get(mt)
        if arch == "Gemma3ForConditionalGeneration" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "architectures": ["Gemma3ForCausalLM"]}
            arch = "Gemma3ForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required key {e.args[0]!r}") from None
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        common = dict(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg, "full_attention", 10000.0),
            rope_scaling=_rope_scaling(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "Gemma3ForCausalLM")),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
        if arch == "Gemma3ForCausalLM":
            window = cfg.get("sliding_window")
            layer_types = cfg.get("layer_types")
            if not layer_types:
                pattern = int(cfg.get("sliding_window_pattern", 6))
                layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                               for i in range(n_layers)]
            return cls(**common, qk_norm=True, norm_offset=1.0, embed_scale=math.sqrt(hidden), sandwich_norm=True,
                       attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                       sliding_window=int(window) if window else None, layer_types=tuple(layer_types),
                       rope_local_theta=_rope_theta(cfg, "sliding_attention", 10000.0),
                       final_logit_softcapping=cfg.get("final_logit_softcapping"),
                       attn_logit_softcapping=cfg.get("attn_logit_softcapping"))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
        layer_types = tuple(cfg.get("layer_types") or ())
        if window and not layer_types:
            layer_types = ("sliding_attention",) * n_layers
        return cls(**common, attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                   qk_norm=arch == "Qwen3ForCausalLM",
                   sliding_window=int(window) if window else None,
                   layer_types=layer_types if window else ())

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        try:
            return cls.from_hf(json.loads(p.read_text()), source=str(p))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: not a Hugging Face checkpoint directory (no config.json)") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{p}: invalid JSON ({e})") from None


def _rope_params(cfg: dict[str, Any], layer_type: str) -> dict:
    """RoPE parameters of one layer type, from transformers>=5 ``rope_parameters`` (flat or per layer type)
    or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        if layer_type in rp or "full_attention" in rp:
            return dict(rp.get(layer_type) or rp.get("full_attention") or {})
        return dict(rp)
    out = dict(cfg.get("rope_scaling") or {})
    if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    if "rope_theta" in cfg:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def _rope_theta(cfg: dict[str, Any], layer_type: str, default: float) -> float:
    return float(_rope_params(cfg, layer_type).get("rope_theta", default))


def _rope_scaling(cfg: dict[str, Any]) -> dict | None:
    rs = {k: v for k, v in _rope_params(cfg, "full_attention").items() if k != "rope_theta"}
    if not rs:
        return None
    rs = dict(rs)
    rs.setdefault("rope_type", rs.get("type", "default"))
    return None if rs["rope_type"] == "default" else rs
