"""Everything an engine settles before it touches weights, in one place: the resolved ``EngineConfig`` (dtype
by device and ISA, device, block size for the attention backend, max_model_len), the model's config and
identity, and the KV pool size. ``LLM`` builds on it; ``PlanningEngine`` stops there.

``PlanningEngine`` answers what a dry run (``batchgen plan``) asks of an engine — ``info``, ``model_config``,
the tokenizer — without loading weights or allocating the KV pool, so planning a large input costs the
tokenizer and the input scan, not a model load.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

import engine.quant.int8_kv as int8_kv
import engine.tuning.decision as decision
from engine.attention.backend import AttentionBackend
from engine.attention.selector import get_backend
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.dtype_policy import DTYPES, DtypeChoice, log_choice
from engine.errors import ConfigError
from engine.interface import EngineInfo
from engine.kernels.families import TABLE_KERNELS
from engine.loader import ModelSource, load_model_config, resolve_model
from engine.loader.resolve import model_identity
from engine.memory import num_kv_blocks
from engine.models.config import ModelConfig
from engine.quant.policy import QuantChoice
from engine.tuning.candidates import Format, kernel_facts, table_choice

log = logging.getLogger("batchgen.engine")

# kv_cache_dtype -> the pool's torch dtype (int8: engine.quant.int8_kv's byte layout)
KV_DTYPES = {**DTYPES, "int8": torch.int8}


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig           # resolved: no "auto", no None where a value is decided
    source: ModelSource
    model_config: ModelConfig
    identity: str
    device: torch.device
    dtype_choice: DtypeChoice
    quant_choice: QuantChoice
    backend: AttentionBackend
    num_kv_blocks: int
    kernels: dict | None = None    # C or torch per kernel family (engine.tuning's choice); None: the table's
    tuning: dict = field(default_factory=dict)     # EngineInfo.tuning: the decision, or why the tables decided

    @property
    def dtype(self) -> torch.dtype:
        return self.dtype_choice.torch_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.config.kv_cache_dtype]

    def info(self, **extra) -> EngineInfo:
        cfg = self.config
        return EngineInfo(
            name=self.source.name, identity=self.identity, architecture=self.model_config.architecture,
            dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs, num_kv_blocks=self.num_kv_blocks, attention_backend=self.backend.name,
            path=str(self.source.path), dtype_reason=self.dtype_choice.reason, config=dataclasses.asdict(cfg),
            quantization=cfg.quantization, quantization_reason=self.quant_choice.reason, tuning=self.tuning,
            **extra)


def setup_engine(cfg: EngineConfig, tune: bool = False, retune: bool = False) -> EngineSetup:
    """Resolve the model and every automatic setting of ``cfg``; ConfigError / ModelLoadError name what is wrong.

    ``auto`` settings on a CPU take the tuner's cached decision for this model and machine (engine.tuning); with
    none cached, ``tune`` measures one (an engine's load) and otherwise the tables decide (planning, validation).
    ``retune``: measure again even if one is cached (``batchgen calibrate --retune``)."""
    source = resolve_model(cfg.model)                          # a bad model spec is the first thing to report
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(cfg.device if cfg.device != "auto" else auto_device)
    quantized_source = source.kind == "gguf"
    untuned = decision.tunable(cfg, device.type)
    needs_kernels = device.type == "cpu" and (untuned is None or cfg.quantization == "int8" or
                                              (cfg.quantization == "auto" and quantized_source))
    facts = kernel_facts(device.type, needs_kernels)
    quant, choice, kv = table_choice(cfg.quantization, cfg.dtype, cfg.kv_cache_dtype, device.type, quantized_source,
                                     facts)
    mcfg = load_model_config(source)
    identity = model_identity(source)
    kernels, tuning = None, decision.table_record(untuned or "no decision cached for this model here (only an "
                                                            "engine's load measures one)", pending=untuned is None)
    if untuned is None:
        tuned = decision.resolve(cfg, mcfg, source, identity, quantized_source, facts,
                                 Format(quant.name, choice.dtype, kv), measure=tune or retune, retune=retune)
        if tuned is not None:                             # explicit fields keep the table's reason (they won)
            tq, tc, kv, kernels = tuned.choices()
            quant = tq if cfg.quantization == "auto" else quant
            choice = tc if cfg.dtype == "auto" else choice
            tuning = tuned.record()
    if device.type == "cpu" and choice.dtype == "float16":
        raise ConfigError("float16 is not supported on CPU; use bfloat16 or float32")
    if cfg.kernels:                                       # explicit families win over the measured ones
        kernels = {**(kernels or {}), **cfg.kernels}
    backend = get_backend(cfg.attention_backend, device, kernels)
    block_size = backend.block_size_for(cfg.block_size)
    if block_size != cfg.block_size:
        log.info("block_size %d -> %d for the %s backend", cfg.block_size, block_size, backend.name)
    max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    cfg = dataclasses.replace(cfg, dtype=choice.dtype, device=str(device), block_size=block_size,
                              max_model_len=max_model_len, quantization=quant.name)
    if kv != choice.dtype:
        if device.type != "cpu":
            raise ConfigError(f"kv_cache_dtype: {kv} differs from dtype {choice.dtype}; on {device.type} the KV "
                              "cache is kept in the activation dtype (use auto)")
    if kv == "int8" and not int8_kv.supported(mcfg.head_dim):
        raise ConfigError(f"kv_cache_dtype: int8 needs head_dim a multiple of {int8_kv.GROUP} (groups of "
                          f"{int8_kv.GROUP} share a scale); this model's is {mcfg.head_dim}")
    if facts.kernels:                         # the resolved families (recorded, and what a pinned config repeats)
        kernels = {**TABLE_KERNELS, **(kernels or {})}
    cfg = dataclasses.replace(cfg, kv_cache_dtype=kv, kernels=kernels if facts.kernels else cfg.kernels)
    blocks = num_kv_blocks(cfg, mcfg, KV_DTYPES[kv], device, block_size, max_model_len)
    return EngineSetup(cfg, source, mcfg, identity, device, choice, quant, backend, blocks, kernels, tuning)


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


__all__ = ["EngineSetup", "setup_engine", "PlanningEngine"]
