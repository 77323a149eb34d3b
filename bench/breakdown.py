"""Where a batchgen system's engine time goes (``batchgen bench --breakdown``): wall time per kernel family and
step kind, with the linears' and the LM head's operation rate.

    with kernel_breakdown() as bd:
        llm.generate(...)
    print("\\n".join(bd.format("batchgen-int8")))

For the run, the engine's hot calls are wrapped with timers (module and class attributes replaced, restored on
exit): the int8 and float linears, the LM head (greedy argmax or logits), the attention backend (its KV write,
packing and kernels), the norms and the unfused GLU. Steps are split into those with prompt work ("prefill",
which may also carry decode rows) and decode-only steps; "other" is a step's time outside the timed families
(embedding, RoPE tables, Python glue). A timed call inside another (the LM head's matmul) counts once, in the
outermost family. Overhead: one ``perf_counter`` pair per call, ~100 calls per decode step (well under 1 %).

Rates: linears count 2·M·K·N operations per call (integer or float, as executed); the LM head 2·rows·hidden·vocab.
Compare them with ``batchgen calibrate`` (and ``--dtype int8``) for how close each family came to the machine.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

FAMILIES = ("linears", "LM head", "attention", "norms", "activations", "other")
KINDS = ("prefill", "decode")


@dataclass
class Breakdown:
    """Seconds, calls and operations per (step kind, family); seconds and count of the steps per kind."""
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    ops: dict[tuple[str, str], float] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, family: str, seconds: float, ops: float) -> None:
        key = (kind, family)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + 1
        self.ops[key] = self.ops.get(key, 0.0) + ops

    def other(self, kind: str) -> float:
        """A kind's step time outside every timed family."""
        timed = sum(v for (k, f), v in self.seconds.items() if k == kind)
        return max(self.step_seconds.get(kind, 0.0) - timed, 0.0)

    def to_dict(self) -> dict:
        out = {}
        for kind in KINDS:
            if not self.steps.get(kind):
                continue
            fam = {f: {"s": self.seconds[(kind, f)], "calls": self.calls[(kind, f)],
                       "ops_per_s": self.ops[(kind, f)] / self.seconds[(kind, f)]
                       if self.ops[(kind, f)] and self.seconds[(kind, f)] > 0 else None}
                   for f in FAMILIES if (kind, f) in self.seconds}
            fam["other"] = {"s": self.other(kind), "calls": None, "ops_per_s": None}
            out[kind] = {"steps": self.steps[kind], "step_s": self.step_seconds[kind], "families": fam}
        return out

    def format(self, label: str) -> list[str]:
        return format_breakdown(label, self.to_dict())


def format_breakdown(label: str, d: dict) -> list[str]:
    """A system's breakdown (``Breakdown.to_dict``) as table lines: seconds, share of the kind's step time, rate."""
    kinds = [k for k in KINDS if k in d]
    if not kinds:
        return []
    head = f"  {'family':<12}" + "".join(f" {k + ' s':>11} {'share':>6} {'rate':>11}" for k in kinds)
    counts = ", ".join(f"{d[k]['steps']} {k} steps" for k in kinds)
    lines = [f"where {label}'s step time went ({counts}):", head]
    for fam in FAMILIES:
        if not any(fam in d[k]["families"] for k in kinds):
            continue
        row = f"  {fam:<12}"
        for k in kinds:
            e = d[k]["families"].get(fam)
            if e is None:
                row += f" {'-':>11} {'':>6} {'':>11}"
                continue
            share = e["s"] / d[k]["step_s"] if d[k]["step_s"] else 0.0
            rate = f"{e['ops_per_s'] / 1e9:.0f} GOP/s" if e["ops_per_s"] else ""
            row += f" {e['s']:11.2f} {share:6.0%} {rate:>11}"
        lines.append(row)
    lines.append(f"  {'steps':<12}" + "".join(f" {d[k]['step_s']:11.2f} {'100%':>6} {'':>11}" for k in kinds))
    return lines


def _panel_ops(args, kwargs) -> float:
    """panel_linear(x, panels, n): 2·M·K·n."""
    x, n = args[0], args[2]
    return 2.0 * x.numel() * n


def _linear_ops(args, kwargs) -> float:
    """F.linear(x, w) / q8_linear(x, w, sw, ws, n, ...) / q8_linear_amx(x, w, sw, n, ...): 2·M·K·N."""
    x = args[0]
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if len(args) >= 5 and isinstance(args[4], int):         # qlinear.q8_linear*: n is the fifth argument
        n = args[4]
    elif len(args) >= 4 and isinstance(args[3], int):       # qlinear.q8_linear_amx: the fourth
        n = args[3]
    else:
        w = args[1] if len(args) > 1 else kwargs["weight"]
        n = w.shape[0]
    return 2.0 * m * k * n


