"""LLM: the engine's door (vLLM's offline API names).

    llm = LLM(model="gemma-3-270m", dtype="auto", **engine_args)   # engine_args: EngineConfig fields
    outs = llm.generate(prompts, SamplingParams(max_tokens=64))    # one RequestOutput per prompt

It implements ``engine.interface.Engine``: the pipeline drives it incrementally (``add_request`` / ``step`` /
``has_unfinished_requests``; a step returns the outputs that finished in it and its ``StepStats``), pins a group's
shared prefix with ``pin_prefix`` / ``unpin_prefix``, and reads ``info`` (an ``EngineInfo``). ``config`` is the
resolved ``EngineConfig``. Nothing outside engine/ reaches further in than ``engine/__init__.py`` exports.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import torch

import engine.attention.key_shift as key_shift
import engine.huge_pages as huge_pages
import engine.kernels.library as library
import engine.omp_wait as omp_wait
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.dtype_policy import log_choice
from engine.errors import ConfigError
from engine.invariance import invariance
from engine.loader import load_model
from engine.malloc import keep_freed_memory
from engine.model_runner import ModelRunner
from engine.models import weight_bytes
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.setup import ModelTarget, locate, settle
from engine.tokenizer import load_tokenizer
from engine.tuning.format_decision import FormatDecision

log = logging.getLogger("batchgen.engine")

class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", *, config: EngineConfig | None = None,
                 **engine_args):
        """``LLM(model, dtype, **engine_args)``: every ``EngineConfig`` field by its (vLLM) name; or
        ``LLM(config=EngineConfig(...))``, the config whole (its model and dtype win)."""
        t0 = time.monotonic()
        marks = _Marks()
        if config is None:
            config = EngineConfig.from_options(model, dtype=dtype, **engine_args)
        elif engine_args:
            raise ConfigError(f"LLM(config=...) takes no further options, got {', '.join(sorted(engine_args))}")
        if config.num_threads:                                  # before tuning: the tuner measures with them
            torch.set_num_threads(config.num_threads)
        target = locate(config)                                 # the model and the device
        setup = settle(target, self._tune(target))              # every other automatic setting, resolved once
        log_choice(setup.dtype_choice)                          # once per engine (validation stays quiet)
        # The one resolved config: the scheduler, runner, info and manifest all see this one.
        self.config = cfg = setup.config
        self.device, self.dtype_choice, self.dtype = setup.device, setup.dtype_choice, setup.dtype
        self.source, self.model_config, self._identity = setup.source, setup.model_config, setup.identity
        self.backend = setup.backend
        if self.device.type == "cpu":
            keep_freed_memory()
        marks("resolve_s")
        # NOTE: the tokenizer (a 33 MB tokenizer.json for a 262k vocabulary, ~0.7 s in the Rust parser) loads on
        # a second thread while the weights are mapped and checksummed (zlib and page-ins release the GIL).
        with ThreadPoolExecutor(1, thread_name_prefix="batchgen-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, self.source, self._identity)
            self.model, self.weights_from = load_model(self.source, self.model_config, self.dtype, self.device,
                                                       self._identity, cfg.quantization, setup.kernels,
                                                       cfg.deterministic)
            marks("weights_s")
            if self.device.type == "cpu":
                huge_pages.move_weights(self.model)    # streamed every decode step: no 4 KiB page walks
                marks("huge_pages_s")
            self.tokenizer = tokenizer.result()
        self.eos_token_ids = _eos_ids(self.model_config, self.tokenizer)
        marks("tokenizer_wait_s")
        if self.device.type == "cpu":
            library.load()                     # built once per CPU and source version, then cached
        marks("kernels_s")
        num_blocks = setup.num_kv_blocks
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, setup.kv_dtype, self.device, self.backend,
                                  cfg.seed)
        if cfg.kv_cache_dtype == "int8":           # each layer's keys stored minus its mean key (finer int8 steps)
            key_shift.calibrate(self.model, self.tokenizer.encode(key_shift.CALIBRATION_TEXT), self.dtype)
        self.scheduler = Scheduler(cfg, num_blocks, cfg.max_model_len, speculator=_speculator(cfg, self.model))
        marks("kv_cache_s")
        self._num_steps = 0
        self.load_time_s = time.monotonic() - t0
        self.info = setup.info(cpu_kernels=library.describe() if self.device.type == "cpu" else "",
                               load_time_s=round(self.load_time_s, 3), weight_bytes=weight_bytes(self.model),
                               bf16_held_weights=any(getattr(m, "packed", False) and m.weight.dtype == torch.bfloat16
                                                     for m in self.model.modules()),
                               load_breakdown={**marks.spans, "weights_from": self.weights_from},
                               omp_wait=omp_wait.describe() if self.device.type == "cpu" else "",
                               invariance=invariance(self._identity, cfg.quantization, cfg.dtype, cfg.kv_cache_dtype,
                                                     cfg.device, cfg.deterministic))
        log.info("engine loaded in %.2fs (%s); weights %.0f MB, %s", self.load_time_s,
                 ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in marks.spans.items()), self.info.weight_bytes / 1e6,
                 setup.quant_choice.reason)
        self._requests: dict[str, Request] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self._grammar_backend = None                # engine.structured: made by the first constrained request

    def _tune(self, target: ModelTarget) -> FormatDecision:
        """Tuning (vLLM's engine core likewise profiles before it sizes the KV cache): the format this engine computes
        in. On a CPU with some of it ``auto``, this machine's decision for the model (engine.tuning), measured now
        when none is cached: every candidate format loaded and timed on the model's shapes (seconds, once per model
        and machine). Elsewhere, or with tuning off, the tables'."""
        return target.decide_format(measure=True)

    # ---- info (self.info: EngineInfo; self.config: the resolved EngineConfig) ---------------------------
    def get_tokenizer(self):
        return self.tokenizer

    # ---- the incremental door ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> None:
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
        req = Request(request_id, token_ids, params, priority=priority, eos_token_ids=self.eos_token_ids)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        if params.structured_outputs is not None:
            self._attach_grammar(req)        # a constraint that cannot compile finishes this request with an error
        self._requests[request_id] = req
        self._prompts[request_id] = text
        self.scheduler.add_request(req)      # an empty or never-fitting prompt finishes there with an error

    def _attach_grammar(self, req: Request) -> None:
        # NOTE: llguidance loads only once a request asks for a constraint.
        from engine.structured.llguidance_backend import LLGuidanceBackend
        from engine.structured.params import StructuredOutputError
        from engine.structured.state import RequestGrammar
        try:
            if self._grammar_backend is None:
                self._grammar_backend = LLGuidanceBackend(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids, cache_key=self._identity)
            backend = self._grammar_backend
            grammar = backend.compile(req.sampling_params.structured_outputs)
            req.grammar = RequestGrammar(backend.new_matcher(grammar), backend.vocab_size, self.eos_token_ids)
        except StructuredOutputError as e:
            req.error = f"request {req.request_id}: {e}"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``), so the next generate computes its prompts
        whole; refused (False) while a request or a pin holds blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def pin_prefix(self, token_ids: Sequence[int]) -> int | None:
        return self.scheduler.pin_prefix(list(token_ids))

    def unpin_prefix(self, pin_id: int) -> None:
        self.scheduler.unpin(pin_id)

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Schedule, run and postprocess one step; return the requests that finished in it and the step's stats
        (the engine keeps none: a caller that records steps aggregates them)."""
        t0 = time.monotonic()
        out = self.scheduler.schedule()
        new_tokens = self.runner.execute(out, self._requests)      # request id -> the token(s) it sampled
        finished = self.scheduler.update_from_output(out, new_tokens, self.runner.forced)
        stats = StepStats(step=self._num_steps, start_time=t0, end_time=time.monotonic(),
                          **self.scheduler.last_step_stats())
        self._num_steps += 1
        self._learn_step_cost(stats)
        results = [self._make_output(r) for r in finished]
        for r in finished:
            self._forget(r.request_id)
        return results, stats

    def _learn_step_cost(self, stats: StepStats) -> None:
        """A decode-only step's duration teaches speculation's gating what a step of that many rows costs."""
        spec = self.scheduler.speculator
        if spec is not None and not stats.num_prefill_tokens and stats.num_decode_tokens:
            spec.cost.observe(stats.num_decode_tokens, stats.end_time - stats.start_time)

    def _make_output(self, req: Request) -> RequestOutput:
        detok = req.detokenizer
        m = RequestMetrics(
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            prefill_start_time=req.prefill_start_time, prefill_end_time=req.prefill_end_time,
            first_token_time=req.first_token_time, token_times=list(req.token_times),
            finish_time=req.finish_time or time.monotonic(), num_preemptions=req.num_preemptions,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
            num_spec_steps=req.num_spec_steps, num_forced_tokens=req.num_forced_tokens)
        if req.grammar is not None:
            m.num_masks_applied, m.mask_time_s = req.grammar.num_masks_applied, req.grammar.mask_time_s
        return RequestOutput(
            request_id=req.request_id, prompt=self._prompts.get(req.request_id),
            prompt_token_ids=req.prompt_token_ids, text=detok.flush() if req.status.finished else detok.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.value if req.status.finished else None,
            num_cached_tokens=req.num_cached_tokens or 0, metrics=m, error=req.error,
            stop_reason=req.stop_reason)

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._prompts.pop(rid, None)
        self.runner.release(rid)

    # ---- batch API -----------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Iterable[int] | None = None, use_tqdm: bool = False,
                 on_step: Callable[[StepStats], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``on_step``: called with each
        step's stats (e.g. ``steps.append``)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        one = isinstance(sampling_params, SamplingParams)
        params = [sampling_params] * len(prompts) if one else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        prios = list(priorities) if priorities is not None else [0] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p, prio in zip(ids, prompts, params, prios):
            self.add_request(rid, prompt, p, prio)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.has_unfinished_requests():
            outputs, stats = self.step()
            if on_step is not None:
                on_step(stats)
            for o in outputs:
                results[o.request_id] = o
                if bar:
                    bar.update(1)
        if bar:
            bar.close()
        return [results[rid] for rid in ids]


class _Marks:
    """Wall-clock spans of start-up phases: ``marks("name_s")`` closes the span since the previous mark."""

    def __init__(self):
        self.spans: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.spans[name] = round(now - self._last, 3)
        self._last = now


def _speculator(cfg, model):
    """engine.spec_decode.speculator.Speculator for ``cfg.speculative_config``, or None. Its step-cost prior:
    a decode step reads every weight once (fixed) and costs ~2 FLOPs per parameter per row (per row), counted
    from the loaded model's tensors; the engine then learns the real costs from its decode steps."""
    from engine.spec_decode.gating import StepCost
    from engine.spec_decode.speculator import Speculator
    if cfg.speculative_config is None:
        return None
    params = sum(t.numel() for t in model.state_dict().values())
    return Speculator(cfg.speculative_config, cfg.max_model_len,
                      StepCost(fixed_s=params * 2 / 30e9, per_row_s=2 * params / 300e9))


def _eos_ids(mcfg, tokenizer) -> tuple[int, ...]:
    ids = set(mcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if mcfg.architecture == "Gemma3ForCausalLM":
        eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(eot, int) and eot != tokenizer.unk_token_id:
            ids.add(eot)
    return tuple(sorted(ids))
