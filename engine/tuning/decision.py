"""The tuner's decision for one model on one machine: made once by measuring (``engine.tuning.probe``), cached as
JSON beside the weights cache (``<cache root>/tuning/``), recorded in ``EngineInfo.tuning`` and so in the manifest.

* Key: the CPU's model name and flags, its core count and torch's thread count, the torch version, the kernel
  build (``engine.kernels.library.build_id``), the model's identity, and which of quantization / dtype /
  kv_cache_dtype were ``auto``. Anything else changed means another file: measured again.
* A file that does not parse, has another format or holds another key is rebuilt (measured again when the engine
  may measure; planning and validation only read).
* Explicit settings win: they are fixed in every candidate, and with all three explicit nothing is tuned.
* ``BATCHGEN_TUNE=off``: no decision is read or measured; the tables (``candidates.table_choice``) decide, as they
  do on CUDA. The tests set it (tests/conftest.py) so that tiny models never pay the probe.
* The choice: the fastest format within the quality bar (``probe.score``: the weighted geometric mean of its step
  times), then per kernel family the implementation whose calls, swapped into that format's steps, score best.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import engine.kernels.library as library
import engine.tuning.probe as probe
from engine.cache_root import cache_root
from engine.config import PINNABLE, EngineConfig
from engine.dtype_policy import DtypeChoice
from engine.errors import ConfigError
from engine.kernels.cpu_features import cpu_model_name, cpu_signature
from engine.kernels.gemm import SMALL_M_MAX
from engine.memory import available_memory_bytes
from engine.quant.policy import QuantChoice
from engine.tuning.candidates import Format, KernelFacts, family_options, format_candidates

log = logging.getLogger("batchgen.engine")

FORMAT = 7        # 2: the attention family joined the measured kernel families; 3: the linears family;
# 4: int8 weights a candidate for float checkpoints too; 5: the int8_prompts family (AMX-BF16 prompt rows);
# 6: a smaller KV cache kept within probe.KV_MARGIN; 7: int8 prompt rows timed at probe.PROMPT_ROWS at least,
# formats whose weights do not fit beside the others' left out
# (decisions measured without a change are measured again)
REQUESTED = PINNABLE          # the fields the tuner decides where they are auto (engine.config)
_FIELD_TYPES = {"key": (dict,), "choice": (dict,), "reason": (str,), "candidates": (list,), "kernels": (dict,),
                "shapes": (list,), "rounds": (int,), "stopped": (str,), "pruned": (list,), "elapsed_s": (int, float),
                "budget_s": (int, float), "measured_at": (int, float), "load_average": (int, float)}


def enabled() -> bool:
    """``BATCHGEN_TUNE`` (default on): off, 0, false or no -> the tables decide."""
    return os.environ.get("BATCHGEN_TUNE", "on").strip().lower() not in ("off", "0", "false", "no")


def tunable(cfg, device_type: str) -> str | None:
    """None when ``cfg`` is tuned here; else why not (the table decides)."""
    if not enabled():
        return "BATCHGEN_TUNE=off: the tables decide"
    if device_type != "cpu":
        return f"{device_type}: not tuned; the tables decide"
    if all(getattr(cfg, f) != "auto" for f in REQUESTED):
        return "quantization, dtype and kv_cache_dtype all explicit: nothing to tune"
    return None


def key_fields(cfg, identity: str) -> dict:
    return {"format": FORMAT, "cpu": cpu_model_name(),
            "cpu_flags": hashlib.sha256(cpu_signature().encode()).hexdigest()[:16], "cores": os.cpu_count(),
            "threads": cfg.num_threads or torch.get_num_threads(), "torch": torch.__version__,
            "kernels": library.build_id(), "model": identity, "requested": {f: getattr(cfg, f) for f in REQUESTED}}


def cache_path(fields: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "tuning" / f"{digest}.json"


@dataclass
class Decision:
    key: dict
    choice: dict                # quantization, dtype, kv_cache_dtype, kernels {family: impl}
    reason: str
    candidates: list = field(default_factory=list)   # per format: name, fields, quality, times_ms, score_ms
    kernels: dict = field(default_factory=dict)      # family -> {impl: est. score_ms, "chosen": impl, "why": ...}
    shapes: list = field(default_factory=list)
    rounds: int = 0             # complete timed rounds of the formats
    stopped: str = ""           # rounds | budget
    pruned: list = field(default_factory=list)       # formats no longer timed once PRUNE_RATIO x the best
    elapsed_s: float = 0.0
    budget_s: float = probe.BUDGET_S
    measured_at: float = 0.0
    load_average: float = 0.0   # the 1-minute load average as the probe started: a busy machine measures poorly
    source: str = "measured"    # measured | cached (not stored)
    path: str = ""              # (not stored)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["source"], d["path"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        names = {f.name for f in dataclasses.fields(cls)} - {"source", "path"}
        if set(d) != names:
            raise ValueError(f"fields {sorted(set(d) ^ names)} differ")
        for name, types in _FIELD_TYPES.items():
            if not isinstance(d[name], types) or isinstance(d[name], bool):
                raise ValueError(f"{name} must be {' or '.join(t.__name__ for t in types)}, got {d[name]!r:.80}")
        try:
            EngineConfig.check_choice(d["choice"])
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if not isinstance(d["choice"].get("kernels"), dict):
            raise ValueError(f"choice.kernels must be a mapping of kernel family to implementation, got "
                             f"{d['choice'].get('kernels')!r:.80}")
        return cls(**d)

    @property
    def format(self) -> Format:
        return Format(*(self.choice[f] for f in REQUESTED))

    def choices(self) -> tuple[QuantChoice, DtypeChoice, str, dict]:
        """(quantization, dtype, KV cache dtype, kernels) as the engine's setup takes them."""
        why = f"tuned ({self.source}): {self.reason}"
        return (QuantChoice(self.choice["quantization"], why), DtypeChoice(self.choice["dtype"], why),
                self.choice["kv_cache_dtype"], dict(self.choice["kernels"]))

    def record(self) -> dict:
        """``EngineInfo.tuning``: the measured candidates with their times, the choice and the reason."""
        return {"mode": "tuned", "source": self.source, "path": self.path, **self.to_dict()}


