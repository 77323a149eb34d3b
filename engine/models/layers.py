"""Layers shared by every architecture; differences are flags, not copies.

Tensors are flat over tokens: no batch dimension, no padding. ``[T, ...]`` is all tokens of all sequences
in the step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata
from engine.errors import ModelLoadError
from engine.kernels import gemm
from engine.models.config import ModelConfig
from engine.models.linear import Linear, StepRows
from engine.models.ops import TorchOps


class OpsModule(nn.Module):
    """A layer that computes through ``self.ops`` (``engine.models.ops``): set once on the finished model by
    ``engine.models.select_ops.bind_ops``; until then plain torch."""

    ops: TorchOps = TorchOps()


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its random init: weights always come from a checkpoint, and ``normal_`` on the
    meta device imports torch's Python meta kernels (~1 s of a cold start). ``packed``: a tied head's float32 weight
    held as the panel kernel's panels (engine.models.select_ops.pack_head; bf16 ones when its values are bf16's);
    rows come out float32."""

    packed = False

    def reset_parameters(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return gemm.panel_rows(self.weight, input_ids).float()
        return super().forward(input_ids)

    def compute_weight(self) -> torch.Tensor:
        """The weight [vocab, hidden] (a packed one unpacked into a fresh float32 tensor)."""
        if not self.packed:
            return self.weight
        return gemm.panel_unpack(self.weight.detach(), self.num_embeddings)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """A packed weight is saved as [vocab, hidden] float32 (what a fresh model loads)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:
            destination[prefix + "weight"] = self.compute_weight()


class RMSNorm(OpsModule):
    """RMSNorm over the last dim. ``offset=1`` is Gemma's ``(1 + w)`` form; the math is ``ops.rms_norm``'s."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self._w32: tuple[int, torch.Tensor] | None = None

    def kernel_weight(self) -> torch.Tensor:
        """offset + weight in float32 for the fused kernel, recomputed if the weight was modified in place."""
        version = self.weight._version
        if self._w32 is None or self._w32[0] != version:
            self._w32 = (version, (self.weight.detach().float() + self.offset).contiguous())
        return self._w32[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with HF's rope scaling variants we support."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    else:
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE, cos/sin computed from the step's positions (no max-length table)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.key = (head_dim, theta, repr(scaling))      # same key -> same cos/sin within a step
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_buffers(self, device) -> None:
        """Recompute inv_freq (float32) after the module was materialized from the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] in ``dtype`` (as HF: computed in float32, then cast)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]     # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(OpsModule):
    """QKV projection (fused), optional q/k RMSNorm, RoPE, then the attention backend over the paged cache."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, c.norm_offset) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, c.norm_offset) if c.qk_norm else None
        self.window = c.layer_window(layer_idx)
        self.scale = c.scale
        self.rotary = RotaryEmbedding(self.head_dim, c.layer_rope_theta(layer_idx), c.layer_rope_scaling(layer_idx))
        self.backend = None                    # set by the model runner (engine.attention.get_backend)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the model runner
        # [Hkv, D] subtracted from every key before it is stored: an int8 cache's (engine.attention.key_shift)
        self.key_shift: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with ``rows`` (last layer): K/V of all T tokens, output [len(rows), hidden]."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        cos, sin = meta.rope_cache(self.rotary, positions, q.dtype)
        q, k = self.ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, cos, sin)
        if self.key_shift is not None:           # softmax is unchanged by one shift of every key
            k = k - self.key_shift
        if rows is not None:                     # later steps need every token's K/V; this step only `rows`
            # NOTE: the backend writes the sampled rows' K/V once more (idempotent, a handful of rows).
            write_kv(self.kv_cache, k, v, meta.slot_mapping)
            if rows.numel() == 0:
                return x.new_empty(0, x.shape[1])
            q, k, v, meta = q[rows], k[rows], v[rows], meta.sample_meta
            step_rows = getattr(self.qkv_proj, "step_rows", None)     # float Linears only
            if step_rows is not None:            # o_proj and the MLP see the sampled rows only
                step_rows.use(meta.output_rows)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, window=self.window, scale=self.scale)  # [R, Hq, D]
        return self.o_proj(out.reshape(out.shape[0], self.q_size))


def run_layers(layers: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
               final_norm: RMSNorm) -> torch.Tensor:
    """Every layer over every token, except that the last one computes only ``meta.sample_rows`` when set; returns
    the final norm of the result.

    Nothing after the last layer's K/V write feeds another token, so for a 4,096-token prefill step that
    samples a handful of rows this skips the last layer's attention, output projection and MLP for the rest.

    A layer returns its residual stream and the output it has not added yet (``Pending``): the next layer adds it in
    the pass that computes its input norm (``with_pending``: ``ops.residual_norm``, one fused kernel on the CPU
    where an add, then the norm, read and wrote the stream twice), the final norm after the last layer. The same
    bits as adding first (the fused kernel's contract, tested).
    """
    *body, last = layers
    pending = None
    for layer in body:
        x, pending = layer(positions, x, meta, pending=pending)
    x, pending = last(positions, x, meta, rows=meta.sample_rows, pending=pending)
    return with_pending(last.ops, x, pending, final_norm)[1]


