"""Benchmark: named workload shapes through batchgen and transformers, side by side in one run.

    batchgen bench shared-prefix --n 48 --groups 4 --prefix-tokens 1500 --doc-tokens 400 \\
        --output-tokens 64 --json bench.json
    batchgen bench --quick --model path/to/hf_dir        # a small smoke run

Every system gets the same token id lists (built from varied English sentences tokenized with the model's
tokenizer, deterministic), decodes greedily and ignores EOS, so all do identical work:

    batchgen          prefix caching on, prompts submitted in planned order (grouped by shared prefix), float
                      weights (``quantization: none``: the float path the int8 systems are compared with; a job's
                      default, ``auto``, is int8 on the CPUs engine.quant.policy names)
    batchgen-nocache  prefix caching off, same order, float weights
    batchgen-int8     prefix caching on, ``quantization: int8`` (engine.quant.int8; KV cache auto: bf16 where
                      engine.quant.policy measured it faster, else the activation dtype)
    batchgen-int8-bf16kv  the same with ``kv_cache_dtype: bfloat16`` (not in the default systems)
    batchgen-int8-int8kv  the same with ``kv_cache_dtype: int8`` (engine.quant.int8_kv; not in the defaults)
    batchgen-spec     prefix caching on, ``speculative_config: auto`` (n-gram drafts where gating says they pay)
    batchgen-default  a job's defaults: ``quantization: auto``, ``speculative_config: auto``, KV cache auto (what a
                      user gets without an engine section; not in the default systems)
    llama.cpp         llama-cpp-python on the same GGUF, when installed (``pip install -e '.[peer]'``):
                      documents in group order, one Llama object keeping its KV between prompts (prefix
                      reuse), swa_full=True (without it Gemma 3's reused prefixes give different tokens),
                      flash_attn=True, n_batch=512
    hf-generate       transformers ``generate`` on left-padded batches, one row per batch size tried
    hf-cb             transformers continuous batching (``generate_batch``), where it runs

A prompt is ``[BOS] + prefix[group] + document[i]``:

    | BOS | system + reference of group g (prefix_tokens - 1) | document i (doc_tokens) |  -> output_tokens

Numbers are only meaningful as ratios inside one run: this machine's cores (and its AMX unit) are shared,
so absolute speeds drift between runs. The run notes the load average before and after.

MFU counts the model FLOPs each system had to compute (``perf.flops``: window-limited attention, LM head
only on sampled rows; padding and masked work are not counted) against the calibrated matmul peak
(``perf.calibrate``); decode MBU counts weight + KV bytes of decode steps against calibrated bandwidth.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL
from engine.errors import ConfigError
from perf import BENCH_EXTRA_SYSTEMS, BENCH_SHAPES, BENCH_SYSTEMS
from perf.breakdown import format_bound, format_breakdown, kernel_breakdown
from perf.roofline import Roofline
from perf.stats import percentiles

# ---- workloads ---------------------------------------------------------------------------------------

SYSTEMS = BENCH_SYSTEMS + BENCH_EXTRA_SYSTEMS     # the default run: BENCH_SYSTEMS


@dataclass(frozen=True)
class Workload:
    shape: str
    n: int                    # documents (requests)
    groups: int               # distinct shared prefixes; document i belongs to group i % groups
    prefix_tokens: int        # BOS + system prompt + reference, per group (0: no shared prefix but BOS)
    doc_tokens: int           # document tokens per request
    output_tokens: int        # tokens generated per request (ignore_eos: exactly this many)

    def __post_init__(self) -> None:
        if self.n < 1 or self.groups < 1 or self.output_tokens < 1 or self.doc_tokens < 1:
            raise ValueError("n, groups, doc_tokens and output_tokens must be >= 1")
        if self.prefix_tokens < 0:
            raise ValueError("prefix_tokens must be >= 0")

    @property
    def prompt_tokens(self) -> int:
        """Tokens of each prompt (the prefix includes BOS; with no prefix, BOS alone leads)."""
        return max(self.prefix_tokens, 1) + self.doc_tokens


SHAPES = {
    # The issue's target: N documents in G groups sharing a long system prompt + reference.
    "shared-prefix": dict(n=48, groups=4, prefix_tokens=1500, doc_tokens=400, output_tokens=64),
    # Long prompt, short output, nothing shared: prefill-bound.
    "long-prompt": dict(n=32, groups=32, prefix_tokens=0, doc_tokens=2000, output_tokens=16),
    # Short prompt, long output, nothing shared: decode-bound.
    "short-prompt": dict(n=32, groups=32, prefix_tokens=0, doc_tokens=64, output_tokens=256),
    # Few documents, long outputs that copy them ("rewrite the document"): memory-bound decode, where
    # speculation pays.
    "long-output": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=300, output_tokens=256),
}
assert tuple(SHAPES) == BENCH_SHAPES, "perf.BENCH_SHAPES lists the shapes for the CLI"
QUICK = {
    "shared-prefix": dict(n=8, groups=2, prefix_tokens=96, doc_tokens=24, output_tokens=6),
    "long-prompt": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=160, output_tokens=4),
    "short-prompt": dict(n=4, groups=4, prefix_tokens=0, doc_tokens=16, output_tokens=24),
    "long-output": dict(n=2, groups=2, prefix_tokens=0, doc_tokens=40, output_tokens=24),
}
# After the document, for shapes whose output should copy it.
INSTRUCTION = {"long-output": "\n\nRewrite the document above word for word, keeping every sentence:\n"}
DEFAULT_HF_BATCH_SIZES = (4, 8, 16)
QUICK_HF_BATCH_SIZES = (4,)


def make_workload(shape: str, quick: bool = False, **sizes) -> Workload:
    """The named shape's default sizes (``quick``: the smoke preset), overridden by non-None ``sizes``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(SHAPES)}")
    base = dict((QUICK if quick else SHAPES)[shape])
    base.update({k: v for k, v in sizes.items() if v is not None})
    return Workload(shape=shape, **base)


