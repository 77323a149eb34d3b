"""SchedulerOutput: the plain description of one step (ids, token ids, positions, block ids; no tensors).

The model runner turns it into tensors. For one scheduled request:

    all_token_ids: [ 0 ........ start_pos | token_ids (computed this step) | ... ]
                     cached / computed KV   positions start_pos .. start_pos+len-1
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]        # the tokens to compute this step
    start_pos: int              # = num_computed_tokens before this step (the KV context already cached)
    block_ids: list[int]        # the request's whole block table, covering start_pos + len(token_ids) tokens
    sample: bool                # the chunk reaches the request's last known token: sample one token for it
    is_prefill: bool            # not a plain one-token decode (prompt chunk, or a recompute after preemption)
    draft_token_ids: list[int] = field(default_factory=list)   # speculated tokens: token_ids = [last] + drafts

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)        # request ids preempted this step
    finished_errors: list[str] = field(default_factory=list)  # request ids finished with FINISHED_ERROR

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
