"""The server's state: files and batches in SQLite, file bodies under the data dir.

    DATA_DIR/serve.db                 files and batches (one row each), in SQLite (WAL)
    DATA_DIR/files/<file id>.jsonl    uploaded inputs and the outputs / error files batches produce
    DATA_DIR/batches/<batch id>/      a batch's run: per-model inputs, job files, outputs, the run's log

Ids are random (``file-`` / ``batch_`` + 24 hex digits) and checked against their pattern before any path is made of
them, so nothing outside the data dir is reachable through an id. Each row belongs to the key that made it (a hash of
the API key; "" without auth): another key sees a 404, as if it did not exist.
"""
from __future__ import annotations

import json
import re
import secrets
import sqlite3
import threading
import time
from pathlib import Path

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL, purpose TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS batches (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL,
  input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT,
  status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
  in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
  cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT,
  total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
"""
_TIMES = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


class Store:
    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir).resolve()
        (self.dir / "files").mkdir(parents=True, exist_ok=True)
        (self.dir / "batches").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.dir / "serve.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    # ---- paths (ids checked first) ------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise KeyError(file_id)
        return self.dir / "files" / f"{file_id}.jsonl"

    def batch_dir(self, batch_id: str) -> Path:
        if not BATCH_ID.fullmatch(batch_id):
            raise KeyError(batch_id)
        return self.dir / "batches" / batch_id

    # ---- files ----------------------------------------------------------------------------------------------
    def new_file_id(self) -> str:
        return f"file-{secrets.token_hex(12)}"

    def add_file(self, file_id: str, owner: str, filename: str, nbytes: int, purpose: str) -> dict:
        with self._lock:
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, 0)",
                             (file_id, owner, filename, nbytes, int(time.time()), purpose))
        return self.get_file(file_id, owner)

    def get_file(self, file_id: str, owner: str) -> dict | None:
        if not FILE_ID.fullmatch(file_id or ""):
            return None
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ? AND owner = ? AND deleted = 0",
                                   (file_id, owner)).fetchone()
        return None if row is None else file_object(row)

    def list_files(self, owner: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM files WHERE owner = ? AND deleted = 0 ORDER BY created_at DESC",
                                    (owner,)).fetchall()
        return [file_object(r) for r in rows]

    def delete_file(self, file_id: str, owner: str) -> bool:
        if self.get_file(file_id, owner) is None:
            return False
        with self._lock:
            self._db.execute("UPDATE files SET deleted = 1 WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # ---- batches --------------------------------------------------------------------------------------------
    def add_batch(self, owner: str, input_file_id: str, endpoint: str, window: str, window_s: float,
                  metadata: dict | None) -> dict:
        bid, now = f"batch_{secrets.token_hex(12)}", int(time.time())
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, owner, input_file_id, endpoint, completion_window, metadata, status, "
                "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                (bid, owner, input_file_id, endpoint, window, json.dumps(metadata) if metadata else None, now,
                 int(now + window_s)))
        return self.get_batch(bid, owner)

    def _row(self, batch_id: str) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()

    def get_batch(self, batch_id: str, owner: str | None) -> dict | None:
        """The batch as OpenAI's ``Batch`` object; ``owner`` None: whoever's (the worker)."""
        if not BATCH_ID.fullmatch(batch_id or ""):
            return None
        row = self._row(batch_id)
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return batch_object(row)

    def owner_of(self, batch_id: str) -> str:
        return self._row(batch_id)["owner"]

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first; ``after``: the batch id the previous page ended with."""
        with self._lock:
            start = None
            if after:
                r = self._db.execute("SELECT seq FROM batches WHERE id = ? AND owner = ?", (after, owner)).fetchone()
                start = r["seq"] if r else None
            q, args = "SELECT * FROM batches WHERE owner = ?", [owner]
            if start is not None:
                q += " AND seq < ?"
                args.append(start)
            rows = self._db.execute(q + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [batch_object(r) for r in rows[:limit]], len(rows) > limit

    def batches_with(self, *statuses: str) -> list[dict]:
        """Every batch in one of ``statuses``, oldest first (the worker's queue)."""
        marks = ", ".join("?" * len(statuses))
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                    statuses).fetchall()
        return [batch_object(r) for r in rows]

    def update_batch(self, batch_id: str, status: str | None = None, when: str | None = None, **fields) -> None:
        """Set ``fields`` (errors as a list, request counts by name), and ``status`` with its ``<when>`` time."""
        if status is not None:
            fields["status"] = status
            if when:
                fields[when] = int(time.time())
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps(fields["errors"])
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE batches SET {cols} WHERE id = ?", (*fields.values(), batch_id))

    def cancel(self, batch_id: str) -> bool:
        """validating / in_progress -> cancelling (atomically); False where the batch is past that."""
        with self._lock:
            cur = self._db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND "
                                   "status IN ('validating', 'in_progress')", (int(time.time()), batch_id))
        return cur.rowcount == 1


def file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


def batch_object(row: sqlite3.Row) -> dict:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{t: row[t] for t in _TIMES},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}


__all__ = ["Store", "FILE_ID", "BATCH_ID", "file_object", "batch_object"]
