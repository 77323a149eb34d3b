"""Row ids checked unique without holding them: an 8-byte hash of each id (8 bytes a row, not a Python string in a
set: ~100 bytes a row), sorted once the input is read; a repeated hash is confirmed on the ids themselves (the id
column read again) before it is reported, so a hash collision never fails a job."""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Iterable

import numpy as np


def id_hash(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class UniqueIds:
    def __init__(self):
        self.hashes = array("Q")

    def add(self, rid: str) -> None:
        self.hashes.append(id_hash(rid))

    def repeated_hashes(self) -> set[int]:
        h = np.sort(np.frombuffer(self.hashes, dtype=np.uint64)) if len(self.hashes) else np.zeros(0, np.uint64)
        return set(h[1:][h[1:] == h[:-1]].tolist())

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


__all__ = ["UniqueIds", "id_hash"]