def table_record(reason: str, pending: bool = False) -> dict:
    """``EngineInfo.tuning`` where the tables decided; ``pending``: this config is tuned here, but no decision is
    cached yet (an engine's load would measure one)."""
    return {"mode": "table", "reason": reason, **({"pending": True} if pending else {})}


def load(path: Path, fields: dict) -> Decision | None:
    """The cached decision, or None when absent; a corrupt or mismatched file is deleted (and None returned)."""
    if not path.is_file():
        return None
    try:
        dec = Decision.from_dict(json.loads(path.read_text()))
        if dec.key != fields:
            raise ValueError("its key is another machine's or model's")
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("tuning decision %s is unusable (%s); rebuilding it", path, e)
        path.unlink(missing_ok=True)
        return None
    dec.source, dec.path = "cached", str(path)
    return dec


def store(path: Path, dec: Decision) -> None:
    """Atomically (a private temporary file, then ``os.replace``); a cache that cannot be written is logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(dec.to_dict(), f, indent=1)
        os.replace(tmp, path)
        dec.path = str(path)
    except OSError as e:
        log.warning("could not write the tuning decision %s (%s); the next load measures again", path, e)


def decide(fields: dict, formats: list[Format], families: dict[Format, dict], shapes: list[probe.Shape],
           m: probe.Measurement, table: Format, num_layers: int) -> Decision:
    """The fastest format on the shapes every live format was timed at, then each kernel family's implementation."""
    scores = probe.format_scores(formats, shapes, m)
    steps = {f: {s.name: m.best(f.name, s.name) for s in shapes if m.best(f.name, s.name) is not None}
             for f in formats}
    cands = [{"name": f.name, **dataclasses.asdict(f), "quality": f.quality()[1], "table": f == table,
              "times_ms": {s: round(t * 1e3, 3) for s, t in steps[f].items()},
              "score_ms": round(scores[f] * 1e3, 3) if f in scores else None, "dropped": f.name in m.pruned}
             for f in formats]
    if not scores:
        best, reason = table, (f"the probe's budget ran out before every candidate was timed on one shape: the "
                               f"table's {table.name}")
    else:
        best = probe.fastest(scores, m)
        def ratio(f: Format) -> float:      # on the shapes both were timed at (a dropped format: fewer)
            both = [s for s in steps[f] if s in steps[best]]
            return (probe.score({s: steps[f][s] for s in both}, shapes)
                    / probe.score({s: steps[best][s] for s in both}, shapes))
        others = ", ".join(f"{f.name}{' (the table)' if f == table else ''} {ratio(f):.2f}x"
                           f"{' (dropped)' if f.name in m.pruned else ''}"
                           for f in sorted(scores, key=ratio) if f != best)
        also = " (the table's choice too)" if best == table else ""
        top = probe.best_scored(scores, m)
        what = (f"fastest of {len(formats)} formats" if top == best else
                f"within {probe.KV_MARGIN:.0%} of {top.name} with a smaller KV cache (the probe's contexts are "
                f"short; at real prompt lengths the cache's bytes count), of {len(formats)} formats")
        reason = (f"{best.name}{also} {what} within the quality bar"
                  + (f" (the others' time: {others})" if others else ""))
    kernels, chosen = {}, {}
    for family, impls in families.get(best, {}).items():
        kernels[family] = _family(family, impls, best, steps.get(best, {}), shapes, m, num_layers)
        chosen[family] = kernels[family]["chosen"]
    return Decision(key=fields, choice={**dataclasses.asdict(best), "kernels": chosen}, reason=reason,
                    candidates=cands, kernels=kernels, shapes=[s.name for s in shapes], rounds=m.rounds,
                    stopped=m.stopped, pruned=m.pruned, elapsed_s=round(m.elapsed_s, 3), measured_at=time.time())


