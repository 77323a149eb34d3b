"""pipeline.execute.ray.assign: whole prefix groups per replica, stealing, requeue after a replica dies (no Ray)."""
from __future__ import annotations

import numpy as np

from pipeline.execute.ray.assign import Assigner, make_units
from pipeline.plan.planner import Plan


def plan_of(group_sizes: list[int], prompt_len=100, head_cached=80) -> Plan:
    """Groups in plan order; every row but a group's first has ``head_cached`` tokens predicted cached."""
    group = np.concatenate([np.full(n, g) for g, n in enumerate(group_sizes)])
    first = np.concatenate([[True] + [False] * (n - 1) for n in group_sizes])
    n = len(group)
    return Plan(order=np.arange(n), cached=np.where(first, 0, head_cached), provider=np.full(n, -1),
                prompt_len=np.full(n, prompt_len), group=group, group_order=list(range(len(group_sizes))),
                block_size=16)


def test_units_cut_groups_in_plan_order_and_cost_compute_tokens():
    units = make_units(plan_of([5, 2]), np.full(7, 10), chunk_rows=2)
    assert [(u.group, list(u.positions)) for u in units] == [(0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [5, 6])]
    assert [u.cost for u in units] == [100 + 10 + 20 + 10, 2 * 30, 30, 110 + 30]


def test_groups_are_cut_into_balanced_contiguous_runs():
    units = make_units(plan_of([8, 4, 3, 1, 6]), np.zeros(22, dtype=int), chunk_rows=4)
    a = Assigner(units, 2)
    # costs 240, 160, 140, 100, 200 (head 100 + 20 per follower); half of 840 is 420: cut after group 1 (400)
    assert [[u.group for u in q] for q in a.queues] == [[0, 0, 1], [2, 3, 4, 4]]


def test_cuts_fall_where_neighbouring_groups_share_the_least_prefix():
    units = make_units(plan_of([1, 1, 1, 1]), np.zeros(4, dtype=int), chunk_rows=4)    # 100 each
    shared = {(0, 1): 300, (1, 2): 0, (2, 3): 300}
    a = Assigner(units, 2, shared=lambda x, y: shared[(x, y)])
    assert [[u.group for u in q] for q in a.queues] == [[0, 1], [2, 3]]
    shared = {(0, 1): 0, (1, 2): 300, (2, 3): 300}          # uneven (100 / 300) beats prefilling 300 again
    a = Assigner(units, 2, shared=lambda x, y: shared[(x, y)])
    assert [[u.group for u in q] for q in a.queues] == [[0], [1, 2, 3]]
    assert [[u.group for u in q] for q in Assigner(units, 3).queues] == [[0], [1, 2], [3]]


def test_take_fills_the_room_and_sticks_to_own_queue():
    a = Assigner(make_units(plan_of([8, 8]), np.zeros(16, dtype=int), chunk_rows=2), 2)
    got = a.take(0, room=5)
    assert [list(u.positions) for u in got] == [[0, 1], [2, 3]]    # a third unit would overflow 5
    assert a.rows_in_flight(0) == 4 and a.take(0, room=1) == []
    for p in (0, 1):
        a.finished(0, p)
    assert a.rows_in_flight(0) == 2 and list(a.in_flight[0]) == [1]


def test_idle_replica_steals_a_whole_unstarted_group_before_splitting_one():
    a = Assigner(make_units(plan_of([4, 2, 2]), np.zeros(8, dtype=int), chunk_rows=2), 2)
    assert [{u.group for u in q} for q in a.queues] == [{0}, {1, 2}]
    a.take(1, room=2)                                  # replica 1 starts group 1
    first = a.take(0, room=4)                          # replica 0 takes all of group 0
    assert {u.group for u in first} == {0}
    for u in first:
        for p in u.positions:
            a.finished(0, p)
    stolen = a.take(0, room=2)                         # idle: takes group 2, which replica 1 has not started
    assert [u.group for u in stolen] == [2] and a.stolen == 1 and a.split == set()
    assert a.prefills() == {0: 1, 1: 1, 2: 1}


def test_stealing_takes_about_half_of_the_victims_queue_in_whole_groups():
    from collections import deque
    units = make_units(plan_of([2, 2, 2, 2]), np.zeros(8, dtype=int), chunk_rows=2)   # 120 each
    a = Assigner([], 2)
    a.queues[1] = deque(units)
    assert [u.group for u in a.take(1, room=2)] == [0]          # replica 1 starts group 0
    # replica 0 has nothing: whole unstarted groups from the back of replica 1's queue (1, 2, 3 are left there,
    # 360 in all): while they fit in half of it -> group 3 only
    got = a.take(0, room=2)
    assert [u.group for u in got] == [3] and a.split == set() and a.stolen == 1
    assert [u.group for u in a.queues[1]] == [1, 2]


def test_stealing_a_chunk_of_a_started_group_counts_a_second_prefill():
    a = Assigner(make_units(plan_of([6]), np.zeros(6, dtype=int), chunk_rows=2), 2)
    a.take(0, room=2)
    got = a.take(1, room=2)                            # replica 1 has no queue: the last chunk of group 0
    assert [list(u.positions) for u in got] == [[4, 5]]
    assert a.prefills() == {0: 2} and a.split == {0}


def test_dead_replica_requeues_unfinished_rows_which_then_run_alone():
    a = Assigner(make_units(plan_of([4, 4]), np.zeros(8, dtype=int), chunk_rows=2), 2)
    a.take(0, room=4)                                  # [0,1], [2,3]
    a.finished(0, 0)
    assert a.lost(0, retire=False) == []
    assert [(u.positions, u.tries) for u in a.orphans] == [([1], 1), ([2, 3], 1)]
    busy = a.take(1, room=4)                           # replica 1 is idle: takes one suspect, alone
    assert [list(u.positions) for u in busy] == [[1]]
    assert a.take(1, room=4) == []                     # nothing next to a suspect while it runs
    a.finished(1, 1)
    assert [list(u.positions) for u in a.take(1, room=4)] == [[2, 3]]
    assert a.incarnation == [1, 0]


def test_a_request_that_keeps_killing_replicas_is_isolated_then_given_up_alone():
    a = Assigner(make_units(plan_of([2, 2]), np.zeros(4, dtype=int), chunk_rows=2), 2, max_tries=2)
    a.take(0, room=2)                                  # [0, 1]; position 1 kills every engine it meets
    assert a.lost(0, retire=False) == []               # a suspect now
    [u] = a.take(0, room=2)
    assert u.positions == [0, 1]                       # alone on the replacement; dies again: halved
    assert a.lost(0, retire=False) == []
    assert [(o.positions, o.tries) for o in a.orphans] == [([0], 1), ([1], 1)]
    [u] = a.take(0, room=2)
    a.finished(0, 0)                                   # the innocent half succeeds
    [u] = a.take(0, room=2)
    [gone] = a.lost(0, retire=False)                   # the killer, alone, at its second death
    assert gone.positions == [1] and gone.tries == 2
    assert not a.orphans and not a.in_flight[0]


def test_a_retired_replica_hands_its_queue_to_the_others():
    a = Assigner(make_units(plan_of([2, 2]), np.zeros(4, dtype=int), chunk_rows=2), 2)
    assert a.lost(1, retire=True) == []
    assert a.retired == {1}
    got = a.take(0, room=10)
    assert sorted(p for u in got for p in u.positions) == [0, 1, 2, 3]
    for p in range(4):
        a.finished(0, p)
    assert a.done