# A layer's output not yet added to the residual stream: (h, the norm h takes before the add, or None)
Pending = tuple[torch.Tensor, RMSNorm | None]


def with_pending(ops: TorchOps, x: torch.Tensor, pending: Pending | None,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + the previous layer's pending output, ``norm`` of that sum) in one pass; (x, norm(x)) for the first."""
    if pending is None:
        return x, norm(x)
    h, h_norm = pending
    return ops.residual_norm(x, h, h_norm, norm)


class GatedMLP(OpsModule):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.fused_act = None                    # the fused kernels' name for act, where they have one
        if act in ("silu", "swish"):
            self.act, self.fused_act = F.silu, "silu"
        elif act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act, self.fused_act = (lambda t: F.gelu(t, approximate="tanh")), "gelu_tanh"
        elif act == "gelu":
            self.act = F.gelu
        else:
            raise ModelLoadError(f"unsupported activation {act!r}; supported: silu, gelu_pytorch_tanh, gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_mlp(x, self)


class CausalLM(OpsModule):
    """Decoder + LM head shared by every architecture; subclasses set ``model_cls`` (the decoder stack)."""

    model_cls: type[nn.Module]
    step_rows: StepRows | None = None          # the float linears' output rows (engine.models.select_ops)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids and positions -> final hidden states: [T, hidden], or [len(meta.sample_rows), hidden]."""
        if self.step_rows is not None:
            self.step_rows.use(meta.output_rows)
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that are sampled: [N, hidden] -> [N, vocab] in the model dtype (the sampler upcasts)."""
        logits = self._raw_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            # in place on the fresh logits (float() copies bf16 ones): no extra [N, vocab] temporaries
            logits = logits.float().div_(cap).tanh_().mul_(cap)
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N] int64: each row's argmax logit, for steps whose every row is plain greedy.

        The final softcap (cap * tanh(x / cap)) is increasing, so it is skipped; an int8 head finds the maximum
        inside its kernel and never writes the [N, vocab] logits. The one possible difference from argmax over
        ``compute_logits``: two float32 logits that differ by less than the capped value's rounding tie there (the
        lower index wins) but not here."""
        return self.ops.lm_argmax(hidden, self._head())

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """[1, hidden] and ascending token ids -> those ids' ``compute_logits`` values, bit for bit, reading only
        their part of an int8 head (structured outputs: a row's few allowed tokens); None for other heads."""
        head = self._head()
        if not (self.ops.int8_head and hasattr(head, "linear_at")):
            return None
        logits = head.linear_at(hidden, ids)
        cap = self.config.final_logit_softcapping
        return logits.float().div_(cap).tanh_().mul_(cap) if cap else logits

    def _head(self) -> nn.Module:
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def _raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.lm_logits(hidden, self._head())


# Fused parameters: (our name, HF name, shard index). Shards are concatenated along dim 0 in index order.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def stacked_rows(config) -> dict[str, int]:
    """Output rows of each HF shard that ``STACKED_PARAMS`` fuses (q_proj -> heads x head_dim, ...)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size}


def shard_names(target: str) -> list[str]:
    """The checkpoint tensors our parameter ``target`` is made of, in row order (itself where nothing is fused)."""
    fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in target), None)
    if fused is None:
        return [target]
    return [target.replace(f".{fused}.", f".{hf}.") for f, hf, _ in sorted(STACKED_PARAMS, key=lambda t: t[2])
            if f == fused]


def load_hf_weights(model: nn.Module, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy HF-named tensors into ``model``, fusing q/k/v and gate/up as ``STACKED_PARAMS`` declares.

    Raises ModelLoadError naming missing or mis-shaped tensors.
    """
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for name, tensor in weights.items():     # a lazy mapping reads each tensor here (engine.loader.lazy_weights)
        if "rotary_emb" in name:
            continue
        target, shard = name, None
        for fused, hf, idx in STACKED_PARAMS:
            if f".{hf}." in name:
                target, shard = name.replace(f".{hf}.", f".{fused}."), idx
                break
        if target not in params:
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings: some checkpoints still store the head
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for {type(model).__name__}")
        if shard is None:
            _copy(params[target], tensor, name, source)
            loaded.add(target)
            continue
        shards = pending.setdefault(target, {})
        shards[shard] = tensor
        if len(shards) == len(shard_names(target)):   # fused as soon as complete: at most a layer's shards held
            _copy(params[target], torch.cat([shards[i] for i in range(len(shards))], dim=0), target, source)
            loaded.add(target)
            del pending[target]
            shards.clear()
    for target, shards in pending.items():
        raise ModelLoadError(f"{source}: {target} needs {len(shard_names(target))} shards, found {sorted(shards)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"{source}: missing tensors: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, source: str) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
