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
from dataclasses import dataclass

import torch

import engine.quant.int8_kv as int8_kv
from engine.attention.backend import AttentionBackend
from engine.attention.selector import get_backend
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.dtype_policy import DTYPES, DtypeChoice, choose_dtype, log_choice
from engine.errors import ConfigError
from engine.interface import EngineInfo
from engine.loader import ModelSource, load_model_config, resolve_model
from engine.loader.resolve import model_identity
from engine.memory import num_kv_blocks
from engine.models.config import ModelConfig
from engine.quant.policy import QuantChoice, choose_quantization, kernel_bf16_attention, kernel_isa, kernel_q8_isa

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
            quantization=cfg.quantization, quantization_reason=self.quant_choice.reason,
            **extra)


def setup_engine(cfg: EngineConfig) -> EngineSetup:
    """Resolve the model and every automatic setting of ``cfg``; ConfigError / ModelLoadError name what is wrong."""
    source = resolve_model(cfg.model)                          # a bad model spec is the first thing to report
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(cfg.device if cfg.device != "auto" else auto_device)
    quantized_source = source.kind == "gguf"
    needs_kernels = device.type == "cpu" and (cfg.quantization == "int8" or
                                              (cfg.quantization == "auto" and quantized_source))
    quant = choose_quantization(cfg.quantization, device.type, kernel_q8_isa() if needs_kernels else None,
                                kernel_bf16_attention() if needs_kernels else False, cfg.dtype,
                                kernel_isa() if needs_kernels else None, quantized_source=quantized_source)
    if quant.name == "int8" and cfg.dtype == "auto":
        # NOTE: int8 weights pass the quality bar with float32 activations and fail it with bf16 ones (bench.quality
        # on gemma-3-270m; figures in docs/perf/code-notes-engine.md).
        choice = DtypeChoice("float32", "auto with int8 weights: float32 activations (bf16 activations fail "
                                        "int8's quality bar)")
    else:
        choice = choose_dtype(cfg.dtype, device.type)      # auto: by device and instruction set
    if device.type == "cpu" and choice.dtype == "float16":
        raise ConfigError("float16 is not supported on CPU; use bfloat16 or float32")
    mcfg = load_model_config(source)
    backend = get_backend(cfg.attention_backend, device)
    block_size = backend.block_size_for(cfg.block_size)
    if block_size != cfg.block_size:
        log.info("block_size %d -> %d for the %s backend", cfg.block_size, block_size, backend.name)
    max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    cfg = dataclasses.replace(cfg, dtype=choice.dtype, device=str(device), block_size=block_size,
                              max_model_len=max_model_len, quantization=quant.name)
    kv = (quant.kv_cache_dtype or choice.dtype) if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    if kv != choice.dtype:
        if device.type != "cpu":
            raise ConfigError(f"kv_cache_dtype: {kv} differs from dtype {choice.dtype}; on {device.type} the KV "
                              "cache is kept in the activation dtype (use auto)")
    if kv == "int8" and not int8_kv.supported(mcfg.head_dim):
        raise ConfigError(f"kv_cache_dtype: int8 needs head_dim a multiple of {int8_kv.GROUP} (groups of "
                          f"{int8_kv.GROUP} share a scale); this model's is {mcfg.head_dim}")
    cfg = dataclasses.replace(cfg, kv_cache_dtype=kv)
    blocks = num_kv_blocks(cfg, mcfg, KV_DTYPES[kv], device, block_size, max_model_len)
    return EngineSetup(cfg, source, mcfg, model_identity(source), device, choice, quant, backend, blocks)


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
        self.step_stats: list = []

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
