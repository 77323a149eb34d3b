"""Predict a planned run's engine time before it runs (``batchgen plan``; the manifest keeps predicted vs achieved).

The plan gives, per request in plan order, its prompt length and predicted cached tokens; the job gives
``max_tokens``. ``predict`` replays the scheduler's token-budget loop coarsely (decodes first, then prefill chunks
of running requests, then new requests in plan order, under ``max_num_batched_tokens`` and ``max_num_seqs``; no
preemption) and prices each step on the roofline: time = max(FLOPs / matmul FLOP/s, bytes / bandwidth), with
this device's calibration (``costmodel.calibrate``) at the engine dtype. The per-step prices are
``costmodel.flops``'s counts (window-limited attention, LM head only where a token is sampled).

What it cannot know: outputs that stop early (EOS, stop strings) make the run shorter than predicted, since every
request is assumed to generate ``max_tokens``; other processes on the cores make it longer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from costmodel import flops as F
from costmodel.roofline import DTYPE_BYTES, INT8_WEIGHT_BYTES, KV_BYTES, RunFormat, matmul_rate

# Per step, beyond the roofline: Python scheduling, metadata, sampling, kernel launches (part of every step;
# measured: docs/perf/code-notes-perf.md).
STEP_OVERHEAD_S = 0.004
# The fraction of the calibrated matmul rate whole engine steps reach: norms, activations, RoPE, softmax and
# K/V writes run between the matmuls, memory-bound (measured: docs/perf/code-notes-perf.md).
ENGINE_EFFICIENCY = 0.8
# The row count of the calibration's large matmuls (costmodel.calibrate's 2048-row shapes): a prefill step this
# large runs at the roofline's rate, measured, whatever the probe's smaller prefill chunk measured
CALIBRATED_ROWS = 2048


@dataclass(frozen=True)
class Prediction:
    engine_s: float            # predicted wall time of the engine's steps (no model load)
    prefill_s: float           # in steps that carry prompt tokens
    decode_s: float            # in decode-only steps
    steps: int
    output_tokens: int         # assumed generated: every request's max_tokens
    basis: str = "roofline"    # roofline | "measured steps (<decision file>)": scaled to the tuner's timings
    measured_steps: dict | None = None   # the tuner's step times it was scaled to: {shape name: seconds}

    def to_dict(self) -> dict:
        return {"engine_s": round(float(self.engine_s), 2), "prefill_s": round(float(self.prefill_s), 2),
                "decode_s": round(float(self.decode_s), 2), "steps": int(self.steps),
                "output_tokens": int(self.output_tokens), "basis": self.basis,
                "measured_steps": self.measured_steps}




def predict(prompt_len, cached, max_tokens, config, dtype_bytes: int, max_num_batched_tokens: int,
            max_num_seqs: int, matmul_flops: float, memory_bandwidth: float,
            small_m_flops: float | None = None, fast_forward: bool = True,
            kv_dtype_bytes: int | None = None, weight_dtype_bytes: float | None = None,
            measured: dict | None = None) -> Prediction:
    """``prompt_len`` / ``cached`` / ``max_tokens``: per request, in plan (admission) order. ``matmul_flops`` is
    the calibrated rate of large matmuls, ``small_m_flops`` that of 16-row ones (decode-sized; default: the same):
    a step's matmuls of M rows run at the log-interpolated rate between the two. ``kv_dtype_bytes``: the KV
    cache's element size (``kv_cache_dtype``; default ``dtype_bytes``); ``weight_dtype_bytes`` the weights' bytes
    per parameter (int8: ``INT8_WEIGHT_BYTES``; default ``dtype_bytes``). ``fast_forward=False`` prices
    decode-only stretches step by step too (the tests compare the two: equal to the last bit). ``measured``: this
    machine's timed engine steps of the running format (engine.tuning's probe, ``measured_steps``): every step's
    roofline price is scaled by measured / priced at the probe's shapes (prefill steps by the prefill chunk's
    ratio up to its rows, going to 1 at ``CALIBRATED_ROWS``; decode-only steps by the ratio at their row count;
    both log-interpolated)."""

    # NOTE: the plan's own int arrays, not int64 copies (read one request at a time; sums accumulate in int64)
    prompt_len, cached = _ints(prompt_len), _ints(cached)
    max_tokens = np.broadcast_to(_ints(max_tokens), prompt_len.shape)
    c = _Costs(config, dtype_bytes, kv_dtype_bytes, weight_dtype_bytes, matmul_flops, small_m_flops,
               memory_bandwidth)
    scale_prefill, scale_decode = _scales(c, measured)

    def price(flops, nbytes, attn, rows: int, sampled: int, prefill: bool):
        """The roofline's price, scaled to this machine's measured steps (``measured``) where given."""
        return c.price(flops, nbytes, attn, rows, sampled) * (scale_prefill if prefill else scale_decode)(rows)

    run = _Replay(c, price, prompt_len, cached, max_tokens, max_num_batched_tokens, max_num_seqs)
    run.replay(fast_forward)
    shapes = (measured or {}).get("shapes") or None
    basis = f"measured steps ({measured['source']})" if shapes else "roofline"
    return Prediction(float(run.t_pre + run.t_dec), float(run.t_pre), float(run.t_dec), run.steps,
                      int(max_tokens.sum()), basis, shapes)


def _ints(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype.kind in "iu" else a.astype(np.int64)


class _Replay:
    """The scheduler's token-budget loop, coarsely, over the plan's requests; each step priced by ``price``."""

    def __init__(self, c: _Costs, price: Callable, prompt_len: np.ndarray, cached: np.ndarray, max_tokens: np.ndarray,
                 max_num_batched_tokens: int, max_num_seqs: int):
        self.c, self.price = c, price
        self.prompt_len, self.cached, self.max_tokens = prompt_len, cached, max_tokens
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.next, self.total = 0, len(prompt_len)      # requests enter in plan order: the next one's position
        self.running: list[_Seq] = []
        self.t_pre = self.t_dec = 0.0
        self.steps = 0

    def replay(self, fast_forward: bool) -> None:
        while self.next < self.total or self.running:
            running = self.running
            if (fast_forward and running and all(r.decoding for r in running)
                    and len(running) <= self.max_num_batched_tokens
                    and (self.next == self.total or len(running) >= self.max_num_seqs)):
                self._decode_stretch()
            else:
                self._step()
            self.running = [r for r in self.running if r.left > 0]

    def _decode_stretch(self) -> None:
        """Decode-only steps until the first request finishes: nothing else can change in between, so they are
        priced together (the same per-step arithmetic, elementwise, summed in step order)."""
        c, running = self.c, self.running
        n, k = len(running), min(r.left for r in running)
        ctx = np.asarray([r.pos + 1 for r in running], dtype=np.int64)[:, None] + np.arange(k)[None, :]
        keys_k = F.keys_read(c.windows, ctx).sum(axis=0).astype(np.float64)
        nbytes = c.kv_tok * keys_k + c.kv_tok * c.config.num_hidden_layers * n + c.w_all
        for t in self.price(c.lin_tok * n, nbytes, c.per_key * keys_k, n, n, False).tolist():
            self.t_dec += t
        self.steps += k
        for r in running:
            r.pos += k
            r.left -= k

    def _step(self) -> None:
        """One step: decodes first (one token each), then prefill chunks of running requests, then new requests in
        plan order, under the token budget and ``max_num_seqs``."""
        c, running = self.c, self.running
        budget = self.max_num_batched_tokens
        decodes = [r for r in running if r.decoding][:budget]
        budget -= len(decodes)
        chunks: list[tuple[_Seq, int]] = []
        for r in running:
            if not r.decoding and budget > 0:
                n = min(r.prompt - r.pos, budget)
                chunks.append((r, n))
                budget -= n
        while self.next < self.total and budget > 0 and len(running) < self.max_num_seqs:
            i = self.next
            self.next += 1
            r = _Seq(pos=int(min(self.cached[i], self.prompt_len[i] - 1)), prompt=int(self.prompt_len[i]),
                     left=int(self.max_tokens[i]))
            running.append(r)
            n = min(r.prompt - r.pos, budget)
            chunks.append((r, n))
            budget -= n
        flops = nbytes = attn = 0.0
        sampled = 0
        for r, n in chunks:
            attn += c.per_key * F.keys_read_range(c.windows, r.pos + 1, r.pos + n)
            flops += c.lin_tok * n
            nbytes += c.kv_tok * float(F.keys_read(c.windows, r.pos)) + c.kv_tok * c.config.num_hidden_layers * n
            r.pos += n
            if r.pos == r.prompt:                          # the chunk that ends the prompt samples a token
                r.decoding = True
                r.left -= 1
                sampled += 1
        if decodes:
            k = float(F.keys_read(c.windows, np.asarray([r.pos + 1 for r in decodes])).sum())
            flops += c.lin_tok * len(decodes)
            attn += c.per_key * k
            nbytes += c.kv_tok * k + c.kv_tok * c.config.num_hidden_layers * len(decodes)
            for r in decodes:
                r.pos += 1
                r.left -= 1
            sampled += len(decodes)
        rows = len(decodes) + sum(n for _, n in chunks)
        nbytes += c.w_all if sampled else c.w_layers
        t = float(self.price(flops, nbytes, attn, rows, sampled, bool(chunks)))
        if chunks:
            self.t_pre += t
        else:
            self.t_dec += t
        self.steps += 1


class _Costs:
    """The model's per-token counts on this machine's roofline, and one step's price."""

    def __init__(self, config, dtype_bytes, kv_dtype_bytes, weight_dtype_bytes, matmul_flops, small_m_flops,
                 memory_bandwidth):
        self.config, self.matmul_flops, self.small_m_flops = config, matmul_flops, small_m_flops
        self.memory_bandwidth = memory_bandwidth
        self.windows = F.window_counts(config)                # layers grouped by window: 2 groups on gemma-3
        self.per_key = 4 * config.num_attention_heads * config.head_dim      # QK + PV FLOPs per attended key
        self.kv_tok = F.kv_bytes_per_token_layer(config, kv_dtype_bytes or dtype_bytes)
        self.lin_tok = F.linear_flops(config, 1)
        self.head_row = F.lm_head_flops(config, 1)
        wb = weight_dtype_bytes or dtype_bytes
        self.w_all = F.weight_bytes(config, wb)
        self.w_layers = F.weight_bytes(config, wb, with_lm_head=False)

    def rate(self, rows: int) -> float:
        return matmul_rate(rows, self.matmul_flops, self.small_m_flops) * ENGINE_EFFICIENCY

    def price(self, flops, nbytes, attn, rows: int, sampled: int):
        """A step's time; elementwise for arrays of steps. Each piece on its own roofline (CPU ops run one after
        another): layer matmuls over all rows, the LM head over the sampled rows, attention at the large-matmul
        rate."""
        return (np.maximum(flops / self.rate(rows), nbytes / self.memory_bandwidth)
                + (self.head_row * sampled / self.rate(sampled) if sampled else 0.0)
                + attn / self.rate(512) + STEP_OVERHEAD_S)

    def prefill_chunk(self, n: int) -> float:
        """One request's first ``n`` prompt tokens in one step, its last one sampled (the probe's prefill shape)."""
        return float(self.price(self.lin_tok * n, self.kv_tok * self.config.num_hidden_layers * n + self.w_all,
                                self.per_key * F.keys_read_range(self.windows, 1, n), n, 1))

    def decode(self, rows: int, context: int) -> float:
        """``rows`` decodes, each with ``context`` tokens cached (the probe's decode shapes)."""
        k = float(F.keys_read(self.windows, np.full(rows, context + 1)).sum())
        return float(self.price(self.lin_tok * rows, self.kv_tok * k + self.kv_tok * self.config.num_hidden_layers
                                * rows + self.w_all, self.per_key * k, rows, rows))


