"""Int8 weights, executed with integer dot products (``quantization: int8``).

Format (the kernel's, ``engine/kernels/csrc/qlinear/``): each weight row is split into groups of 32 along K with one
fp16 scale per group (llama.cpp's Q8_0: ``scale = max|w| / 127`` rounded to fp16, values in [-127, 127]) and the
group's sum of quants as int16 (the correction the asymmetric activations need): 1.125 bytes a weight stored; a
decode step on an AVX512-VNNI build reads 1.0625 (its few-row tiles sum the quants themselves).
Activations are quantized per token and group of 32 on the fly, asymmetric uint8 (scale and minimum).

- ``quantize_rows``: float [N, K] -> (int8 [N, Kp], fp16 scales [N, Kp/32]), K zero-padded to a multiple of 32.
- ``pack``: that pair -> the kernel's packed layout (16-column blocks, N padded to a multiple of 32) with the
  per-group sums of quants.
- ``Int8Linear`` replaces ``nn.Linear``; ``Int8GluLinear`` a gated MLP's gate_up (rows interleaved in blocks of
  16 so that the GLU runs inside the matmul's store); ``Int8Embedding`` replaces a (tied) embedding: lookups dequantize
  only the rows they read, and as the LM head it multiplies in int8.
- ``quantize_model`` converts a float model in place; ``direct`` supplies (int8, scales) for tensors that are
  already int8 x per-32 scale in a GGUF file (Q8_0, Q5_0, Q4_0), which map exactly, without a float round trip.
  For Q8_0 requantizing gives the same quants; for Q5_0 / Q4_0 it would not (max|w| / 127 is not their step, so
  every value would move by up to half a new step): the default GGUF's q/k/gate/up projections are Q5_0.
- ``int8_structure`` gives the same modules empty (on the meta device) for loading a cached quantized state.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

import engine.kernels.qlinear as qlinear

QK = 32


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Rows quantized at once: each row on its own, so cutting a large weight (an 8B model's 128k-row embedding: 2 GB in
# float32) bounds the temporaries at a few of these slices without changing a bit
QUANT_ROWS = 8192


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row and group of 32: (q int8 [N, Kp], scale float16 [N, Kp // 32]). The quants are taken
    against the fp16 scale the kernel reads (not the float32 one before rounding), so dequantizing is exact."""
    if w.shape[0] > QUANT_ROWS:
        parts = [quantize_rows(w[i:i + QUANT_ROWS]) for i in range(0, w.shape[0], QUANT_ROWS)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    n, k = w.shape
    kp = padded(k, QK)
    w = w.float()
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    g = w.view(n, kp // QK, QK)
    scale = (g.abs().amax(-1) / 127.0).to(torch.float16)
    if not torch.isfinite(scale).all():
        raise ValueError(f"int8 quantization: a group's largest weight is beyond fp16 scales (max |w| "
                         f"{float(g.abs().max()):.3g}) or not finite; use quantization: none for this model")
    f = scale.float()
    inv = torch.where(f > 0, 1.0 / f, torch.zeros_like(f))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(n, kp)
    return q, scale


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, Kp] int8, scale [N, G] fp16 values) -> packed (w int8 [Np * Kp], sw float16 [Np * G], ws int16
    [Np * G]: each group's sum of quants). A float32 scale is rounded to fp16 (exact for the GGUF formats' scales,
    which are fp16 already)."""
    n, kp = q.shape
    g = kp // QK
    np_ = padded(n, 2 * 16)
    scale = scale.to(torch.float16)
    if np_ != n:
        q = torch.nn.functional.pad(q, (0, 0, 0, np_ - n))
        scale = torch.nn.functional.pad(scale, (0, 0, 0, np_ - n))
    w = q.view(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    sw = scale.view(np_ // 16, 16, g).permute(0, 2, 1).contiguous().view(-1)
    wsum = q.view(np_, g, QK).sum(-1, dtype=torch.int32).to(torch.int16)      # |sum| <= 32 * 127: exact
    ws = wsum.view(np_ // 16, 16, g).permute(0, 2, 1).contiguous().view(-1)
    return w, sw, ws


def unpack(w: torch.Tensor, sw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float weights the packed int8 stands for, [n, k] float32 (tests, reference math)."""
    kp = padded(k, QK)
    np_ = w.numel() // kp
    g = kp // QK
    q = w.view(np_ // 16, kp // 4, 16, 4).permute(0, 2, 1, 3).reshape(np_, kp).float()
    s = sw.float().view(np_ // 16, g, 16).permute(0, 2, 1).reshape(np_, g)
    return (q.view(np_, g, QK) * s[..., None]).view(np_, kp)[:n, :k]


class Int8Linear(nn.Module):
    """y = x @ W^T (+ bias) with W packed int8; x bf16 or float32 [T, K] -> y [T, N] in x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        kp, np_ = padded(in_features, QK), padded(out_features, 32)
        self.register_buffer("qweight", torch.empty(np_ * kp, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(np_ * kp // QK, dtype=torch.float16, device=device))
        self.register_buffer("sums", torch.empty(np_ * kp // QK, dtype=torch.int16, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, k: int, bias: torch.Tensor | None = None):
        mod = cls(k, q.shape[0], bias is not None, device="meta")
        mod.set_packed(*pack(q, scale))
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod

    def set_packed(self, w: torch.Tensor, sw: torch.Tensor, ws: torch.Tensor) -> None:
        self.qweight, self.scales, self.sums = w, sw, ws
        self._wmax = None

    @property
    def wmax(self) -> int:
        """max|w| over the int8 values, measured once (also after a cached state was loaded): the avx2 kernel's
        faster path needs <= 64 (the default GGUF's exact Q5_0 tensors: 16; Q8_0 and requantized ones: 127)."""
        if getattr(self, "_wmax", None) is None:
            lo, hi = torch.aminmax(self.qweight)
            self._wmax = max(-int(lo), int(hi))
        return self._wmax

    # The model's StepRows (engine.models.linear) when the ``int8_prompts`` kernel family is "bf16": its prompt rows
    # go through AMX-BF16 tiles over the weights dequantized to bf16 (qlinear.q8_linear_amx), its output rows through
    # the int8 dot products. None: every row through the int8 dot products.
    step_rows = None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.step_rows is not None:
            y = split_rows(x2, self.step_rows.spec, self.out_features,
                           lambda r, out: qlinear.q8_linear(r, self.qweight, self.scales, self.sums,
                                                            self.out_features, self.wmax, out=out),
                           lambda r, out: qlinear.q8_linear_amx(r, self.qweight, self.scales, self.out_features,
                                                                out=out))
        else:
            y = qlinear.q8_linear(x2, self.qweight, self.scales, self.sums, self.out_features, self.wmax)
        if self.bias is not None:
            y += self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    forward = linear

    def linear_at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Outputs ``ids`` (int64, ascending) of ``linear(x)``, bit for bit: [M, len(ids)]. Reads only the packed
        32-row tiles holding them (the kernel computes each output from its own tile): a constrained row's allowed
        tokens out of a 262k-row LM head for a fraction of the whole head's read."""
        tiles_total = self.qweight.numel() // padded(self.in_features, QK) // 32
        tiles, inverse = torch.unique(ids // 32, return_inverse=True)
        pick = [t.view(tiles_total, -1)[tiles].reshape(-1) for t in (self.qweight, self.scales, self.sums)]
        y = qlinear.q8_linear(x.reshape(-1, x.shape[-1]), *pick, len(tiles) * 32, self.wmax)
        y = y[:, inverse * 32 + ids % 32]
        return y + self.bias[ids].to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (groups of {QK})"


def glu_interleave(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up rows [gate (I) | up (I)] -> blocks of 16: gate rows 16b..16b+15, then up rows 16b..16b+15, so each
    of the kernel's 32-column tiles holds 16 gates and their 16 ups (``engine.kernels.qlinear.q8_linear_glu``)."""
    n = q.shape[0]
    order = torch.arange(n).view(2, n // 32, 16).transpose(0, 1).reshape(-1)
    return q[order], scale[order]


class Int8GluLinear(Int8Linear):
    """A gated MLP's fused gate_up projection in int8, its rows interleaved by ``glu_interleave`` (2I a multiple of
    32, no bias). ``glu(x, act)`` is act(gate) * up in one kernel call, without the [T, 2I] product; ``linear``
    still returns gate | up."""

    @staticmethod
    def fits(out_features: int, bias: bool) -> bool:
        return out_features % 32 == 0 and not bias

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        y = super().linear(x)
        i = self.out_features // 2
        return y.view(*y.shape[:-1], i // 16, 2, 16).transpose(-3, -2).reshape(*y.shape[:-1], 2 * i)

    forward = linear

    def glu(self, x: torch.Tensor, act: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])

        def int8_rows(r: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            return qlinear.q8_linear_glu(r, self.qweight, self.scales, self.sums, self.out_features, act, self.wmax,
                                         out=out)
        if self.step_rows is not None:
            y = split_rows(x2, self.step_rows.spec, self.out_features // 2, int8_rows,
                           lambda r, out: qlinear.q8_linear_amx(r, self.qweight, self.scales, self.out_features, act,
                                                                out=out))
        else:
            y = int8_rows(x2)
        return y.view(*x.shape[:-1], self.out_features // 2)

    def glu_down(self, x: torch.Tensor, act: str, down: nn.Module) -> torch.Tensor:
        """``down(self.glu(x, act))``, bit for bit, with the prompt rows' GLU result passed to ``down`` in bf16 where
        both run those rows on AMX tiles over float32 activations: down's tiles read it as bf16 anyway (rounded the
        same way), so the [T, I] result is written and read at half the bytes. Rows split as ``glu``'s."""
        if (self.step_rows is None or x.dtype != torch.float32 or type(down) is not Int8Linear
                or down.step_rows is None):
            return down(self.glu(x, act))
        x2 = x.reshape(-1, x.shape[-1])

        def output_rows(r: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            h = qlinear.q8_linear_glu(r, self.qweight, self.scales, self.sums, self.out_features, act, self.wmax)
            return qlinear.q8_linear(h, down.qweight, down.scales, down.sums, down.out_features, down.wmax, out=out)

        def prompt_rows(r: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            h = qlinear.q8_linear_amx(r, self.qweight, self.scales, self.out_features, act, out_dtype=torch.bfloat16)
            return qlinear.q8_linear_amx(h, down.qweight, down.scales, down.out_features, out=out,
                                         out_dtype=torch.float32)
        y = split_rows(x2, self.step_rows.spec, down.out_features, output_rows, prompt_rows)
        if down.bias is not None:
            y += down.bias.to(y.dtype)
        return y.view(*x.shape[:-1], down.out_features)


def split_rows(x: torch.Tensor, out_rows, n: int, output_fn, prompt_fn) -> torch.Tensor:
    """x [M, K]'s output rows (``StepRows.spec``: the first ``out_rows`` rows, or where a bool mask is True) through
    ``output_fn``, the others (prompt positions) through ``prompt_fn``: [M, n]. The int8 linears' split here, the
    float linears' too (engine.models.linear.split_linear).

    Each fn is called as ``fn(rows, out)`` and returns its [len(rows), n] result: written into ``out`` (a dense row
    range of the step's result, so the two parts are never copied together) where it is not None."""
    m = x.shape[0]
    if isinstance(out_rows, int):
        k = min(out_rows, m)
        if k == m:
            return output_fn(x, None)
        if k == 0:
            return prompt_fn(x, None)
        y = x.new_empty(m, n)
        output_fn(x[:k], y[:k])
        prompt_fn(x[k:], y[k:])
        return y
    y = x.new_empty(m, n)
    if bool(out_rows.any()):
        y[out_rows] = output_fn(x[out_rows], None)
    rest = ~out_rows
    if bool(rest.any()):
        y[rest] = prompt_fn(x[rest], None)
    return y


def _is_gate_up(name: str, lin: nn.Linear) -> bool:
    return name.endswith("gate_up_proj") and Int8GluLinear.fits(lin.out_features, lin.bias is not None)


class Int8Embedding(Int8Linear):
    """An embedding table in int8: ``forward(ids)`` dequantizes the rows it reads; ``linear`` is the tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(embedding_dim, num_embeddings, bias=False, device=device)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's greedy tokens: the index of each row's largest logit, no [rows, vocab] logits written."""
        return qlinear.q8_argmax(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.sums, self.out_features,
                                 self.wmax)[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return qlinear.q8_embed(ids.reshape(-1), self.qweight, self.scales, self.embedding_dim,
                                    self.dtype).view(*ids.shape, self.embedding_dim)


def _linears(model: nn.Module):
    """(parent, attribute name, module) of every nn.Linear inside the decoder and the untied LM head."""
    for name, mod in list(model.named_modules()):
        for attr, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                yield f"{name}.{attr}" if name else attr, mod, attr, child


def int8_structure(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Swap in empty int8 modules (meta device) of the right shapes: the skeleton a cached state loads into."""
    for name, parent, attr, lin in _linears(model):
        cls = Int8GluLinear if _is_gate_up(name, lin) else Int8Linear
        setattr(parent, attr, cls(lin.in_features, lin.out_features, lin.bias is not None, device="meta"))
    emb = model.model.embed_tokens
    model.model.embed_tokens = Int8Embedding(emb.num_embeddings, emb.embedding_dim, dtype, device="meta")
    return model


@torch.no_grad()
def quantize_model(model: nn.Module, direct: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                   shards: dict[str, list[tuple[str, int]]] | None = None,
                   weight_of: Callable[[str], torch.Tensor] | None = None) -> nn.Module:
    """Replace the float linears and the embedding with int8 ones, in place; returns the model.

    direct: already-int8 weights by HF tensor name (GGUF Q8_0 / Q5_0 / Q4_0), as (int8 [rows, Kp], scales [rows, G]).
    shards: for fused weights (our name -> [(HF name, rows), ...] in row order) so that a fused tensor can take
    some shards from ``direct`` and quantize the rest; quantization is per row, so the result is identical to
    quantizing the fused float tensor. ``weight_of(our name)``: a float weight read only when its turn comes
    (the linears and the embedding may then be on the meta device: ``engine.loader.int8_build``); default: the
    module's own.
    """
    direct, shards = direct or {}, shards or {}

    def own(mod: nn.Module) -> torch.Tensor:     # an untied head packed by select_ops.pack_head: bf16, same values
        return mod.compute_weight() if getattr(mod, "packed", False) and hasattr(mod, "compute_weight") else mod.weight
    fetch = weight_of or (lambda name: own(model.get_submodule(name.rpartition(".")[0])))

    def rows_q(our: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = shards.get(our, [(our, rows)])
        qs, ss, start, w = [], [], 0, None
        for hf, n in parts:
            d = direct.get(hf)              # a lazy mapping reads it once, here
            if d is not None and d[0].shape[0] == n:
                q, s = d
            else:                           # the float weight, read only where a shard needs it
                w = fetch(our) if w is None else w
                q, s = quantize_rows(w[start:start + n])
            qs.append(q)
            ss.append(s.to(torch.float16))
            start += n
        return torch.cat(qs), torch.cat(ss)

    for name, parent, attr, lin in _linears(model):
        q, s = rows_q(f"{name}.weight", lin.out_features)
        cls = Int8GluLinear if _is_gate_up(name, lin) else Int8Linear
        if cls is Int8GluLinear:
            q, s = glu_interleave(q, s)
        setattr(parent, attr, cls.from_quantized(q, s, lin.in_features, lin.bias))
    emb = model.model.embed_tokens
    q, s = rows_q("model.embed_tokens.weight", emb.num_embeddings)
    qemb = Int8Embedding(emb.num_embeddings, emb.embedding_dim, emb.weight.dtype, device="meta")
    qemb.set_packed(*pack(q, s))
    model.model.embed_tokens = qemb
    return model
