"""Timing the candidates (``engine.tuning.candidates``) on the model's real shapes, within a budget.

Shapes: one prefill chunk at the token budget (at most ``PREFILL_MAX`` tokens, fewer for larger models, so that every
candidate is timed more than once within the budget on two cores: the linears are compute-bound long before that
many rows) and
decode steps at 1, 8, 48 and ``max_num_seqs`` rows, each row over ``DECODE_CONTEXT`` tokens of a KV pool larger
than the last-level cache.

Two phases share the budget (an injectable clock). Formats first (``FORMAT_SHARE`` of it), timed as whole engine
steps (``ModelRunner.execute``: its weights, its KV cache dtype, greedy sampling); after each round a format
``PRUNE_RATIO`` times slower than the best is no longer timed (within the first round already, after each shape,
one ``EARLY_PRUNE_RATIO`` times slower on the shapes timed so far: the time goes to repeating the contenders, whose
first timed call at a shape still pays first-use costs). Then the kernel families of the fastest format, as
their own calls at the same shapes (C and torch on the same tensors), which a whole step would drown in noise.
Each phase warms every candidate up with one untimed call, then times rounds, shape by shape with the candidates
in a rotated order, until ``MAX_ROUNDS`` or its budget: a task whose last time would overrun it is not started.
Weights are loaded (and, the very first time, converted into the weights cache) before the clock starts.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import engine.memory as memory
from engine.dtype_policy import DTYPES, KV_DTYPES
from engine.tuning.candidates import Format

BUDGET_S = 15.0
BUDGET_REF_LAYER_PARAMS = 4e8    # a 0.5B model's decoder linears: the size BUDGET_S is enough for
BUDGET_MAX_SCALE = 4.0
FORMAT_SHARE = 0.8
MAX_ROUNDS = 5
PRUNE_RATIO = 1.5
EARLY_PRUNE_RATIO = 2.5      # within the first round, on the shapes timed so far (the prefill first)
PREFILL_MAX = 1024
PREFILL_MIN = 64
PREFILL_OPS = 2.5e11         # the prefill shape's linear operations at most: about two seconds on two cores
DECODE_ROWS = (1, 8, 48)
DECODE_CONTEXT = 512
POOL_TOKENS = 8192           # the decode rows' KV pool: beyond the last-level cache, as a running batch's is


@dataclass(frozen=True)
class Shape:
    name: str                # "prefill 1024" | "decode 48"
    kind: str                # prefill | decode
    rows: int                # prefill: tokens in the chunk; decode: sequences
    weight: float            # in the score: the prefill counts as much as all decode row counts together


def probe_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 layer_params: int = 0) -> list[Shape]:
    """The shapes for a model whose decoder layers hold ``layer_params`` weights (0: unknown): the prefill chunk
    shrinks with the model (``PREFILL_OPS``, at least ``PREFILL_MIN`` tokens) so that every shape is timed within
    the budget at 0.5-8B too."""
    cap = PREFILL_MAX
    if layer_params > 0:
        cap = max(PREFILL_MIN, min(PREFILL_MAX, int(PREFILL_OPS / (2 * layer_params))))
    p = max(1, min(max_num_batched_tokens, max_model_len, cap))
    rows = sorted({r for r in (*DECODE_ROWS, max_num_seqs) if r <= max_num_seqs})
    return [Shape(f"prefill {p}", "prefill", p, 0.5)] + [Shape(f"decode {r}", "decode", r, 0.5 / len(rows))
                                                        for r in rows]


# The candidates' models are loaded side by side (their steps interleave, so the VM's drift hits every format alike):
# their weights together must fit in this share of the memory available when the tuner starts, the rest left for
# the probe's KV pools and activations and the engine's own load after it. A format whose model would not fit
# beside those kept is not measured (Llama-3.1-8B: float32 weights 30 GB, all three formats' models 53 GB).
MEMORY_SHARE = 0.6


def model_bytes(fmt: Format, mcfg) -> int:
    """About what ``fmt``'s model of ``mcfg`` holds in memory (the KV pool not counted): ``engine.memory``'s."""
    return memory.model_bytes(fmt.quantization, fmt.dtype, mcfg)


def fitting(formats: list[Format], table: Format, mcfg, available: int | None) -> tuple[list[Format], list[Format]]:
    """(measured, left out): the formats whose models (one per quantization and dtype) fit together in
    ``MEMORY_SHARE`` of ``available`` bytes, the table's model first, then the smaller ones; all where
    ``available`` is unknown."""
    if available is None:
        return list(formats), []
    size = {(f.quantization, f.dtype): model_bytes(f, mcfg) for f in formats}
    kept, room = set(), MEMORY_SHARE * available
    for key in sorted(size, key=lambda k: (k != (table.quantization, table.dtype), size[k])):
        if size[key] <= room:
            kept.add(key)
            room -= size[key]
    return ([f for f in formats if (f.quantization, f.dtype) in kept],
            [f for f in formats if (f.quantization, f.dtype) not in kept])


# The int8_prompts family's calls carry at least this many prompt rows: real prompts' chunks carry hundreds to
# thousands, while the probe's whole-step prefill shrinks with the model (64 rows at 4B), where per-call costs weigh
# far more (Qwen3-4B on the AMX Xeon: at 64 rows the AMX tiles' per-call work made the dot products look 2.8x
# faster, and the engine's 2,000-row prompts then ran through them at half the tiles' rate)
PROMPT_ROWS = 512


def family_rows(family: str, s: Shape) -> int:
    """The rows a family's calls at shape ``s`` carry: the shape's own, or ``PROMPT_ROWS`` at least for the int8
    linears' prompt rows (``decision._family`` scales their difference to the shape's rows)."""
    return max(s.rows, PROMPT_ROWS) if family == "int8_prompts" and s.kind == "prefill" else s.rows


def budget_for(layer_params: int) -> float:
    """The probe's budget for a model whose decoder linears hold ``layer_params`` weights: ``BUDGET_S`` up to a
    0.5B model, growing with the weights (at most ``BUDGET_MAX_SCALE`` times): a step's time grows with them, and a
    budget that ends inside the first round keeps only first calls, which pay first-use costs (1.5B: a 95-row
    prefill timed once at 2.5x its engine rate, the plan's prediction 62 % high)."""
    return BUDGET_S * min(BUDGET_MAX_SCALE, max(1.0, layer_params / BUDGET_REF_LAYER_PARAMS))


def layer_params(mcfg) -> int:
    """The decoder layers' linear weights: what one token's prefill multiplies by (twice, in operations)."""
    q, kv = mcfg.num_attention_heads * mcfg.head_dim, mcfg.num_key_value_heads * mcfg.head_dim
    h = mcfg.hidden_size
    return mcfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * mcfg.intermediate_size)


