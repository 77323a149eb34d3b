"""Run history: one SQLite row per run of a job, under the state directory.

The runner records a run with ``start_run`` before compute and closes it with ``finish_run``; ``batchgen status``
reads it back with ``recent_runs``. Several processes (cron firing jobs, a user running ``status``) may use the
database at once: it runs in WAL mode with a busy timeout, and every write is one short transaction.

State directory, first that is set: the ``state_dir`` argument, ``$BATCHGEN_STATE_DIR``,
``$XDG_STATE_HOME/batchgen``, ``~/.local/state/batchgen``. The database is ``<state dir>/history.sqlite``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from engine import BatchgenError
from pipeline.io.paths import resolve_state_dir

DB_NAME = "history.sqlite"
FINAL_STATUSES = ("ok", "failed", "interrupted")
BUSY_TIMEOUT_S = 30.0

# Schema migrations, applied in order; PRAGMA user_version is the number applied. Append, never edit.
_MIGRATIONS = [
    """
    CREATE TABLE runs (
        id             INTEGER PRIMARY KEY AUTOINCREMENT,
        job            TEXT NOT NULL,
        started_at     REAL NOT NULL,           -- unix seconds
        finished_at    REAL,                    -- NULL while running
        status         TEXT NOT NULL CHECK (status IN ('running', 'ok', 'failed', 'interrupted')),
        pid            INTEGER,
        host           TEXT,
        config         TEXT,                    -- JSON config summary (model, input, output, ...)
        rows_done      INTEGER,
        rows_skipped   INTEGER,
        rows_failed    INTEGER,
        tokens_per_s   REAL,
        cache_hit_rate REAL,
        trace_path     TEXT,
        report_path    TEXT,
        error          TEXT
    );
    CREATE INDEX runs_by_job ON runs (job, started_at);
    """,
    """
    ALTER TABLE runs ADD COLUMN phase TEXT;        -- while running: 'queued' (waiting for the machine) | 'computing'
    ALTER TABLE runs ADD COLUMN queued_s REAL;     -- seconds waited for the machine (pipeline.run.admission)
    ALTER TABLE runs ADD COLUMN engine_s REAL;     -- seconds from engine loaded to last step
    """,
]
SCHEMA_VERSION = len(_MIGRATIONS)
log = logging.getLogger("batchgen.pipeline")


class HistoryError(BatchgenError):
    """The history database cannot be used (unwritable state dir, newer schema, unknown run)."""


@dataclass(frozen=True)
class HistoryRun:
    """One row of the history. ``status`` is 'running', 'ok', 'failed', 'interrupted', or 'died' (a run still
    marked running whose process is gone from this host: killed before it could record its end)."""
    id: int
    job: str
    started_at: float
    finished_at: float | None
    status: str
    pid: int | None
    host: str | None
    config: dict
    rows_done: int | None
    rows_skipped: int | None
    rows_failed: int | None
    tokens_per_s: float | None
    cache_hit_rate: float | None
    trace_path: str | None
    report_path: str | None
    error: str | None
    phase: str | None = None
    queued_s: float | None = None
    engine_s: float | None = None

    @property
    def duration_s(self) -> float | None:
        """Wall time; for a run still going, time so far."""
        if self.finished_at is not None:
            return self.finished_at - self.started_at
        return time.time() - self.started_at if self.status == "running" else None




def db_path(state_dir: str | Path | None = None) -> Path:
    return resolve_state_dir(state_dir) / DB_NAME


@contextmanager
def _connect(state_dir: str | Path | None, create: bool = True) -> Iterator[sqlite3.Connection]:
    path = db_path(state_dir)
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a writer takes the lock up front
        # and waits out the busy timeout instead of failing on lock upgrade.
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except (OSError, sqlite3.Error) as e:
        raise HistoryError(f"cannot open run history {path}: {e}; set BATCHGEN_STATE_DIR to a writable "
                           "directory") from None
    with closing(conn):
        conn.row_factory = sqlite3.Row
        conn.text_factory = lambda b: b.decode("utf-8", "replace")     # a damaged text is text, not an error
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            _migrate(conn, path)
            yield conn
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:     # also damage found only by a later query
            if _is_busy(e):
                raise HistoryError(f"run history {path} is busy ({e}); try again") from None
            raise HistoryError(f"run history {path} is unusable ({e}); move it aside to start a new one") from None


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the schema up to date, retrying with backoff while another process holds the file.

    NOTE: SQLite answers ``PRAGMA journal_mode = WAL`` with "database is locked" at once, without waiting out the
    busy timeout, while another connection holds the still rollback-journal file: several processes setting up a
    new database together (cron firing jobs at once) would fail without these retries."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            return _migrate_once(conn, path)
        except sqlite3.OperationalError as e:
            if not _is_busy(e) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.25)


def _is_busy(e: sqlite3.Error) -> bool:
    return "locked" in str(e) or "busy" in str(e)


def _migrate_once(conn: sqlite3.Connection, path: Path) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        raise HistoryError(f"run history {path} has schema version {version}, newer than this batchgen "
                           f"understands ({SCHEMA_VERSION}); upgrade batchgen or set BATCHGEN_STATE_DIR")
    conn.execute("PRAGMA journal_mode = WAL")        # persistent: set once, stays with the file
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]   # another process may have migrated
        for sql in _MIGRATIONS[version:]:
            for stmt in filter(str.strip, sql.split(";")):
                conn.execute(stmt)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _write(conn: sqlite3.Connection, sql: str, params: tuple) -> sqlite3.Cursor:
    conn.execute("BEGIN IMMEDIATE")
    try:
        cur = conn.execute(sql, params)
        conn.execute("COMMIT")
        return cur
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def start_run(job: str, config_summary: dict | str | None = None, *,
              state_dir: str | Path | None = None) -> int:
    """Record that a run of ``job`` starts now; returns its run id (for ``finish_run``).

    Args:
        job: the job name.
        config_summary: what identifies this run's setup (model, input/output paths, schedule, ...): a
            JSON-serializable dict, or a string.
    """
    config = config_summary if isinstance(config_summary, str) else json.dumps(config_summary or {}, default=str)
    with _connect(state_dir) as conn:
        cur = _write(conn, "INSERT INTO runs (job, started_at, status, pid, host, config) "
                           "VALUES (?, ?, 'running', ?, ?, ?)",
                     (job, time.time(), os.getpid(), socket.gethostname(), config))
        return int(cur.lastrowid)


def set_phase(run_id: int, phase: str, queued_s: float | None = None, *,
              state_dir: str | Path | None = None) -> None:
    """A running run's phase: 'queued' (waiting for the machine) or 'computing' (with the seconds it waited)."""
    with _connect(state_dir) as conn:
        _write(conn, "UPDATE runs SET phase = ?, queued_s = COALESCE(?, queued_s) WHERE id = ?",
               (phase, queued_s, run_id))


