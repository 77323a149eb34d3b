"""The plan: which request runs when, so that every shared prefix is computed once and reused.

Input: the prompt groups (one per distinct head = text before the document, as token ids) and, per request,
its group and prompt length. Output: an order over requests, the cached tokens each is predicted to get, and
its *provider* (the earlier request whose computed blocks it reuses), which the runner uses as a gate:

    prefix tree over full blocks of the heads (block_size tokens per edge)

        root ── [sys A blocks] ──┬── [ref 1 blocks] ── group 0 (120 docs)
                                 └── [ref 2 blocks] ── group 1 (80 docs)
        root ── [sys B blocks] ───── [ref 3 blocks] ── group 2 (50 docs)

    order: depth-first, larger subtrees first -> group 0, group 1, group 2; rows of a group in input order.

The prediction replays the engine's prefix cache rules: full blocks only, and the last prompt token is always
computed (``hit <= (prompt_len - 1) // block_size`` blocks). Blocks are assumed to stay cached while needed:
the feeder (pipeline/execute/feeder.py) makes that true by pinning a group's head and by admitting a request no earlier
than its provider: the engine schedules by priority (plan position), so the provider computes and registers
the shared blocks first, even when both join the same step. Hits inside documents (two documents opening with
the same 16+ tokens) are not predicted.

Memory: per request 12 bytes (order, prompt length and cached tokens by position, int32). A group's rows are
contiguous, so the group and the provider of a position are worked out from per-group segments (``group_at``,
``provider_at``); the whole arrays are made only when asked for (``group``, ``provider``). ``make_plan_streamed``
takes the requests a chunk at a time (a counting sort), so planning holds nothing else per request; token ids
are held once per group.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

INDEX = np.int32          # request indices, positions, group ids and token counts: 4 bytes each (< 2^31)

# (first request index, group ids, prompt lengths, keep) of consecutive requests; keep: planned (not a copy)
Chunk = tuple[int, np.ndarray, np.ndarray, np.ndarray | None]


class Plan:
    """``order``: request index at each plan position; ``cached`` / ``prompt_len``: by position; ``group_order``:
    group ids in plan order. Planned by ``make_plan``: ``segments[i]`` is the first position of ``group_order[i]``
    (one more entry: the end) and ``along[i]`` the position computing each of its head's blocks. Otherwise (the
    baselines, a subset) ``group`` and ``provider`` are given by position."""

    def __init__(self, order: np.ndarray, cached: np.ndarray, prompt_len: np.ndarray, group_order: list[int],
                 block_size: int, *, provider: np.ndarray | None = None, group: np.ndarray | None = None,
                 segments: np.ndarray | None = None, along: list[np.ndarray] | None = None):
        self.order, self.cached, self.prompt_len = order, cached, prompt_len
        self.group_order, self.block_size = list(group_order), block_size
        if segments is None and (provider is None or group is None):
            raise ValueError("a Plan needs its segments, or its group and provider by position")
        self.segments, self.along = segments, along
        self._group, self._provider = group, provider

    @property
    def num_requests(self) -> int:
        return int(self.order.shape[0])

    # ---- by position ----
    def _segment(self, p: int) -> int:
        return int(np.searchsorted(self.segments, p, side="right")) - 1

    def group_at(self, p: int) -> int:
        if self._group is not None:
            return int(self._group[p])
        return int(self.group_order[self._segment(p)])

    def provider_at(self, p: int) -> int:
        if self._provider is not None:
            return int(self._provider[p])
        hits = int(self.cached[p]) // self.block_size
        return int(self.along[self._segment(p)][hits - 1]) if hits > 0 else -1

    @property
    def group(self) -> np.ndarray:
        """Group id by position (made on first use: 4 bytes a request)."""
        if self._group is None:
            self._group = np.repeat(np.asarray(self.group_order, dtype=INDEX),
                                    np.diff(self.segments)).astype(INDEX, copy=False)
        return self._group

    @property
    def provider(self) -> np.ndarray:
        """Provider position by position, -1 for none (made on first use: 4 bytes a request)."""
        if self._provider is None:
            self._provider = self.providers(0, self.num_requests)
        return self._provider

    def providers(self, start: int, stop: int) -> np.ndarray:
        """The provider positions of positions ``start``..``stop``-1 (-1: none), made for that slice alone."""
        if self._provider is not None:
            return self._provider[start:stop]
        out = np.full(stop - start, -1, dtype=INDEX)
        i = self._segment(start) if stop > start else len(self.along)
        while i < len(self.along) and self.segments[i] < stop:
            a, b = max(int(self.segments[i]), start), min(int(self.segments[i + 1]), stop)
            hits = self.cached[a:b] // self.block_size
            table = np.append(self.along[i], -1).astype(INDEX)
            out[a - start:b - start] = np.where(hits > 0, table[np.maximum(hits - 1, 0)], -1)
            i += 1
        return out

    def subset(self, mask: np.ndarray) -> "Plan":
        """The plan positions where ``mask`` is true, in plan order (providers are not remapped: -1 kept only)."""
        group = self.group[mask]
        return Plan(self.order[mask], self.cached[mask], self.prompt_len[mask],
                    [g for g in self.group_order if (group == g).any()], self.block_size,
                    provider=np.where(self.provider[mask] < 0, -1, 0).astype(INDEX), group=group)

    # ---- totals ----
    @property
    def prompt_tokens(self) -> int:
        return plan_sum(self.prompt_len)

    @property
    def cached_tokens(self) -> int:
        return plan_sum(self.cached)

    @property
    def tokens_to_compute(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def plan_sum(a: np.ndarray, where: np.ndarray | slice = slice(None)) -> int:
    """An int32 array's sum in int64 (of the positions ``where`` is true: a mask), a slice at a time (no int64
    copy the size of the plan)."""
    step = 1 << 20
    if isinstance(where, slice):
        return sum(int(a[i:i + step].sum(dtype=np.int64)) for i in range(0, len(a), step))
    return sum(int(a[i:i + step][where[i:i + step]].sum(dtype=np.int64)) for i in range(0, len(a), step))


class _Node:
    __slots__ = ("children", "groups", "size", "key")

    def __init__(self, key: tuple = ()):
        self.children: dict[tuple, _Node] = {}
        self.groups: list[int] = []     # groups whose head's full blocks end at this node
        self.size = 0                   # requests in this subtree
        self.key = key


def order_groups(heads: list[tuple[int, ...]], group_sizes: list[int], block_size: int) -> list[int]:
    """Group ids in depth-first order over the block-level prefix tree, larger subtrees first.

    Ties break on token ids, so the order depends only on the set of prompts, never on input order.
    """
    root = _Node()
    for gid, head in enumerate(heads):
        node = root
        node.size += group_sizes[gid]
        for b in range(len(head) // block_size):
            key = tuple(head[b * block_size:(b + 1) * block_size])
            node = node.children.setdefault(key, _Node(key))
            node.size += group_sizes[gid]
        node.groups.append(gid)

    out: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(sorted(node.groups, key=lambda g: (-group_sizes[g], heads[g])))
        kids = sorted(node.children.values(), key=lambda n: (-n.size, n.key))
        stack.extend(reversed(kids))
    return out


def make_plan(heads: list[tuple[int, ...]], request_group: np.ndarray, prompt_len: np.ndarray,
              block_size: int) -> Plan:
    """Plan requests. ``request_group[i]`` is request i's group id, ``prompt_len[i]`` its prompt length.

    Within a group, requests keep their given (input) order.
    """
    request_group = np.asarray(request_group, dtype=INDEX)
    prompt_len = np.asarray(prompt_len, dtype=INDEX)
    sizes = np.bincount(request_group, minlength=len(heads)) if len(request_group) else \
        np.zeros(len(heads), dtype=np.int64)
    return make_plan_streamed(heads, sizes.tolist(), lambda: iter([(0, request_group, prompt_len, None)]),
                              block_size)


def make_plan_streamed(heads: list[tuple[int, ...]], sizes: list[int], chunks: Callable[[], Iterable[Chunk]],
                       block_size: int) -> Plan:
    """``make_plan`` over requests read a chunk at a time (``chunks()``: ``Chunk``s in request order, read once);
    ``sizes[g]``: how many kept requests group g has. A counting sort: each group's first position is known from
    the sizes, so every request goes straight to its position; input order is kept within a group."""
    group_order = [g for g in order_groups(heads, sizes, block_size) if sizes[g]]
    n = int(sum(sizes))
    starts = np.zeros(len(group_order) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([sizes[g] for g in group_order])
    fill = np.zeros(len(heads), dtype=np.int64)         # by group id: its next free position
    fill[group_order] = starts[:-1]
    stop = np.zeros(len(heads), dtype=np.int64)         # by group id: its end (0 for a group with no request)
    stop[group_order] = starts[1:]
    order = np.empty(n, dtype=INDEX)
    plen = np.empty(n, dtype=INDEX)
    for first, groups, lens, keep in chunks():
        index = np.arange(first, first + len(groups), dtype=INDEX)
        if keep is not None:
            index, groups, lens = index[keep], groups[keep], lens[keep]
        s = np.argsort(groups, kind="stable")
        gs = groups[s]
        ids, at, counts = np.unique(gs, return_index=True, return_counts=True)
        if (fill[ids] + counts > stop[ids]).any():
            raise ValueError("the chunks' requests do not match the group sizes")
        pos = fill[gs] + (np.arange(len(gs)) - np.repeat(at, counts))
        order[pos] = index[s]
        plen[pos] = lens[s]
        fill[ids] += counts
    if not np.array_equal(fill[group_order], starts[1:]):
        raise ValueError("the chunks' requests do not match the group sizes")
    cached = np.zeros(n, dtype=INDEX)
    along_of: list[np.ndarray] = []
    node_ids: dict[tuple[int, tuple], int] = {}   # (parent node id, block's tokens) -> node id: a block chain
    computed_by: dict[int, int] = {}               # node id -> plan position of the request computing it
    for i, g in enumerate(group_order):
        pos, end = int(starts[i]), int(starts[i + 1])
        head = heads[g]
        k = len(head) // block_size
        path, parent = [], -1
        for b in range(k):
            parent = node_ids.setdefault((parent, tuple(head[b * block_size:(b + 1) * block_size])), len(node_ids))
            path.append(parent)
        # The group's first request (the leader) reuses what earlier groups computed ...
        depth = 0
        while depth < k and path[depth] in computed_by:
            depth += 1
        along = np.asarray([computed_by.get(p, pos) for p in path], dtype=INDEX)   # who computes each head block
        for b in range(depth, k):
            computed_by[path[b]] = pos
        # ... and every request (leader included) gets min(blocks available, cap) blocks.
        caps = np.maximum((plen[pos:end] - 1) // block_size, 0)
        hits = np.minimum(caps, k)
        hits[0] = min(int(caps[0]), depth)
        cached[pos:end] = hits * block_size
        along_of.append(along)
    return Plan(order, cached, plen, group_order, block_size, segments=starts, along=along_of)


def unplanned(request_group: np.ndarray, prompt_len: np.ndarray, block_size: int, how: str,
              seed: int = 0) -> Plan:
    """Baselines for benchmarking the planner: rows fed as given ("input") or shuffled ("shuffled"), with
    no grouping, gating or pinning (what a script around an engine would do). Hits are not predicted."""
    request_group = np.asarray(request_group, dtype=INDEX)
    n = request_group.shape[0]
    order = (np.arange(n) if how == "input" else np.random.default_rng(seed).permutation(n)).astype(INDEX)
    return Plan(order, np.zeros(n, dtype=INDEX), np.asarray(prompt_len, dtype=INDEX)[order],
                sorted(set(request_group.tolist())), block_size, provider=np.full(n, -1, dtype=INDEX),
                group=request_group[order])