@dataclass
class Task:
    candidate: str           # a format's name, or "<family>:<impl>@<dtype>"
    shape: str
    fn: Callable[[], object]


@dataclass
class Measurement:
    times: dict[tuple[str, str], list[float]] = field(default_factory=dict)   # (candidate, shape) -> seconds
    rounds: int = 0          # complete timed rounds
    elapsed_s: float = 0.0
    stopped: str = "rounds"  # rounds | budget
    pruned: list[str] = field(default_factory=list)      # candidates no longer timed after some round

    def best(self, candidate: str, shape: str) -> float | None:
        t = self.times.get((candidate, shape))
        return min(t) if t else None


def measure(tasks: list[Task], clock: Callable[[], float] = time.perf_counter, budget_s: float = BUDGET_S,
            max_rounds: int = MAX_ROUNDS, prune: Callable[[Measurement], set[str]] | None = None,
            early_prune: Callable[[Measurement], set[str]] | None = None,
            warmup_shape: str | None = None) -> Measurement:
    """One untimed call of each candidate (at ``warmup_shape``, else its first task), then timed rounds: shape by
    shape (all candidates of one shape close together in time), the candidates rotated each round. ``early_prune``:
    within the first round, after each shape, the candidates to time no more (far slower already). ``prune``:
    after each round, the candidates to time no more."""
    m = Measurement(times={(t.candidate, t.shape): [] for t in tasks})
    start = clock()
    last: dict[tuple[str, str], float] = {}

    def run(t: Task, timed: bool) -> bool:
        key, now = (t.candidate, t.shape), clock()
        if now - start + last.get(key, 0.0) > budget_s:
            return False
        t.fn()
        last[key] = clock() - now
        if timed:
            m.times[key].append(last[key])
        return True

    by_shape: dict[str, list[Task]] = {}
    warmup: dict[str, Task] = {}
    for t in tasks:
        by_shape.setdefault(t.shape, []).append(t)
        if t.candidate not in warmup or t.shape == warmup_shape:
            warmup[t.candidate] = t
    done = all(run(t, False) for t in warmup.values())
    for rnd in range(1, max_rounds + 1):
        for group in by_shape.values():
            live = [t for t in group if t.candidate not in m.pruned]
            k = rnd % max(len(live), 1)
            done = done and all(run(t, True) for t in live[k:] + live[:k])
            if done and rnd == 1 and early_prune:    # within the first round, after each shape: the far slower
                m.pruned += sorted(early_prune(m) - set(m.pruned))    # go, so the rest get more rounds
        if not done:
            break
        m.rounds = rnd
        m.pruned += sorted((prune(m) if prune else set()) - set(m.pruned))
    m.elapsed_s, m.stopped = clock() - start, "rounds" if done else "budget"
    return m


