"""The job dir of one job (beside its output): a lock, committed result parts, and the run's scratch files.

("job dir" is per output; "state dir" is the per-user directory of ``pipeline.run.history``.)

    out/summaries.parquet                     the output (assembled atomically at the end)
    out/summaries.parquet.manifest.json       the run manifest
    out/.summaries.parquet.batchgen/          the job dir
        lock                                  flock-held by the running process; its pid + host inside
        parts/part-<time>-<seq>.parquet       committed results, one row per finished row (by row_key)
        keys.arrow / spill.arrow              this run's row keys (input order) / prompts to compute
        runs/<run id>/                        the run's trace (pipeline.run.trace) -> `batchgen report <dir>`
        current_run                           the id of an unfinished run (a resume appends to its trace)

A part is written to a temp name, fsynced and renamed, so a kill at any point leaves only whole parts; the
results they hold are never recomputed. Rows are identified by ``row_key`` (id + hash of what determines
the result), so a changed prompt, model or parameter makes a new key and the row is computed again.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.io.tables import write_parquet_atomic, write_parquet_stream_atomic
from pipeline.job.rows import RESULT_SCHEMA, ResultRow, results_table
from pipeline.problems import RunError


def job_dir_for(output_path: str | Path) -> Path:
    out = Path(output_path)
    return out.parent / f".{out.name}.batchgen"


def manifest_path_for(output_path: str | Path) -> Path:
    out = Path(output_path)
    return out.parent / f"{out.name}.manifest.json"


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


RUN_ID = re.compile(r"\d{8}-\d{6}(-\d+)?")        # pipeline.run.recorder: time.strftime("%Y%m%d-%H%M%S")[-n]
log = logging.getLogger("batchgen.pipeline")


def _lock_holder(path: Path) -> dict:
    """Who holds the lock at ``path``, as its file says ({} while it is being written, or unreadable)."""
    try:
        d = json.loads(path.read_text() or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def first_of_each_key(results: pa.Table) -> pa.Table:
    """One row per row_key, the first in commit order (a result committed twice: a resume raced a commit)."""
    keys = results.column("row_key")
    if pc.count_distinct(keys).as_py() == results.num_rows:
        return results
    pos = pa.array(np.arange(results.num_rows, dtype=np.int64))
    first = (pa.table({"row_key": keys, "pos": pos}).group_by("row_key", use_threads=False)
             .aggregate([("pos", "min")]).column("pos_min").to_numpy())
    return results.take(np.sort(first))


class RunState:
    def __init__(self, output_path: str | Path, job_name: str):
        self.dir = job_dir_for(output_path)
        self.parts = self.dir / "parts"
        self.job_name = job_name
        self._seq = 0
        self._fd: int | None = None

    # ---- lock ---------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the job's lock: ``flock`` on ``<job dir>/lock``, held for the run's life; the kernel drops it when
        the process dies, so a killed run never leaves it held, and a lock file being written (empty yet) is
        still someone's lock. The file's content (pid, host, start) is for humans and the refusal's message."""
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"job {self.job_name!r}: cannot create the run state directory {self.dir}: "
                           f"{e.strerror or e}") from None
        path = self.dir / "lock"
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:
                raise RunError(f"job {self.job_name!r}: cannot open the lock {path}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                other = _lock_holder(path)
                raise RunError(f"job {self.job_name!r} is already running (pid {other.get('pid', '?')} on "
                               f"{other.get('host', '?')}, started {other.get('started', '?')}); lock file {path}. "
                               "Wait for it to finish.") from None
            if not _same_file(fd, path):     # its holder removed it between our open and flock: not the lock now
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(me).encode())
            self._fd = fd
            return
        raise RunError(f"job {self.job_name!r}: cannot take the lock {path}")

    def unlock(self) -> None:
        """Remove the lock file, then release it (a process that opened it meanwhile sees another file, retries)."""
        if self._fd is not None:
            (self.dir / "lock").unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    # ---- the unfinished run ---------------------------------------------------------------------------
    def current_run(self) -> str | None:
        """The id of the unfinished run ``current_run`` names (a resume appends to its trace); None when there is
        none, or when the file does not hold a run id (warned, naming the file): a new run id is taken."""
        path = self.dir / "current_run"
        try:
            run_id = path.read_bytes().decode().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            run_id = f"unreadable ({e})"
        if RUN_ID.fullmatch(run_id):
            return run_id
        log.warning("%s does not hold a run id (%r); this run starts a new trace", path, run_id[:60])
        return None

    # ---- committed results --------------------------------------------------------------------------
    def part_files(self) -> list[Path]:
        return sorted(p for p in self.parts.glob("part-*.parquet")) if self.parts.is_dir() else []

    def _read_parts(self, **read) -> Iterator[pa.Table]:
        """Each committed part (``pq.read_table(part, **read)``), in commit order. A part being written when a run
        died is removed, an unreadable one moved aside: its rows are computed again."""
        for tmp in self.parts.glob(".*.tmp-*") if self.parts.is_dir() else ():
            tmp.unlink(missing_ok=True)                 # a part whose write was interrupted
        for p in self.part_files():
            try:
                table = pq.read_table(p, **read)
            except (pa.ArrowException, OSError) as e:
                # NOTE: parts are renamed into place only when whole; an unreadable one was damaged later
                # (disk fault). Its rows are simply computed again.
                log.warning("committed part %s is unreadable (%s); moved aside as .corrupt, its rows are computed "
                            "again", p, str(e)[:200])
                p.rename(p.with_suffix(".corrupt"))
                continue
            yield table

    def done_parts(self) -> Iterator[pa.Table]:
        """Each committed part's results, in commit order."""
        return self._read_parts(schema=RESULT_SCHEMA)

    def done_keys(self) -> Iterator[list[str]]:
        """Each committed part's row keys (only that column read), in commit order."""
        for t in self._read_parts(columns=["row_key"]):
            yield t.column("row_key").to_pylist()

    def load_done(self) -> pa.Table:
        """All committed results, one row per ``row_key`` (the first committed wins)."""
        tables = list(self.done_parts())
        return first_of_each_key(pa.concat_tables(tables)) if tables else RESULT_SCHEMA.empty_table()

    def commit(self, rows: list[ResultRow]) -> None:
        """Make ``rows`` durable as one part file."""
        if not rows:
            return
        self._seq += 1
        table = results_table(rows)
        write_parquet_atomic(table, self.parts / f"part-{time.time_ns():020d}-{self._seq:06d}.parquet")

    def compact(self, tables: Iterator[pa.Table]) -> None:
        """Replace all parts by one holding ``tables`` (every committed result once; the whole part is written
        first, then the old ones go)."""
        old = self.part_files()
        if len(old) <= 1:
            return
        write_parquet_stream_atomic(tables, RESULT_SCHEMA, self.parts / f"part-{time.time_ns():020d}-compact.parquet")
        for p in old:
            p.unlink(missing_ok=True)

    def scratch(self, name: str) -> Path:
        return self.dir / name