# A family keeps the table's implementation unless another's estimated step score is lower by more than this: the
# probe's shapes are short, where two implementations can time within a VM's noise while the longer contexts of real
# prompts set them apart (the attention family at 1.5B shapes: docs/perf/xeon-amx.md).
FAMILY_MARGIN = 0.05


def _family(family: str, impls: tuple[str, ...], fmt: Format, step_s: dict, shapes: list[probe.Shape],
            m: probe.Measurement, num_layers: int) -> dict:
    """A family's implementations scored as ``fmt``'s steps with that implementation's calls swapped in for the
    table's (which the steps ran): elementwise and linears once per layer, the head once per step; attention's
    times are whole prefill steps (the difference to the C one, which the format's steps ran, swapped in once); the
    int8 prompt rows' calls, timed at ``probe.family_rows``, scaled to the step's rows."""
    def t(impl: str, s: probe.Shape) -> float | None:
        if impl == "table":         # the small-M kernel up to SMALL_M_MAX rows, torch beyond
            rows = s.rows if s.kind == "decode" else 1
            impl = "c" if rows <= SMALL_M_MAX[getattr(torch, fmt.dtype)] else "torch"
        return m.best(f"{family}:{impl}@{fmt.dtype}", s.name)
    base, calls = {"elementwise": ("c", num_layers), "attention": ("c", 1), "linears": ("c", num_layers),
                   "int8_prompts": ("int8", num_layers)}.get(family, ("table", 1))
    common = [s for s in shapes if s.name in step_s and all(t(i, s) is not None for i in (*impls, base))]
    if not common:
        return {"chosen": base, "why": "not timed within the budget: the table's"}
    def swapped(i: str, s: probe.Shape) -> float:    # calls of more rows than the step's scaled to its rows
        return step_s[s.name] + calls * (t(i, s) - t(base, s)) * s.rows / probe.family_rows(family, s)
    est = {i: probe.score({s.name: max(swapped(i, s), 1e-6) for s in common}, shapes) for i in impls}
    best = min(impls, key=est.get)
    why = f"{best}: the lowest estimated step score"
    if base in est and best != base and est[base] <= est[best] * (1 + FAMILY_MARGIN):
        why = f"{base}: the table's, within {FAMILY_MARGIN:.0%} of {best}'s estimate (the probe's noise)"
        best = base
    calls_ms = {i: {s.name: round(t(i, s) * 1e3, 4) for s in common} for i in impls}
    return {"chosen": best, "why": why,
            "score_ms": {i: round(v * 1e3, 3) for i, v in est.items()}, "calls_ms": calls_ms}