def _scales(c: _Costs, measured: dict | None) -> tuple[Callable[[int], float], Callable[[int], float]]:
    """(prefill steps' factor, decode-only steps' factor), each by the step's row count: measured / priced at the
    probe's shapes; 1 without a measurement. A prefill chunk slower than priced (factor > 1) goes to 1 at
    ``CALIBRATED_ROWS`` (log-interpolated): the probe's chunk is small for larger models (95 rows at 1.5B), where
    per-call costs (float32 weights unpacked for torch, small-matmul efficiency) weigh far more than in an engine
    step of thousands of rows, whose rate the calibration measured (at 1B the chunk's factor alone priced runs
    46 % high). A chunk faster than priced (factor < 1) keeps its factor: the calibration's rate is low for this
    model's shapes (it times one small matrix; int8 kernels run wider models' rows faster), and more rows are never
    slower per row (Zen 4, Qwen2.5-0.5B shape, int8: the decay to 1 priced runs 46 % high)."""
    pre, dec = None, []
    for name, seconds in ((measured or {}).get("shapes") or {}).items():
        kind, _, n = name.partition(" ")
        if kind == "prefill":
            pre = (int(n), seconds / c.prefill_chunk(int(n)))
        elif kind == "decode":
            dec.append((int(n), seconds / c.decode(int(n), measured["context"])))

    def prefill(rows: int) -> float:
        if pre is None:
            return 1.0
        n, f = pre
        if n >= CALIBRATED_ROWS or f <= 1.0:
            return f
        return float(np.interp(np.log(max(rows, 1)), [np.log(n), np.log(CALIBRATED_ROWS)], [f, 1.0]))
    dec.sort()
    if not dec:
        return prefill, lambda rows: 1.0
    logs, ratios = np.log([r for r, _ in dec]), np.asarray([f for _, f in dec])

    def decode(rows: int) -> float:
        return float(np.interp(np.log(max(rows, 1)), logs, ratios))
    return prefill, decode


