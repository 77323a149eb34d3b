"""One planned batch of requests: a plan (``pipeline.plan.planner``) and what its positions mean. Position p is request
``requests[plan.order[p]]`` (a ``rows.RowRequest``), whose token ids ``prompt(p)`` builds; a sampled row's seed is
its own (``row_seed``). ``copies``: requests that take another's result instead of being computed
(``pipeline.prepare.dedup``; they are among ``requests``, never in the plan)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.job.job_prompts import JobPrompts
from pipeline.job.rows import Copy, RowRequest
from pipeline.plan.copies import NO_COPIES, Copies
from pipeline.plan.planner import INDEX, Plan


@dataclass
class Batch:
    """One planned batch: ``requests`` (by request index) in ``plan``'s order; ``job``: each request's job index."""
    plan: Plan
    heads: list                       # group id -> the shared head's token ids
    requests: Sequence[RowRequest]    # by request index; ``plan.order[p]`` is position p's
    job: np.ndarray | JobOffsets      # by request index: the request's job (without reading the request)
    prompts: list[JobPrompts]         # by job index: tails and parameter sets
    copies: Copies = NO_COPIES        # requests that take another's result

    @property
    def num_copies(self) -> int:
        return len(self.copies)

    def copies_at(self, p: int) -> list[Copy]:
        """The rows that take position ``p``'s result (none for most)."""
        if not len(self.copies):
            return []
        return [Copy(q.job, q.key, q.params) for q in (self.requests[int(c)]
                                                        for c in self.copies.of(int(self.plan.order[p])))]

    def request(self, p: int) -> RowRequest:
        return self.requests[int(self.plan.order[p])]

    def prompt(self, p: int) -> tuple[list[int], object]:
        """(token ids, SamplingParams) of position ``p``: its group's head, its document ids, its tail."""
        q = self.request(p)
        jp = self.prompts[q.job]
        params = jp.param_sets[q.params]
        if not params.greedy:      # a sampled row draws from its own seed: its tokens are a function of the row
            params = dataclasses.replace(params, seed=row_seed(params.seed, q.key))
        return list(self.heads[q.group]) + q.doc_ids + list(jp.tail_ids[q.tail]), params

    def job_by_position(self) -> np.ndarray:
        """Each plan position's job (int32: 4 bytes a position)."""
        order, out = self.plan.order, np.empty(self.plan.num_requests, dtype=INDEX)
        step = 1 << 20
        for a in range(0, len(order), step):
            out[a:a + step] = self.job[order[a:a + step]]
        return out

    def max_tokens(self) -> np.ndarray:
        """Per position: its job's ``generation.max_tokens`` (the Ray assignment's cost estimate; one job's a
        broadcast, nothing per position)."""
        per_job = np.asarray([jp.params.max_tokens for jp in self.prompts], dtype=INDEX)
        if len(set(per_job.tolist())) <= 1:
            return np.broadcast_to(per_job[:1] if len(per_job) else np.zeros(1, INDEX), (self.plan.num_requests,))
        return per_job[self.job_by_position()]

    def close(self) -> None:
        close = getattr(self.requests, "close", None)
        if close is not None:
            close()


class JobOffsets:
    """Request index -> job index, from each job's first request index (``offsets``, one more: the end): nothing
    per request."""

    def __init__(self, offsets):
        self.offsets = np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index):
        found = np.searchsorted(self.offsets, index, side="right") - 1
        return found.astype(INDEX) if isinstance(found, np.ndarray) else int(found)


def row_seed(seed: int | None, key: str) -> int:
    """A sampled row's seed: the job's (or the request's) seed, None as 0, mixed with the row key, so each row draws
    its own stream (rows under one job seed are not correlated) and the same row draws the same one in any batch,
    run, resume or replica (docs/guide/determinism.md)."""
    digest = hashlib.sha256(f"{0 if seed is None else int(seed)}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


__all__ = ["Batch", "JobOffsets", "row_seed"]
