"""The transformers baselines: ``generate`` on left-padded batches (hf-generate) and continuous batching (hf-cb).

The module's name is this system's; ``from transformers import ...`` below is the library (absolute imports).
NOTE: transformers is imported inside the functions: it takes seconds, and a bench of batchgen systems alone
never needs it; some names (GgufConfig, ContinuousBatchingConfig) exist only in some versions.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from bench.result import SystemResult
from bench.workloads import BenchPrompt
from engine.loader.resolve import resolve_model


def load_hf_model(model: str, dtype: torch.dtype):
    """The same checkpoint through transformers: the GGUF (dequantized) or the HF directory; SDPA attention."""
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    path = Path(src.path)
    if src.kind == "gguf":
        # NOTE: dense weights in ``dtype``, as our engine holds them (packed-GGUF kernels would compare
        # quantized matmuls, not engines).
        try:
            from transformers import GgufConfig
            kw = {"quantization_config": GgufConfig(dequantize=True)}
        except ImportError:
            kw = {}
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                 attn_implementation="sdpa", **kw)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return m.eval()


def _clock_processor():
    from transformers import LogitsProcessor

    class Clock(LogitsProcessor):
        """Called once per generation step, right after the step's forward: one timestamp per token."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores
    return Clock()


def _hf_gen_config(T: int, pad_id: int):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=T, min_new_tokens=T, do_sample=False, pad_token_id=pad_id,
                            eos_token_id=None, bos_token_id=None)


@torch.inference_mode()
def run_hf_generate(model, prompts: list[BenchPrompt], T: int, batch_size: int, pad_id: int, roof) -> SystemResult:
    """transformers ``generate`` over left-padded batches of ``batch_size``, in planned order."""
    from transformers import LogitsProcessorList

    def gen(batch, n_tokens, clock=None):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        procs = LogitsProcessorList([clock] if clock else [])
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_hf_gen_config(n_tokens, pad_id),
                             logits_processor=procs)
        return out[:, width:].tolist()

    gen([p.token_ids for p in prompts[:2]], 2)     # warm-up
    res = SystemResult(system="hf-generate", label=f"hf-generate bs={batch_size}", ttft_s=[], tpot_s=[], outputs=[])
    res.extra["batch_size"] = batch_size
    t0 = time.perf_counter()
    pre_flops = pre_s = dec_bytes = dec_s = total = 0.0
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        clock = _clock_processor()
        tb = time.perf_counter()
        outs = gen([p.token_ids for p in batch], T, clock)
        res.outputs.extend(outs)
        ts = clock.times
        for p in batch:
            res.ttft_s.append(ts[0] - t0)
            if len(ts) > 1:
                res.tpot_s.append((ts[-1] - ts[0]) / (len(ts) - 1))
        if roof is not None:
            lens = [len(p.token_ids) for p in batch]
            pf = sum(roof.request_flops(L, 0, 1) for L in lens)
            df = sum(roof.decode_flops([L + k for L in lens]) for k in range(1, T))
            pre_flops += pf
            pre_s += ts[0] - tb
            dec_bytes += sum(roof.decode_bytes([L + k for L in lens]) for k in range(1, T))
            dec_s += ts[-1] - ts[0]
            total += pf + df
    res.wall_s = time.perf_counter() - t0
    res.num_requests = len(prompts)
    res.prompt_tokens = sum(len(p.token_ids) for p in prompts)
    res.output_tokens = sum(len(o) for o in res.outputs)
    if roof is not None:
        res.flops, res.mfu = total, roof.mfu(total, res.wall_s)
        res.prefill_mfu, res.decode_mbu = roof.mfu(pre_flops, pre_s), roof.mbu(dec_bytes, dec_s)
    return res


def hf_continuous_batching_available(model) -> str | None:
    """None when this transformers has ``generate_batch``; else why not."""
    if not hasattr(model, "generate_batch"):
        return "this transformers has no generate_batch (continuous batching)"
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return "this transformers has no ContinuousBatchingConfig"
    return None


def run_hf_cb(model, prompts: list[BenchPrompt], T: int, pad_id: int, max_batch_tokens: int, roof) -> SystemResult:
    """transformers continuous batching (paged cache, its own scheduler; block sharing allowed).

    NOTE: on CPU the cache size cannot be inferred from device memory, so it is sized to hold every request.
    """
    from transformers import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    page = 256
    # NOTE: transformers sizes its activations (full-vocab logits for every batched token) from max_batch_tokens
    # and refuses to start when that exceeds free memory (4096 did here); 512 fits and still batches.
    max_batch_tokens = min(max_batch_tokens, 512)
    num_blocks = sum(-(-(len(p.token_ids) + T) // page) for p in prompts) + 2
    # NOTE: on CPU transformers budgets a fraction (max_memory_percent) of total RAM minus what torch holds;
    # its default left just short of what this workload needs (docs/perf/code-notes-perf.md). The KV cache itself
    # is small.
    cfg = lambda: ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks,  # noqa: E731
                                           max_batch_tokens=max_batch_tokens, max_memory_percent=0.8)
    gen_cfg = _hf_gen_config(T, pad_id)
    model.generate_batch([list(p.token_ids) for p in prompts[:2]], generation_config=_hf_gen_config(2, pad_id),
                         continuous_batching_config=cfg(), warmup=False)     # warm-up
    t0 = time.perf_counter()
    out = model.generate_batch([list(p.token_ids) for p in prompts], generation_config=gen_cfg,
                               continuous_batching_config=cfg(), record_timestamps=True, warmup=False)
    wall = time.perf_counter() - t0
    res = SystemResult(system="hf-cb", label="hf-cb", wall_s=wall, num_requests=len(prompts), ttft_s=[], tpot_s=[],
                       outputs=[])
    res.extra.update(max_batch_tokens=max_batch_tokens, page_size=page, num_blocks=num_blocks)
    results = list(out.values())
    errors = [r.error for r in results if r.error]
    if errors or len(results) != len(prompts):
        res.extra["errors"] = errors[:3] or [f"{len(results)} results for {len(prompts)} prompts"]
    for r in results:
        res.outputs.append(list(r.generated_tokens))
        ts = r.timestamps or []
        if ts:
            res.ttft_s.append(ts[0] - t0)
        if len(ts) > 1:
            res.tpot_s.append((ts[-1] - ts[0]) / (len(ts) - 1))
    res.prompt_tokens = sum(len(p.token_ids) for p in prompts)
    res.output_tokens = sum(len(o) for o in res.outputs)
    if roof is not None and not res.extra.get("errors"):
        res.flops = sum(roof.request_flops(len(p.token_ids), 0, T) for p in prompts)
        res.mfu = roof.mfu(res.flops, wall)
    return res