# ---- prompt text ---------------------------------------------------------------------------------------

_SUBJECTS = ("The customer", "Our support team", "The warehouse manager", "A regional director", "The billing system",
             "The technician", "Every new employee", "The auditor", "A loyal subscriber", "The delivery driver",
             "The product owner", "Their legal department", "The night shift", "A junior analyst")
_VERBS = ("reported", "reviewed", "questioned", "approved", "rejected", "summarized", "escalated", "documented",
          "measured", "explained", "disputed", "scheduled", "replaced", "forgot")
_OBJECTS = ("the late shipment", "an invoice from March", "the warranty claim", "a damaged screen",
            "the quarterly forecast", "the refund policy", "two missing parcels", "the renewal notice",
            "a broken charger", "the service agreement", "the password reset flow", "a duplicate payment",
            "the battery recall", "the store credit balance", "the cancellation request")
_TAILS = ("after a long call", "before the deadline", "without any receipt", "with three attachments",
          "in the weekly meeting", "for the second time", "despite the holiday", "according to clause 4.2",
          "on behalf of a colleague", "while the system was down", "at 9:45 on Tuesday", "by registered mail")


def _sentences(rng: random.Random, count: int) -> str:
    out = []
    for _ in range(count):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(_SUBJECTS).lower()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.2:
            s += f" (ref {rng.randint(1000, 99999)})"
        out.append(s + ".")
    return " ".join(out)


def text_tokens(tokenizer, num_tokens: int, seed: int, header: str = "") -> list[int]:
    """Exactly ``num_tokens`` token ids (no special tokens) of deterministic varied text after ``header``."""
    if num_tokens <= 0:
        return []
    rng = random.Random(seed)
    ids = tokenizer.encode(header, add_special_tokens=False) if header else []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + _sentences(rng, 16), add_special_tokens=False)
    return ids[:num_tokens]


@dataclass(frozen=True)
class BenchPrompt:
    index: int                # position in arrival order (document i)
    group: int
    token_ids: tuple[int, ...]


def build_prompts(tokenizer, w: Workload, seed: int = 0) -> list[BenchPrompt]:
    """The workload's prompts in planned order (grouped by shared prefix, arrival order within a group)."""
    bos = tokenizer.bos_token_id
    lead = [bos] if bos is not None else []
    prefixes = []
    for g in range(w.groups):
        if w.prefix_tokens <= len(lead):
            prefixes.append(lead[:max(w.prefix_tokens, 1)] if lead else [])
            continue
        header = (f"You are reviewer number {g} of the operations group. Summarize the document below in two "
                  f"sentences, citing the reference where it applies.\nReference {g}:\n")
        prefixes.append(lead + text_tokens(tokenizer, w.prefix_tokens - len(lead), seed * 7919 + g, header))
    prompts = []
    tail = tokenizer.encode(INSTRUCTION[w.shape], add_special_tokens=False) if w.shape in INSTRUCTION else []
    for i in range(w.n):
        g = i % w.groups
        doc = text_tokens(tokenizer, w.doc_tokens, seed * 7919 + 100_003 + i, f"\nDocument {i}:\n")
        prompts.append(BenchPrompt(i, g, tuple(prefixes[g] + doc + tail)))
    return sorted(prompts, key=lambda p: (p.group, p.index))


