"""The typed door between pipeline/ and engine/: what an engine says about itself (``EngineInfo``), what the
pipeline may call on it (``Engine``) and on its tokenizer (``Tokenizer``). ``engine.LLM`` implements it; so do
``engine.PlanningEngine``, the tests' fake engine and a Ray replica's proxy. Nothing in pipeline/ reaches past this.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

from engine.config import EngineConfig
from engine.outputs import RequestOutput, StepStats
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:                  # the model code and the tuner pull in torch; the door stays cheap to import
    from engine.models.config import ModelConfig
    from engine.tuning.format_decision import FormatDecision


@dataclass(frozen=True)
class EngineInfo:
    """One engine's identity and resolved settings, fixed once it has loaded."""
    name: str                          # the model's display name (alias or file/dir name)
    identity: str                      # fingerprint of the model files (row keys, manifests, caches)
    architecture: str                  # e.g. Gemma3ForCausalLM
    config: EngineConfig               # the resolved config: dtype, device, max_model_len, block size, formats, ...
    num_kv_blocks: int | None = None   # KV pool size in blocks (None: unbounded, e.g. a fake)
    attention_backend: str = "torch"
    path: str = ""                     # the model file or directory
    # engine.tuning.format_decision: the format (weights, activations, KV cache, kernels), why each part, and
    # whether the tables or the tuner decided; None where nothing was decided (fakes)
    format: FormatDecision | None = None
    cpu_kernels: str = ""              # which native kernel build runs, or why none
    load_time_s: float = 0.0
    load_breakdown: dict = field(default_factory=dict)   # phase -> seconds, plus "weights_from"
    weight_bytes: int = 0              # resident bytes of the loaded weights (int8 packs included)
    # float32 weights held as their bf16 values (engine.models.linear.use_c_linears, select_ops.pack_head): the
    # same results, half the bytes a decode step streams
    bf16_held_weights: bool = False
    omp_wait: str = ""                 # how OpenMP threads wait at barriers (engine.omp_wait)
    # engine.invariance: what a row's tokens depend on besides the row (model, formats, kernel build, threads, ...)
    # and its "fingerprint"; empty where not computed (planning, fakes)
    invariance: dict = field(default_factory=dict)

    @property
    def format_choice(self) -> dict:
        """What ``EngineConfig.pinned`` takes: the resolved format and kernel families of this engine."""
        c = self.config
        return {"quantization": c.quantization, "dtype": c.dtype, "kv_cache_dtype": c.kv_cache_dtype,
                "kernels": dict(c.kernels or {})}

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (manifests, traces, the report): the resolved settings flat beside the whole config, the
        format's reasons and its tuning record."""
        c, fmt = self.config, self.format
        return copy.deepcopy({
            "name": self.name, "identity": self.identity, "architecture": self.architecture, "dtype": c.dtype,
            "device": c.device, "max_model_len": c.max_model_len, "block_size": c.block_size,
            "max_num_seqs": c.max_num_seqs, "num_kv_blocks": self.num_kv_blocks,
            "attention_backend": self.attention_backend, "path": self.path,
            "dtype_reason": fmt.dtype.reason if fmt else "", "cpu_kernels": self.cpu_kernels,
            "load_time_s": self.load_time_s, "load_breakdown": self.load_breakdown, "config": c.to_dict(),
            "quantization": c.quantization, "quantization_reason": fmt.quantization.reason if fmt else "",
            "weight_bytes": self.weight_bytes, "bf16_held_weights": self.bf16_held_weights,
            "omp_wait": self.omp_wait, "tuning": fmt.record() if fmt else {},
            "invariance": self.invariance})


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
