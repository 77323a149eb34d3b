"""Identical requests computed once: rows of every job on the model whose prompt (head, document, tail), sampling
parameters and structured constraint are equal are planned once, and the one result is written to each row.

Outputs are batch-invariant and a row's tokens are a function of its prompt and parameters
(docs/guide/determinism.md), so a copy's result is what computing it would have given. Only greedy rows are
merged: a sampled row draws from a seed mixed with its own row key (``plan.batch.row_seed``), so two sampled rows
never share a stream. A map_reduce part is never merged (its parts are planned as they come). A job with
``generation.dedup: false`` neither merges its rows nor lends them to another job's.

The index holds a 16-byte digest and one int per distinct row to compute (not the rows), in an open-addressing
table of numpy arrays (``DigestTable``): 24 bytes a slot, at most 3/4 full (a dict of bytes to int took ~110 bytes
a row: 112 MB of a 1M-row plan's 1,009 MB).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from pipeline.job.rows import Copy

_LOCAL_BITS = 40
_LOCAL_MASK = (1 << _LOCAL_BITS) - 1


class DigestTable:
    """``setdefault`` for 16-byte digests -> non-negative ints, in three flat arrays probed linearly (``array``, not
    numpy: its element access from Python is several times faster)."""

    def __init__(self, capacity: int = 1024):
        self._alloc(capacity)
        self.size = 0

    def _alloc(self, capacity: int) -> None:
        self.lo = array("Q", bytes(8 * capacity))
        self.hi = array("Q", bytes(8 * capacity))
        self.val = array("q", b"\xff" * (8 * capacity))            # -1: empty
        self.mask = capacity - 1

    def __len__(self) -> int:
        return self.size

    def setdefault(self, digest: bytes, value: int) -> int:
        """The value stored for ``digest``, storing ``value`` first if there is none."""
        return self._put(int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little"), value)

    def _put(self, lo: int, hi: int, value: int) -> int:
        mask, keys, val = self.mask, self.lo, self.val
        i = lo & mask
        while True:
            v = val[i]
            if v < 0:
                keys[i], self.hi[i], val[i] = lo, hi, value
                self.size += 1
                if self.size * 4 > 3 * (mask + 1):
                    self._grow()
                return value
            if keys[i] == lo and self.hi[i] == hi:
                return v
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = (self.lo, self.hi, self.val)
        self._alloc(2 * (self.mask + 1))
        self.size = 0
        for a, b, v in zip(*old):
            if v >= 0:
                self._put(a, b, v)


@dataclass
class Dedup:
    """The first request of each distinct content (job, index in the job's spill file; packed in one int) and the
    copies of each."""
    first: DigestTable = field(default_factory=DigestTable)
    copies: dict[tuple[int, int], list[Copy]] = field(default_factory=dict)

    def claim(self, digest: bytes, job: int, local: int) -> tuple[int, int] | None:
        """The request that already has this content (None: this one is the first, and is recorded as such)."""
        packed = job << _LOCAL_BITS | local
        first = self.first.setdefault(digest, packed)
        return None if first == packed else (first >> _LOCAL_BITS, first & _LOCAL_MASK)

    def add(self, first: tuple[int, int], copy: Copy) -> None:
        self.copies.setdefault(first, []).append(copy)

    def by_request(self, offsets: list[int]) -> dict[int, list[Copy]]:
        """The copies keyed by the batch's request index (``offsets[job]`` + index in the job's spill file)."""
        return {offsets[j] + local: cs for (j, local), cs in self.copies.items()}


def content_digest(group: int, document: str, tail: str, params) -> bytes | None:
    """What makes two rows the same request (their head is their planner ``group``: head text and chat template);
    None for a row that is never merged (sampled)."""
    if not params.greedy:
        return None
    h = hashlib.blake2b(digest_size=16)
    for part in (str(group), document, tail, repr(params)):
        b = part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.digest()


__all__ = ["Copy", "Dedup", "content_digest"]
