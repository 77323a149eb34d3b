"""EngineConfig: one frozen config for the engine, validated once, passed down whole.

A config as written (``from_options``: ``LLM(model, **options)``, a job's ``engine:`` section) may leave settings
``auto``; ``engine.setup`` resolves it into the same class with every automatic value concrete, the one config an
engine runs and ``EngineInfo.config`` reports. It is hashable (a cache key, a set member): ``speculative_config``
is kept as a frozen ``SpecConfig`` (or None) and ``kernels`` as a frozen ``Kernels`` mapping, whatever form the
user gave them in, so two configs that mean the same are equal.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from engine.errors import ConfigError
from engine.kernels.families import check_kernels

DEFAULT_MODEL = "gemma-3-270m"        # google/gemma-3-270m, Q4_K_M GGUF from PyPI (engine.loader.resolve)

# CPU default KV pool: a quarter of the memory available at start, at most 4 GiB (18 KiB/token for gemma-3-270m
# in bf16: 4 GiB holds ~230k tokens, 128 sequences of 1,800).
DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CACHE_MAX_BYTES = 4 * 1024**3
QUANTIZATIONS = ("none", "int8", "auto")
PINNABLE = ("quantization", "dtype", "kv_cache_dtype")     # the format: what the tuner decides


@dataclass(frozen=True)
class SpecConfig:
    """``EngineConfig.speculative_config``: n-gram speculation (engine.spec_decode), by vLLM's names::

        speculative_config: {method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 2, prompt_lookup_max: 5,
                             gating: auto}     # auto: only when it pays (spec_decode/gating.py); always: every step
    """
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    gating: str = "auto"                      # auto | always

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ConfigError(f"speculative_config.method: only ngram is supported, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config.num_speculative_tokens must be in 1..16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.gating not in ("auto", "always"):
            raise ConfigError(f"speculative_config.gating must be auto or always, got {self.gating!r}")

    @classmethod
    def parse(cls, value) -> SpecConfig | None:
        """None / "off" -> None; "auto" -> the defaults; a mapping of vLLM's names; a SpecConfig as it is."""
        if value is None or value == "off":
            return None
        if value == "auto":
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be off, auto or a mapping, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**value)

    def to_json(self) -> str | dict:
        """"auto" for the defaults (what ``auto`` means), else the mapping."""
        return "auto" if self == SpecConfig() else dataclasses.asdict(self)