def _warmup_prompts(tokenizer, n: int = 2, length: int = 48) -> list[list[int]]:
    return [text_tokens(tokenizer, length, 999_001 + i, "Warm-up. ") for i in range(n)]


# ---- results -------------------------------------------------------------------------------------------

@dataclass
class SystemResult:
    system: str                       # batchgen | batchgen-nocache | hf-generate | hf-cb
    label: str                        # e.g. "hf-generate bs=8"
    wall_s: float | None = None
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from a prefix cache (known for batchgen only)
    output_tokens: int = 0
    ttft_s: list[float] | None = None
    tpot_s: list[float] | None = None
    flops: float | None = None        # model FLOPs this system computed (perf.flops)
    mfu: float | None = None          # flops / wall / calibrated peak
    prefill_mfu: float | None = None  # over the time spent in steps (batches) with prompt work
    decode_mbu: float | None = None   # decode-only steps: bytes moved / time / calibrated bandwidth
    match_rate: float | None = None   # fraction of requests whose output ids equal batchgen-nocache's
    skipped: str | None = None
    extra: dict = field(default_factory=dict)
    outputs: list[list[int]] | None = field(default=None, repr=False)   # per planned prompt; not saved

    @property
    def output_tps(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s else None

    @property
    def total_tps(self) -> float | None:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else None

    @property
    def hit_rate(self) -> float | None:
        if not self.prompt_tokens or not self.system.startswith("batchgen"):
            return None
        return self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("outputs")
        for name in ("ttft_s", "tpot_s"):
            vals = d.pop(name)
            d[name.replace("_s", "")] = percentiles(vals) if vals else None
        d.update(output_tokens_per_s=self.output_tps, total_tokens_per_s=self.total_tps, hit_rate=self.hit_rate)
        return d


# ---- systems ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchOptions:
    workload: Workload
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    threads: int | None = None
    systems: tuple[str, ...] = BENCH_SYSTEMS
    hf_batch_sizes: tuple[int, ...] = DEFAULT_HF_BATCH_SIZES
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    roofline: bool = True             # load (or measure) a calibration for MFU/MBU
    breakdown: bool = False           # time batchgen's kernel families per step kind (perf.breakdown)
    quick: bool = False
    seed: int = 0
    log: bool = True                  # progress lines on stderr

    def engine_args(self) -> dict:
        args = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_memory": self.kv_cache_memory, "num_threads": self.threads}
        return {k: v for k, v in args.items() if v is not None}


def _say(opts: BenchOptions, msg: str) -> None:
    if opts.log:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# name -> (prefix caching, quantization, speculation, kv_cache_dtype)
BATCHGEN_VARIANTS = {"batchgen": (True, "none", None, "auto"), "batchgen-nocache": (False, "none", None, "auto"),
                     "batchgen-int8": (True, "int8", None, "auto"),
                     "batchgen-int8-bf16kv": (True, "int8", None, "bfloat16"),
                     "batchgen-int8-int8kv": (True, "int8", None, "int8"),
                     "batchgen-spec": (True, "none", "auto", "auto"),
                     "batchgen-default": (True, "auto", "auto", "auto")}
INT8_SYSTEMS = ("batchgen-int8", "batchgen-int8-bf16kv", "batchgen-int8-int8kv")


def run_batchgen(opts: BenchOptions, prompts: list[BenchPrompt], name: str, roof) -> tuple[SystemResult, object]:
    """One LLM per setting (a fresh prefix cache), a short warm-up, then the whole workload in one generate."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prefix_caching, quantization, spec, kv_dtype = BATCHGEN_VARIANTS[name]
    t = time.monotonic()
    # int8 picks its own activation dtype (auto: float32, engine.setup) unless float32 was asked for anyway
    dtype = opts.dtype if quantization == "none" or opts.dtype == "float32" else "auto"
    llm = LLM(opts.model, dtype=dtype, enable_prefix_caching=prefix_caching, quantization=quantization,
              speculative_config=spec, kv_cache_dtype=kv_dtype, **opts.engine_args())
    _say(opts, f"{name}: loaded in {time.monotonic() - t:.1f} s; warming up")
    T = opts.workload.output_tokens
    llm.generate(_warmup_prompts(llm.get_tokenizer()), SamplingParams(temperature=0, ignore_eos=True, max_tokens=2))
    first_step = len(llm.step_stats)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=T)
    timers = kernel_breakdown() if opts.breakdown else contextlib.nullcontext()
    with timers as bd:
        t0 = time.monotonic()
        outs = llm.generate([list(p.token_ids) for p in prompts], params, priorities=range(len(prompts)))
        wall = time.monotonic() - t0
    steps = llm.step_stats[first_step:]
    res = SystemResult(
        system=name, label=name, wall_s=wall, num_requests=len(outs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        cached_tokens=sum(o.num_cached_tokens for o in outs), output_tokens=sum(len(o.token_ids) for o in outs),
        ttft_s=[o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None],
        tpot_s=[o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None],
        outputs=[list(o.token_ids) for o in outs])
    errors = [o.error for o in outs if o.error]
    if errors:
        res.extra["errors"] = errors[:3]
    res.extra.update(_step_summary(steps))
    if bd is not None:
        res.extra["breakdown"] = bd.to_dict()
    res.extra["preemptions"] = sum(o.metrics.num_preemptions for o in outs)
    res.extra["quantization"] = llm.info.quantization          # what auto resolved to (batchgen-default)
    drafts = sum(o.metrics.num_draft_tokens for o in outs)
    if drafts:
        acc = sum(o.metrics.num_accepted_tokens for o in outs)
        spec_steps = sum(1 for s in steps if s.num_draft_tokens)
        res.extra.update(draft_tokens=drafts, accepted_tokens=acc, acceptance_rate=acc / drafts,
                         speculating_steps=spec_steps,
                         mean_accepted_per_spec_step_seq=acc / max(sum(s.num_decode_seqs for s in steps
                                                                       if s.num_draft_tokens), 1))
    if roof is not None:
        _batchgen_roofline(res, outs, steps, roof)
    return res, llm


def _step_summary(steps) -> dict:
    pre = [s for s in steps if s.num_prefill_tokens]
    dec = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    dur = lambda ss: sum(s.end_time - s.start_time for s in ss)  # noqa: E731
    widest = max((s.num_decode_seqs for s in dec), default=0)
    decode_tokens = sum(s.num_decode_seqs + s.num_accepted_tokens for s in dec)      # tokens emitted
    full = [s for s in dec if s.num_decode_seqs == widest]
    return {"steps": len(steps), "prefill_steps": len(pre), "decode_only_steps": len(dec),
            "widest_decode_batch": widest,
            "decode_step_ms_widest": (1e3 * dur(full) / len(full)) if full else None,
            # decode time / decode tokens (not per step): speculation emits several tokens a step
            "decode_tokens_per_s": decode_tokens / dur(dec) if dec and dur(dec) > 0 else None,
            "prefill_step_s": dur(pre), "decode_only_step_s": dur(dec),
            "mean_decode_batch": (sum(s.num_decode_seqs for s in dec) / len(dec)) if dec else None,
            "mean_prefill_tokens_per_step": (sum(s.num_prefill_tokens for s in pre) / len(pre)) if pre else None}


def _batchgen_roofline(res: SystemResult, outs, steps, roof: Roofline) -> None:
    """Assign each decode token to its step by time, so each step's context lengths are exact."""
    starts = [s.start_time for s in steps]
    ctx_by_step: dict[int, list[int]] = {}
    total = 0.0
    for o in outs:
        L = len(o.prompt_token_ids)
        total += roof.request_flops(L, o.num_cached_tokens, 1)     # prefill + first token
        for k, t in enumerate(o.metrics.token_times[1:], start=1):
            ctx_by_step.setdefault(bisect.bisect_right(starts, t) - 1, []).append(L + k)
    pre_flops, pre_s, dec_bytes, dec_s = total, 0.0, 0.0, 0.0
    for i, s in enumerate(steps):
        ctx = ctx_by_step.get(i, [])
        d = s.end_time - s.start_time
        if s.num_prefill_tokens:
            pre_s += d
            pre_flops += roof.decode_flops(ctx) if ctx else 0
        elif ctx:
            dec_s += d
            dec_bytes += roof.decode_bytes(ctx)
        total += roof.decode_flops(ctx) if ctx else 0
    res.flops = total
    res.mfu = roof.mfu(total, res.wall_s)
    res.prefill_mfu = roof.mfu(pre_flops, pre_s)
    res.decode_mbu = roof.mbu(dec_bytes, dec_s)


def load_hf_model(model: str, dtype: torch.dtype):
    """The same checkpoint through transformers: the GGUF (dequantized) or the HF directory; SDPA attention."""
    from transformers import AutoModelForCausalLM

    from engine.loader.resolve import resolve_model
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
    import logging

    from transformers import ContinuousBatchingConfig
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    page = 256
    # NOTE: transformers sizes its activations (full-vocab logits for every batched token) from max_batch_tokens
    # and refuses to start when that exceeds free memory (4096 wanted ~14 GB here); 512 fits and still batches.
    max_batch_tokens = min(max_batch_tokens, 512)
    num_blocks = sum(-(-(len(p.token_ids) + T) // page) for p in prompts) + 2
    # NOTE: on CPU transformers budgets a fraction (max_memory_percent) of total RAM minus what torch holds;
    # its default left ~5.8 GB here, just short of what this workload needs. The KV cache itself is small.
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


# ---- the run ---------------------------------------------------------------------------------------------

def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _calibration(opts: BenchOptions, device: str):
    from perf.calibrate import get_calibration
    return get_calibration(device, opts.dtype, quick=opts.quick)


def run_bench(opts: BenchOptions, on_progress=None) -> dict:
    """Run every selected system on the workload; return the result dict (what ``--json`` saves).

    ``on_progress(partial_result)`` is called after each system (e.g. to save partial JSON of a long run).
    """
    unknown = sorted(set(opts.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    w = opts.workload
    env = {"commit": _git_commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": opts.dtype, "model": opts.model, "loadavg_before": _loadavg(), "started": time.time()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    results: list[SystemResult] = []
    prompts = tokenizer = roof = None
    model_info = None

    def summary() -> dict:
        _agreement(results)
        return {"workload": dataclasses.asdict(w), "env": env, "model_info": model_info,
                "systems": [r.to_dict() for r in results], "ratios": ratios(results)}

    def add(res: SystemResult) -> None:
        results.append(res)
        if on_progress is not None:
            on_progress(summary())

    def ensure_prompts():
        """The prompts (and roofline), built once from the model's tokenizer and config, before any system."""
        nonlocal prompts, tokenizer, roof
        if prompts is None:
            from engine.loader import load_model_config, resolve_model
            from engine.tokenizer import load_tokenizer
            src = resolve_model(opts.model)
            tok = tokenizer = load_tokenizer(src)
            mcfg = load_model_config(src)
            prompts = build_prompts(tok, w, opts.seed)
            if opts.roofline:
                cal = _calibration(opts, "cpu" if not torch.cuda.is_available() else "cuda")
                dtype_bytes = 4 if opts.dtype == "float32" else 2
                roof = Roofline(mcfg, dtype_bytes, cal)
                env["calibration"] = {"device": cal.device, "matmul_flops": cal.matmul_flops,
                                      "memory_bandwidth": cal.memory_bandwidth, "quick": cal.quick}
        return prompts

    for name in BATCHGEN_VARIANTS:
        if name not in opts.systems:
            continue
        from engine.llm import LLM  # noqa: F401  (import errors surface before any timing)
        _say(opts, f"{name}: loading {opts.model}")
        llm = None
        try:
            ensure_prompts()
            res, llm = run_batchgen(opts, prompts, name, roof)
            model_info = model_info or llm.info.to_dict()
        except ConfigError as e:        # a setting this model cannot take (an int8 KV cache off its head_dim)
            res = SystemResult(system=name, label=name, skipped=str(e))
        finally:
            del llm
            gc.collect()
        if not res.skipped:
            _say(opts, f"{name}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        add(res)

    from engine.config import EngineConfig
    hf_systems = [s for s in ("hf-generate", "hf-cb") if s in opts.systems]
    if hf_systems:
        _say(opts, f"transformers: loading {opts.model}")
        t = time.monotonic()
        from engine.dtype_policy import DTYPES
        hf_dtype = DTYPES[opts.dtype]
        try:
            hf = load_hf_model(opts.model, hf_dtype)
        except (ImportError, ValueError, OSError) as e:   # e.g. GGUF loading needs `accelerate`
            for name in hf_systems:
                add(SystemResult(system=name, label=name, skipped=f"cannot load in transformers: {e}"))
            hf_systems = []
        env["hf_load_s"] = time.monotonic() - t
    if hf_systems:
        ensure_prompts()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if "hf-generate" in hf_systems:
            for bs in opts.hf_batch_sizes:
                _say(opts, f"hf-generate bs={bs}: running")
                res = run_hf_generate(hf, prompts, w.output_tokens, bs, pad_id, roof)
                _say(opts, f"hf-generate bs={bs}: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
                add(res)
        if "hf-cb" in hf_systems:
            why = hf_continuous_batching_available(hf)
            if why:
                add(SystemResult(system="hf-cb", label="hf-cb", skipped=why))
            else:
                _say(opts, "hf-cb: running")
                try:
                    res = run_hf_cb(hf, prompts, w.output_tokens, pad_id, opts.max_num_batched_tokens
                                    or EngineConfig.max_num_batched_tokens, roof)
                    _say(opts, f"hf-cb: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
                except Exception as e:      # NOTE: a baseline that breaks is reported, not fatal
                    res = SystemResult(system="hf-cb", label="hf-cb", skipped=f"failed: {type(e).__name__}: {e}")
                add(res)
        del hf
        gc.collect()

    if "llama.cpp" in opts.systems:
        ensure_prompts()
        _say(opts, "llama.cpp: running")
        res = run_llama_cpp(opts, prompts)
        if not res.skipped:
            _say(opts, f"llama.cpp: {res.wall_s:.1f} s, {res.output_tps:.1f} output tok/s")
        add(res)

    env["loadavg_after"] = _loadavg()
    env["finished"] = time.time()
    return summary()


def run_llama_cpp(opts: BenchOptions, prompts: list[BenchPrompt]) -> SystemResult:
    """llama.cpp through llama-cpp-python: its best configuration measured on this workload (module docstring)."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return SystemResult(system="llama.cpp", label="llama.cpp",
                            skipped="llama-cpp-python not installed (pip install -e '.[peer]')")
    # which build runs (its instruction sets): a peer built for another CPU kind is not the same peer
    _say(opts, f"llama.cpp {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}")
    from engine.loader import resolve_model
    src = resolve_model(opts.model)
    if src.kind != "gguf":
        return SystemResult(system="llama.cpp", label="llama.cpp", skipped="the model is not a GGUF file")
    T = opts.workload.output_tokens
    n_ctx = max(len(p.token_ids) for p in prompts) + T + 16
    threads = opts.threads or torch.get_num_threads()
    llm = Llama(model_path=str(src.path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, swa_full=True, verbose=False)
    ordered = sorted(prompts, key=lambda p: (p.group, p.index))
    outputs: dict[int, list[int]] = {}
    ttft, tpot = [], []

    def one(p: BenchPrompt, limit: int) -> list[int]:
        out, t0, t_first = [], time.monotonic(), None
        # greedy (top_k=1), no penalties; reset=True keeps the longest common prefix of the previous prompt
        for tok in llm.generate(list(p.token_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            t_first = t_first or time.monotonic()
            out.append(int(tok))
            if len(out) >= limit:
                break
        if limit == T:
            ttft.append(t_first - t0)
            if len(out) > 1:
                tpot.append((time.monotonic() - t_first) / (len(out) - 1))
        return out

    one(BenchPrompt(-1, -1, tuple(prompts[0].token_ids[:16])), 2)          # warm-up, like the others
    t0 = time.monotonic()
    for p in ordered:
        outputs[p.index] = one(p, T)
    wall = time.monotonic() - t0
    outs = [outputs[p.index] for p in prompts]
    llm.close()
    return SystemResult(system="llama.cpp", label="llama.cpp", wall_s=wall, num_requests=len(outs),
                        prompt_tokens=sum(len(p.token_ids) for p in prompts), cached_tokens=0,
                        output_tokens=sum(len(o) for o in outs), ttft_s=ttft, tpot_s=tpot, outputs=outs,
                        extra={"note": "llama-cpp-python, n_batch=512, flash_attn, swa_full, group order"})


def _agreement(results: list[SystemResult]) -> None:
    """match_rate: per system, fraction of requests whose greedy output equals batchgen-nocache's (or batchgen's)."""
    ref = next((r for r in results if r.system == "batchgen-nocache" and r.outputs), None) \
        or next((r for r in results if r.system == "batchgen" and r.outputs), None)
    if ref is None:
        return
    for r in results:
        if r.outputs is not None and len(r.outputs) == len(ref.outputs):
            r.match_rate = sum(a == b for a, b in zip(r.outputs, ref.outputs)) / len(ref.outputs)


def ratios(results: list[SystemResult]) -> dict:
    """Throughput ratios (same work, so wall-time ratios): batchgen (cache on/off) vs the best transformers."""
    # NOTE: a system that failed (errors, or fewer output tokens than the workload asks) did not do the same
    # work, so it is never "the best": its wall time would be meaningless.
    most = max((r.output_tokens for r in results if not r.skipped), default=0)
    ok = [r for r in results if r.wall_s and not r.skipped and not r.extra.get("errors")
          and r.output_tokens == most]
    by = {r.system: r for r in ok if r.system.startswith("batchgen")}
    hf = [r for r in ok if r.system.startswith("hf-")]
    best = min(hf, key=lambda r: r.wall_s) if hf else None
    out = {"best_transformers": best.label if best else None}
    on, off = by.get("batchgen"), by.get("batchgen-nocache")
    if on and best:
        out["batchgen_vs_best_transformers"] = best.wall_s / on.wall_s
    if off and best:
        out["batchgen_nocache_vs_best_transformers"] = best.wall_s / off.wall_s
    if on and off:
        out["batchgen_vs_batchgen_nocache"] = off.wall_s / on.wall_s
    for r in hf:
        if on:
            out[f"batchgen_vs_{r.label.replace(' ', '_')}"] = r.wall_s / on.wall_s
    sp = by.get("batchgen-spec")
    if sp and on:
        out["batchgen_spec_vs_batchgen"] = on.wall_s / sp.wall_s
        a, b = sp.extra.get("decode_tokens_per_s"), on.extra.get("decode_tokens_per_s")
        if a and b:
            out["spec_vs_nospec_decode_tokens_per_s"] = a / b
    peer = next((r for r in ok if r.system == "llama.cpp"), None)
    for q8 in filter(None, (by.get(n) for n in INT8_SYSTEMS)):
        key = q8.system.replace("batchgen-", "").replace("-", "_")           # int8, int8_bf16kv
        if on:
            out[f"batchgen_{key}_vs_batchgen"] = on.wall_s / q8.wall_s
            a, b = q8.extra.get("decode_step_ms_widest"), on.extra.get("decode_step_ms_widest")
            if a and b:
                out[f"{key}_vs_float_decode_step"] = b / a
    dflt = by.get("batchgen-default")
    if dflt and on:
        out["batchgen_default_vs_batchgen"] = on.wall_s / dflt.wall_s
    if peer:
        for r in filter(None, (on, *(by.get(n) for n in INT8_SYSTEMS), dflt)):
            out[f"{r.system.replace('-', '_')}_vs_llama_cpp"] = peer.wall_s / r.wall_s
    return out


# ---- the table ---------------------------------------------------------------------------------------

def _f(v, fmt: str, scale: float = 1.0) -> str:
    """``v * scale`` formatted; "n/a" right-aligned to the same width when unknown."""
    width = int(re.match(r"\d*", fmt).group() or 0)
    return format("n/a", f">{width}") if v is None else format(v * scale, fmt)


def format_table(result: dict) -> str:
    """The printed table: one row per system configuration, then the ratios."""
    w, env = result["workload"], result["env"]
    lines = [f"workload {w['shape']}: n={w['n']} groups={w['groups']} prefix={w['prefix_tokens']} "
             f"doc={w['doc_tokens']} out={w['output_tokens']} | model {env['model']} {env['dtype']} "
             f"threads={env['threads']} | load avg {env.get('loadavg_before')} -> {env.get('loadavg_after')}"]
    head = (f"{'system':<20} {'wall s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT50 s':>9} {'TTFT90 s':>9} "
            f"{'TPOT50ms':>9} {'TPOT90ms':>9} {'hit %':>6} {'MFU %':>6} {'preMFU%':>7} {'decMBU%':>7} {'match':>6}")
    lines += [head, "-" * len(head)]
    for s in result["systems"]:
        if s["skipped"]:
            lines.append(f"{s['label']:<20} skipped: {s['skipped']}")
            continue
        if s["extra"].get("errors"):       # did not do the workload: its rates would be meaningless
            first = " ".join(str(s["extra"]["errors"][0]).split())
            lines.append(f"{s['label']:<20} failed after {_f(s['wall_s'], '.1f')} s: {first[:100]}")
            continue
        tt, tp = s["ttft"] or {}, s["tpot"] or {}
        lines.append(
            f"{s['label']:<20} {_f(s['wall_s'], '8.2f')} {_f(s['output_tokens_per_s'], '10.1f')} "
            f"{_f(s['total_tokens_per_s'], '10.1f')} {_f(tt.get('p50'), '9.2f')} {_f(tt.get('p90'), '9.2f')} "
            f"{_f(tp.get('p50'), '9.1f', 1e3)} {_f(tp.get('p90'), '9.1f', 1e3)} "
            f"{_f(s['hit_rate'], '6.1f', 100)} {_f(s['mfu'], '6.1f', 100)} {_f(s['prefill_mfu'], '7.1f', 100)} "
            f"{_f(s['decode_mbu'], '7.1f', 100)} {_f(s['match_rate'], '6.2f')}")
    lines.append("")
    r = result["ratios"]
    best = r.get("best_transformers")
    if "batchgen_vs_best_transformers" in r:
        lines.append(f"batchgen (prefix cache on) vs best transformers ({best}): "
                     f"{r['batchgen_vs_best_transformers']:.2f}x")
    if "batchgen_nocache_vs_best_transformers" in r:
        lines.append(f"batchgen (prefix cache off) vs best transformers ({best}): "
                     f"{r['batchgen_nocache_vs_best_transformers']:.2f}x")
    if "batchgen_vs_batchgen_nocache" in r:
        lines.append(f"batchgen cache on vs cache off: {r['batchgen_vs_batchgen_nocache']:.2f}x")
    for key, label in (("int8", "int8"), ("int8_bf16kv", "int8 (bf16 KV)"), ("int8_int8kv", "int8 (int8 KV)")):
        if f"batchgen_{key}_vs_batchgen" in r:
            lines.append(f"batchgen {label} vs batchgen {env['dtype']}: {r[f'batchgen_{key}_vs_batchgen']:.2f}x wall"
                         + (f", {r[f'{key}_vs_float_decode_step']:.2f}x per decode-only step at the widest batch"
                            if f"{key}_vs_float_decode_step" in r else ""))
    if "batchgen_default_vs_batchgen" in r:
        dl = next((x for x in result["systems"] if x["system"] == "batchgen-default"), {})
        q = (dl.get("extra") or {}).get("quantization")
        lines.append(f"batchgen defaults{f' (quantization {q})' if q else ''} vs batchgen {env['dtype']}: "
                     f"{r['batchgen_default_vs_batchgen']:.2f}x wall")
    if "batchgen_spec_vs_batchgen" in r:
        sp = next((x for x in result["systems"] if x["system"] == "batchgen-spec"), {})
        rate = sp.get("extra", {}).get("acceptance_rate")
        lines.append(f"batchgen speculation (auto) vs off: {r['batchgen_spec_vs_batchgen']:.2f}x wall"
                     + (f", {r['spec_vs_nospec_decode_tokens_per_s']:.2f}x decode tokens/s"
                        if "spec_vs_nospec_decode_tokens_per_s" in r else "")
                     + (f"; acceptance {rate:.0%} of {sp['extra']['draft_tokens']} drafts" if rate is not None
                        else "; gating kept it off"))
    for key, label in (("batchgen_vs_llama_cpp", "batchgen"), ("batchgen_int8_vs_llama_cpp", "batchgen int8"),
                       ("batchgen_int8_bf16kv_vs_llama_cpp", "batchgen int8 (bf16 KV)"),
                       ("batchgen_int8_int8kv_vs_llama_cpp", "batchgen int8 (int8 KV)"),
                       ("batchgen_default_vs_llama_cpp", "batchgen defaults")):
        if key in r:
            lines.append(f"{label} vs llama.cpp: {r[key]:.2f}x")
    for s in result["systems"]:
        if s["extra"].get("breakdown"):
            lines += ["", *format_breakdown(s["label"], s["extra"]["breakdown"])]
    float_sys = next((s for s in result["systems"] if s["system"] == "batchgen" and not s["skipped"]
                      and s["extra"].get("breakdown")), None)
    bounds = [line for s in result["systems"] if float_sys and s["system"] in INT8_SYSTEMS and not s["skipped"]
              and s["extra"].get("breakdown")
              for line in format_bound(s["label"], float_sys["label"], float_sys["extra"]["breakdown"],
                                       s["extra"]["breakdown"])]
    if bounds:
        lines += ["", "int8's matmul bound (perf.breakdown.matmul_bound):", *bounds]
    if env.get("calibration"):
        c = env["calibration"]
        lines.append(f"roofline: calibrated peak {c['matmul_flops'] / 1e9:.0f} GFLOP/s, "
                     f"{c['memory_bandwidth'] / 1e9:.1f} GB/s{' (quick)' if c['quick'] else ''}; "
                     "MFU counts model FLOPs each system computed (no padding, window-limited attention)")
    return "\n".join(lines)


def save_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


# ---- command line ------------------------------------------------------------------------------------

def options_from(shape: str, quick: bool, n=None, groups=None, prefix_tokens=None, doc_tokens=None,
                 output_tokens=None, hf_batch_sizes=None, **kw) -> BenchOptions:
    """BenchOptions from command-line values (None = the shape's / preset's default); shared with the CLI."""
    w = make_workload(shape, quick, n=n, groups=groups, prefix_tokens=prefix_tokens, doc_tokens=doc_tokens,
                      output_tokens=output_tokens)
    if hf_batch_sizes is None:
        hf_batch_sizes = QUICK_HF_BATCH_SIZES if quick else DEFAULT_HF_BATCH_SIZES
    if kw.get("dtype", "auto") == "auto":      # what the engine would choose on this CPU, for every system
        from engine.dtype_policy import choose_dtype
        kw["dtype"] = choose_dtype("auto", "cpu").dtype
    return BenchOptions(workload=w, quick=quick, hf_batch_sizes=tuple(hf_batch_sizes), **kw)
