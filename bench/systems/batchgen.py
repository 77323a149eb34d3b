"""The batchgen systems: our engine, one LLM per variant (prefix caching, quantization, speculation, KV dtype)."""
from __future__ import annotations

import bisect
import contextlib
import time
from typing import Callable

from bench.breakdown import kernel_breakdown
from bench.options import BenchOptions, say
from bench.plan_prediction import plan_prediction
from bench.result import SystemResult
from bench.workloads import STRUCTURED_SCHEMA, BenchPrompt, prompt_tokenizer, warmup_prompts
from costmodel.roofline import Roofline, RunFormat
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

BATCHGEN_VARIANTS = {"batchgen": (True, "none", None, "auto"), "batchgen-nocache": (False, "none", None, "auto"),
                     "batchgen-int8": (True, "int8", None, "auto"),
                     "batchgen-int8-bf16kv": (True, "int8", None, "bfloat16"),
                     "batchgen-int8-int8kv": (True, "int8", None, "int8"),
                     "batchgen-spec": (True, "none", "auto", "auto"),
                     "batchgen-default": (True, "auto", "auto", "auto"),
                     "batchgen-default-nocache": (False, "auto", "auto", "auto"),
                     "batchgen-nondet": (True, "none", None, "auto"),            # deterministic: false, the cost
                     "batchgen-default-nondet": (True, "auto", "auto", "auto")}  # of batch invariance
# The same settings with every request constrained to ``workloads.STRUCTURED_SCHEMA`` (same output tokens):
# structured name -> the unconstrained twin it is compared with (``table.ratios``).
STRUCTURED_TWINS = {"batchgen-structured": "batchgen", "batchgen-default-structured": "batchgen-default"}
BATCHGEN_VARIANTS.update({s: BATCHGEN_VARIANTS[base] for s, base in STRUCTURED_TWINS.items()})


RoofFor = Callable[[RunFormat], "Roofline | None"]


def run_batchgen(opts: BenchOptions, prompts: list[BenchPrompt], name: str,
                 roof_for: RoofFor | None) -> tuple[SystemResult, object]:
    """One LLM per setting (a fresh prefix cache), a short warm-up, then the whole workload in one generate.

    ``roof_for(format)``: the roofline of the format the engine ran (``RunFormat.of(llm.info)``: its calibration,
    weight and KV bytes), or None (no roofline: ``--no-roofline``)."""
    llm, warmup_s = load_batchgen(opts, name)
    return time_batchgen(opts, llm, prompts, name, roof_for, warmup_s), llm


def load_batchgen(opts: BenchOptions, name: str) -> tuple[LLM, float]:
    """The variant's LLM, loaded and warmed up as it will run: (the LLM, the warm-up's seconds)."""
    prefix_caching, quantization, spec, kv_dtype = BATCHGEN_VARIANTS[name]
    t = time.monotonic()
    # int8 picks its own activation dtype (auto: float32, engine.setup) unless float32 was asked for anyway
    dtype = opts.dtype if quantization == "none" or opts.dtype == "float32" else "auto"
    llm = LLM(opts.model, dtype=dtype, enable_prefix_caching=prefix_caching, quantization=quantization,
              speculative_config=spec, kv_cache_dtype=kv_dtype, deterministic=not name.endswith("-nondet"),
              **opts.engine_args())
    say(opts, f"{name}: loaded in {time.monotonic() - t:.1f} s; warming up")
    # a constrained system prepares its grammar backend's tokenizer view and compiles the schema here, once per
    # process (as the model load, not in the timed generate; its time is reported)
    t_warm = time.monotonic()
    warm = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2, structured_outputs=_structured(name))
    llm.generate(warmup_prompts(prompt_tokenizer(llm.get_tokenizer())), warm)
    return llm, time.monotonic() - t_warm


def _structured(name: str) -> StructuredOutputsParams | None:
    return StructuredOutputsParams(json=STRUCTURED_SCHEMA) if name in STRUCTURED_TWINS else None


def time_batchgen(opts: BenchOptions, llm: LLM, prompts: list[BenchPrompt], name: str, roof_for: RoofFor | None,
                  warmup_s: float) -> SystemResult:
    """The whole workload in one timed generate on a loaded LLM, its row (steps, limits, the plan's prediction)."""
    T = opts.workload.output_tokens
    structured = _structured(name)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=T, structured_outputs=structured)
    timers = kernel_breakdown() if opts.breakdown else contextlib.nullcontext()
    with timers as bd:
        t0 = time.monotonic()
        steps = []
        outs = llm.generate([list(p.token_ids) for p in prompts], params, priorities=range(len(prompts)),
                            on_step=steps.append)
        wall = time.monotonic() - t0
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
    res.extra["quantization"] = llm.info.config.quantization   # what auto resolved to (batchgen-default)
    fmt = RunFormat.of(llm.info)
    res.extra["format"] = fmt.label
    res.extra["warmup_s"] = round(warmup_s, 3)
    _plan_prediction(res, llm, prompts, T)
    if structured is not None:
        res.extra.update(structured=_structured_summary(outs))
    drafts = sum(o.metrics.num_draft_tokens for o in outs)
    if drafts:
        acc = sum(o.metrics.num_accepted_tokens for o in outs)
        spec_steps = sum(1 for s in steps if s.num_draft_tokens)
        res.extra.update(draft_tokens=drafts, accepted_tokens=acc, acceptance_rate=acc / drafts,
                         speculating_steps=spec_steps,
                         mean_accepted_per_spec_step_seq=acc / max(sum(s.num_decode_seqs for s in steps
                                                                       if s.num_draft_tokens), 1))
    roof = roof_for(fmt) if roof_for is not None else None
    if roof is not None:
        _batchgen_roofline(res, outs, steps, roof, fmt)
    return res