class Kernels(Mapping):
    """``EngineConfig.kernels``: C or torch per kernel family (engine.kernels.families), frozen and hashable; equal
    to a mapping of the same pairs, in any order (the order given is kept for display). A ConfigError names a bad
    family or implementation."""

    def __init__(self, kernels: Mapping[str, str]):
        pairs = dict(kernels)
        try:
            check_kernels(pairs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._pairs = tuple(pairs.items())

    def __getitem__(self, family: str) -> str:
        return dict(self._pairs)[family]

    def __iter__(self):
        return (f for f, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(frozenset(self._pairs))

    def __repr__(self) -> str:
        return f"Kernels({dict(self._pairs)!r})"


def freeze_kernels(kernels: Mapping[str, str] | None) -> Kernels | None:
    """``kernels`` as ``Kernels``; None for None or an empty mapping."""
    if kernels is None:
        return None
    if not isinstance(kernels, Mapping):
        raise ConfigError(f"kernels must be a mapping of kernel family to c or torch, got {kernels!r}")
    return Kernels(kernels) or None


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"                      # auto -> by device and ISA (engine.dtype_policy); or float32,
                                             # bfloat16, float16
    device: str = "auto"                     # auto -> cuda if available else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None       # bytes for the KV pool; None -> default (CPU) / fraction (CUDA)
    gpu_memory_utilization: float = 0.85     # CUDA: fraction of free memory for the KV pool when no bytes given
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (tests, tuning); wins over bytes
    max_num_seqs: int = 128                  # decode is matmul-bound on CPU: more rows per step, more tokens/s
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None         # None -> the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"          # auto | torch | flash_attn
    seed: int = 0
    num_threads: int | None = None           # CPU: torch threads; None -> leave torch's default
    speculative_config: SpecConfig | None = SpecConfig()  # n-gram speculation (engine.spec_decode); given as
                                             # None / "off", "auto" (the defaults) or a mapping of SpecConfig's names
    quantization: str = "auto"               # auto: int8 for GGUF weights on CPUs where measured faster within
                                             # the quality bar, else none (engine.quant.policy) | none: weights in
                                             # `dtype` (GGUF dequantized at load) | int8: int8 weights, integer
                                             # dot products (CPU)
    deterministic: bool = True               # a row's tokens do not depend on the other rows of its steps (float
                                             # linears padded to a row floor, one head kernel for all row counts;
                                             # docs/guide/determinism.md); false: the faster kernel per shape
    kv_cache_dtype: str = "auto"             # auto: the activation dtype (int8 weights: bf16 where measured
                                             # faster, engine.quant.policy) | bfloat16 | float32 (vLLM's name).
                                             # bfloat16 under float32 activations (int8's): half the KV bytes,
                                             # attention in bf16 (engine.attention.torch_backend) | int8: int8 +
                                             # a scale per 32 values, 0.56x bf16's bytes (engine.quant.int8_kv; CPU)
    kernels: Kernels | None = None           # CPU: C or torch per kernel family, e.g. {attention: torch}
                                             # (engine.kernels.families); families not named: measured
                                             # (engine.tuning). Resolved: every family, where the kernel library loads
    load_format: str = "auto"                # auto: the weights in the files | dummy: made up from config.json
                                             # (engine.loader.dummy; vLLM's name), for speed at real model sizes

    @classmethod
    def from_options(cls, model: str = DEFAULT_MODEL, **options) -> EngineConfig:
        """The config for keyword options by their vLLM names (``LLM(model, **options)``, a job's ``engine:``
        section). An unknown name is a ConfigError naming it and the known ones; a bad value, the field's own."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def pinned(self, choice: Mapping) -> EngineConfig:
        """This config with its ``auto`` quantization / dtype / kv_cache_dtype and its unnamed kernel families taken
        from ``choice`` (``EngineInfo.format_choice`` of an earlier engine): a resumed, incremental or Ray run
        computes in the format its first rows were computed in. Fields given by name keep their value."""
        fixed = {f: choice[f] for f in PINNABLE if getattr(self, f) == "auto" and choice.get(f)}
        kernels = {**(choice.get("kernels") or {}), **(self.kernels or {})}
        return dataclasses.replace(self, **fixed, kernels=kernels or None)

    @staticmethod
    def check_choice(choice) -> None:
        """A ConfigError naming the field (``choice.dtype``, ``choice.kernels``, ...) where ``choice``, a format as
        ``pinned`` takes it and as a file of ours recorded it (a tuning decision, a job's engine format), is not one
        an engine can take: each of quantization / dtype / kv_cache_dtype a concrete value this config accepts,
        kernels absent or a mapping of kernel family to implementation."""
        if not isinstance(choice, Mapping):
            raise ConfigError(f"choice must be a mapping, got {type(choice).__name__}")
        for f in PINNABLE:
            value = choice.get(f)
            if not isinstance(value, str) or value == "auto":
                raise ConfigError(f"choice.{f} must be a concrete value, got {value!r}")
            try:
                EngineConfig(**{f: value})
            except ConfigError as e:
                raise ConfigError(f"choice.{e}") from None
        kernels = choice.get("kernels")
        if kernels is not None and not isinstance(kernels, Mapping):
            raise ConfigError(f"choice.kernels must be a mapping of kernel family to implementation, got {kernels!r}")
        try:
            freeze_kernels(kernels)
        except ConfigError as e:
            raise ConfigError(f"choice.kernels: {e}") from None

    def to_dict(self) -> dict:
        """JSON-ready, by field name (a manifest's ``model.config``): ``speculative_config`` as "off", "auto" or its
        mapping, ``kernels`` as a mapping; ``from_options`` takes it back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        spec = self.speculative_config
        d["speculative_config"] = "off" if spec is None else spec.to_json()
        d["kernels"] = dict(self.kernels) if self.kernels is not None else None
        return d

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        # NOTE: normalized in place (a frozen dataclass's own __post_init__ may): equal meanings, equal configs
        object.__setattr__(self, "speculative_config", SpecConfig.parse(self.speculative_config))
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8"):
            raise ConfigError(f"kv_cache_dtype must be auto, float32, bfloat16 or int8, got {self.kv_cache_dtype!r}")
        object.__setattr__(self, "kernels", freeze_kernels(self.kernels))
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "flash_attn"):
            raise ConfigError(f"attention_backend must be auto, torch or flash_attn, got {self.attention_backend!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be >= 1")
