"""Step 3 of a run: one planned batch of requests through an ``Execution``.

    Batch           (``pipeline.plan.batch``) a plan and what its positions mean
    Execution       what computes a batch, finished request by finished request. ``Runner`` drives one loop over
                    it (commit, stop, progress) whatever computes:
                      LocalExecution  (here) the engine in this process, fed by ``pipeline.execute.feeder.Feeder``
                      RayExecution    (``pipeline.execute.ray.driver``) engine replicas as Ray actors

    ex.start(); ex.begin(batch)
    while not ex.done:              # the caller's checks between polls: commit when due, stop when asked
        for position, output in ex.poll(): ...
        for steps, source in ex.steps(): ...
    ex.close()

Request ids the engine sees are plan positions.

Test hook ``BATCHGEN_FAULT=step-delay:S`` (as ``BATCHGEN_RAY_FAULT``'s): sleep S seconds after every local engine
step, so a tiny model's run lasts long enough to be killed mid-way (tests of resume, cancel and the server).
"""
from __future__ import annotations

import os
import time
from typing import Iterator, Protocol

from engine import Engine, EngineInfo, RequestOutput, StepStats
from pipeline.execute.feeder import Feeder
from pipeline.plan.batch import Batch


def step_delay(faults: list[str]) -> float:
    """The seconds a fault list's ``step-delay:S`` entries ask to sleep after each engine step (test hook)."""
    return sum(float(f.strip().partition(":")[2]) for f in faults if f.strip().startswith("step-delay:"))


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
        self._step_delay = step_delay(os.environ.get("BATCHGEN_FAULT", "").split(","))

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
        if self._step_delay:
            time.sleep(self._step_delay)
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
