"""batchgen's engine: our own paged-KV inference engine on torch.

The door (vLLM's names): ``from engine import LLM, SamplingParams``.
"""
from engine.config import EngineConfig
from engine.errors import BatchgenError, ConfigError, ModelLoadError
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in torch and the model code; import it lazily so `import engine` stays cheap.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "RequestMetrics", "StepStats",
           "BatchgenError", "ConfigError", "ModelLoadError"]