def score(step_s: dict[str, float], shapes: list[Shape]) -> float:
    """Weighted geometric mean of step times over ``shapes`` (those in ``step_s``), weights renormalized."""
    used = [s for s in shapes if s.name in step_s]
    total = sum(s.weight for s in used)
    return math.exp(sum(s.weight * math.log(max(step_s[s.name], 1e-9)) for s in used) / total)


def format_scores(formats: list[Format], shapes: list[Shape], m: Measurement) -> dict[Format, float]:
    """Each format's ``score`` on the shapes every live (not dropped) format was timed at ({} when there is none);
    a dropped format's on those of them it was timed at before it was dropped (shown, never chosen)."""
    live = [f for f in formats if f.name not in m.pruned] or formats
    common = [s.name for s in shapes if all(m.best(f.name, s.name) is not None for f in live)]
    out = {}
    for f in formats:
        mine = [s for s in common if m.best(f.name, s) is not None]
        if mine:
            out[f] = score({s: m.best(f.name, s) for s in mine}, shapes)
    return out


# A format whose KV cache takes fewer bytes a value is kept over the best-scored one that differs from it only in its
# KV cache dtype while it scores within this margin of it: the probe's contexts are short (decode rows over
# DECODE_CONTEXT tokens, a prefill from an empty cache), where the cache's bytes hardly count and two KV dtypes time
# within the noise, while at real prompts' lengths they set the formats apart (Qwen2.5-0.5B on the AMX Xeon: the
# probe put kv-float32 2 % ahead, and on 1,900-token prompts it ran 1.13-1.65x slower than kv-bfloat16, whose cache
# the AMX attention kernels read; docs/perf/xeon-amx.md). The smaller cache also holds twice the tokens.
KV_MARGIN = 0.10


def best_scored(scores: dict[Format, float], m: Measurement) -> Format:
    """The best-scored format that was not dropped."""
    return min((f for f in scores if f.name not in m.pruned), key=scores.get)


def fastest(scores: dict[Format, float], m: Measurement) -> Format:
    """``best_scored``, or one like it with a smaller KV cache within ``KV_MARGIN``."""
    best = best_scored(scores, m)

    def kv_bytes(f: Format) -> int:
        return KV_DTYPES[f.kv_cache_dtype].itemsize
    smaller = [f for f in scores if f.name not in m.pruned
               and (f.quantization, f.dtype) == (best.quantization, best.dtype)
               and kv_bytes(f) < kv_bytes(best) and scores[f] <= scores[best] * (1 + KV_MARGIN)]
    return min(smaller, key=lambda f: (kv_bytes(f), scores[f])) if smaller else best


