"""The format an engine computes in (weights, activations, KV cache, kernel families) and why: ``FormatDecision``.

``decide_format`` makes it from a config as written, on this device, for this model: the tables' choice
(``candidates.table_choice``), or on a CPU this machine's tuned decision for the model (``decision.resolve``): the
cached one, or with ``measure`` one measured now (every candidate format loaded and timed, ``probe``). Explicit
settings win over both. On a CPU the format's weights must fit in ``engine.memory.WEIGHTS_SHARE`` of the memory
available: where they would not, ``auto`` weights become int8 (quantized at load) if those fit, and anything else is
a ConfigError naming the sizes before a byte is loaded (the tuner only measures formats that fit; the tables and a
cached decision from a roomier moment are checked here). Nothing here sizes the KV pool: ``engine.setup`` does, and
makes the resolved ``EngineConfig`` from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import engine.memory as memory
import engine.tuning.decision as decision
from engine.config import EngineConfig, Kernels, freeze_kernels
from engine.dtype_policy import DtypeChoice
from engine.errors import ConfigError
from engine.kernels.families import TABLE_KERNELS
from engine.loader import ModelSource
from engine.memory import WEIGHTS_SHARE, model_bytes
from engine.models.config import ModelConfig
from engine.quant.policy import QuantChoice
from engine.tuning.candidates import Format, KernelFacts, kernel_facts, table_choice

NOT_CACHED = "no decision cached for this model here (only an engine's load measures one)"


@dataclass(frozen=True)
class FormatDecision:
    """``EngineInfo.format``: each part of the format with why, and who decided (the tables, the tuner, a pin)."""
    quantization: QuantChoice          # none | int8, and why
    dtype: DtypeChoice                 # the activation dtype, and why
    kv_cache_dtype: str                # bfloat16 | float32 | float16 | int8
    kernels: Kernels | None            # every family where the kernel library is loaded; else the explicit ones
    tuned: decision.Decision | None = None   # the tuner's decision (cached, or measured here); None: the tables'
    not_tuned: str = ""                # why this config is not tuned here; "" where it is (then ``tuned`` is None
                                       # only while no decision is cached)
    pinned_choice: dict | None = None  # the recorded format of a job's earlier rows this engine was pinned to
    pinned_reason: str = ""            # (pipeline.run.engine_format), and where it was recorded

    @property
    def tunable(self) -> bool:
        """This config is tuned on this machine (some of its format is auto, on a CPU, tuning on)."""
        return not self.not_tuned

    @property
    def pending(self) -> bool:
        """Tunable here, but no decision is cached yet: an engine's load measures one."""
        return self.tunable and self.tuned is None

    @property
    def choice(self) -> dict:
        """The format as ``EngineConfig.pinned`` takes it (and ``engine_format.json`` records it)."""
        return {"quantization": self.quantization.name, "dtype": self.dtype.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "kernels": dict(self.kernels or {})}

    def pinned(self, choice: dict, reason: str) -> FormatDecision:
        """This decision, noted as pinned to an earlier run's recorded ``choice`` (the manifest says so)."""
        return dataclasses.replace(self, pinned_choice=choice, pinned_reason=reason)

    def record(self) -> dict:
        """JSON-ready (``EngineInfo.to_dict()["tuning"]``, the manifest): {"mode": "tuned", "source", "choice",
        "reason", "candidates" (with their times), "kernels", ...}; {"mode": "table", "reason", "pending" (only when
        True)}; or {"mode": "pinned", "choice", "reason", "engine": the engine's own record}."""
        own = (self.tuned.record() if self.tuned is not None else
               decision.table_record(self.not_tuned or NOT_CACHED, pending=self.pending))
        if self.pinned_choice is None:
            return own
        return {"mode": "pinned", "choice": self.pinned_choice, "reason": self.pinned_reason, "engine": own}