@dataclass
class _Seq:
    pos: int                   # tokens in the KV cache
    prompt: int
    left: int                  # tokens still to generate
    decoding: bool = False


def plan_pricer(info, model_config) -> Callable | None:
    """``predict`` for planned runs on an engine (``EngineInfo``): ``price(plan, max_tokens)`` (``max_tokens`` per
    plan position) -> Prediction, or None (no pricer) when the model's shape is unknown (e.g. a stand-in engine).
    This device's cached calibration at the engine dtype (a quick one measured, about a second, the first time) and
    the tuner's timed steps of this format here (``measured_steps``) are read once, for every plan priced."""
    if model_config is None:
        return None
    # NOTE: lazy: calibrate pulls in torch; the runner (pipeline.run.runner) loads this module without torch
    from costmodel.calibrate import AMX_PROMPT_KERNEL, get_calibration
    # NOTE: int8 engines: the linears run at the int8 kernel's rate (its own calibration), their weights stream
    # at int8's bytes (INT8_WEIGHT_BYTES), KV at kv_cache_dtype's.
    cfg = info.config
    int8 = cfg.quantization == "int8" and str(cfg.device).startswith("cpu")
    cal = get_calibration(cfg.device, "int8" if int8 else cfg.dtype, quick=True)
    # the engine's own int8 kernel runs the linears, whatever other int8 kernel set the machine's peak
    ours = (cal.kernel_flops or {}).get("q8_linear") if int8 else None
    mm_flops, small_flops = (ours["matmul_flops"], ours["small_m_flops"]) if ours else (cal.matmul_flops,
                                                                                         cal.small_m_flops)
    if int8 and RunFormat.of(info).calibration_dtype == "bfloat16":
        # prompt rows on AMX-BF16 tiles: large steps at our tile kernel's rate (oneDNN's bf16 peak where a calibration
        # has not timed it); decode-sized rows keep the int8 kernel's rate
        bf16 = get_calibration(cfg.device, "bfloat16", quick=True)
        amx = (bf16.kernel_flops or {}).get(AMX_PROMPT_KERNEL)
        mm_flops = amx["matmul_flops"] if amx else bf16.matmul_flops
    dtype_bytes = DTYPE_BYTES.get(cfg.dtype, 2)
    kv_bytes = KV_BYTES.get(cfg.kv_cache_dtype, dtype_bytes)
    measured = measured_steps(info)

    def price(plan, max_tokens) -> Prediction | None:
        if not plan.num_requests:
            return None
        return predict(plan.prompt_len, plan.cached, max_tokens, model_config, dtype_bytes,
                       cfg.max_num_batched_tokens, cfg.max_num_seqs, mm_flops, cal.memory_bandwidth,
                       small_flops, kv_dtype_bytes=kv_bytes,
                       weight_dtype_bytes=INT8_WEIGHT_BYTES if int8 else None, measured=measured)
    return price


def measured_steps(info) -> dict | None:
    """This machine's timed engine steps of ``info``'s format (engine.tuning), or None (none timed here, another
    device)."""
    cfg = info.config
    if not str(cfg.device).startswith("cpu"):
        return None
    # NOTE: lazy, as above (engine.tuning imports torch)
    from engine.tuning.candidates import Format
    from engine.tuning.decision import measured_steps as lookup
    return lookup(cfg, info.identity, Format(cfg.quantization, cfg.dtype, cfg.kv_cache_dtype))
