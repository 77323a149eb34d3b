"""KV cache manager: per-request block tables on top of the block pool, prefix lookup, and prefix pins.

The scheduler talks only to this class (never to the pool). One request's block table covers its tokens:

    all_token_ids:  | hit (cached blocks) | computed earlier | new this step | not yet computed |
    block table:    [ b0  b1 | b2  b3 ...                                  ]
                                                         ^ blocks cover num_computed + num_new tokens

A block is registered in the prefix cache as soon as it is full of tokens scheduled for computation (their
ids are known from ``all_token_ids``), so a request admitted later in the same step can already hit it.
NOTE: that relies on the model runner writing every token's K/V of a step before any attention of the step
reads the cache (per layer, as a batched forward does).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens, hash_request_tokens
from engine.request import Request


@dataclass
class _Pin:
    hashes: tuple[BlockHash, ...]
    held: dict[BlockHash, KVBlock] = field(default_factory=dict)   # the blocks this pin holds a ref on


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates KV blocks to requests and finds cached prefixes.

    Invariants:
        * ``req_to_blocks[r]`` covers ``ceil((num_computed + num_new) / block_size)`` blocks after allocate.
        * the first ``num_registered_blocks[r]`` blocks of a request have been offered to the prefix cache.
        * each block's ref_cnt = number of requests holding it + number of pins holding it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        # Pins hold blocks no request can use: at most half the pool is claimed by pins, so a small pool still
        # runs every request (a prefix that finds no pin room is only likelier to be evicted).
        self.pin_budget_blocks = num_blocks // 2
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_registered_blocks: dict[str, int] = {}
        self._pins: dict[int, _Pin] = {}
        self._pins_by_hash: dict[BlockHash, set[int]] = {}
        self._pin_ids = itertools.count()
        # Cumulative prefix-cache stats, in tokens; counted once per admission (see allocate_slots).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._stats_taken = (0, 0)

    # ---- lookup -------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest chain of cached full blocks matching the start of ``request.all_token_ids``.

        The hit is capped at ``num_tokens - 1`` tokens (rounded down to whole blocks) so the last token is
        always computed and there are logits to sample from. Does not take references (allocate_slots does).

        Returns:
            (blocks, num_computed_tokens) with num_computed_tokens = len(blocks) * block_size; ([], 0) when
            caching is off.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Make the request's block table cover its computed tokens, the prefix hit and ``num_new_tokens``.

        Args:
            request: ``request.num_computed_tokens`` excludes ``new_computed_blocks`` (not yet advanced).
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: the prefix hit from ``get_computed_blocks`` (only for a request with no blocks).
        Returns:
            the newly allocated blocks (maybe empty), or None when the free pool is too small; nothing is
            changed then, and the caller should preempt someone or stop admitting.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        is_new = blocks is None
        if is_new:
            blocks = []
        elif new_computed_blocks:
            raise ValueError(f"request {request.request_id} already has blocks; prefix hits only at admission")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = _cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # NOTE: a hit on a free (cached) block removes it from the free queue, so it counts against the pool.
        num_hit_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_hit_free:
            return None

        if is_new:
            self.req_to_blocks[request.request_id] = blocks
            self.num_registered_blocks[request.request_id] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_tokens
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)

        if self.enable_caching:
            self._cache_blocks(request, blocks, min(num_total, request.num_tokens) // self.block_size)
        return new_blocks

    def _cache_blocks(self, request: Request, blocks: list[KVBlock], num_full_blocks: int) -> None:
        num_cached = self.num_registered_blocks[request.request_id]
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request)
        for block in self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full_blocks):
            for pin_id in self._pins_by_hash.get(block.block_hash, ()):
                self._pin_take(self._pins[pin_id], block)
        self.num_registered_blocks[request.request_id] = num_full_blocks

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to all full blocks of ``all_token_ids`` (incremental)."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(tokens) // bs):
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix blocks stay cached longest.

        Blocks registered in the cache whose tokens lie beyond ``request.num_computed_tokens`` (scheduled
        this step, then preempted before running) lose their hash: their content was never computed.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.num_registered_blocks.pop(request.request_id, 0)
        if blocks is None:
            return
        for block in blocks[request.num_computed_tokens // self.block_size:num_cached]:
            if block.block_hash is not None and block.ref_cnt <= 1 + self._num_pin_refs(block):
                self._pin_release_hash(block)
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- pins ---------------------------------------------------------------------------------------
    def pin_prefix(self, token_ids: Sequence[int]) -> int | None:
        """Keep the full blocks of ``token_ids`` from eviction until ``unpin``.

        Blocks of the chain already cached get an extra ref now; the others get it when they are cached.
        Returns:
            a pin id for ``unpin``, or None when the pin would claim more than ``pin_budget_blocks`` in all.
        """
        hashes = tuple(hash_request_tokens(self.block_size, token_ids)) if self.enable_caching else ()
        if self.num_pin_claimed_blocks() + len(hashes) > self.pin_budget_blocks:
            return None
        pin_id = next(self._pin_ids)
        pin = _Pin(hashes)
        self._pins[pin_id] = pin
        for block_hash in pin.hashes:
            self._pins_by_hash.setdefault(block_hash, set()).add(pin_id)
            block = self.block_pool.get_cached_block(block_hash)
            if block is not None:
                self._pin_take(pin, block)
        return pin_id

    def unpin(self, pin_id: int) -> None:
        """Release exactly the refs the pin took (unknown ids are ignored)."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return
        for block_hash in pin.hashes:
            waiting = self._pins_by_hash.get(block_hash)
            if waiting is not None:
                waiting.discard(pin_id)
                if not waiting:
                    del self._pins_by_hash[block_hash]
        # Deepest blocks first, so the chain's head stays cached longest.
        self.block_pool.free_blocks(reversed(list(pin.held.values())))

    def num_pin_claimed_blocks(self) -> int:
        """Blocks the live pins will hold once their chains are cached (what the pin budget counts)."""
        return sum(len(pin.hashes) for pin in self._pins.values())

    def num_pinned_blocks(self) -> int:
        return len({id(b) for pin in self._pins.values() for b in pin.held.values()})

    def _pin_take(self, pin: _Pin, block: KVBlock) -> None:
        if block.block_hash not in pin.held:
            self.block_pool.touch([block])
            pin.held[block.block_hash] = block

    def _num_pin_refs(self, block: KVBlock) -> int:
        return sum(1 for pid in self._pins_by_hash.get(block.block_hash, ())
                   if self._pins[pid].held.get(block.block_hash) is block)

    def _pin_release_hash(self, block: KVBlock) -> None:
        """The block loses its hash: pins holding it let go and wait for the hash to be cached again."""
        for pin_id in self._pins_by_hash.get(block.block_hash, ()):
            pin = self._pins[pin_id]
            if pin.held.get(block.block_hash) is block:
                del pin.held[block.block_hash]
                self.block_pool.free_blocks([block])

    # ---- stats --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in tokens since the previous call."""
        q0, h0 = self._stats_taken
        self._stats_taken = (self.prefix_cache_queries, self.prefix_cache_hits)
        return self.prefix_cache_queries - q0, self.prefix_cache_hits - h0

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; refused (False) while any block is held by a request or a pin."""
        return self.block_pool.reset_prefix_cache()