def decide_format(cfg: EngineConfig, device_type: str, source: ModelSource, model_config: ModelConfig, identity: str,
                  *, measure: bool = False, retune: bool = False) -> FormatDecision:
    """The format for ``cfg`` (as written) on ``device_type`` for the model at ``source``. ``measure``: with no
    decision cached (or one measured on a busier machine), measure one now: this loads and times every candidate
    format, seconds of work. ``retune``: measure even if one is cached (``batchgen calibrate --retune``)."""
    quantized_source = source.kind == "gguf"
    not_tuned = decision.tunable(cfg, device_type)
    needs_kernels = device_type == "cpu" and (not_tuned is None or cfg.quantization == "int8" or
                                              (cfg.quantization == "auto" and quantized_source))
    facts = kernel_facts(device_type, needs_kernels)
    quant, dtype, kv = table_choice(cfg.quantization, cfg.dtype, cfg.kv_cache_dtype, device_type, quantized_source,
                                    facts)
    tuned, kernels = None, {}
    if not_tuned is None:
        tuned = decision.resolve(cfg, model_config, source, identity, quantized_source, facts,
                                 Format(quant.name, dtype.dtype, kv), measure=measure or retune, retune=retune)
    if tuned is not None:                        # explicit fields keep the table's reason (they won)
        tq, tc, kv, kernels = tuned.choices()
        quant = tq if cfg.quantization == "auto" else quant
        dtype = tc if cfg.dtype == "auto" else dtype
    if device_type == "cpu":
        fitted = fit_memory(cfg, source, model_config, quant, dtype, kv, facts, memory.available_memory_bytes())
        if fitted[0] is not quant:               # a smaller format than the one decided: the table's kernels
            (quant, dtype, kv, facts), kernels = fitted, {}
            if tuned is not None:                # measured when more memory was free: not what runs now
                tuned, not_tuned = None, "the tuned format's weights do not fit the memory available now"
    kernels = {**kernels, **(cfg.kernels or {})}            # explicit families win over the measured ones
    if facts.kernels:                            # every family, as it runs (recorded, and what a pin repeats)
        kernels = {**TABLE_KERNELS, **kernels}
    return FormatDecision(quant, dtype, kv, freeze_kernels(kernels), tuned, not_tuned or "")


def fit_memory(cfg: EngineConfig, source: ModelSource, mcfg: ModelConfig, quant: QuantChoice, dtype: DtypeChoice,
               kv: str, facts: KernelFacts, available: int | None
               ) -> tuple[QuantChoice, DtypeChoice, str, KernelFacts]:
    """The format decided, where its weights fit in ``WEIGHTS_SHARE`` of ``available`` bytes (or that is unknown);
    else, with ``quantization: auto``, int8 weights where the kernels load and they fit (the format the tables give
    an explicit int8); else ConfigError naming the sizes and what would fit."""
    need = model_bytes(quant.name, dtype.dtype, mcfg)
    if available is None or need <= WEIGHTS_SHARE * available:
        return quant, dtype, kv, facts
    what = (f"{source.name}'s weights as {quant.name}/{dtype.dtype} take ~{gib(need)}, more than "
            f"{WEIGHTS_SHARE:.0%} of the {gib(available)} of memory available here")
    small = model_bytes("int8", "float32", mcfg)
    int8_fits = small <= WEIGHTS_SHARE * available
    if int8_fits and quant.name != "int8" and cfg.quantization == "auto" and cfg.dtype in ("auto", "float32"):
        facts = facts if facts.kernels else kernel_facts("cpu", True)
        if facts.q8_isa is not None:
            q, d, k = table_choice("int8", cfg.dtype, cfg.kv_cache_dtype, "cpu", source.kind == "gguf", facts)
            return QuantChoice("int8", f"auto: {what}; int8 weights (~{gib(small)}, quantized at load) fit "
                                       f"({q.reason})", q.kv_cache_dtype), d, k, facts
    hint = (f"set quantization: int8 (~{gib(small)}; activations float32)" if int8_fits and quant.name != "int8"
            else "use a smaller model or a machine with more memory")
    raise ConfigError(f"{what}: {hint}")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


__all__ = ["FormatDecision", "decide_format", "fit_memory"]
