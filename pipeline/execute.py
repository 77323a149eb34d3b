"""Step 3 of a run: one planned batch of requests through an ``Execution``.

    Batch           a plan (``pipeline.planner``) and what its positions mean: position p is request
                    ``requests[plan.order[p]]`` (a ``rows.Request``), whose token ids ``prompt(p)`` builds
    Execution       what computes a batch, finished request by finished request. ``Runner`` drives one loop over
                    it (commit, stop, progress) whatever computes:
                      LocalExecution  (here) the engine in this process, fed by ``pipeline.feeder.Feeder``
                      RayExecution    (``pipeline.ray.driver``) engine replicas as Ray actors

    ex.start(); ex.begin(batch)
    while not ex.done:              # the caller's checks between polls: commit when due, stop when asked
        for position, output in ex.poll(): ...
        for steps, source in ex.steps(): ...
    ex.close()

Request ids the engine sees are plan positions.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import numpy as np

from engine import Engine, EngineInfo, RequestOutput, StepStats
from pipeline.feeder import Feeder
from pipeline.planner import Plan
from pipeline.rows import Request

if TYPE_CHECKING:
    from pipeline.jobrun import JobPrompts


@dataclass
class Batch:
    """One planned batch: ``requests`` (by request index) in ``plan``'s order; ``job``: each request's job index."""
    plan: Plan
    heads: list                       # group id -> the shared head's token ids
    requests: Sequence[Request]       # by request index; ``plan.order[p]`` is position p's
    job: np.ndarray                   # by request index: the request's job (without reading the request)
    prompts: list[JobPrompts]         # by job index: tails and parameter sets

    def request(self, p: int) -> Request:
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
        per_job = np.asarray([jp.params.max_tokens for jp in self.prompts], dtype=np.int64)
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


class Execution(Protocol):
    """Computes batches; ``Runner`` calls ``start`` once, then per batch ``begin`` and ``poll`` until ``done``."""

    def start(self) -> None: ...

    def begin(self, batch: Batch) -> None: ...

    @property
    def done(self) -> bool:
        """Nothing more will finish in this batch (every position did, or nothing is left to schedule)."""

    def poll(self) -> Iterator[tuple[int, RequestOutput]]:
        """Compute a little (one engine step; one replica call); yield (plan position, output) as they finish."""

    def steps(self) -> list[tuple[list[StepStats], int]]:
        """Engine steps taken since the last call, each list with its source (which engine, for the trace)."""

    def close(self) -> None: ...

    def engine_info(self) -> EngineInfo:
        """The engine that computed (the manifest's model section)."""

    def summary(self) -> dict | None:
        """The manifest's ``this_run.distributed`` (None: computed in this process)."""


class LocalExecution:
    """The engine in this process: a ``Feeder`` keeps a bounded window of the plan in it."""

    def __init__(self, llm: Engine, window: int, max_open_groups: int):
        self.llm, self.window, self.max_open_groups = llm, window, max_open_groups
        self.feeder: Feeder | None = None
        self._exhausted = False
        self._steps: list[StepStats] = []       # taken since the last steps()

    def start(self) -> None:
        pass

    def begin(self, batch: Batch) -> None:
        self.feeder = Feeder(batch.plan, batch.heads, batch.prompt, window=self.window,
                             max_open_groups=self.max_open_groups)
        self._exhausted = False

    @property
    def done(self) -> bool:
        return self._exhausted

    def poll(self) -> Iterator[tuple[int, RequestOutput]]:
        llm, feeder = self.llm, self.feeder
        feeder.admit(llm)
        if not feeder.in_flight:
            self._exhausted = True
            return
        outs, stats = llm.step()
        self._steps.append(stats)
        for out in outs:
            p = int(out.request_id)
            feeder.on_finished(llm, p)
            yield p, out

    def steps(self) -> list[tuple[list[StepStats], int]]:
        new, self._steps = self._steps, []
        return [(new, 0)] if new else []

    def close(self) -> None:
        pass

    def engine_info(self) -> EngineInfo:
        return self.llm.info

    def summary(self) -> dict | None:
        return None


__all__ = ["Batch", "Execution", "LocalExecution"]
