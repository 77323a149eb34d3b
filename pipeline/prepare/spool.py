"""Per-row records kept on disk, not in memory: what a plan of any number of rows needs of each row (its group and
prompt length, its id's hash, its content digest) is appended to unnamed temporary files (``tempfile``: in
``$TMPDIR``, gone when closed or when the process dies) and read back a chunk at a time. ``Partitions`` splits
records by a hash into files small enough to load one at a time (sorting each finds repeats: ids, duplicates)."""
from __future__ import annotations

import tempfile
from typing import Iterator

import numpy as np

CHUNK_ROWS = 1 << 20


class Spool:
    """Records of one numpy ``dtype``, appended in order and read back in order (``chunks``); at most
    ``buffer_rows`` of them in memory."""

    def __init__(self, dtype, buffer_rows: int = 1 << 16):
        self.dtype = np.dtype(dtype)
        self.rows = 0
        self._buffer_rows = buffer_rows
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._file = None

    def append(self, records: np.ndarray) -> None:
        records = np.asarray(records, dtype=self.dtype)
        if not len(records):
            return
        self._pending.append(records)
        self._pending_rows += len(records)
        self.rows += len(records)
        if self._pending_rows >= self._buffer_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="batchgen-")
        self._file.seek(0, 2)
        for part in self._pending:
            self._file.write(part.tobytes())
        self._pending, self._pending_rows = [], 0

    def chunks(self, rows: int = CHUNK_ROWS) -> Iterator[np.ndarray]:
        """The records in append order, ``rows`` at a time (each chunk a fresh array)."""
        self._flush()
        if self._file is None:
            return
        size = self.dtype.itemsize
        for a in range(0, self.rows, rows):
            self._file.seek(a * size)
            n = min(rows, self.rows - a)
            yield np.frombuffer(self._file.read(n * size), dtype=self.dtype)

    def read_all(self) -> np.ndarray:
        parts = list(self.chunks())
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def close(self) -> None:
        self._pending = []
        if self._file is not None:
            self._file.close()
            self._file = None


class Partitions:
    """``Spool``s of one dtype, a record going to the one its hash names (``part = hash % count``); each is loaded
    alone (``parts``): with 64 of them, 10M records of 24 bytes are 3.75 MB a part."""

    def __init__(self, dtype, count: int = 64, buffer_rows: int = 4096):
        self.count = count
        self._spools = [Spool(dtype, buffer_rows) for _ in range(count)]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self._spools)

    def add(self, records: np.ndarray, hashes: np.ndarray) -> None:
        if not len(records):
            return
        part = (np.asarray(hashes, dtype=np.uint64) % np.uint64(self.count)).astype(np.intp)
        by = np.argsort(part, kind="stable")
        ids, at = np.unique(part[by], return_index=True)
        for p, a, b in zip(ids.tolist(), at.tolist(), [*at[1:].tolist(), len(by)]):
            self._spools[p].append(records[by[a:b]])

    def parts(self) -> Iterator[np.ndarray]:
        """Every part's records (in the order added), one part at a time, part 0 first, an empty array for an empty
        part (two ``Partitions`` of the same count, hashed alike, line up part by part)."""
        for s in self._spools:
            yield s.read_all()

    def close(self) -> None:
        for s in self._spools:
            s.close()


__all__ = ["CHUNK_ROWS", "Partitions", "Spool"]
