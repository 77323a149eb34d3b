"""Everything an engine settles without weights, in one place: the model (its files, config and identity) and the
device (``ModelTarget``), then, for a format (``engine.tuning.format_decision``), the resolved ``EngineConfig``
(dtype, device, block size for the attention backend, max_model_len, formats, kernel families) and the KV pool
size (``EngineSetup``). ``setup_engine`` takes the format the tables or this machine's cached tuning decision give;
``LLM`` decides it in its own tuning phase (measuring when none is cached), then settles the rest the same way.

``PlanningEngine`` answers what a dry run (``batchgen plan``) asks of an engine — ``info``, ``model_config``,
the tokenizer — without loading weights or allocating the KV pool, so planning a large input costs the
tokenizer and the input scan, not a model load.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

import engine.quant.int8_kv as int8_kv
from engine.attention.backend import AttentionBackend
from engine.attention.selector import get_backend
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.dtype_policy import KV_DTYPES, DtypeChoice, log_choice
from engine.errors import ConfigError
from engine.interface import EngineInfo
from engine.loader import ModelSource, load_model_config, resolve_model
from engine.loader.resolve import model_identity
from engine.memory import model_bytes, num_kv_blocks
from engine.models.config import ModelConfig
from engine.quant.policy import QuantChoice
from engine.tuning.format_decision import FormatDecision, decide_format

log = logging.getLogger("batchgen.engine")


@dataclass(frozen=True)
class ModelTarget:
    """What an engine is for, settled first: the config as written, the model and the device."""
    requested: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    identity: str
    device: torch.device

    def decide_format(self, measure: bool = False, retune: bool = False) -> FormatDecision:
        """``engine.tuning.format_decision.decide_format`` for this model here (``measure``: seconds of timing)."""
        return decide_format(self.requested, self.device.type, self.source, self.model_config, self.identity,
                             measure=measure, retune=retune)


def locate(cfg: EngineConfig) -> ModelTarget:
    """The model of ``cfg`` (ModelLoadError naming what is wrong) and its device."""
    source = resolve_model(cfg.model, cfg.load_format)        # a bad model spec is the first thing to report
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(cfg.device if cfg.device != "auto" else auto_device)
    return ModelTarget(cfg, source, load_model_config(source), model_identity(source), device)


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig           # resolved: no "auto", no None where a value is decided
    source: ModelSource
    model_config: ModelConfig
    identity: str
    device: torch.device
    format: FormatDecision
    backend: AttentionBackend
    num_kv_blocks: int

    @property
    def dtype_choice(self) -> DtypeChoice:
        return self.format.dtype

    @property
    def quant_choice(self) -> QuantChoice:
        return self.format.quantization

    @property
    def kernels(self) -> dict | None:
        """C or torch per kernel family (None: the table's, no kernel library here)."""
        return dict(self.config.kernels) if self.config.kernels else None

    @property
    def dtype(self) -> torch.dtype:
        return self.dtype_choice.torch_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.config.kv_cache_dtype]

    def info(self, **extra) -> EngineInfo:
        return EngineInfo(name=self.source.name, identity=self.identity, architecture=self.model_config.architecture,
                          config=self.config, num_kv_blocks=self.num_kv_blocks, attention_backend=self.backend.name,
                          path=str(self.source.path), format=self.format, **extra)


def settle(target: ModelTarget, fmt: FormatDecision) -> EngineSetup:
    """Every automatic setting of ``target.requested`` resolved with the format ``fmt``, and the KV pool sized;
    ConfigError names a setting that cannot run here."""
    cfg, device, mcfg = target.requested, target.device, target.model_config
    dtype, kv = fmt.dtype.dtype, fmt.kv_cache_dtype
    if device.type == "cpu" and dtype == "float16":
        raise ConfigError("float16 is not supported on CPU; use bfloat16 or float32")
    kernels = dict(fmt.kernels) if fmt.kernels else None
    backend = get_backend(cfg.attention_backend, device, kernels)
    block_size = backend.block_size_for(cfg.block_size)
    if block_size != cfg.block_size:
        log.info("block_size %d -> %d for the %s backend", cfg.block_size, block_size, backend.name)
    max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    if kv != dtype and device.type != "cpu":
        raise ConfigError(f"kv_cache_dtype: {kv} differs from dtype {dtype}; on {device.type} the KV "
                          "cache is kept in the activation dtype (use auto)")
    if kv == "int8" and not int8_kv.supported(mcfg.head_dim):
        raise ConfigError(f"kv_cache_dtype: int8 needs head_dim a multiple of {int8_kv.GROUP} (groups of "
                          f"{int8_kv.GROUP} share a scale); this model's is {mcfg.head_dim}")
    cfg = dataclasses.replace(cfg, dtype=dtype, device=str(device), block_size=block_size, max_model_len=max_model_len,
                              quantization=fmt.quantization.name, kv_cache_dtype=kv, kernels=fmt.kernels)
    weights = model_bytes(fmt.quantization.name, dtype, mcfg) if device.type == "cpu" else 0
    blocks = num_kv_blocks(cfg, mcfg, KV_DTYPES[kv], device, block_size, max_model_len, weights)
    return EngineSetup(cfg, target.source, mcfg, target.identity, device, fmt, backend, blocks)


def setup_engine(cfg: EngineConfig) -> EngineSetup:
    """Resolve the model and every automatic setting of ``cfg`` without weights; ConfigError / ModelLoadError name
    what is wrong. ``auto`` formats on a CPU take the tuner's cached decision for this model and machine
    (engine.tuning); with none cached, the tables decide (planning, validation): ``format.pending`` says so."""
    target = locate(cfg)
    return settle(target, target.decide_format())


def tune_format(cfg: EngineConfig, retune: bool = False) -> FormatDecision:
    """The format of ``cfg`` here, measured now when no decision is cached (``retune``: even if one is) — what an
    engine's load would decide, for a process that loads none (a Ray driver, ``batchgen calibrate --retune``)."""
    return locate(cfg).decide_format(measure=True, retune=retune)


class PlanningEngine:
    """The ``engine.Engine`` door for dry runs: settings, model shape and tokenizer; no weights, no KV pool."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", *, setup: EngineSetup | None = None,
                 **engine_args):
        """``setup``: one already resolved (validation's), else resolved here from ``LLM``'s arguments."""
        from engine.tokenizer import load_tokenizer
        self.setup = setup or setup_engine(EngineConfig.from_options(model, dtype=dtype, **engine_args))
        log_choice(self.setup.dtype_choice)
        self.config = self.setup.config
        self.model_config = self.setup.model_config
        self.info = self.setup.info(cpu_kernels="not loaded (planning only)")
        self.tokenizer = load_tokenizer(self.setup.source, self.setup.identity)

    def get_tokenizer(self):
        return self.tokenizer

    def _refuse(self, *_, **__):
        raise RuntimeError("PlanningEngine plans only; use engine.LLM to run requests")

    add_request = step = pin_prefix = unpin_prefix = _refuse

    def has_unfinished_requests(self) -> bool:
        return False

    def num_unfinished_requests(self) -> int:
        return 0


__all__ = ["ModelTarget", "EngineSetup", "locate", "settle", "setup_engine", "tune_format", "PlanningEngine"]
