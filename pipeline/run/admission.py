"""Machine-wide admission: one batchgen run computes on a machine at a time; the others queue, first come first
served.

Why: an engine uses every core it has (torch threads = cores). Two runs at once do not finish sooner — each
slows down several-fold (OpenMP barriers spin against each other), each loads the model, and each prefills the
shared prefixes the other already has. Waiting and then running alone is faster for both. Jobs that should
share a prefix cache belong in one ``batchgen submit`` (``batchgen cron install`` groups same-time jobs).

Mechanism, in ``<state dir>/machine/<host>/``:
- ``lock``: held with ``flock`` by the run that computes. The kernel drops it when that process dies, so a
  killed run never leaves the machine locked.
- ``queue/<time_ns>-<pid>.json``: one ticket per waiting run; the oldest live ticket goes next (FIFO).
  Tickets of processes that are gone are removed by whoever sees them.
- ``holder.json``: who computes now (pid, jobs, since), for ``batchgen status``.
``wait=False`` (``batchgen submit --no-wait``) fails at once when the machine is busy, as the per-output lock
does for a job that is already running.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pipeline.io.paths import resolve_state_dir
from pipeline.job.state import pid_alive as _alive
from pipeline.problems import RunError


class MachineBusy(RunError):
    """Another run computes on this machine and the caller chose not to wait."""


@dataclass(frozen=True)
class Occupant:
    pid: int
    jobs: tuple[str, ...]
    since: float                 # unix seconds: started computing (holder) or started waiting (ticket)

    def describe(self) -> str:
        return (f"pid {self.pid} ({', '.join(self.jobs) or '?'}) since "
                f"{time.strftime('%H:%M:%S', time.localtime(self.since))}")


def machine_dir(state_dir: str | Path | None = None) -> Path:
    return resolve_state_dir(state_dir) / "machine" / socket.gethostname()


def _read(path: Path) -> Occupant | None:
    try:
        d = json.loads(path.read_text())
        return Occupant(int(d["pid"]), tuple(d.get("jobs", ())), float(d.get("since", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def queue(state_dir: str | Path | None = None) -> list[Occupant]:
    """The waiting runs, in the order they will go; stale tickets (process gone) are removed."""
    return [o for _, o in _tickets(machine_dir(state_dir) / "queue")]


def _tickets(qdir: Path) -> list[tuple[Path, Occupant]]:
    out = []
    for p in sorted(qdir.glob("*.json")) if qdir.is_dir() else []:
        occ = _read(p)
        if occ is None or not _alive(occ.pid):
            p.unlink(missing_ok=True)
            continue
        out.append((p, occ))
    return out


def holder(state_dir: str | Path | None = None) -> Occupant | None:
    """The run computing now, or None."""
    return _holder(machine_dir(state_dir))


def _holder(mdir: Path) -> Occupant | None:
    occ = _read(mdir / "holder.json")
    return occ if occ is not None and _alive(occ.pid) else None


def _write_atomic(path: Path, record: dict) -> None:
    """Readers never see a half-written file: write a temporary one, then rename it into place."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


class MachineLock:
    def __init__(self, jobs: Sequence[str], state_dir: str | Path | None = None, wait: bool = True,
                 poll_s: float = 0.2):
        self.dir = machine_dir(state_dir)
        self.jobs, self.wait, self.poll_s = tuple(jobs), wait, poll_s
        self._fd: int | None = None

    def acquire(self, on_wait: Callable[[Occupant | None, int], None] | None = None) -> float:
        """Block until this run may compute (FIFO); returns the seconds spent waiting. ``on_wait(holder,
        runs_ahead)`` is called once if it has to wait. Raises MachineBusy when busy and ``wait`` is False."""
        qdir = self.dir / "queue"
        qdir.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "jobs": list(self.jobs), "since": time.time()}
        ticket = qdir / f"{time.time_ns():020d}-{os.getpid()}.json"
        _write_atomic(ticket, me)
        fd = os.open(self.dir / "lock", os.O_CREAT | os.O_RDWR, 0o644)
        t0, told = time.monotonic(), False
        try:
            while True:
                ahead = [o for p, o in _tickets(qdir) if p.name < ticket.name]
                if not ahead:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        pass
                busy = _holder(self.dir)
                if not self.wait:
                    who = busy.describe() if busy else (ahead[0].describe() if ahead else "another run")
                    raise MachineBusy(f"this machine is busy: batchgen run {who} is computing"
                                      f"{f' and {len(ahead)} more are queued' if ahead else ''}; rerun without "
                                      "--no-wait to queue behind it (runs at once slow each other down)")
                if not told and on_wait is not None:
                    on_wait(busy, len(ahead))
                    told = True
                time.sleep(self.poll_s)
        except BaseException:
            os.close(fd)
            raise
        finally:
            ticket.unlink(missing_ok=True)
        self._fd = fd
        _write_atomic(self.dir / "holder.json", {**me, "since": time.time()})
        return time.monotonic() - t0

    def release(self) -> None:
        if self._fd is None:
            return
        occ = _read(self.dir / "holder.json")
        if occ is not None and occ.pid == os.getpid():
            (self.dir / "holder.json").unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
