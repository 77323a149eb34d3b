"""The model's compute ops, chosen once when the model is built (vLLM's CustomOp idea: a native and a CPU
implementation, the choice made at build time, not inside each layer's forward).

``TorchOps`` is the native path (CUDA, or no kernel library); ``CpuKernelOps`` runs the fused C kernels
(``engine.kernels``). Both know the model's weight format (float or int8, ``engine.quant.int8``), read once from
the finished model. ``engine.models.select_ops.bind_ops`` sets the chosen object on every layer (``layer.ops``);
layers call ``self.ops.rms_norm(...)`` etc. What truly varies per call (this tensor's dtype, a row count) stays a
check inside the implementation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import engine.kernels.elementwise as elementwise
import engine.kernels.gemm as gemm
from engine.kernels.families import TABLE_KERNELS, check_kernels
from engine.kernels.library import SUFFIX
from engine.models.linear import TILE, invariant_linear, pad_targets, widened

if TYPE_CHECKING:
    from engine.models.layers import GatedMLP, RMSNorm


class TorchOps:
    """Plain torch. ``int8_head``: the LM head is an int8 module (``linear`` in integer dot products);
    ``int8_argmax``: it is the tied int8 embedding, whose kernel finds each row's maximum logit (``argmax``);
    ``int8_glu``: every gated MLP's gate_up is an ``Int8GluLinear`` (the GLU inside the matmul's store)."""

    name = "torch"

    def __init__(self, int8_head: bool = False, int8_argmax: bool = False, int8_glu: bool = False,
                 deterministic: bool = False):
        self.int8_head, self.int8_argmax, self.int8_glu = int8_head, int8_argmax, int8_glu
        self.deterministic = deterministic        # row-invariant float heads (engine.models.linear)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(int8_head={self.int8_head}, int8_argmax={self.int8_argmax}, "
                f"int8_glu={self.int8_glu}, deterministic={self.deterministic})")

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The mean square accumulated in float32 straight from the input (no float32 copy of the activations),
        then applied in the activation dtype: HF's math in float32, within an ulp or two in bfloat16."""
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).pow_(2).div_(x.shape[-1])
        inv = torch.rsqrt(ms.add_(norm.eps)).to(x.dtype)
        w = (norm.weight.float() + norm.offset).to(x.dtype) if norm.offset else norm.weight
        return x * inv * w

    def residual_norm(self, x: torch.Tensor, h: torch.Tensor, h_norm: RMSNorm | None,
                      out_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + (self.rms_norm(h, h_norm) if h_norm is not None else h)
        return x, (self.rms_norm(x, out_norm) if out_norm is not None else None)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Optional q/k RMSNorm, then neox RoPE (rotate-half, in q's dtype like HF)."""
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm), self.rms_norm(k, k_norm)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def gated_mlp(self, x: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        if self.int8_glu and mlp.fused_act:           # one int8 call: act(gate) * up without the [T, 2I] product
            return mlp.gate_up_proj.glu_down(x, mlp.fused_act, mlp.down_proj)
        return mlp.down_proj(self.glu(mlp.gate_up_proj(x), mlp))

    def glu(self, gate_up: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.act(gate) * up

    def lm_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        if self.int8_head:                            # engine.quant.int8: integer dot products
            return head.linear(hidden)
        return self.float_logits(hidden, head.weight, _vocab(head))

    def float_logits(self, hidden: torch.Tensor, weight: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        """``hidden`` @ the head's weight^T: [vocab, hidden], or its panels (3-D: select_ops.pack_head) with
        ``vocab`` rows."""
        if weight.dim() == 3 or weight.dtype != hidden.dtype:   # a packed head (pack_head) on torch's path
            weight = widened(weight, hidden.dtype, vocab)
        if self.deterministic and hidden.device.type == "cpu" and hidden.dim() == 2:
            # rows padded to a row count torch computes invariantly (engine.models.linear's probe)
            targets = pad_targets(weight.detach())
            return invariant_linear(hidden, weight, None, targets or (), TILE if targets is None else 0)
        return hidden @ weight.t()

    def lm_argmax(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        if self.int8_argmax:                          # the maximum found inside the kernel: no [N, vocab] logits
            return head.argmax(hidden)
        return self.lm_logits(hidden, head).max(dim=-1).indices     # max(dim) is faster than argmax on CPU


def _vocab(head: nn.Module) -> int:
    """The head's output rows: an embedding's entries or a linear's outputs (its weight may be panels)."""
    return head.num_embeddings if isinstance(head, nn.Embedding) else head.out_features


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CpuKernelOps(TorchOps):
    """The fused C kernels (CPU, the kernel library loaded); tensors in a dtype they lack take torch's path.
    ``kernels``: family -> implementation (``engine.kernels.families``), one choice for every row count; missing
    families take ``TABLE_KERNELS`` (attention's is the backend's, engine.attention.torch_backend)."""

    name = "cpu_kernels"

    def __init__(self, int8_head: bool = False, int8_argmax: bool = False, int8_glu: bool = False,
                 kernels: dict[str, str] | None = None, deterministic: bool = False):
        super().__init__(int8_head, int8_argmax, int8_glu, deterministic)
        self.kernels = {**TABLE_KERNELS, **(kernels or {})}
        check_kernels(self.kernels)
        self._elementwise = self.kernels["elementwise"] == "c"

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, kernels={self.kernels})"

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self._elementwise and x.dtype in SUFFIX:   # one fused pass, float32 math (as HF's Gemma)
            return elementwise.rms_norm(x, norm.kernel_weight(), norm.eps)
        return super().rms_norm(x, norm)

    def residual_norm(self, x: torch.Tensor, h: torch.Tensor, h_norm: RMSNorm | None,
                      out_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One fused pass (``engine.kernels.elementwise.add_rms_norm``): the same values as the three separate
        passes."""
        if self._elementwise and x.dtype in SUFFIX and h.dtype == x.dtype and x.dim() == 2 and (h_norm or out_norm):
            return elementwise.add_rms_norm(x, h, h_norm.kernel_weight() if h_norm else None,
                                            h_norm.eps if h_norm else 0.0,
                                            out_norm.kernel_weight() if out_norm else None,
                                            out_norm.eps if out_norm else 0.0)
        return super().residual_norm(x, h, h_norm, out_norm)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._elementwise or q.dtype not in SUFFIX:
            return super().qk_norm_rope(q, k, q_norm, k_norm, cos, sin)
        if q_norm is not None:                        # norm + RoPE fused, one pass each for q and k
            return (elementwise.rms_norm(q, q_norm.kernel_weight(), q_norm.eps, cos, sin),
                    elementwise.rms_norm(k, k_norm.kernel_weight(), k_norm.eps, cos, sin))
        return elementwise.rope_(q, cos, sin), elementwise.rope_(k, cos, sin)   # in place in the fresh qkv output

    def glu(self, gate_up: torch.Tensor, mlp: GatedMLP) -> torch.Tensor:
        if self._elementwise and mlp.fused_act and gate_up.dtype in SUFFIX:
            return elementwise.glu(gate_up, mlp.fused_act)
        return super().glu(gate_up, mlp)

    def float_logits(self, hidden: torch.Tensor, weight: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        head = self.kernels["lm_head"]
        if self.deterministic and head == "table":
            # one kernel for every row count: the C kernel for float32 heads (about torch's time up to 64 rows, faster
            # below 16), torch for bf16 ones (the C kernel 2-4x slower from 16 rows; docs/perf/zen5-epyc-determinism.md)
            head = "c" if hidden.dtype == torch.float32 else "torch"
        if head != "torch" and weight.dim() == 3 and hidden.dtype == torch.float32 and hidden.dim() == 2:
            return gemm.panel_linear(hidden, weight, vocab)          # panels: pack_head under "c" / the table
        if head != "torch" and gemm.small_m_ok(hidden, weight, any_rows=head == "c"):   # streams the head once
            return gemm.small_m_linear(hidden, weight)
        return super().float_logits(hidden, weight, vocab)
