"""Admission: which planned requests enter the engine, and when.

The plan orders requests so each shared prefix is computed once (``pipeline.plan.planner``). The feeder keeps a
bounded window of them in the engine and releases followers as their provider starts:

* ``ready`` is a heap of plan positions whose provider is already in the engine (or who have none);
* when a provider is admitted, its group's head is pinned (while followers still need it) and its followers
  become ready at once. NOTE: they may join in the same step: the engine admits by priority (= plan
  position), so the provider is scheduled first and registers its prefix blocks in the step it computes them.
  Waiting for the provider to *finish* would leave the batch at one request per group for its whole decode;
* at most ``max_open_groups`` heads are pinned at once, but admission never stalls with nothing in flight;
* when a provider's last follower finishes, its pin is released.

It talks to the engine only through ``add_request`` / ``pin_prefix`` / ``unpin_prefix`` (``engine.Engine``);
which prompt a position means is the caller's ``prompt_of(position) -> (token ids, params)``. No engine is
needed to test it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from pipeline.plan.planner import Plan


@dataclass
class Feeder:
    plan: Plan
    heads: Sequence[Sequence[int]]                 # group id -> the shared head's token ids
    prompt_of: Callable[[int], tuple[list[int], object]]   # plan position -> (token ids, SamplingParams)
    window: int                                    # requests kept in the engine at most
    max_open_groups: int = 16                      # shared heads pinned at once
    in_flight: set[int] = field(default_factory=set)
    finished: int = 0
    pins: dict[int, int] = field(default_factory=dict)        # provider position -> pin id
    _ready: list[int] = field(default_factory=list)
    _waiters: dict[int, list[int]] = field(default_factory=dict)     # provider -> followers not yet ready
    _dependents: dict[int, int] = field(default_factory=dict)        # provider -> followers not yet finished
    _open_groups: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        provider = self.plan.provider
        for p in np.nonzero(provider >= 0)[0].tolist():
            self._waiters.setdefault(int(provider[p]), []).append(p)
        self._dependents = {p: len(w) for p, w in self._waiters.items()}
        self._ready = [p for p in range(self.plan.num_requests) if provider[p] < 0]
        heapq.heapify(self._ready)

    @property
    def done(self) -> bool:
        return self.finished == self.plan.num_requests

    @property
    def num_open_groups(self) -> int:
        return len(self._open_groups)

    def admit(self, engine) -> int:
        """Add ready requests (plan order) until the window is full; returns how many were added."""
        added = 0
        while self._ready and len(self.in_flight) < self.window:
            p = self._ready[0]
            g = int(self.plan.group[p])
            if p in self._dependents and g not in self._open_groups and self.in_flight \
                    and len(self._open_groups) >= self.max_open_groups:
                break
            heapq.heappop(self._ready)
            if p in self._dependents:
                self._open_groups.add(g)
            if p in self._waiters:
                # NOTE: the engine refuses pins past its budget (None); an unpinned head is only likelier to
                # be evicted.
                pin_id = engine.pin_prefix(list(self.heads[g]))
                if pin_id is not None:
                    self.pins[p] = pin_id
                for w in self._waiters.pop(p):
                    heapq.heappush(self._ready, w)
            ids, params = self.prompt_of(p)
            engine.add_request(str(p), ids, params, priority=p)
            self.in_flight.add(p)
            added += 1
        return added

    def on_finished(self, engine, position: int) -> None:
        """Position ``position`` finished: release its provider's pin when it was the last follower."""
        self.in_flight.discard(position)
        self.finished += 1
        prov = int(self.plan.provider[position])
        if prov < 0:
            return
        self._dependents[prov] -= 1
        if self._dependents[prov] == 0:
            if prov in self.pins:
                engine.unpin_prefix(self.pins.pop(prov))
            self._open_groups.discard(int(self.plan.group[prov]))


__all__ = ["Feeder"]
