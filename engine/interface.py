"""The typed door between pipeline/ and engine/: what an engine says about itself (``EngineInfo``), what the
pipeline may call on it (``Engine``) and on its tokenizer (``Tokenizer``). ``engine.LLM`` implements it; so do
``engine.PlanningEngine``, the tests' fake engine and a Ray replica's proxy. Nothing in pipeline/ reaches past this.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

from engine.outputs import RequestOutput, StepStats
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:                  # the model code pulls in torch; the door stays cheap to import
    from engine.models.config import ModelConfig


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
    omp_wait: str = ""                 # how OpenMP threads wait at barriers (engine.omp_wait)
    # engine.tuning: {"mode": "tuned", "source": measured | cached, "choice", "reason", "candidates" (with their
    # times), "kernels", ...} or {"mode": "table", "reason", "pending" (only when True: no decision cached yet)}
    # where the tables decided; a pipeline run pinned to a job's recorded format says {"mode": "pinned", ...}
    tuning: dict = field(default_factory=dict)
    # engine.invariance: what a row's tokens depend on besides the row (model, formats, kernel build, threads, ...)
    # and its "fingerprint"; empty where not computed (planning, fakes)
    invariance: dict = field(default_factory=dict)

    @property
    def format_choice(self) -> dict:
        """What ``EngineConfig.pinned`` takes: the resolved format and kernel families of this engine."""
        return {"quantization": self.quantization, "dtype": self.dtype,
                "kv_cache_dtype": self.config.get("kv_cache_dtype") or self.dtype,
                "kernels": dict(self.config.get("kernels") or {})}

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (manifests, traces, the report)."""
        return dataclasses.asdict(self)


class Tokenizer(Protocol):
    """What the pipeline asks of a model's tokenizer (a transformers fast tokenizer satisfies it).

    ``backend_tokenizer`` (the Rust ``tokenizers.Tokenizer`` underneath, when there is one) lets the pipeline
    batch-encode documents and count tokens without transformers' per-call overhead; None where absent."""
    bos_token: str | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> Mapping[str, list[list[int]]]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """What the pipeline drives: requests in, finished ``RequestOutput``s out, one ``step`` at a time."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def model_config(self) -> ModelConfig | None: ...   # the model's shape (FLOP/byte counts); None for a fake

    def get_tokenizer(self) -> Tokenizer: ...

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> None: ...

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """One step: the requests that finished in it, and its stats (kept by the caller that records them)."""

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    def pin_prefix(self, token_ids: Sequence[int]) -> int | None:
        """Keep the full blocks of ``token_ids`` cached; a pin id, or None when the engine's pin budget is spent
        (pins are an optimization: the caller goes on without one)."""

    def unpin_prefix(self, pin_id: int) -> None: ...


__all__ = ["Engine", "EngineInfo", "Tokenizer"]