def _plan_prediction(res: SystemResult, llm, prompts: list[BenchPrompt], output_tokens: int) -> None:
    """What ``batchgen plan`` would predict for this run (``bench.plan_prediction``), in ``res.extra``:
    ``predicted_engine_s`` and the whole ``prediction``."""
    try:
        pred = plan_prediction(llm, prompts, output_tokens)
    except Exception as e:        # NOTE: as in a pipeline run, a prediction never loses the measurement
        res.extra["prediction_error"] = f"{type(e).__name__}: {e}"
        return
    if pred is not None:
        res.extra["predicted_engine_s"] = pred.engine_s
        res.extra["prediction"] = pred.to_dict()


def _structured_summary(outs) -> dict:
    """What the grammar did: forced tokens (their share of the output: what they give back), masks, mask time,
    and how many outputs are a valid prefix of the schema's JSON (the engine's checks are exact, so all)."""
    forced = sum(o.metrics.num_forced_tokens for o in outs)
    out_tokens = sum(len(o.token_ids) for o in outs)
    return {"forced_tokens": forced, "forced_share": forced / out_tokens if out_tokens else None,
            "masks_applied": sum(o.metrics.num_masks_applied for o in outs),
            "mask_time_s": sum(o.metrics.mask_time_s for o in outs),
            "json_prefix_ok": sum(o.text.lstrip().startswith('{"category":"') for o in outs)}


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


def step_contexts(outs, steps) -> dict[int, list[int]]:
    """Each decode token's context (tokens it attends to, itself included) under the step that computed it: the
    step whose span holds its token time."""
    starts = [s.start_time for s in steps]
    ctx_by_step: dict[int, list[int]] = {}
    for o in outs:
        L = len(o.prompt_token_ids)
        for k, t in enumerate(o.metrics.token_times[1:], start=1):
            ctx_by_step.setdefault(bisect.bisect_right(starts, t) - 1, []).append(L + k)
    return ctx_by_step


def stage_sums(outs, steps, roof: Roofline) -> dict:
    """The run's model FLOPs, and what the fractions divide: steps with prompt work (FLOPs, seconds), decode-only
    steps (bytes: weights once + K/V read and written, seconds) and, of those, the 1-row ones (num_decode_seqs 1)."""
    ctx_by_step = step_contexts(outs, steps)
    total = sum(roof.request_flops(len(o.prompt_token_ids), o.num_cached_tokens, 1) for o in outs)
    sums = {"prefill_flops": total, "prefill_s": 0.0, "decode_bytes": 0.0, "decode_s": 0.0,
            "decode1_bytes": 0.0, "decode1_s": 0.0, "decode1_steps": 0}
    for i, s in enumerate(steps):
        ctx = ctx_by_step.get(i, [])
        d, fl = s.end_time - s.start_time, roof.decode_flops(ctx) if ctx else 0
        total += fl
        if s.num_prefill_tokens:
            sums["prefill_s"] += d
            sums["prefill_flops"] += fl
        elif ctx:
            nbytes = roof.decode_bytes(ctx)
            sums["decode_s"] += d
            sums["decode_bytes"] += nbytes
            if s.num_decode_seqs == 1:
                sums["decode1_s"] += d
                sums["decode1_bytes"] += nbytes
                sums["decode1_steps"] += 1
    sums["flops"] = total
    return sums


def step_limits(sums: dict, roof: Roofline, fmt: RunFormat) -> dict:
    """How close to the limit: prefill FLOP/s over the format's matmul peak, decode-only (and 1-row
    decode-only) bytes/s over the read bandwidth; fractions None without a calibration or without such steps."""
    rate = lambda a, t: a / t if t > 0 else None  # noqa: E731
    cal = roof.cal
    get = (lambda k: cal.get(k)) if isinstance(cal, dict) else (lambda k: getattr(cal, k, None))
    return {"format": fmt.label, "calibration_dtype": fmt.calibration_dtype,
            "matmul_flops": get("matmul_flops") if cal else None,
            "memory_bandwidth": get("memory_bandwidth") if cal else None,
            "peak_kernel": (get("peak_kernel") or None) if cal else None, "quick": bool(cal and get("quick")),
            "prefill_flops_per_s": rate(sums["prefill_flops"], sums["prefill_s"]),
            "decode_bytes_per_s": rate(sums["decode_bytes"], sums["decode_s"]),
            "decode1_bytes_per_s": rate(sums["decode1_bytes"], sums["decode1_s"]),
            "decode1_steps": sums["decode1_steps"],
            "prefill_peak_fraction": roof.mfu(sums["prefill_flops"], sums["prefill_s"]),
            "decode_bound_fraction": roof.mbu(sums["decode_bytes"], sums["decode_s"]),
            "decode1_bound_fraction": roof.mbu(sums["decode1_bytes"], sums["decode1_s"])}


def _batchgen_roofline(res: SystemResult, outs, steps, roof: Roofline, fmt: RunFormat) -> None:
    """MFU / MBU and the limit fractions on the roofline of the format that ran; decode tokens assigned to their
    steps by time, so each step's context lengths are exact."""
    sums = stage_sums(outs, steps, roof)
    res.flops = sums["flops"]
    res.mfu = roof.mfu(sums["flops"], res.wall_s)
    res.prefill_mfu = roof.mfu(sums["prefill_flops"], sums["prefill_s"])
    res.decode_mbu = roof.mbu(sums["decode_bytes"], sums["decode_s"])
    res.limits = step_limits(sums, roof, fmt)
    res.prefill_peak_fraction = res.limits.pop("prefill_peak_fraction")
    res.decode_bound_fraction = res.limits.pop("decode_bound_fraction")
    res.decode1_bound_fraction = res.limits.pop("decode1_bound_fraction")
