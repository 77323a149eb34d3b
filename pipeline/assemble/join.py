"""The output's rows in input order, in memory bounded by a chunk, not by the rows.

The row keys (``keys.arrow``: row_idx, row_key in input order) are joined with the committed results (every part
file; the first committed result of a key wins: ``state.first_of_each_key``, as in ``RunState.load_done``) by a
partitioned hash join:

    1. partition   keys and results go to P bucket files by a hash of the key (P = rows / ``chunk_rows``, at
                   least 1), so each bucket holds every result its keys can match
    2. join        each bucket in memory: its keys left-joined with its results, sorted by row_idx, written back;
                   the counts the manifest needs (errors, tokens, schema validity, rows without a result) are
                   summed here, before any output is written
    3. merge       the P sorted runs read together, a chunk of consecutive row_idx at a time: the output's rows in
                   input order, never more than a chunk (plus one read batch per bucket) in memory

Files go under a scratch directory of the job dir and are removed with it. A job of fewer than ``chunk_rows``
rows is one bucket: the same steps, all small.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.io.tables import resized
from pipeline.job.rows import KEYS_SCHEMA, RESULT_SCHEMA
from pipeline.job.state import first_of_each_key
from pipeline.problems import RunError

CHUNK_ROWS = 131_072          # rows of one bucket (join) and of one merged chunk: the assembly's memory bound
_READ_ROWS = 65_536           # rows of one record batch in the bucket files
JOINED_SCHEMA = pa.schema([KEYS_SCHEMA.field("row_idx")] + list(RESULT_SCHEMA))


def key_buckets(keys: pa.Array | pa.ChunkedArray, n: int) -> np.ndarray:
    """Bucket 0..n-1 of each key, from a hash of its last 8 bytes (a row key ends in 20 hex digits of a hash of its
    content: ``prompts.row_key``); equal keys always share a bucket, for any string."""
    if n <= 1:
        return np.zeros(len(keys), dtype=np.int64)
    arr = keys.cast(pa.large_binary())
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    _, offs_buf, data_buf = arr.buffers()[:3]
    offs = np.frombuffer(offs_buf, dtype=np.int64)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size else np.zeros(1, np.uint8)
    starts, ends = offs[:-1], offs[1:]
    h = np.zeros(len(arr), dtype=np.uint64)
    for k in range(1, 9):
        pos = ends - k
        inside = pos >= starts
        byte = np.where(inside, data[np.where(inside, pos, 0)], 0).astype(np.uint64)
        h = h * np.uint64(257) + byte + np.uint64(1)
    h *= np.uint64(0x9E3779B97F4A7C15)               # Fibonacci hashing: the high bits are well mixed
    return ((h >> np.uint64(32)) % np.uint64(n)).astype(np.int64)


class _Buckets:
    """P Arrow IPC files of one schema, written batch by batch, each row to its key's bucket."""

    def __init__(self, directory: Path, name: str, schema: pa.Schema, n: int):
        self.paths = [directory / f"{name}-{b:04d}.arrow" for b in range(n)]
        self.schema, self.n = schema, n
        self._writers = [pa.ipc.new_file(str(p), schema) for p in self.paths]

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        b = key_buckets(table.column("row_key"), self.n)
        order = np.argsort(b, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(b, minlength=self.n))])
        table = table.take(order) if self.n > 1 else table
        for i in range(self.n):
            if bounds[i + 1] > bounds[i]:
                self._writers[i].write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]))

    def close(self) -> None:
        for w in self._writers:
            w.close()

    def read(self, i: int) -> pa.Table:
        with pa.OSFile(str(self.paths[i])) as f:       # NOTE: not memory-mapped: mapped pages count in RSS
            return pa.ipc.open_file(f).read_all()


@dataclass
class JoinCounts:
    """What the manifest counts over every output row (summed bucket by bucket)."""
    rows: int = 0
    missing: int = 0              # rows without a committed result (an unfinished run)
    rows_with_error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    json_valid: int = 0           # answered (summary, no error) and valid against its schema ...
    json_invalid: int = 0         # ... answered and not valid

    def add(self, t: pa.Table) -> None:
        self.rows += t.num_rows
        self.missing += t.column("finish_reason").null_count
        self.rows_with_error += t.num_rows - t.column("error").null_count
        self.prompt_tokens += pc.sum(t.column("prompt_tokens")).as_py() or 0
        self.cached_tokens += pc.sum(t.column("cached_tokens")).as_py() or 0
        answered = pc.and_(t.column("summary").is_valid(), t.column("error").is_null())
        self.json_valid += pc.sum(pc.and_(answered, t.column("json_error").is_null())).as_py() or 0
        self.json_invalid += pc.sum(pc.and_(answered, t.column("json_error").is_valid())).as_py() or 0


