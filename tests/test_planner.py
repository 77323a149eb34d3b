"""Planner: depth-first, larger subtrees first; predicted hits follow the engine's rules; providers."""
import numpy as np
import pytest

from pipeline.plan.planner import make_plan, make_plan_streamed, order_groups

BS = 4


def test_order_is_depth_first_larger_subtrees_first():
    sys_a, sys_b = [1] * 8, [2] * 8
    heads = [tuple(sys_b + [5] * 4), tuple(sys_a + [3] * 4), tuple(sys_a + [4] * 4)]
    # sys_a subtree holds 2 + 3 = 5 requests, sys_b 4: sys_a's groups first, larger (group 2) first.
    assert order_groups(heads, [4, 2, 3], BS) == [2, 1, 0]


def test_predicted_hits_and_providers():
    heads = [tuple(range(10, 22)), tuple(range(10, 18)) + (99, 98, 97, 96)]   # share 2 blocks, 3 full each
    groups = np.array([0, 1, 0, 1, 0])
    lens = np.array([20, 20, 20, 13, 20])
    plan = make_plan(heads, groups, lens, BS)
    assert plan.group.tolist() == [0, 0, 0, 1, 1]                   # group 0 is larger
    assert plan.order.tolist() == [0, 2, 4, 1, 3]                   # input order within a group
    # leader of group 0: nothing cached; followers: 3 head blocks; group 1's leader: the 2 shared blocks;
    # its follower (13 tokens, cap (13-1)//4 = 3 blocks) gets 3 blocks.
    assert plan.cached.tolist() == [0, 12, 12, 8, 12]
    assert plan.provider.tolist() == [-1, 0, 0, 0, 3]
    assert plan.hit_rate == 44 / 93


def test_last_token_always_computed():
    heads = [tuple(range(8))]                                        # exactly 2 blocks
    plan = make_plan(heads, np.array([0, 0]), np.array([8, 8]), BS)  # prompt == head: cap is 1 block
    assert plan.cached.tolist() == [0, 4]


def test_order_independent_of_input_order():
    rng = np.random.default_rng(0)
    heads = [tuple([g] * 8 + [g + 100] * (4 * g)) for g in range(5)]
    groups = rng.integers(0, 5, size=50)
    lens = rng.integers(30, 60, size=50)
    a = make_plan(heads, groups, lens, BS)
    perm = rng.permutation(50)
    b = make_plan(heads, groups[perm], lens[perm], BS)
    assert a.group_order == b.group_order and a.cached_tokens == b.cached_tokens


def test_streamed_plan_equals_the_whole_plan_however_chunked():
    """``make_plan_streamed`` (a counting sort over chunks, copies left out) gives the plan ``make_plan`` gives
    the kept requests, and its per-position group and provider (from segments) equal the arrays."""
    rng = np.random.default_rng(1)
    heads = [tuple([1] * 8 + [g + 2] * (4 * (g % 3))) for g in range(6)]
    n = 200
    groups = rng.integers(0, 6, size=n).astype(np.int32)
    lens = rng.integers(2, 40, size=n).astype(np.int32)
    keep = rng.random(n) > 0.2
    whole = make_plan(heads, groups[keep], lens[keep], BS)
    kept_index = np.flatnonzero(keep)
    for rows in (1, 7, 64, n):
        sizes = np.bincount(groups[keep], minlength=6).tolist()
        chunks = [(a, groups[a:a + rows], lens[a:a + rows], keep[a:a + rows]) for a in range(0, n, rows)]
        plan = make_plan_streamed(heads, sizes, lambda: iter(chunks), BS)
        assert plan.order.tolist() == kept_index[whole.order].tolist()
        assert plan.cached.tolist() == whole.cached.tolist() and plan.group_order == whole.group_order
        assert plan.provider.tolist() == whole.provider.tolist() and plan.group.tolist() == whole.group.tolist()
        assert [plan.provider_at(p) for p in range(plan.num_requests)] == whole.provider.tolist()
        assert [plan.group_at(p) for p in range(plan.num_requests)] == whole.group.tolist()
        fresh = make_plan_streamed(heads, sizes, lambda: iter(chunks), BS)      # providers(): no array made
        m = plan.num_requests
        assert all(fresh.providers(a, b).tolist() == whole.provider[a:b].tolist()
                   for a, b in ((0, 0), (0, 5), (3, 90), (17, m), (m, m)))
    bad = [(0, groups, lens, None)]                                  # the sizes say copies were left out
    with pytest.raises(ValueError, match="group sizes"):
        make_plan_streamed(heads, np.bincount(groups[keep], minlength=6).tolist(), lambda: iter(bad), BS)
