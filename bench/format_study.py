"""Which int8 format could drop the int8 matmul's per-group float work, measured against the quality bar.

    batchgen bench --quality --formats [--model M] [--positions 2000]

Today's format (``csrc/qlinear/``): weights int8 per row and group of 32 (the GGUF's own groups), activations
uint8 per token and group of 32, asymmetric (scale and minimum). Each group of 32 along K ends the VNNI tile's
integer sums: per accumulator one convert, one multiply (weight scale x activation scale), one FMA and one more
FMA for the minimum, against eight ``vpdpbusd``: about 4 of every 12 vector instructions. Coarser scales would let
the int32 sums run longer:

- activations per token (one scale and minimum per row): a group's float work shrinks to a convert and one FMA;
- the same after SmoothQuant (each input channel divided by max|x|^a / max|w|^(1-a), the weights' columns
  multiplied by it, then requantized per group of 32): the usual cure for outlier channels;
- weights per row (one scale per output channel, from the float weights): with per-token activations, no float
  work inside K at all — the tight ``vpdpbusd`` loop's rate;
- the tied LM head per row.

Every format is *simulated* on a float32 copy of the model: each linear sees its input quantized and dequantized
exactly as the kernel would (``simulate_activations``: the kernel's rounding, tested against its quants) and
multiplies float32 copies of the quantized weights; everything else is float32. The first row simulates today's
format, a check on the simulation against the real int8 rows of ``batchgen bench --quality``.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

from bench.quality import sample_sequences, sequence_logits
from engine import LLM
from engine.models.select_ops import pack_head
from engine.quant.int8 import QK, quantize_rows, unpack

# (name, linear weights, linear activations, LM-head weights, LM-head activations, SmoothQuant alpha)
# weights: "group" (today's int8, as loaded) | "row"; activations: "group" (per token and 32) | "token"
FORMATS = (
    ("today: W per 32, A per 32", "group", "group", "group", "group", None),
    ("A per token", "group", "token", "group", "group", None),
    ("A per token + SmoothQuant 0.75", "group", "token", "group", "group", 0.75),
    ("W per row", "row", "group", "group", "group", None),
    ("W per row, A per token", "row", "token", "group", "group", None),
    ("LM head W per row", "group", "group", "row", "group", None),
)


def simulate_activations(x: torch.Tensor, per: str) -> torch.Tensor:
    """x [T, K] float32 after the kernel's asymmetric uint8 quantization, dequantized (q * scale + minimum).
    per: "group" (per token and group of 32: csrc/qlinear/driver.h's quant_row) or "token" (one group per row)."""
    t, k = x.shape
    g = QK if per == "group" else k
    kp = -(-k // g) * g
    x = x.float()
    if kp != k:                                   # a partial last group: its min and max over its real values
        x = torch.cat([x, x[:, -1:].expand(t, kp - k)], 1)
    v = x.view(t, kp // g, g)
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    s = (hi - lo) / 255.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round((v - lo) * inv).clamp_(0, 255)
    return (q * s + lo).view(t, kp)[:, :k]


def quantize_per_row(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per output row, dequantized (float32)."""
    s = w.float().abs().amax(-1, keepdim=True) / 127.0
    return torch.round(w.float() / torch.where(s > 0, s, torch.ones_like(s))).clamp_(-127, 127) * s


def quantize_per_group(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row and group of 32 (engine.quant.int8.quantize_rows), dequantized."""
    q, s = quantize_rows(w)
    n, k = w.shape
    return (q.float().view(n, -1, QK) * s[..., None]).view(n, -1)[:, :k]


def int8_weights(mod) -> torch.Tensor:
    """An int8 engine module's weights as float32 [out, in], in the float model's row order."""
    w = unpack(mod.qweight, mod.scales, mod.out_features, mod.in_features)
    if hasattr(mod, "glu"):                       # Int8GluLinear: rows interleaved in blocks of 16 (glu_interleave)
        n = mod.out_features
        w = w.view(n // 32, 2, 16, -1).transpose(0, 1).reshape(n, -1)
    return w


class SimulatedLinear(nn.Module):
    """A float linear standing in for an int8 one in the format ``study.fmt`` names."""

    def __init__(self, study: "Study", lin: nn.Linear, group_w: torch.Tensor):
        super().__init__()
        w = lin.compute_weight() if getattr(lin, "packed", False) else lin.weight     # panels: [out, in] again
        self.study, self.float_w, self.group_w = study, w.detach().float(), group_w
        self.bias = lin.bias
        self.xmax: torch.Tensor | None = None     # max |x| per input channel on the calibration text (SmoothQuant)
        self._derived: dict = {}

    def _weights(self, kind: str, alpha: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (kind, alpha)
        if key not in self._derived:
            if alpha is None:
                self._derived[key] = (self.group_w if kind == "group" else quantize_per_row(self.float_w), None)
            else:
                if self.xmax is None:
                    raise RuntimeError("SmoothQuant formats need Study.calibrate first")
                smooth = (self.xmax.clamp_min(1e-5) ** alpha /
                          self.float_w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha))
                w = self.float_w * smooth
                self._derived[key] = (quantize_per_group(w) if kind == "group" else quantize_per_row(w), smooth)
        return self._derived[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        fmt = self.study.fmt
        if fmt is None:                           # calibration: float32, recording max |x| per channel
            m = x2.abs().amax(0)
            self.xmax = m if self.xmax is None else torch.maximum(self.xmax, m)
            y = x2 @ self.float_w.t()
        else:
            _, wkind, akind, _, _, alpha = fmt
            w, smooth = self._weights(wkind, alpha)
            y = simulate_activations(x2 if smooth is None else x2 / smooth, akind) @ w.t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


class Study:
    """A float32 model whose linears and LM head simulate the format in ``fmt`` (None: float32, calibrating)."""

    def __init__(self, model: str):
        self.ref = LLM(model, dtype="float32", quantization="none", kv_cache_memory=64 << 20)
        self.sim = LLM(model, dtype="float32", quantization="none", kv_cache_memory=64 << 20)
        q8 = LLM(model, dtype="float32", quantization="int8", kv_cache_memory=64 << 20)
        q8_mods = dict(q8.model.named_modules())
        self.fmt = None
        for name, parent in list(self.sim.model.named_modules()):
            for attr, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    full = f"{name}.{attr}" if name else attr
                    setattr(parent, attr, SimulatedLinear(self, child, int8_weights(q8_mods[full])))
        model_ = self.sim.model
        if not model_.config.tie_word_embeddings:
            raise ValueError("the format study simulates a tied LM head (the default model's)")
        pack_head(model_, False)                  # the tied head as [vocab, hidden] float32 again
        emb = model_.model.embed_tokens
        head = emb.weight.detach().float().clone()
        head_group = int8_weights(q8.model.model.embed_tokens)
        head_row = quantize_per_row(head)
        with torch.no_grad():                     # lookups read the int8 table, as the int8 engine's do
            emb.weight.copy_(head_group)
        del q8
        gc.collect()

        def raw_logits(hidden: torch.Tensor) -> torch.Tensor:
            if self.fmt is None:
                return hidden.float() @ head.t()
            _, _, _, hw, ha, _ = self.fmt
            return simulate_activations(hidden.float(), ha) @ (head_group if hw == "group" else head_row).t()
        model_._raw_logits = raw_logits           # CausalLM.compute_logits calls self._raw_logits

    def calibrate(self, seq: list[int]) -> None:
        """Record each linear's max |x| per input channel over ``seq`` (SmoothQuant's statistics)."""
        self.fmt = None
        sequence_logits(self.sim.model, seq, [len(seq)], 16)

    def logprobs(self, llm, seq: list[int]) -> torch.Tensor:
        return F.log_softmax(sequence_logits(llm.model, seq, [len(seq)], 16).float(), -1)


def measure(model: str = "gemma-3-270m", positions: int = 2000, formats=FORMATS, log=print) -> dict:
    """{format name: {"top1", "kl", "positions"}} against float32 on the sample documents; SmoothQuant calibrates
    on the next sample sequence after the measured ones."""
    study = Study(model)                          # loaded outside inference mode: RMSNorm tracks weight versions
    with torch.inference_mode():
        return _measure(study, positions, formats, log)


def _measure(study: Study, positions: int, formats, log) -> dict:
    tok = study.ref.get_tokenizer()
    seqs = sample_sequences(tok, positions)
    calib = sample_sequences(tok, positions + 2000)[len(seqs)]
    study.calibrate(calib)
    stats = {f[0]: [0, 0.0, 0] for f in formats}
    for s in seqs:
        ref = study.logprobs(study.ref, s)
        p_ref, top_ref = ref.exp(), ref.argmax(-1)
        for fmt in formats:
            study.fmt = fmt
            lp = study.logprobs(study.sim, s)
            st = stats[fmt[0]]
            st[0] += int((top_ref == lp.argmax(-1)).sum())
            st[1] += float((p_ref * (ref - lp)).sum())
            st[2] += ref.shape[0]
    results = {}
    for fmt in formats:
        agree, kl, n = stats[fmt[0]]
        results[fmt[0]] = {"top1": agree / n, "kl": kl / n, "positions": n}
        log(f"{fmt[0]:32s} top-1 agreement {agree / n:.4f}  mean KL {kl / n:.6f}  (simulated, {n} positions)")
    return results
