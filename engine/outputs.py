"""What the engine hands back: RequestOutput (one per prompt, with its metrics) and StepStats (one per step)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps in time.monotonic() seconds; derived latencies in seconds (None when not reached)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    prefill_start_time: float | None = None
    prefill_end_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0          # speculation: draft tokens proposed / accepted for this request
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0            # steps that verified drafts for this request
    num_forced_tokens: int = 0         # structured outputs: tokens the grammar forced (entered as a prefill chunk)
    num_masks_applied: int = 0         # steps where the unconstrained choice was rejected and a full mask applied
    mask_time_s: float = 0.0           # time spent computing / applying grammar masks for this request

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        if self.prefill_start_time is None or self.prefill_end_time is None:
            return None
        return self.prefill_end_time - self.prefill_start_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int             # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    error: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepStats:
    """One engine step, recorded cheaply (host-side counters only)."""
    step: int
    start_time: float
    end_time: float
    num_prefill_tokens: int            # tokens of requests still in their prompt
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int          # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int             # of those, tokens found
    num_preemptions: int
    num_sampled: int                   # logits rows computed (LM head work)
    num_draft_tokens: int = 0          # speculation: draft tokens verified this step ...
    num_accepted_tokens: int = 0       # ... accepted and emitted (a stop can cut an accepted run short)
    num_emitted_tokens: int = 0        # output tokens this step added (= num_sampled without speculation)
