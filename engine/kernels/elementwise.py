"""Fused elementwise passes in bf16 and float32 (csrc/elementwise.c, csrc/masked_softmax.c): GeGLU/SwiGLU, RMSNorm
with optional RoPE, RoPE, the residual add with its norms, the prefill tile's masked softmax."""
from __future__ import annotations

import torch

import engine.kernels.library as library
from engine.kernels.library import SUFFIX

_GLU = {"gelu_tanh": "gelu_tanh_mul", "silu": "silu_mul"}


def elementwise_ok(x: torch.Tensor) -> bool:
    """True when the fused elementwise kernels can take ``x`` (bf16 or float32 on the CPU) and the library loaded."""
    return x.dtype in SUFFIX and x.device.type == "cpu" and library.load() is not None


def _fn(name: str, x: torch.Tensor):
    return getattr(library.load(), f"{name}_{SUFFIX[x.dtype]}")


def glu(x: torch.Tensor, act: str) -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up, [T, I]. act: gelu_tanh | silu."""
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    _fn(_GLU[act], x)(x.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, dim, token stride) of a [T, H, D] or [T, D] view whose rows are dense."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    t, h, d = x.shape
    if x.stride(2) != 1 or (h > 1 and x.stride(1) != d):
        raise ValueError("engine.kernels.elementwise: rows must be dense")
    return t, h, d, x.stride(0)


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (weight_f32 = offset + weight, float32), then RoPE when cos/sin are given
    ([T, 1, D] or [T, D], x's dtype). Returns a new dense tensor shaped like x."""
    t, h, d, stride = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    c = s = None
    if cos is not None:
        c, s = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    _fn("rms_norm_rope", x)(x.data_ptr(), t, h, d, stride, weight_f32.data_ptr(), eps,
                            c.data_ptr() if c is not None else None, s.data_ptr() if s is not None else None,
                            out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, wh: torch.Tensor | None, eps_h: float,
                 wo: torch.Tensor | None, eps_o: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual add with its norms, one pass: xo = x + (rms_norm(h, wh) if wh is given else h), then
    rms_norm(xo, wo) when wo is given (else None). x, h: [T, D] in the same dtype; wh/wo: offset + weight in
    float32. Equal bit for bit to ``rms_norm`` then torch's add then ``rms_norm``."""
    x, h = x.contiguous(), h.contiguous()
    t, d = x.shape
    xo = torch.empty_like(x)
    out = torch.empty_like(x) if wo is not None else None
    _fn("add_rms_norm", x)(x.data_ptr(), h.data_ptr(), t, d, wh.data_ptr() if wh is not None else None, eps_h,
                           wo.data_ptr() if wo is not None else None, eps_o, xo.data_ptr(),
                           out.data_ptr() if out is not None else None, torch.get_num_threads())
    return xo, out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE in place on a [T, H, D] view with dense rows (e.g. q inside the fused qkv output)."""
    t, h, d, stride = _rows(x)
    c, s = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    _fn("rope_neox", x)(x.data_ptr(), t, h, d, stride, c.data_ptr(), s.data_ptr(), torch.get_num_threads())
    return x


def masked_softmax_(scores: torch.Tensor, t: int, g: int, q_start: int, k_start: int,
                    window: int | None) -> torch.Tensor:
    """In place on dense bf16/fp32 scores [..., t, g, S] of a prefill tile: causal (and window) mask + softmax."""
    assert scores.is_contiguous() and scores.dtype in SUFFIX
    S = scores.shape[-1]
    outer = scores.numel() // (t * g * S)
    fn = getattr(library.load(), f"masked_softmax_{SUFFIX[scores.dtype]}")
    fn(scores.data_ptr(), outer, t, g, S, q_start, k_start, window or 0, torch.get_num_threads())
    return scores
