"""Which replica computes which planned requests (``batchgen submit --ray``); no Ray in here.

The plan (``pipeline.plan.planner``) puts each prefix group's requests next to each other. For several engine
replicas the driver cuts every group into *units* of at most ``chunk_rows`` consecutive plan positions and
hands them out so that a prefix is prefilled once per replica that serves it:

* **whole groups per replica, following the prefix tree**: the groups, in plan order (depth-first over the
  prefix tree, so groups sharing a system prompt are neighbours), are cut into one contiguous run per replica,
  balanced by predicted compute tokens (prompt tokens not predicted cached, plus ``max_tokens``), each cut
  placed where the two groups beside it share the fewest prefix tokens (those are prefilled again);
* **stealing**: a replica whose queue is empty takes about half the queued work of the replica with the most:
  whole groups that one has not started, from the back of its queue, while they fit in that half; when none
  does, the back half of the chunks of its last group (that group's prefix is then prefilled on both: a
  *split* group, which the manifest counts);
* **faults**: when a replica dies, the unfinished requests of its in-flight units go back to the front of the
  queue with one more try. A unit that has failed before runs *alone* on an idle replica, so a request that
  kills its engine takes no innocent units down with it again; a suspect of several rows that kills its
  replica again is halved, until the killer is alone; a single request at ``max_tries`` deaths is given up
  (the caller writes its error row).

Positions are plan positions (``plan.order`` indices): the request ids the engine sees.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from pipeline.plan.planner import Plan


@dataclass(eq=False)
class Unit:
    uid: int
    group: int
    positions: Sequence[int]             # plan positions, ascending (a range until a lost unit is cut up)
    cost: int                            # predicted compute tokens
    tries: int = 0                       # times a replica died while it was in flight
    left: set[int] = field(default_factory=set)   # positions not finished yet (filled when dispatched)

    def __len__(self) -> int:
        return len(self.positions)


def make_units(plan: Plan, max_tokens: np.ndarray, chunk_rows: int) -> list[Unit]:
    """Every group's plan positions, in plan order, cut into units of at most ``chunk_rows`` (nothing per position
    but the units' ranges)."""
    n = plan.num_requests
    if n == 0:
        return []
    if plan.segments is not None:
        spans = zip(plan.segments[:-1].tolist(), plan.segments[1:].tolist(), plan.group_order)
    else:
        g = plan.group
        starts = np.concatenate([[0], np.nonzero(g[1:] != g[:-1])[0] + 1, [n]]).tolist()
        spans = ((a, b, int(g[a])) for a, b in zip(starts[:-1], starts[1:]))
    units: list[Unit] = []
    step = max(1, chunk_rows)
    for a, b, group in spans:
        for s in range(a, b, step):
            e = min(s + step, b)
            cost = int(plan.prompt_len[s:e].sum(dtype=np.int64) - plan.cached[s:e].sum(dtype=np.int64)
                       + np.sum(max_tokens[s:e], dtype=np.int64))
            units.append(Unit(len(units), int(group), range(s, e), cost))
    return units