def _slow(formats: list[Format], shapes: list[Shape], ratio: float = PRUNE_RATIO
          ) -> Callable[[Measurement], set[str]]:
    def prune(m: Measurement) -> set[str]:
        scores = format_scores(formats, shapes, m)
        return {f.name for f, v in scores.items() if v > ratio * min(scores.values())}
    return prune


# ---- building the tasks on a real model ---------------------------------------------------------------------
def run_probe(cfg, source, mcfg, identity: str, formats: list[Format], families: dict[Format, dict],
              fallback: Format, clock: Callable[[], float] = time.perf_counter,
              budget_s: float = BUDGET_S) -> tuple[list[Shape], Measurement]:
    """Load each format's model (from the weights cache; converted into it the first time), then ``measure`` the
    formats and the kernel families (``families``: format -> {family: implementations}) of the fastest one
    (``fallback`` when no shape was timed for every format). The two phases' times are merged."""
    from engine.attention.selector import get_backend
    from engine.loader import load_model

    backend = get_backend(cfg.attention_backend, "cpu")
    block_size = backend.block_size_for(cfg.block_size)
    max_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    shapes = probe_shapes(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len, layer_params(mcfg))
    models = {}
    for f in formats:
        if (f.quantization, f.dtype) not in models:
            models[(f.quantization, f.dtype)] = load_model(source, mcfg, DTYPES[f.dtype], "cpu", identity,
                                                           f.quantization)[0]
    tasks = [t for f in formats
             for t in format_tasks(f, models[(f.quantization, f.dtype)], mcfg, shapes, block_size, backend)]
    warm = shapes[min(1, len(shapes) - 1)].name                # the cheapest: decode at one row
    m = measure(tasks, clock, budget_s * FORMAT_SHARE, prune=_slow(formats, shapes), warmup_shape=warm,
                early_prune=_slow(formats, shapes, EARLY_PRUNE_RATIO))
    scores = format_scores(formats, shapes, m)
    best = fastest(scores, m) if scores else fallback
    model = models[(best.quantization, best.dtype)]
    tasks = [t for family, impls in families.get(best, {}).items()
             for t in (attention_tasks(best, impls, model, mcfg, shapes, block_size) if family == "attention"
                       else family_tasks(family, impls, model, shapes))]
    if tasks:
        fam = measure(tasks, clock, budget_s - m.elapsed_s, warmup_shape=warm)
        m.times.update(fam.times)
        m.elapsed_s += fam.elapsed_s
    return shapes, m