def _head_ops(args, kwargs) -> float:
    """CausalLM.greedy_tokens / compute_logits(self, hidden): 2·rows·hidden·vocab."""
    model, hidden = args[0], args[1]
    cfg = model.config
    return 2.0 * (hidden.numel() // hidden.shape[-1]) * cfg.hidden_size * cfg.vocab_size


class _Clock:
    def __init__(self, bd: Breakdown):
        self.bd, self.kind, self.depth = bd, "prefill", 0

    def timed(self, fn: Callable, family: str, ops: Callable | None = None) -> Callable:
        """fn wrapped: its wall time (and ops(args, kwargs), the call's operations) added to `family`."""
        clock = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if clock.depth:                     # inside another timed call: counted there
                return fn(*args, **kwargs)
            clock.depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                clock.depth -= 1
                clock.bd.add(clock.kind, family, dt, ops(args, kwargs) if ops else 0.0)
        return wrapper

    def step(self, fn: Callable) -> Callable:
        clock = self

        @functools.wraps(fn)
        def wrapper(runner, out, requests):
            clock.kind = "prefill" if out.num_prefill_tokens else "decode"     # the scheduler's own count
            t = time.perf_counter()
            try:
                return fn(runner, out, requests)
            finally:
                bd = clock.bd
                bd.step_seconds[clock.kind] = bd.step_seconds.get(clock.kind, 0.0) + time.perf_counter() - t
                bd.steps[clock.kind] = bd.steps.get(clock.kind, 0) + 1
        return wrapper


@contextlib.contextmanager
def kernel_breakdown() -> Iterator[Breakdown]:
    """Time the engine's kernel families for the duration of the block (one engine at a time in this process)."""
    # NOTE: lazy: torch and the engine load only for --breakdown (bench/table.py imports this module for its
    # formatting, and the CLI lists systems without torch)
    import torch.nn.functional as F

    import engine.kernels.elementwise as elementwise
    import engine.kernels.qlinear as qlinear
    import engine.models.linear as linear
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_runner import ModelRunner
    from engine.models.layers import CausalLM

    bd = Breakdown()
    clock = _Clock(bd)
    patches: list[tuple[object, str, object]] = []

    def patch(owner, name: str, new) -> None:
        patches.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, new)

    try:
        patch(ModelRunner, "execute", clock.step(ModelRunner.execute))
        for name in ("q8_linear", "q8_linear_glu", "q8_linear_amx"):
            patch(qlinear, name, clock.timed(getattr(qlinear, name), "linears", _linear_ops))
        patch(F, "linear", clock.timed(F.linear, "linears", _linear_ops))
        patch(linear, "small_m_linear", clock.timed(linear.small_m_linear, "linears", _linear_ops))
        patch(linear, "panel_linear", clock.timed(linear.panel_linear, "linears", _panel_ops))
        for name in ("greedy_tokens", "compute_logits"):
            patch(CausalLM, name, clock.timed(getattr(CausalLM, name), "LM head", _head_ops))
        patch(TorchAttentionBackend, "forward", clock.timed(TorchAttentionBackend.forward, "attention"))
        for name in ("rms_norm", "add_rms_norm"):
            patch(elementwise, name, clock.timed(getattr(elementwise, name), "norms"))
        patch(elementwise, "glu", clock.timed(elementwise.glu, "activations"))
        yield bd
    finally:
        for owner, name, old in reversed(patches):
            setattr(owner, name, old)


__all__ = ["FAMILIES", "Breakdown", "format_breakdown", "kernel_breakdown"]


MATMUL_FAMILIES = ("linears", "LM head")


def matmul_bound(float_d: dict, int8_d: dict, kind: str | None, target: float) -> dict | None:
    """What the int8 path's matmuls (linears + LM head) would have to reach for ``target``x the float path's step
    time, everything else as measured in both runs (``Breakdown.to_dict``s). kind: "decode", or None for all steps.

    {"ratio": measured step-time ratio, "matmul_only": the ratio if nothing but the matmuls took time (no faster
    attention, norms or glue can lift the ratio past it), "needed_speedup": int8 matmul time that ``target``
    needs, as a multiple of the float path's matmul speed (None: unreachable, the rest alone is too slow),
    "needed_rate": the int8 matmuls' operations per second at that time}; None without both breakdowns."""
    kinds = [kind] if kind else list(KINDS)

    def split(d: dict) -> tuple[float, float, float]:
        mm = ops = total = 0.0
        for k in kinds:
            if k not in d:
                continue
            total += d[k]["step_s"]
            for fam in MATMUL_FAMILIES:
                e = d[k]["families"].get(fam)
                if e:
                    mm += e["s"]
                    ops += (e["ops_per_s"] or 0.0) * e["s"]
        return mm, total - mm, ops

    f_mm, f_rest, _ = split(float_d)
    q_mm, q_rest, q_ops = split(int8_d)
    if not (f_mm > 0 and q_mm > 0):
        return None
    need = (f_mm + f_rest) / target - q_rest
    return {"ratio": (f_mm + f_rest) / (q_mm + q_rest), "matmul_only": f_mm / q_mm,
            "needed_speedup": f_mm / need if need > 0 else None,
            "needed_rate": q_ops / need if need > 0 else None}


def format_bound(label: str, float_label: str, float_d: dict, int8_d: dict,
                 targets: tuple[tuple[str | None, float], ...] = ((None, 1.8), ("decode", 2.0))) -> list[str]:
    """The ``matmul_bound`` lines for each (kind, target)."""
    lines = []
    for kind, target in targets:
        b = matmul_bound(float_d, int8_d, kind, target)
        if b is None:
            continue
        what = "decode-only steps" if kind == "decode" else "all steps"
        need = (f"{target:.1f}x with the rest as measured needs int8's matmuls at {b['needed_speedup']:.2f}x "
                f"{float_label}'s speed ({b['needed_rate'] / 1e9:.0f} GOP/s)" if b["needed_speedup"] else
                f"{target:.1f}x is out of reach even with int8 matmuls taking no time")
        lines.append(f"{label} vs {float_label}, {what}: {b['ratio']:.2f}x; matmuls alone {b['matmul_only']:.2f}x "
                     f"(the ratio if nothing else took time); {need}")
    return lines
