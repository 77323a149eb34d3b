"""Datasets in, Parquet out.

Input: a Parquet file, a directory of Parquet files, a glob, or a ``datasets`` ``save_to_disk`` directory,
or a URI that ``pyarrow.fs`` understands (``file://``, ``s3://``, ``gs://``, ``hdfs://``: a file or a prefix of
Parquet files), always read in record batches (memory stays bounded). Output: Parquet written atomically (temp file +
``os.replace``), either one file or a directory of shards.
"""
from __future__ import annotations

import glob as globlib
import itertools
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.io.openai_batch import READ_SCHEMA, count_requests, iter_request_batches
from pipeline.io.paths import is_uri
from pipeline.problems import RunError


class InputError(Exception):
    """An input that cannot be read; the message names the path. Turned into a job Problem by the caller."""


def _uri_files(uri: str) -> list[str]:
    """The Parquet files under a ``pyarrow.fs`` URI (a file, or every .parquet below a prefix), sorted."""
    scheme = uri.split("://", 1)[0]
    try:
        fs, base = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.File:
            return [uri]
        if info.type != pafs.FileType.Directory:
            raise InputError(f"{uri}: no such file or prefix")
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{uri}: cannot list ({e})") from None
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")
                   and not i.base_name.startswith((".", "_")))
    if not files:
        raise InputError(f"{uri}: contains no .parquet files")
    return [f"{scheme}://{f}" for f in files]


def input_files(path: str) -> list[Path] | list[str]:
    """The Parquet files a path names, sorted (so row order is stable); URIs stay URIs."""
    if is_uri(path):
        return _uri_files(path)
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in globlib.glob(path, recursive=True) if Path(p).is_file())
        if not files:
            raise InputError(f"{path}: the glob matches no files")
        return files
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not f.name.startswith((".", "_")))
        if not files:
            raise InputError(f"{path}: directory contains no .parquet files")
        return files
    if p.is_file():
        return [p]
    raise InputError(f"{path}: no such file or directory")


def _jsonl_file(path: str) -> str:
    """An OpenAI Batch input: one JSONL file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: no such file (input.format openai_batch reads one .jsonl file)")
    try:
        with open(p, "rb") as fh:
            fh.read(1)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    return str(p)


def _open_dataset(path: str, split: str | None):
    import datasets  # NOTE: imported lazily; it is slow to import and most jobs read Parquet.
    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise InputError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise InputError(f"{path}: the dataset has splits {', '.join(ds)}; choose one with input.split")
            split = next(iter(ds))
        if split not in ds:
            raise InputError(f"{path}: no split {split!r}; splits are {', '.join(ds)}")
        ds = ds[split]
    return ds


def input_schema(path: str, fmt: str, split: str | None = None) -> pa.Schema:
    """The input's schema (read from file metadata only)."""
    if fmt == "datasets":
        return _open_dataset(path, split).data.schema
    if fmt == "openai_batch":
        _jsonl_file(path)
        return READ_SCHEMA
    files = input_files(path)
    try:
        return pq.read_schema(files[0])
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{files[0]}: not a readable Parquet file ({e})") from None


def count_rows(path: str, fmt: str, split: str | None = None, limit: int | None = None) -> int:
    if fmt == "datasets":
        n = _open_dataset(path, split).num_rows
    elif fmt == "openai_batch":
        n = count_requests(_jsonl_file(path))
    else:
        n = 0
        for f in input_files(path):
            try:
                n += pq.ParquetFile(f).metadata.num_rows
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{f}: not a readable Parquet file ({e})") from None
    return n if limit is None else min(n, limit)


def iter_batches(path: str, fmt: str, columns: list[str], batch_size: int = 1024, split: str | None = None,
                 limit: int | None = None) -> Iterator[pa.RecordBatch]:
    """Yield record batches of ``columns`` in input order, at most ``limit`` rows in total."""
    remaining = limit if limit is not None else float("inf")
    if fmt == "datasets":
        table = _open_dataset(path, split).data.table.select(columns)   # memory-mapped Arrow, not loaded
        sources = [table.to_batches(max_chunksize=batch_size)]
    elif fmt == "openai_batch":
        sources = [(b.select(columns) for b in iter_request_batches(_jsonl_file(path), batch_size))]
    else:
        sources = (_parquet_batches(f, columns, batch_size) for f in input_files(path))
    for source in sources:
        for batch in source:
            if remaining <= 0:
                return
            if batch.num_rows > remaining:
                batch = batch.slice(0, int(remaining))
            remaining -= batch.num_rows
            if batch.num_rows:
                yield batch