def finish_run(run_id: int, status: str, *, rows_done: int = 0, rows_skipped: int = 0, rows_failed: int = 0,
               tokens_per_s: float | None = None, cache_hit_rate: float | None = None,
               trace_path: str | Path | None = None, report_path: str | Path | None = None,
               error: str | None = None, state_dir: str | Path | None = None,
               queued_s: float | None = None, engine_s: float | None = None) -> None:
    """Close run ``run_id`` with its outcome.

    Args:
        status: 'ok' (finished), 'failed' (stopped by an error; give ``error``), 'interrupted' (SIGTERM/Ctrl-C).
        rows_done / rows_skipped / rows_failed: rows computed this run / already done before (resumed or
            incremental) / finished with a per-row error.
        tokens_per_s, cache_hit_rate: the run's throughput and prefix-cache hit rate (0..1).
        trace_path, report_path: where the run's trace and report (manifest) were written.
    """
    if status not in FINAL_STATUSES:
        raise ValueError(f"status must be one of {', '.join(FINAL_STATUSES)}; got {status!r}")
    with _connect(state_dir) as conn:
        cur = _write(conn, "UPDATE runs SET finished_at = ?, status = ?, rows_done = ?, rows_skipped = ?, "
                           "rows_failed = ?, tokens_per_s = ?, cache_hit_rate = ?, trace_path = ?, report_path = ?, "
                           "error = ?, phase = NULL, queued_s = COALESCE(?, queued_s), engine_s = ? WHERE id = ?",
                     (time.time(), status, rows_done, rows_skipped, rows_failed, tokens_per_s, cache_hit_rate,
                      None if trace_path is None else str(trace_path),
                      None if report_path is None else str(report_path), error, queued_s, engine_s, run_id))
        if cur.rowcount != 1:
            raise HistoryError(f"no run with id {run_id} in {db_path(state_dir)}")


