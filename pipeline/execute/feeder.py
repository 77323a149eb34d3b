"""Admission: which planned requests enter the engine, and when.

The plan orders requests so each shared prefix is computed once (``pipeline.plan.planner``). The feeder keeps a
bounded window of them in the engine and releases followers as their provider starts:

* ``ready`` holds the plan positions whose provider is already in the engine (or who have none), smallest first:
  sorted arrays merged by a heap of their next positions (``_Sorted``), so its memory grows with the providers,
  not with the rows (a provider's followers become ready together);
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
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from pipeline.plan.planner import Plan


class _Sorted:
    """Positions from sorted int arrays, smallest first: a heap of (next position, array id), a cursor per array."""

    def __init__(self):
        self._heap: list[tuple[int, int]] = []
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}
        self._ids = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, positions: np.ndarray) -> None:
        if len(positions):
            i = next(self._ids)
            self._arrays[i] = (positions, 0)
            heapq.heappush(self._heap, (int(positions[0]), i))

    def peek(self) -> int:
        return self._heap[0][0]

    def pop(self) -> int:
        p, i = heapq.heappop(self._heap)
        arr, cur = self._arrays[i]
        if cur + 1 < len(arr):
            self._arrays[i] = (arr, cur + 1)
            heapq.heappush(self._heap, (int(arr[cur + 1]), i))
        else:
            del self._arrays[i]
        return p


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
    _ready: _Sorted = field(default_factory=_Sorted)
    _waiters: dict[int, np.ndarray] = field(default_factory=dict)    # provider -> followers not yet ready (sorted)
    _dependents: dict[int, int] = field(default_factory=dict)        # provider -> followers not yet finished
    _open_groups: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        # each provider's followers, in plan order (int32 positions: 4 bytes a follower), and the positions with
        # no provider; the plan's providers are made a slice at a time (nothing else the size of the plan)
        self._ready = _Sorted()
        parts: dict[int, list[np.ndarray]] = {}
        n, step = self.plan.num_requests, 1 << 20
        for a in range(0, n, step):
            provider = self.plan.providers(a, min(a + step, n))
            self._ready.add((np.flatnonzero(provider < 0) + a).astype(np.int32))
            followers = np.flatnonzero(provider >= 0)
            by_provider = followers[np.argsort(provider[followers], kind="stable")]
            providers, starts = np.unique(provider[by_provider], return_index=True)
            ends = np.append(starts[1:], len(by_provider))
            for p, s, e in zip(providers.tolist(), starts.tolist(), ends.tolist()):
                parts.setdefault(p, []).append((by_provider[s:e] + a).astype(np.int32))
        self._waiters = {p: w[0] if len(w) == 1 else np.concatenate(w) for p, w in parts.items()}
        self._dependents = {p: len(w) for p, w in self._waiters.items()}

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
            p = self._ready.peek()
            g = self.plan.group_at(p)
            if p in self._dependents and g not in self._open_groups and self.in_flight \
                    and len(self._open_groups) >= self.max_open_groups:
                break
            self._ready.pop()
            if p in self._dependents:
                self._open_groups.add(g)
            if p in self._waiters:
                # NOTE: the engine refuses pins past its budget (None); an unpinned head is only likelier to
                # be evicted.
                pin_id = engine.pin_prefix(list(self.heads[g]))
                if pin_id is not None:
                    self.pins[p] = pin_id
                self._ready.add(self._waiters.pop(p))
            ids, params = self.prompt_of(p)
            engine.add_request(str(p), ids, params, priority=p)
            self.in_flight.add(p)
            added += 1
        return added

    def on_finished(self, engine, position: int) -> None:
        """Position ``position`` finished: release its provider's pin when it was the last follower."""
        self.in_flight.discard(position)
        self.finished += 1
        prov = self.plan.provider_at(position)
        if prov < 0:
            return
        self._dependents[prov] -= 1
        if self._dependents[prov] == 0:
            if prov in self.pins:
                engine.unpin_prefix(self.pins.pop(prov))
            self._open_groups.discard(self.plan.group_at(prov))


__all__ = ["Feeder"]
