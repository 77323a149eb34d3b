"""Choosing a finished model's ops (``engine.models.ops``) once, and setting them on its layers."""
from __future__ import annotations

import logging

import torch
from torch import nn

import engine.kernels.library as library
from engine.errors import ModelLoadError
from engine.kernels.qlinear import prompt_amx_ok
from engine.models.layers import Embedding, GatedMLP, OpsModule
from engine.models.linear import StepRows, bf16_exact, kernel_weight, make_row_invariant, use_c_linears
from engine.models.ops import CpuKernelOps, TorchOps
from engine.quant.int8 import Int8Embedding, Int8GluLinear, Int8Linear

log = logging.getLogger("batchgen.engine")


def choose_ops(model: nn.Module, device, kernels: dict[str, str] | None = None,
               deterministic: bool = True) -> TorchOps:
    """The ops for a finished model (weights loaded, int8 swapped in) on ``device``: the C kernels on a CPU where
    the library loads, torch otherwise; the weight format read from the model's modules once. ``kernels``: C or
    torch per kernel family (``engine.kernels.families``; engine.tuning's choice), None: the table's."""
    head = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    glu = {isinstance(m.gate_up_proj, Int8GluLinear) for m in model.modules() if isinstance(m, GatedMLP)}
    if len(glu) > 1:
        raise ModelLoadError("some gated MLPs have an int8 GLU projection and some do not")
    fmt = dict(int8_head=isinstance(head, Int8Linear), int8_argmax=isinstance(head, Int8Embedding),
               int8_glu=glu == {True}, deterministic=deterministic)
    if torch.device(device).type == "cpu" and library.load() is not None:
        return CpuKernelOps(**fmt, kernels=kernels)
    return TorchOps(**fmt)


def bind_ops(model: nn.Module, device=None, ops: TorchOps | None = None,
             kernels: dict[str, str] | None = None, deterministic: bool = True) -> nn.Module:
    """Set ``ops`` (default: ``choose_ops`` for ``device``, default where the model's weights are, and ``kernels``)
    on every layer. ``deterministic``: a row's bits do not depend on the step's other rows (float linears padded
    to this machine's row floor, engine.models.linear; one head kernel for every row count)."""
    if ops is None:
        if device is None:
            device = next(model.parameters(), None)
            device = device.device if device is not None else next(model.buffers()).device
        ops = choose_ops(model, device, kernels, deterministic)
    make_row_invariant(model, deterministic)
    kernels = getattr(ops, "kernels", {})                              # CpuKernelOps only
    model.step_rows = use_c_linears(model, kernels.get("linears") == "c")
    if model.step_rows is not None:
        model.step_rows.prompts_too = kernels.get("prefill_linears") == "c"
    amx_rows = use_amx_prompts(model, kernels.get("int8_prompts") == "bf16")
    model.step_rows = model.step_rows or amx_rows
    head = kernels.get("lm_head")
    pack_head(model, head == "c" or (head == "table" and deterministic))
    for mod in model.modules():
        if isinstance(mod, OpsModule):
            mod.ops = ops
    return model


def pack_head(model: nn.Module, enabled: bool) -> None:
    """The float32 head as the C head kernel reads it (``enabled``), as ``engine.models.linear.use_c_linears``
    holds the linears: a tied embedding as the panel kernel's panels (bf16 ones when every value is a bf16 value:
    decode streams half its bytes for the same bits; lookups come out float32), an untied head whose values are
    bf16's as bf16 [vocab, hidden] for the dot-product kernel. ``enabled`` False: back to float32 [vocab, hidden]."""
    head = model.model.embed_tokens if model.config.tie_word_embeddings else getattr(model, "lm_head", None)
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return
    if getattr(head, "packed", False):
        full = head.compute_weight() if isinstance(head, Embedding) else head.weight.detach().float()
        head.weight, head.packed = nn.Parameter(full, requires_grad=False), False
    if not enabled or head.weight.device.type != "cpu":
        return
    w = head.weight.detach()
    if isinstance(head, Embedding) and w.dtype == torch.float32:
        head.weight, head.packed = nn.Parameter(kernel_weight(w), requires_grad=False), True
    elif not isinstance(head, Embedding) and (packed := bf16_exact(w)) is not None:
        head.weight, head.packed = nn.Parameter(packed, requires_grad=False), True


def use_amx_prompts(model: nn.Module, enabled: bool):
    """Give the decoder's int8 linears (not the LM head or the embedding) one shared ``StepRows`` when ``enabled``
    (the ``int8_prompts`` family's "bf16", where ``prompt_amx_ok()``): their prompt rows then take AMX-BF16
    tiles. Returns it, or None (every row through the int8 dot products). Asked for where the tiles are not on
    (``kernels: {int8_prompts: bf16}`` on a CPU without AMX-BF16, or ``BATCHGEN_AMX=0``), it says so in the log and
    the prompt rows take the int8 dot products."""
    rows = StepRows() if enabled and prompt_amx_ok() else None
    taken = False
    for mod in model.model.layers.modules():
        if type(mod) in (Int8Linear, Int8GluLinear):
            mod.step_rows = rows
            taken = True
    if enabled and taken and rows is None:
        log.warning("kernels: int8_prompts: bf16 needs AMX-BF16 tiles, which this CPU, kernel build or "
                    "BATCHGEN_AMX=0 does not give; the int8 linears' prompt rows take the int8 dot products")
    return rows if taken else None