class Assigner:
    """Per-replica queues of units; ``take`` what a replica should run next, ``lost`` what a dead one had."""

    def __init__(self, units: list[Unit], num_replicas: int, max_tries: int = 3,
                 shared: Callable[[int, int], int] | None = None):
        self.max_tries = max_tries
        self.queues: list[deque[Unit]] = [deque() for _ in range(num_replicas)]
        self.orphans: deque[Unit] = deque()          # requeued after a replica died
        self.in_flight: list[dict[int, Unit]] = [{} for _ in range(num_replicas)]
        self.retired: set[int] = set()
        self.served: dict[int, set[tuple[int, int]]] = {}   # group -> {(replica, incarnation)} that ran it
        self.incarnation = [0] * num_replicas
        self.stolen = 0                               # units moved to another replica's queue
        self.split: set[int] = set()                  # groups whose chunks were spread over replicas
        self._next_uid = max((u.uid for u in units), default=0)
        owner = _segments(units, num_replicas, shared or (lambda a, b: 0))
        for u in units:                               # units are in plan order: each queue keeps it
            self.queues[owner[u.group]].append(u)

    # ---- queries ----
    def rows_in_flight(self, r: int) -> int:
        return sum(len(u.left) for u in self.in_flight[r].values())

    @property
    def queued(self) -> int:
        return len(self.orphans) + sum(len(q) for q in self.queues)

    @property
    def done(self) -> bool:
        return self.queued == 0 and not any(self.in_flight)

    def prefills(self) -> dict[int, int]:
        """Group -> how many replicas (counting a restarted one anew) computed some of it."""
        return {g: len(s) for g, s in sorted(self.served.items())}

    # ---- handing out ----
    def take(self, r: int, room: int) -> list[Unit]:
        """Units for replica ``r`` that fit in ``room`` rows (at least one when it has nothing in flight)."""
        idle = not self.in_flight[r]
        if any(u.tries for u in self.in_flight[r].values()):
            return []                               # a suspect runs alone
        suspect = next((u for u in self.orphans if u.tries), None) if idle else None
        if suspect is not None:                     # a unit that was in flight when a replica died: alone
            self.orphans.remove(suspect)
            return self._dispatch(r, [suspect])
        out: list[Unit] = []
        while True:
            u = next((o for o in self.orphans if not o.tries), None)
            src = self.orphans
            if u is None:
                src = self.queues[r]
                u = src[0] if src else (None if out else self._steal(r))   # steal for an empty batch only
            if u is None or (len(u) > room and (out or not idle)):
                break
            src.remove(u)
            out.append(u)
            room -= len(u)
        return self._dispatch(r, out)

    def _dispatch(self, r: int, units: list[Unit]) -> list[Unit]:
        for u in units:
            u.left = set(u.positions)
            self.in_flight[r][u.uid] = u
            self.served.setdefault(u.group, set()).add((r, self.incarnation[r]))
        return units

    def _steal(self, r: int) -> Unit | None:
        """Move about half the queued work of the replica with the most into ``r``'s queue (whole groups it has
        not started, from the back, while they fit in that half; else the back half of its last group's chunks);
        returns ``r``'s next unit, or None when no replica has queued work."""
        victims = [v for v in range(len(self.queues)) if v != r and self.queues[v]]
        if not victims:
            return None
        v = max(victims, key=lambda i: (sum(u.cost for u in self.queues[i]), -i))
        q = list(self.queues[v])
        half = sum(u.cost for u in q) / 2
        started = {g for g, s in self.served.items() if any(rr == v for rr, _ in s)}
        moved: list[Unit] = []
        while q:
            gid = q[-1].group
            group = [u for u in q if u.group == gid]
            if gid in started or sum(u.cost for u in moved + group) > half:
                break
            moved = group + moved
            q = [u for u in q if u.group != gid]
        if not moved:                                   # split the last group: its back half of chunks
            gid = q[-1].group
            tail = [u for u in q if u.group == gid]
            take = max(1, len(tail) // 2)
            moved = tail[len(tail) - take:]
            q = q[:len(q) - take]
            if take < len(tail) or gid in started:
                self.split.add(gid)
        self.queues[v] = deque(q)
        self.queues[r].extend(moved)
        self.stolen += len(moved)
        return self.queues[r][0]

    def _halves(self, u: Unit) -> list[Unit]:
        mid = len(u.positions) // 2
        out = []
        for part in (u.positions[:mid], u.positions[mid:]):
            self._next_uid += 1
            out.append(Unit(self._next_uid, u.group, part, u.cost * len(part) // len(u.positions), tries=u.tries))
        return out

    # ---- results and faults ----
    def finished(self, r: int, position: int) -> None:
        for uid, u in list(self.in_flight[r].items()):
            if position in u.left:
                u.left.discard(position)
                if not u.left:
                    del self.in_flight[r][uid]
                return

    def lost(self, r: int, retire: bool) -> list[Unit]:
        """Replica ``r`` died: its unfinished units go back first (a try more); returns those given up.
        ``retire``: no replacement comes, so its queue goes to the others too."""
        given_up = []
        back = []
        for u in sorted(self.in_flight[r].values(), key=lambda u: u.positions[0]):
            u.positions = sorted(u.left)
            if u.tries and len(u.positions) > 1:
                # NOTE: it ran alone and killed its replica again: halve it (both halves still run alone), so the
                # request that kills engines ends up alone and only its own row is given up.
                back += self._halves(u)
                continue
            u.tries += 1
            (given_up if u.tries >= self.max_tries else back).append(u)
        self.in_flight[r] = {}
        self.orphans.extendleft(reversed(back))
        self.incarnation[r] += 1
        if retire:
            self.retired.add(r)
            self.orphans.extend(self.queues[r])
            self.queues[r] = deque()
        return given_up


def _segments(units: list[Unit], k: int, shared: Callable[[int, int], int]) -> dict[int, int]:
    """Group -> replica: the groups in plan order cut into ``k`` contiguous runs. Cut ``j`` goes where
    |cost before the cut - j/k of the total| + the prefix tokens the two groups at the cut share (which the
    second replica must prefill again) is least: the plan's depth-first order keeps groups that share a system
    prompt next to each other, so runs follow the prefix tree."""
    groups: list[int] = []
    cost: dict[int, int] = {}
    for u in units:
        if not groups or groups[-1] != u.group:
            groups.append(u.group)
        cost[u.group] = cost.get(u.group, 0) + u.cost
    m = len(groups)
    cum = np.concatenate([[0], np.cumsum([cost[g] for g in groups])]) if m else np.zeros(1)
    lcp = np.asarray([shared(groups[i], groups[i + 1]) for i in range(m - 1)] + [0], dtype=np.float64)
    total = float(cum[-1])
    cuts, prev = [], 0
    for j in range(1, k):
        if prev + 1 >= m:
            break
        p = np.arange(prev + 1, m)
        score = np.abs(cum[p] - j * total / k) + lcp[p - 1]
        prev = int(p[int(np.argmin(score))])
        cuts.append(prev)
    owner, r = {}, 0
    for i, g in enumerate(groups):
        while r < len(cuts) and i >= cuts[r]:
            r += 1
        owner[g] = r
    return owner


__all__ = ["Unit", "make_units", "Assigner"]
