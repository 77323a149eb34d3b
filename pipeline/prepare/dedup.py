"""Identical requests computed once: rows of every job on the model whose prompt (head, document, tail), sampling
parameters and structured constraint are equal are planned once, and the one result is written to each row.

Outputs are batch-invariant and a row's tokens are a function of its prompt and parameters
(docs/guide/determinism.md), so a copy's result is what computing it would have given. Only greedy rows are
merged: a sampled row draws from a seed mixed with its own row key (``plan.batch.row_seed``), so two sampled rows
never share a stream. A map_reduce part is never merged (its parts are planned as they come). A job with
``generation.dedup: false`` neither merges its rows nor lends them to another job's.

Nothing per row stays in memory while the input streams: each mergeable row's 16-byte digest and request go to
disk in parts by digest (``spool.Partitions``); once every job is read, ``resolve`` sorts one part at a time and
names each repeated content's first request (the lowest: earlier job, earlier row) and its copies. Every row is
spilled (a copy too: its key and parameters are read back when its result is written); the plan leaves copies
out. What stays is 16 bytes a copy (``Copies``).
"""
from __future__ import annotations

import hashlib
from array import array

import numpy as np

from pipeline.job.rows import Copy
from pipeline.plan.copies import NO_COPIES, Copies
from pipeline.prepare.spool import Partitions

_LOCAL_BITS = 40
_BUFFER = 1 << 16
RECORD = np.dtype([("lo", "<u8"), ("hi", "<u8"), ("req", "<i8")])


class Dedup:
    """The digests of every mergeable request of the jobs on the model (``add``), on disk; ``resolve`` once all
    are in."""

    def __init__(self):
        self._parts = Partitions(RECORD)
        self._lo, self._hi, self._req = array("Q"), array("Q"), array("q")

    def add(self, digest: bytes, job: int, local: int) -> None:
        """Request ``local`` of job ``job``'s spill file has this content."""
        self._lo.append(int.from_bytes(digest[:8], "little"))
        self._hi.append(int.from_bytes(digest[8:16], "little"))
        self._req.append(job << _LOCAL_BITS | local)
        if len(self._req) >= _BUFFER:
            self._flush()

    def _flush(self) -> None:
        records = np.empty(len(self._req), dtype=RECORD)
        records["lo"], records["hi"] = np.frombuffer(self._lo, np.uint64), np.frombuffer(self._hi, np.uint64)
        records["req"] = np.frombuffer(self._req, np.int64)
        self._parts.add(records, records["lo"])
        self._lo, self._hi, self._req = array("Q"), array("Q"), array("q")

    def resolve(self, offsets) -> Copies:
        """The copies, by the batch's request index (``offsets[job]`` + index in the job's spill file)."""
        self._flush()
        offsets = np.asarray(offsets, dtype=np.int64)
        firsts, copies = [], []
        for part in self._parts.parts():
            part = part[np.lexsort((part["req"], part["hi"], part["lo"]))]
            same = (part["lo"][1:] == part["lo"][:-1]) & (part["hi"][1:] == part["hi"][:-1])
            if not same.any():
                continue
            run = np.concatenate([[0], np.cumsum(~same)])            # which content each record is
            leader = np.flatnonzero(np.concatenate([[True], ~same]))  # each content's first record
            req = offsets[part["req"] >> _LOCAL_BITS] + (part["req"] & ((1 << _LOCAL_BITS) - 1))
            is_copy = np.concatenate([[False], same])
            firsts.append(req[leader[run[is_copy]]])
            copies.append(req[is_copy])
        self.close()
        if not firsts:
            return NO_COPIES
        return Copies(np.concatenate(firsts), np.concatenate(copies))

    def close(self) -> None:
        self._parts.close()


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