def format_tasks(fmt: Format, model, mcfg, shapes: list[Shape], block_size: int, backend) -> list[Task]:
    """Whole engine steps of ``model`` with a KV pool of the format's dtype, one task per shape."""
    from engine.model_runner import ModelRunner, bind_kv_caches
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler_output import ScheduledRequest, SchedulerOutput

    ctx = max(1, min(DECODE_CONTEXT, mcfg.max_position_embeddings - 1))
    per_row = -(-(ctx + 1) // block_size)
    prefill = max((s.rows for s in shapes if s.kind == "prefill"), default=1)
    blocks = max(-(-prefill // block_size), -(-POOL_TOKENS // block_size), per_row) + 1
    kv_dtype = KV_DTYPES[fmt.kv_cache_dtype]
    runner = ModelRunner(model, blocks, block_size, kv_dtype, torch.device("cpu"), backend)
    for pool in (p for kv in runner.kv_caches for p in kv):       # real pages with real values, not zero pages
        _fill(pool)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    tasks = []
    for s in shapes:
        if s.kind == "prefill":
            reqs = {"p": Request("p", [(7 * i + 3) % mcfg.vocab_size for i in range(s.rows)], greedy)}
            sched = [ScheduledRequest("p", reqs["p"].prompt_token_ids, 0, list(range(-(-s.rows // block_size))),
                                      True, True)]
        else:
            reqs = {f"d{i}": Request(f"d{i}", [1] * ctx, greedy) for i in range(s.rows)}
            sched = [ScheduledRequest(f"d{i}", [(11 * i + 5) % mcfg.vocab_size], ctx,
                                      [(i * per_row + j) % (blocks - 1) for j in range(per_row)], True, False)
                     for i in range(s.rows)]

        def step(out=SchedulerOutput(sched), reqs=reqs):
            bind_kv_caches(model, runner.kv_caches, backend)     # formats that share a model share its layers
            runner.execute(out, reqs)
        tasks.append(Task(fmt.name, s.name, step))
    return tasks


def _fill(pool: torch.Tensor) -> None:
    if pool.dtype == torch.int8:                 # int8_kv's bytes: zero quants and scales
        pool.fill_(0)
        return
    flat = pool.view(pool.shape[0], -1)
    flat.copy_((torch.randn(1, flat.shape[1]) * 0.5).to(pool.dtype).expand_as(flat))


def family_tasks(family: str, impls: tuple[str, ...], model, shapes: list[Shape]) -> list[Task]:
    """One layer's calls of ``family`` (elementwise: rms_norm, residual_norm, qk_norm_rope, glu; lm_head: the float
    head's logits at the sampled rows; linears: the float linears at the decode rows) at each shape, per
    implementation, on the same tensors."""
    from engine.models.layers import RMSNorm
    from engine.models.ops import CpuKernelOps

    if family == "linears":
        return linears_tasks(impls, model, shapes)
    if family == "int8_prompts":
        return int8_prompts_tasks(impls, model, shapes)

    dtype = model.model.norm.weight.dtype             # the activations' (a packed head's weight is bf16)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    hidden = model.config.hidden_size
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm) and m.weight.shape[0] == hidden]
    n1, n2 = norms[0], norms[min(1, len(norms) - 1)]
    head = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    vocab = head.num_embeddings if model.config.tie_word_embeddings else head.out_features
    if family == "lm_head":
        head_weights = _head_weights(model, head, dtype)
    g = torch.Generator().manual_seed(0)
    tasks = []
    for s in shapes:
        rows = s.rows if family == "elementwise" or s.kind == "decode" else 1   # a prefill samples one row
        x, h = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
        if family == "elementwise":
            qkv = torch.randn(rows, attn.q_size + 2 * attn.kv_size, generator=g).to(dtype)
            cos, sin = attn.rotary.cos_sin(torch.arange(rows), dtype)
            gate_up = torch.randn(rows, 2 * mlp.down_proj.in_features, generator=g).to(dtype)
        for impl in impls:
            ops = CpuKernelOps(kernels={family: impl})
            if family == "lm_head":         # "c" reads the head as the engine holds it; torch as torch would
                w = head_weights[impl]

                def fn(ops=ops, x=x, w=w):
                    return ops.float_logits(x, w, vocab)
            else:
                def fn(ops=ops, x=x, h=h, qkv=qkv, cos=cos, sin=sin, gate_up=gate_up, rows=rows):
                    ops.rms_norm(x, n1)
                    ops.residual_norm(x, h, n1, n2)
                    q = qkv[:, :attn.q_size].view(rows, attn.num_heads, attn.head_dim)
                    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(rows, attn.num_kv_heads, attn.head_dim)
                    ops.qk_norm_rope(q, k, attn.q_norm, attn.k_norm, cos, sin)
                    if mlp.fused_act:
                        ops.glu(gate_up, mlp)
            tasks.append(Task(f"{family}:{impl}@{dtype_name(dtype)}", s.name, fn))
    return tasks


def _head_weights(model, head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's weight per ``lm_head`` implementation: "c" as the engine holds it under "c" (select_ops.pack_head:
    a tied float32 head as panels), "torch" as torch would ([vocab, hidden] in ``dtype``)."""
    from engine.models.select_ops import pack_head
    packed = getattr(head, "packed", False)
    pack_head(model, True)
    c = head.weight.detach()
    pack_head(model, False)
    plain = head.weight.detach().to(dtype)
    pack_head(model, packed)
    return {"c": c, "torch": plain}


def linears_tasks(impls: tuple[str, ...], model, shapes: list[Shape]) -> list[Task]:
    """The ``linears`` family: one layer's float linears (QKV, output, gate-up, down) at each decode shape's rows,
    all of them output positions ("c": the C few-row kernel; "torch": torch's padded matmul). Prefill rows are
    torch's under both, so prefill shapes are not timed."""
    from engine.models.linear import Linear, kernel_weight, split_linear

    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if type(m) is Linear]
    if not linears:
        return []
    # "c": the weights as the engine holds them under "c" (panels); "torch": as torch would hold them ([out, in])
    plain = [m.compute_weight().detach() for m in linears]
    weights = {"c": [m.weight.detach() if m.packed else kernel_weight(w) for m, w in zip(linears, plain)],
               "torch": plain}
    dtype = weights["torch"][0].dtype
    g = torch.Generator().manual_seed(0)
    tasks = []
    for s in (s for s in shapes if s.kind == "decode"):
        xs = [torch.randn(s.rows, m.in_features, generator=g).to(dtype) for m in linears]
        for impl in impls:
            def fn(xs=xs, ws=weights[impl], out=s.rows if impl == "c" else 0):
                for m, x, w in zip(linears, xs, ws):
                    split_linear(x, w, m.bias, out, m.pad_to, m.tile, m.out_features)
            tasks.append(Task(f"linears:{impl}@{dtype_name(dtype)}", s.name, fn))
    return tasks


def int8_prompts_tasks(impls: tuple[str, ...], model, shapes: list[Shape]) -> list[Task]:
    """The ``int8_prompts`` family: one layer's int8 linears (QKV, output, gate-up with its GLU, down) at each prefill
    shape's rows (``PROMPT_ROWS`` at least), all of them prompt positions ("int8": the int8 dot products; "bf16":
    AMX-BF16 tiles). Output rows take the int8 dot products under both, so decode shapes are not timed."""
    from engine.models.linear import StepRows
    from engine.quant.int8 import Int8GluLinear, Int8Linear

    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if type(m) in (Int8Linear, Int8GluLinear)]
    if not linears:
        return []
    dtype = model.model.norm.weight.dtype             # the activations'
    g = torch.Generator().manual_seed(0)
    tasks = []
    for s in (s for s in shapes if s.kind == "prefill"):
        xs = [torch.randn(family_rows("int8_prompts", s), m.in_features, generator=g).to(dtype) for m in linears]
        for impl in impls:
            rows = StepRows() if impl == "bf16" else None        # spec 0: every row a prompt row

            def fn(xs=xs, rows=rows):
                saved = [m.step_rows for m in linears]
                try:
                    for m, x in zip(linears, xs):
                        m.step_rows = rows
                        m.glu(x, "silu") if isinstance(m, Int8GluLinear) else m.linear(x)
                finally:
                    for m, r in zip(linears, saved):
                        m.step_rows = r
            tasks.append(Task(f"int8_prompts:{impl}@{dtype_name(dtype)}", s.name, fn))
    return tasks


def attention_tasks(fmt: Format, impls: tuple[str, ...], model, mcfg, shapes: list[Shape],
                    block_size: int) -> list[Task]:
    """The ``attention`` family: ``fmt``'s whole prefill step with each prefill implementation (decode attention is
    the same C kernel in both, so only the prefill shape is timed)."""
    from engine.attention.torch_backend import TorchAttentionBackend
    prefill = [s for s in shapes if s.kind == "prefill"]
    return [dataclasses.replace(t, candidate=f"attention:{impl}@{fmt.dtype}")
            for impl in impls
            for t in format_tasks(fmt, model, mcfg, prefill, block_size, TorchAttentionBackend(prefill=impl))]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["BUDGET_S", "budget_for", "MAX_ROUNDS", "Shape", "Task", "Measurement", "probe_shapes", "layer_params",
           "measure", "score", "format_tasks", "fitting", "model_bytes", "family_rows", "family_tasks", "linears_tasks",
           "int8_prompts_tasks", "attention_tasks"]
