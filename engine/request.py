"""Request: one sequence's token ids and counters, plus the timestamps its metrics come from.

A request is counters (vLLM v1's idea): ``num_computed_tokens`` advances by what the scheduler granted; the
tokens still to compute are ``all_token_ids[num_computed_tokens:]``. Prefill, chunked prefill, a prefix-cache
hit and decode are all that one subtraction.

    all_token_ids:  [ prompt ........................ | output ..... ]
                      ^cached (prefix hit) ^computed    ^ next to compute
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"          # EOS, stop token or stop string
    FINISHED_LENGTH = "length"         # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"           # e.g. prompt can never fit in the KV pool

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0                  # lower runs first (the planner's order); ties by arrival
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None   # prompt tokens served from the prefix cache at first scheduling
    num_preemptions: int = 0
    error: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0          # speculation: draft tokens proposed for this request ...
    num_accepted_tokens: int = 0       # ... and accepted
    num_spec_steps: int = 0            # steps that verified drafts for it (mean accepted length = accepted / this)
    num_forced_tokens: int = 0         # structured outputs: tokens the grammar forced (appended without sampling)
    grammar: Any = None                # structured outputs: engine.structured.state.RequestGrammar, or None
    detokenizer: Any = None            # its text and stop strings: engine.detokenizer.IncrementalDetokenizer, or None
    # Block hashes of the request's full blocks, filled incrementally by the KV cache manager.
    block_hashes: list = field(default_factory=list)

    # Metrics (time.monotonic seconds).
    first_scheduled_time: float | None = None
    prefill_start_time: float | None = None
    prefill_end_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End the request with a finished ``status`` (``stop_reason``: the stop token id or stop string)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        self.status = status
        self.finish_time = time.monotonic()
        if stop_reason is not None:
            self.stop_reason = stop_reason

    @property
    def is_finished(self) -> bool:
        return self.status.finished
