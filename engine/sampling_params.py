"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0          # 0 -> greedy
    top_k: int = 0                    # 0 or -1 -> off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # >1 discourages tokens already in prompt or output (HF/vLLM semantics)
    presence_penalty: float = 0.0     # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence in generated tokens
    seed: int | None = None           # per-request generator: same seed -> same output in any batch
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # constrain the output (engine/structured)

    def __post_init__(self) -> None:
        # Accept lists / a single string from YAML and user code, store tuples (frozen + hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.structured_outputs, dict):      # from YAML / a batch line
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
