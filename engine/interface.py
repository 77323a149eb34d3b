"""The typed door between pipeline/ and engine/: what an engine says about itself (``EngineInfo``) and what the
pipeline may call on it (``Engine``). ``engine.LLM`` implements it; so does the tests' fake engine, and so will a
remote replica. Nothing in pipeline/ reaches past this.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from engine.outputs import RequestOutput, StepStats
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """One engine's identity and resolved settings, fixed once it has loaded."""
    name: str                          # the model's display name (alias or file/dir name)
    identity: str                      # fingerprint of the model files (row keys, manifests, caches)
    architecture: str                  # e.g. Gemma3ForCausalLM
    dtype: str                         # resolved: bfloat16 | float16 | float32
    device: str                        # resolved: cpu | cuda | cuda:N
    max_model_len: int
    block_size: int                    # KV block size in tokens (the prefix cache's granularity)
    max_num_seqs: int
    num_kv_blocks: int | None = None   # KV pool size in blocks (None: unbounded, e.g. a fake)
    attention_backend: str = "torch"
    path: str = ""                     # the model file or directory
    dtype_reason: str = ""             # why this dtype (engine.dtype_policy)
    cpu_kernels: str = ""              # which native kernel build runs, or why none
    load_time_s: float = 0.0
    load_breakdown: dict = field(default_factory=dict)   # phase -> seconds, plus "weights_from"
    config: dict = field(default_factory=dict)           # the resolved EngineConfig, as a dict
    quantization: str = "none"         # resolved: none | int8 (engine.quant.policy)
    quantization_reason: str = ""
    weight_bytes: int = 0              # resident bytes of the loaded weights (int8 packs included)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (manifests, traces, the report)."""
        return dataclasses.asdict(self)


@runtime_checkable
class Engine(Protocol):
    """What the pipeline drives: requests in, finished ``RequestOutput``s out, one ``step`` at a time."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def model_config(self) -> Any: ...          # engine.models.ModelConfig, or None (FLOP/byte counts)

    @property
    def step_stats(self) -> list[StepStats]: ...

    def get_tokenizer(self) -> Any: ...

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    def pin_prefix(self, token_ids: Sequence[int]) -> int | None:
        """Keep the full blocks of ``token_ids`` cached; a pin id, or None when the engine's pin budget is spent
        (pins are an optimization: the caller goes on without one)."""

    def unpin_prefix(self, pin_id: int) -> None: ...


__all__ = ["Engine", "EngineInfo"]
