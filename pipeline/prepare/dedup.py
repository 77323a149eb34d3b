"""Identical requests computed once: rows of every job on the model whose prompt (head, document, tail), sampling
parameters and structured constraint are equal are planned once, and the one result is written to each row.

Outputs are batch-invariant and a row's tokens are a function of its prompt and parameters
(docs/guide/determinism.md), so a copy's result is what computing it would have given. Only greedy rows are
merged: a sampled row draws from a seed mixed with its own row key (``plan.batch.row_seed``), so two sampled rows
never share a stream. A map_reduce part is never merged (its parts are planned as they come). A job with
``generation.dedup: false`` neither merges its rows nor lends them to another job's.

The index holds a 16-byte digest and one int per distinct row to compute (not the rows): ~150 bytes a row.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from pipeline.job.rows import Copy

_LOCAL_BITS = 40
_LOCAL_MASK = (1 << _LOCAL_BITS) - 1


@dataclass
class Dedup:
    """The first request of each distinct content (job, index in the job's spill file; packed in one int) and the
    copies of each."""
    first: dict[bytes, int] = field(default_factory=dict)
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