BUSY_LOAD_PER_CORE = 0.75      # a probe started above this load average per core measured a busy machine


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def quieter_now(dec: Decision) -> bool:
    """True when ``dec`` was measured on a busy machine (other work on the cores skews the candidates' times, and
    a probe that runs out of budget times fewer shapes) and the machine is at most half as busy now: the engine
    measures again rather than keep a skewed decision for good."""
    cores = os.cpu_count() or 1
    return dec.load_average > BUSY_LOAD_PER_CORE * cores and load_average() <= dec.load_average / 2


def resolve(cfg, mcfg, source, identity: str, quantized_source: bool, facts: KernelFacts, table: Format, *,
            measure: bool, retune: bool = False) -> Decision | None:
    """The decision for ``cfg`` (``tunable`` already checked): the cached one, else (``measure``) a new one, measured
    and cached; None when there is none and it may not be measured here."""
    fields = key_fields(cfg, identity)
    path = cache_path(fields)
    if not retune and (dec := load(path, fields)) is not None:
        if not (measure and quieter_now(dec)):
            log.info("tuning: %s (decision %s)", dec.reason, path)
            return dec
        log.info("tuning: the cached decision was measured on a busy machine (load average %.1f on %d cores); "
                 "the machine is quieter now: measuring again", dec.load_average, os.cpu_count() or 1)
    if not measure:
        return None
    formats = format_candidates(cfg.quantization, cfg.dtype, cfg.kv_cache_dtype, facts)
    if table not in formats:            # the table's choice is always measured against the rest (where it fits)
        formats.insert(0, table)
    avail = available_memory_bytes()
    formats, unfit = probe.fitting(formats, table, mcfg, avail)
    too_big = ""
    if unfit:
        too_big = (f"; not measured: {', '.join(f.name for f in unfit)} (their weights do not fit beside the others' "
                   f"in {probe.MEMORY_SHARE:.0%} of the {avail / 2**30:.1f} GiB available)")
        log.info("tuning: %s", too_big[2:])
    if not formats:
        log.warning("tuning: no format's weights fit in %.0f%% of the %.1f GiB available; the tables decide",
                    100 * probe.MEMORY_SHARE, avail / 2**30)
        return None
    families = {f: family_options(f, facts) for f in formats}
    t0 = time.perf_counter()
    budget = probe.budget_for(probe.layer_params(mcfg))
    log.info("tuning: measuring %d formats (%s) on this machine, once (budget %.0f s)", len(formats),
             ", ".join(f.name for f in formats), budget)
    busy = load_average()
    shapes, m = probe.run_probe(cfg, source, mcfg, identity, formats, families, table, budget_s=budget)
    dec = decide(fields, formats, families, shapes, m, table, mcfg.num_hidden_layers)
    dec.reason += too_big
    dec.load_average, dec.budget_s = round(busy, 2), budget
    store(path, dec)
    log.info("tuning: %s; kernels %s (%.1f s, %d rounds, load average %.1f; decision %s)", dec.reason,
             dec.choice["kernels"], time.perf_counter() - t0, dec.rounds, busy, path)
    return dec


def measured_steps(cfg, identity: str, fmt: Format) -> dict | None:
    """This machine's measured step times of ``fmt`` for the model (any cached decision of the same machine, model,
    torch and kernel build that timed it, whatever was asked for ``auto``): {"shapes": {name: seconds}, "context":
    the decode rows' context, "source": the file}; None when no decision here timed it. What ``batchgen plan``'s
    prediction and the report's roofline scale to (costmodel.predict)."""
    want = {k: v for k, v in key_fields(cfg, identity).items() if k != "requested"}
    root = cache_root() / "tuning"
    for path in sorted(root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if root.is_dir() else []:
        try:
            d = json.loads(path.read_text())
            if {k: v for k, v in d["key"].items() if k != "requested"} != want:
                continue
            for c in d["candidates"]:
                if (c["quantization"], c["dtype"], c["kv_cache_dtype"]) == (fmt.quantization, fmt.dtype,
                                                                           fmt.kv_cache_dtype) and c["times_ms"]:
                    return {"shapes": {s: ms / 1e3 for s, ms in c["times_ms"].items()},
                            "context": probe.DECODE_CONTEXT, "source": str(path)}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


__all__ = ["measured_steps", "Decision", "enabled", "tunable", "key_fields", "cache_path", "load", "store", "decide",
           "resolve", "table_record"]
