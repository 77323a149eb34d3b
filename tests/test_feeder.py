"""pipeline.execute.feeder: admission in plan order under a window, followers released when their provider is admitted,
one pin per provider released after its last follower, a bound on open groups that never stalls. No engine:
a recorder stands in for the three calls the feeder makes."""
from __future__ import annotations

import numpy as np

from pipeline.execute.feeder import Feeder
from pipeline.plan.planner import Plan


class Recorder:
    def __init__(self, pin_budget: int = 1 << 30):
        self.calls: list[tuple] = []
        self.pin_budget = pin_budget
        self.live_pins: set[int] = set()

    def add_request(self, rid, ids, params, priority=0):
        self.calls.append(("add", int(rid), priority))

    def pin_prefix(self, ids):
        if len(self.live_pins) >= self.pin_budget:
            self.calls.append(("pin-refused", tuple(ids)))
            return None
        pid = len(self.calls)
        self.live_pins.add(pid)
        self.calls.append(("pin", tuple(ids), pid))
        return pid

    def unpin_prefix(self, pid):
        self.live_pins.remove(pid)
        self.calls.append(("unpin", pid))

    def added(self):
        return [c[1] for c in self.calls if c[0] == "add"]


def _plan(groups: list[int], providers: list[int]) -> Plan:
    n = len(groups)
    return Plan(order=np.arange(n), cached=np.zeros(n, dtype=np.int64), provider=np.asarray(providers),
                prompt_len=np.full(n, 32), group=np.asarray(groups), group_order=sorted(set(groups)), block_size=16)


HEADS = [(1, 2), (3, 4), (5, 6)]


def _feeder(plan, window, **kw):
    return Feeder(plan, HEADS, lambda p: ([p], None), window=window, **kw)


def test_followers_join_with_their_provider_and_pin_is_released_after_the_last():
    # group 0: provider 0, followers 1, 2; group 1: provider 3, follower 4; 5 stands alone
    plan = _plan([0, 0, 0, 1, 1, 2], [-1, 0, 0, -1, 3, -1])
    eng = Recorder()
    f = _feeder(plan, window=10)
    assert f.admit(eng) == 6
    assert eng.added() == [0, 1, 2, 3, 4, 5]                    # plan order; followers right after provider
    pins = [c for c in eng.calls if c[0] == "pin"]
    assert [c[1] for c in pins] == [HEADS[0], HEADS[1]]          # one pin per provider with followers
    assert eng.calls.index(pins[0]) < eng.calls.index(("add", 0, 0))   # pinned before its requests run
    f.on_finished(eng, 1)
    f.on_finished(eng, 0)
    assert not any(c[0] == "unpin" for c in eng.calls)           # follower 2 still needs the head
    f.on_finished(eng, 2)
    assert eng.calls[-1] == ("unpin", pins[0][2]) and f.pins.keys() == {3}
    for p in (3, 4, 5):
        f.on_finished(eng, p)
    assert f.done and not eng.live_pins and not f.in_flight


def test_window_bounds_requests_in_the_engine():
    plan = _plan([0] * 5, [-1, 0, 0, 0, 0])
    eng = Recorder()
    f = _feeder(plan, window=2)
    assert f.admit(eng) == 2 and eng.added() == [0, 1]
    assert f.admit(eng) == 0                                     # full
    f.on_finished(eng, 0)
    assert f.admit(eng) == 1 and eng.added() == [0, 1, 2]


def test_open_groups_are_bounded_but_never_stall():
    # three groups, each a provider with one follower; at most one open group at once
    plan = _plan([0, 0, 1, 1, 2, 2], [-1, 0, -1, 2, -1, 4])
    eng = Recorder()
    f = _feeder(plan, window=10, max_open_groups=1)
    f.admit(eng)
    assert eng.added() == [0, 1]                                 # group 1 waits for group 0 to close
    f.on_finished(eng, 0)
    f.admit(eng)
    assert eng.added() == [0, 1]
    f.on_finished(eng, 1)                                        # group 0 closed
    f.admit(eng)
    assert eng.added() == [0, 1, 2, 3] and f.num_open_groups == 1
    # with nothing in flight a new group always opens (no stall even at the bound)
    f2 = _feeder(_plan([0, 0], [-1, 0]), window=10, max_open_groups=0)
    assert f2.admit(Recorder()) == 2


def test_refused_pin_still_admits_everyone():
    plan = _plan([0, 0, 1, 1], [-1, 0, -1, 2])
    eng = Recorder(pin_budget=1)
    f = _feeder(plan, window=10)
    f.admit(eng)
    assert eng.added() == [0, 1, 2, 3]
    assert [c[0] for c in eng.calls if c[0].startswith("pin")] == ["pin", "pin-refused"]
    for p in range(4):
        f.on_finished(eng, p)
    assert f.done and not eng.live_pins


def test_a_large_plan_is_admitted_in_order_from_arrays_not_per_row_objects():
    """100,000 positions in 3 groups (each a provider and its followers) and 1,000 alone, admitted through a window
    of 64: the admission order is the old per-row heap's, and the ready set is a few sorted arrays at any time
    (one per released provider and one of positions without a provider), never a Python object per row."""
    n, rng = 101_000, np.random.default_rng(0)
    groups = np.sort(rng.integers(0, 3, n - 1_000)).tolist() + [2] * 1_000
    starts = {g: groups.index(g) for g in range(3)}
    providers = [-1 if i == starts[g] or i >= n - 1_000 else starts[g] for i, g in enumerate(groups)]
    plan = _plan(groups, providers)
    eng, f = Recorder(), _feeder(plan, window=64)
    most = 0
    while not f.done:
        f.admit(eng)
        most = max(most, len(f._ready._arrays))
        for p in sorted(f.in_flight)[:16]:
            f.on_finished(eng, p)
    assert eng.added() == list(range(n)) and most <= 4 and f.done and not eng.live_pins
