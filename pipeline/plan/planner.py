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

Memory: per request only a few integers (int32 numpy arrays: ~20 bytes a request in the plan); token ids are held
once per group.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INDEX = np.int32          # request indices, positions, group ids and token counts: 4 bytes each (< 2^31)


@dataclass
class Plan:
    order: np.ndarray          # [num_requests] request index (as given) at each plan position
    cached: np.ndarray         # [num_requests] predicted cached tokens, by plan position
    provider: np.ndarray       # [num_requests] plan position this one reuses blocks from, -1 if none
    prompt_len: np.ndarray     # [num_requests] prompt tokens, by plan position
    group: np.ndarray          # [num_requests] group id, by plan position
    group_order: list[int]     # group ids in plan order
    block_size: int

    @property
    def num_requests(self) -> int:
        return int(self.order.shape[0])

    def subset(self, mask: np.ndarray) -> "Plan":
        """The plan positions where ``mask`` is true, in plan order (providers are not remapped: -1 kept only)."""
        return Plan(order=self.order[mask], cached=self.cached[mask], provider=np.where(self.provider[mask] < 0, -1, 0),
                    prompt_len=self.prompt_len[mask], group=self.group[mask],
                    group_order=[g for g in self.group_order if (self.group[mask] == g).any()],
                    block_size=self.block_size)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_len.sum())

    @property
    def cached_tokens(self) -> int:
        return int(self.cached.sum())

    @property
    def tokens_to_compute(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
    n = request_group.shape[0]
    sizes = np.bincount(request_group, minlength=len(heads)).tolist() if n else [0] * len(heads)
    group_order = [g for g in order_groups(heads, sizes, block_size) if sizes[g]]

    by_group = np.argsort(request_group, kind="stable").astype(INDEX)   # request ids grouped, input order kept
    starts = np.concatenate([[0], np.cumsum(sizes)])                    # group g's requests in by_group
    order = np.concatenate([by_group[starts[g]:starts[g + 1]] for g in group_order]) if n else \
        np.zeros(0, dtype=INDEX)
    del by_group

    plen = prompt_len[order]
    cached = np.zeros(n, dtype=INDEX)
    provider = np.full(n, -1, dtype=INDEX)
    node_ids: dict[tuple[int, tuple], int] = {}   # (parent node id, block's tokens) -> node id: a block chain
    computed_by: dict[int, int] = {}               # node id -> plan position of the request computing it
    pos = 0
    for g in group_order:
        head = heads[g]
        k = len(head) // block_size
        path, parent = [], -1
        for b in range(k):
            parent = node_ids.setdefault((parent, tuple(head[b * block_size:(b + 1) * block_size])), len(node_ids))
            path.append(parent)
        count = sizes[g]
        # The group's first request (the leader) reuses what earlier groups computed ...
        depth = 0
        while depth < k and path[depth] in computed_by:
            depth += 1
        along = [computed_by.get(p, pos) for p in path]                # who computes each head block
        for b in range(depth, k):
            computed_by[path[b]] = pos
        # ... and every request (leader included) gets min(blocks available, cap) blocks.
        caps = (plen[pos:pos + count] - 1) // block_size
        avail = np.full(count, k, dtype=INDEX)
        avail[0] = depth
        hits = np.minimum(avail, np.maximum(caps, 0))
        cached[pos:pos + count] = hits * block_size
        along_arr = np.asarray(along + [-1], dtype=INDEX)
        provider[pos:pos + count] = np.where(hits > 0, along_arr[np.maximum(hits - 1, 0)], -1)
        pos += count
    group = request_group[order] if n else np.zeros(0, dtype=INDEX)
    return Plan(order=order, cached=cached, provider=provider, prompt_len=plen, group=group,
                group_order=group_order, block_size=block_size)


def unplanned(request_group: np.ndarray, prompt_len: np.ndarray, block_size: int, how: str,
              seed: int = 0) -> Plan:
    """Baselines for benchmarking the planner: rows fed as given ("input") or shuffled ("shuffled"), with
    no grouping, gating or pinning (what a script around an engine would do). Hits are not predicted."""
    request_group = np.asarray(request_group, dtype=INDEX)
    n = request_group.shape[0]
    order = (np.arange(n) if how == "input" else np.random.default_rng(seed).permutation(n)).astype(INDEX)
    return Plan(order=order, cached=np.zeros(n, dtype=INDEX), provider=np.full(n, -1, dtype=INDEX),
                prompt_len=np.asarray(prompt_len, dtype=INDEX)[order], group=request_group[order],
                group_order=sorted(set(request_group.tolist())), block_size=block_size)