@dataclass
class KeyedResults:
    """The join of one job's row keys with its committed results (``prepare`` then ``rows_in_order``)."""
    keys_path: Path
    parts: Iterable[pa.Table]         # the committed parts in commit order (``RunState.done_parts``)
    scratch: Path
    num_rows: int
    chunk_rows: int = CHUNK_ROWS
    counts: JoinCounts = field(default_factory=JoinCounts)
    _results: _Buckets | None = None
    _joined: list[Path] = field(default_factory=list)

    @property
    def num_buckets(self) -> int:
        return max(1, -(-self.num_rows // self.chunk_rows))

    def prepare(self) -> JoinCounts:
        """Steps 1 and 2: partition and join every bucket; returns the counts (``missing`` > 0: rows lack a result)."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        n = self.num_buckets
        keys = _Buckets(self.scratch, "keys", KEYS_SCHEMA, n)
        try:
            with pa.OSFile(str(self.keys_path)) as f:
                reader = pa.ipc.open_file(f)
                for i in range(reader.num_record_batches):
                    keys.add(pa.Table.from_batches([reader.get_batch(i)]))
        finally:
            keys.close()
        self._results = results = _Buckets(self.scratch, "results", RESULT_SCHEMA, n)
        try:
            for table in resized(self.parts, _READ_ROWS):
                results.add(table)
        finally:
            results.close()
        for b in range(n):
            joined = _join_bucket(keys.read(b), first_of_each_key(results.read(b)))
            self.counts.add(joined)
            path = self.scratch / f"joined-{b:04d}.arrow"
            with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, JOINED_SCHEMA) as w:
                w.write_table(joined, max_chunksize=_READ_ROWS)
            self._joined.append(path)
            keys.paths[b].unlink()
        return self.counts

    def rows_in_order(self) -> Iterator[pa.Table]:
        """Step 3: the joined rows (``JOINED_SCHEMA``) in input order, ``chunk_rows`` at a time."""
        runs = [_SortedRun(p) for p in self._joined]
        try:
            for lo in range(0, self.num_rows, self.chunk_rows):
                hi = min(lo + self.chunk_rows, self.num_rows)
                chunk = pa.concat_tables([r.take_below(hi) for r in runs]).sort_by("row_idx")
                if not np.array_equal(chunk.column("row_idx").to_numpy(), np.arange(lo, hi)):
                    raise RunError(f"internal error assembling the output: rows {lo}..{hi - 1} are not each keyed "
                                   "once; the committed results are intact, run again")
                yield chunk
        finally:
            for r in runs:
                r.close()

    def results(self) -> Iterator[pa.Table]:
        """Every committed result once (the first of each key), bucket by bucket: ``RunState.compact``'s tables."""
        for b in range(self.num_buckets):
            yield first_of_each_key(self._results.read(b))

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


class _SortedRun:
    """One bucket's joined rows (sorted by row_idx), read a batch at a time."""

    def __init__(self, path: Path):
        self._file = pa.OSFile(str(path))
        self._reader = pa.ipc.open_file(self._file)
        self._next = 0
        self._buf = JOINED_SCHEMA.empty_table()

    def take_below(self, hi: int) -> pa.Table:
        """The rows with row_idx < ``hi`` not taken yet."""
        pieces = []
        while True:
            idx = self._buf.column("row_idx").to_numpy()
            cut = int(np.searchsorted(idx, hi))
            pieces.append(self._buf.slice(0, cut))
            self._buf = self._buf.slice(cut)
            if self._buf.num_rows or self._next >= self._reader.num_record_batches:
                break
            self._buf = pa.Table.from_batches([self._reader.get_batch(self._next)])
            self._next += 1
        return pa.concat_tables(pieces)

    def close(self) -> None:
        self._file.close()


def _join_bucket(keys: pa.Table, results: pa.Table) -> pa.Table:
    joined = keys.join(results, "row_key", join_type="left outer", use_threads=False).sort_by("row_idx")
    return joined.select(JOINED_SCHEMA.names).cast(JOINED_SCHEMA)


__all__ = ["CHUNK_ROWS", "JoinCounts", "KeyedResults", "key_buckets"]