def recent_runs(job: str | None = None, limit: int = 20, *, state_dir: str | Path | None = None) -> list[HistoryRun]:
    """The ``limit`` most recent runs (of ``job``, or of every job), newest first. An absent database is empty."""
    if not db_path(state_dir).exists():
        return []
    where, params = ("WHERE job = ?", (job,)) if job else ("", ())
    with _connect(state_dir) as conn:
        rows = conn.execute(f"SELECT * FROM runs {where} ORDER BY started_at DESC, id DESC LIMIT ?",
                            (*params, limit)).fetchall()
    return _rows(rows, db_path(state_dir))


def get_run(run_id: int, *, state_dir: str | Path | None = None) -> HistoryRun:
    with _connect(state_dir) as conn:
        row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise HistoryError(f"no run with id {run_id} in {db_path(state_dir)}")
    try:
        return _to_run(row)
    except ValueError as e:
        raise HistoryError(f"run history {db_path(state_dir)}: run {run_id} is unusable ({e})") from None


def _rows(rows: list[sqlite3.Row], path: Path) -> list[HistoryRun]:
    """The rows that validate; each other one is skipped with a warning naming the file, the row and the field."""
    out = []
    for r in rows:
        try:
            out.append(_to_run(r))
        except ValueError as e:
            log.warning("run history %s: run %s is unusable (%s); skipped", path, dict(r).get("id"), e)
    return out


_INT, _NUM, _TEXT = (int,), (int, float), (str,)
_TYPES = {"id": (_INT, False), "job": (_TEXT, False), "started_at": (_NUM, False), "finished_at": (_NUM, True),
          "status": (_TEXT, False), "pid": (_INT, True), "host": (_TEXT, True), "rows_done": (_INT, True),
          "rows_skipped": (_INT, True), "rows_failed": (_INT, True), "tokens_per_s": (_NUM, True),
          "cache_hit_rate": (_NUM, True), "trace_path": (_TEXT, True), "report_path": (_TEXT, True),
          "error": (_TEXT, True), "phase": (_TEXT, True), "queued_s": (_NUM, True), "engine_s": (_NUM, True)}


def _to_run(row: sqlite3.Row) -> HistoryRun:
    """One row as a HistoryRun; ValueError naming the field whose value is not of its column's type."""
    stored = dict(row)
    d = {k: stored.get(k) for k in _FIELDS}         # a column gone from a damaged schema: null, and checked so
    for name, (types, nullable) in _TYPES.items():
        v = d.get(name)
        if not (v is None and nullable) and not isinstance(v, types):
            raise ValueError(f"{name} must be {'/'.join(t.__name__ for t in types)}"
                             f"{' or null' if nullable else ''}, got {v!r:.60}")
    if d["status"] not in ("running", *FINAL_STATUSES):
        raise ValueError(f"status must be running, {', '.join(FINAL_STATUSES)}; got {d['status']!r:.60}")
    try:
        d["config"] = json.loads(d["config"]) if d["config"] else {}
    except (TypeError, ValueError, RecursionError):
        d["config"] = {"summary": d["config"]}
    if not isinstance(d["config"], dict):
        d["config"] = {"summary": d["config"]}
    if d["status"] == "running" and d["host"] == socket.gethostname() and d["pid"] and not _alive(d["pid"]):
        d["status"] = "died"
        d["error"] = d["error"] or f"process {d['pid']} ended without recording the run's end (killed?)"
    return HistoryRun(**d)


_FIELDS = set(HistoryRun.__dataclass_fields__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # exists, owned by someone else
        return True
    return True
