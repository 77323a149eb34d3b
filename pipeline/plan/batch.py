"""One planned batch of requests: a plan (``pipeline.plan.planner``) and what its positions mean. Position p is request
``requests[plan.order[p]]`` (a ``rows.RowRequest``), whose token ids ``prompt(p)`` builds; a sampled row's seed is
its own (``row_seed``). ``copies``: rows that take a request's result instead of being computed
(``pipeline.prepare.dedup``)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.job.job_prompts import JobPrompts
from pipeline.job.rows import Copy, RowRequest
from pipeline.plan.planner import Plan


@dataclass
class Batch:
    """One planned batch: ``requests`` (by request index) in ``plan``'s order; ``job``: each request's job index."""
    plan: Plan
    heads: list                       # group id -> the shared head's token ids
    requests: Sequence[RowRequest]    # by request index; ``plan.order[p]`` is position p's
    job: np.ndarray                   # by request index: the request's job (without reading the request)
    prompts: list[JobPrompts]         # by job index: tails and parameter sets
    copies: dict[int, list[Copy]] = field(default_factory=dict)   # by request index: rows that take its result

    @property
    def num_copies(self) -> int:
        return sum(len(c) for c in self.copies.values())

    def copies_at(self, p: int) -> list[Copy]:
        """The rows that take position ``p``'s result (none for most)."""
        return self.copies.get(int(self.plan.order[p]), []) if self.copies else []

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

    def max_tokens(self) -> np.ndarray:
        """Per position: its job's ``generation.max_tokens`` (the Ray assignment's cost estimate)."""
        per_job = np.asarray([jp.params.max_tokens for jp in self.prompts], dtype=np.int32)
        return per_job[self.job[self.plan.order]]

    def close(self) -> None:
        close = getattr(self.requests, "close", None)
        if close is not None:
            close()


def row_seed(seed: int | None, key: str) -> int:
    """A sampled row's seed: the job's (or the request's) seed, None as 0, mixed with the row key, so each row draws
    its own stream (rows under one job seed are not correlated) and the same row draws the same one in any batch,
    run, resume or replica (docs/guide/determinism.md)."""
    digest = hashlib.sha256(f"{0 if seed is None else int(seed)}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


__all__ = ["Batch", "row_seed"]
