"""batchgen's engine: our own paged-KV inference engine on torch.

The door (vLLM's names): ``from engine import LLM, SamplingParams``; the typed contract the pipeline codes
against: ``Engine`` and ``EngineInfo`` (engine/interface.py). The pipeline imports only what this module
exports.
"""
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import BatchgenError, ConfigError, ModelLoadError
from engine.interface import Engine, EngineInfo, Tokenizer
from engine.omp_wait import apply as _apply_omp_wait
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputError, StructuredOutputsParams, check_structured

_apply_omp_wait()      # NOTE: before anything loads torch's OpenMP runtime (engine/omp_wait.py says why)

# Imported on first use, so `import engine` stays cheap (these pull in torch or the model code).
_LAZY = {"LLM": ("engine.llm", "LLM"), "PlanningEngine": ("engine.setup", "PlanningEngine"),
         "setup_engine": ("engine.setup", "setup_engine"), "tune_format": ("engine.setup", "tune_format"),
         "choose_dtype": ("engine.dtype_policy", "choose_dtype"),
         "resolve_model": ("engine.loader.resolve", "resolve_model"),
         "load_model_config": ("engine.loader", "load_model_config")}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(name)


__all__ = ["LLM", "PlanningEngine", "SamplingParams", "EngineConfig", "DEFAULT_MODEL", "Engine", "EngineInfo",
           "Tokenizer", "RequestOutput", "RequestMetrics", "StepStats", "BatchgenError", "ConfigError",
           "ModelLoadError", "StructuredOutputsParams", "StructuredOutputError", "check_structured",
           "choose_dtype", "setup_engine", "tune_format", "resolve_model", "load_model_config"]