def _parquet_batches(f: Path | str, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
    """A row group at a time: one reader over every row group of a file kept ~7 MB more Arrow memory per 100k-row
    row group read (pyarrow 26: 150 MB after 2M rows; docs/perf/plan-memory.md); one reader per row group
    keeps Arrow's memory flat."""
    try:
        yield from _by_row_group(pq.ParquetFile(f), batch_size, columns)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{f}: cannot read Parquet ({e})") from None


def _by_row_group(pf: pq.ParquetFile, batch_size: int, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    for rg in range(pf.metadata.num_row_groups):
        yield from pf.iter_batches(batch_size=batch_size, columns=columns, row_groups=[rg])


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def resized(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """Consecutive tables cut and joined into tables of exactly ``rows`` rows (the last may be shorter)."""
    buf: list[pa.Table] = []
    buffered = 0
    for t in tables:
        buf.append(t)
        buffered += t.num_rows
        while buffered >= rows:
            whole = pa.concat_tables(buf)
            yield whole.slice(0, rows)
            buf, buffered = [whole.slice(rows)], buffered - rows
    if buffered:
        yield pa.concat_tables(buf)


def write_parquet_atomic(table: pa.Table, path: str | Path) -> None:
    """Write ``table`` to ``path`` so that readers see the old file or the whole new one, never a part.

    Raises ``RunError`` on a full disk (the temp file is removed; the old file is untouched).
    """
    write_parquet_stream_atomic(iter([table]), table.schema, path)


def write_parquet_stream_atomic(tables: Iterator[pa.Table], schema: pa.Schema, path: str | Path) -> int:
    """``write_parquet_atomic`` of tables as they come (each one row group or more; ``schema`` all of theirs), so
    the file's rows are never all in memory. Returns the rows written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    rows = 0
    try:
        with open(tmp, "wb") as fh:
            with pq.ParquetWriter(fh, schema, compression="zstd") as w:
                for t in tables:
                    w.write_table(t if t.schema.equals(schema) else t.cast(schema))
                    rows += t.num_rows
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write {path}: {e.strerror or e}. What was committed before is intact; "
                       "free space / fix permissions and run the same command again to resume.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows


def write_bytes_atomic(data: bytes, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write {path}: {e.strerror or e}") from None


def write_output(batches: Iterator[pa.Table], path: str | Path, directory: bool) -> int:
    """Write the output: one file, or (``directory``) a dir of ``part-NNNNN.parquet`` shards, one per batch.

    A directory is built next to the target and swapped in with two renames (the old one is removed after),
    so the target never holds a mix of old and new shards. Returns the number of rows written.
    """
    path = Path(path)
    if not directory:
        first = next(batches, None)
        if first is None:
            raise ValueError("no output tables")
        return write_parquet_stream_atomic(itertools.chain([first], batches), first.schema, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    rows = 0
    try:
        for i, table in enumerate(batches):
            write_parquet_atomic(table, tmp / f"part-{i:05d}.parquet")
            rows += table.num_rows
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows


def read_output(path: str | Path) -> pa.Table:
    """Read an output written by ``write_output`` (file or shard directory)."""
    path = Path(path)
    if path.is_dir():
        return pa.concat_tables([pq.read_table(f) for f in sorted(path.glob("part-*.parquet"))])
    return pq.read_table(path)


def iter_output_batches(path: str | Path, batch_size: int = 65_536, columns: list[str] | None = None):
    """Record batches of an output written by ``write_output`` (``columns``: only those), in order, without
    reading it whole (a row group at a time, as ``_parquet_batches``)."""
    path = Path(path)
    for f in sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]:
        yield from _by_row_group(pq.ParquetFile(f), batch_size, columns)
