"""Block pool: the KV blocks, their ref counts, the LRU free queue and the prefix-cache hash map.

Pure Python bookkeeping, no tensors: a block is an id into the model runner's KV tensors.

    free queue (LRU):  head -> [evict first ... evict last] <- tail
    hash map:          block_hash -> KVBlock   (full blocks whose content is known)

A freed block keeps its hash and stays findable until ``get_new_blocks`` pops it from the head of the free
queue (lazy eviction). A prefix hit on a free block (``touch``) takes it out of the queue again.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes

# NOTE: the root parent is a fixed digest, so every hash input has the same layout (parent is always 32 bytes).
_ROOT_PARENT: BlockHash = hashlib.sha256(b"batchgen/kv-block/root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Content address of one full block: sha256(parent hash | token count | token ids as int64 | extra keys).

    Args:
        parent_hash: hash of the previous block in the sequence, None for the first block.
        token_ids: the block's token ids.
        extra_keys: anything else the KV content depends on (e.g. an adapter name); must have a stable repr.
    Returns:
        32 bytes, deterministic across processes and machines (never Python's ``hash()``).
    """
    h = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_PARENT)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def hash_request_tokens(block_size: int, token_ids: Sequence[int], extra_keys: tuple | None = None,
                        ) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


class KVBlock:
    """One KV block. ``ref_cnt`` counts holders (requests, pins); 0 means it sits in the free queue."""
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """Owns all blocks. Invariants: a block is in the free queue iff ref_cnt == 0; the hash map only points to
    blocks whose ``block_hash`` is that key; ``num_free_blocks`` counts cached-but-free blocks as free."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # NOTE: OrderedDict gives O(1) pop-from-head, append-to-tail and remove-from-middle (a prefix hit).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    # ---- allocation ---------------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue (evicting their hashes); each gets ref_cnt 1."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a pin); free blocks leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Blocks reaching 0 go to the free queue in the order given:
        hashed blocks to the tail (evicted last), unhashed ones to the head (nothing to keep, reuse first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # ---- prefix cache -------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> list[KVBlock]:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes[i]``.

        A block whose hash already maps to another block stays unhashed (the first copy is the findable one).
        Returns:
            the blocks newly registered, in order.
        """
        if not self.enable_caching:
            return []
        new = []
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            new.append(block)
        return new

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash (its content turned out never to be computed)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash. Refused (returns False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    # ---- stats --------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first); for tests and debugging."""
        return list(self._free)
