"""Row ids checked unique without holding them: an 8-byte hash of each id, kept on disk in parts by hash
(``spool.Partitions``: nothing per row in memory), each part sorted alone once the input is read; a repeated hash
is confirmed on the ids themselves (the id column read again) before it is reported, so a hash collision never
fails a job."""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Iterable

import numpy as np

from pipeline.prepare.spool import Partitions

_BUFFER = 1 << 16


def id_hash(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class UniqueIds:
    def __init__(self):
        self._buffer = array("Q")
        self._parts = Partitions(np.uint64)

    def add(self, rid: str) -> None:
        self._buffer.append(id_hash(rid))
        if len(self._buffer) >= _BUFFER:
            self._flush()

    def _flush(self) -> None:
        h = np.frombuffer(self._buffer, dtype=np.uint64).copy()
        self._parts.add(h, h >> np.uint64(32))
        self._buffer = array("Q")

    def repeated_hashes(self) -> set[int]:
        self._flush()
        out: set[int] = set()
        for part in self._parts.parts():
            h = np.sort(part)
            out.update(h[1:][h[1:] == h[:-1]].tolist())
        return out

    def first_repeat(self, ids: Callable[[], Iterable[tuple[int, str]]]) -> tuple[str, int] | None:
        """The first id that appears again and the row where it does, or None; ``ids()`` yields (row, id) in input
        order again (read only when some hash repeats)."""
        suspects = self.repeated_hashes()
        if not suspects:
            return None
        seen: set[str] = set()
        for row_no, rid in ids():
            if id_hash(rid) in suspects:
                if rid in seen:
                    return rid, row_no
                seen.add(rid)
        return None

    def close(self) -> None:
        self._parts.close()


__all__ = ["UniqueIds", "id_hash"]
