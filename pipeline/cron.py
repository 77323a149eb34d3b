"""batchgen's entries in the user's crontab: validate schedules, install / list / remove, via the real ``crontab``.

batchgen owns one marked block; every entry in it ends with a ``# batchgen:<job>`` tag (a shell comment, so
cron ignores it). Writes rebuild that block and leave every other line of the crontab as it was::

    MAILTO=me@example.com                                       <- the user's lines: never touched
    # BEGIN batchgen (managed by `batchgen cron`; edits here are overwritten)
    0 2 * * * cd /work && mkdir -p /logs && PATH=... /venv/bin/batchgen submit /work/jobs/a.yaml --quiet \
        >> /logs/a.log 2>&1 # batchgen:a          (one line in the crontab)
    # END batchgen

An entry is self-contained, since cron runs it with ``PATH=/usr/bin:/bin`` and ``HOME`` from passwd, in
``$HOME``: it changes to the working directory (job paths are relative to it), sets ``PATH`` (the batchgen
executable's directory first) and ``BATCHGEN_STATE_DIR`` (so the run's history lands where ``batchgen status``
looks), runs the batchgen executable by absolute path on the absolute job file, and appends stdout and stderr
to ``<log dir>/<job>.log``.
"""
from __future__ import annotations

import os
import pwd
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from croniter import croniter

from engine import BatchgenError
from pipeline.history import resolve_state_dir

BEGIN = "# BEGIN batchgen (managed by `batchgen cron`; edits here are overwritten)"
END = "# END batchgen"
TAG = "# batchgen:"
_TAG_RE = re.compile(r"\s# batchgen:([A-Za-z0-9][A-Za-z0-9_.-]*)\s*$")
MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
MAX_COMMAND = 998          # Debian cron rejects a longer command ("command too long")
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
FIELDS = ("minute (0-59)", "hour (0-23)", "day-of-month (1-31)", "month (1-12 or jan-dec)",
          "day-of-week (0-7 or sun-sat)")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


class CronError(BatchgenError):
    """A bad schedule, or the crontab cannot be read or written."""


class ScheduledJob(Protocol):
    """What ``install`` needs of a job (``pipeline.job.Job`` has it)."""
    name: str
    file: str
    schedule: str | None


@dataclass(frozen=True)
class CronEntry:
    name: str          # the job name (from the tag)
    schedule: str      # the 5 fields, or an @macro
    command: str       # what cron runs
    line: str          # the crontab line as written


def validate_schedule(expr: str) -> str:
    """Check a cron schedule: 5 fields (minute hour day-of-month month day-of-week) or an @macro such as
    ``@daily``. Returns it with whitespace normalized; raises ``CronError`` saying what is wrong."""
    if not isinstance(expr, str) or not expr.strip():
        raise CronError(f"schedule must be a cron expression like '0 2 * * *' (minute hour day month weekday); "
                        f"got {expr!r}")
    fields = expr.split()
    if len(fields) == 1 and fields[0].startswith("@"):
        if fields[0] not in MACROS:
            raise CronError(f"unknown schedule macro {fields[0]!r}; use one of {', '.join(MACROS)} or 5 fields "
                            "like '0 2 * * *'")
        return fields[0]
    if len(fields) != 5:
        raise CronError(f"schedule {expr!r} has {len(fields)} field{'s' * (len(fields) != 1)}; a cron expression "
                        "has 5: minute hour day-of-month month day-of-week, e.g. '0 2 * * *' (02:00 daily)")
    bad = [name for i, name in enumerate(FIELDS) if not _field_ok(fields, i)]
    if bad or not croniter.is_valid(" ".join(fields)):
        where = f": check the {' and '.join(bad)} field{'s' * (len(bad) > 1)}" if bad else ""
        raise CronError(f"schedule {expr!r} is not a valid cron expression{where}")
    return " ".join(fields)


def _field_ok(fields: list[str], i: int) -> bool:
    """Field ``i`` alone (the others '*'): plain cron syntax (numbers, names, * , - /), which croniter accepts.
    NOTE: croniter also takes Quartz extras (L, W, #, ?) that Debian's cron rejects; refuse them here."""
    field = fields[i]
    if not re.fullmatch(r"[0-9A-Za-z*,/-]+", field):
        return False
    names = _MONTHS if i == 3 else _DAYS if i == 4 else ()
    if any(w.lower() not in names for w in re.findall(r"[A-Za-z]+", field)):
        return False
    return croniter.is_valid(" ".join(field if j == i else "*" for j in range(5)))


def batchgen_executable() -> list[str]:
    """How cron should start batchgen: the ``batchgen`` script this process runs as (or the one next to this
    interpreter), else this interpreter importing ``pipeline.cli``. Absolute paths; venv symlinks are kept (not
    resolved), so the venv's interpreter and packages are used."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "batchgen" and argv0.exists():
        return [os.path.abspath(argv0)]
    sibling = Path(sys.executable).parent / "batchgen"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    return [os.path.abspath(sys.executable), "-c", "from pipeline.cli import main; main()"]


def entry_line(name: str, schedule: str, job_file: str | Path, *, workdir: str | Path, log_dir: str | Path,
               state_dir: str | Path, executable: Sequence[str]) -> str:
    """One crontab line for a job (see the module docstring)."""
    q = shlex.quote
    exe_dir = os.path.dirname(executable[0])
    path = ":".join(dict.fromkeys([exe_dir, *BASE_PATH.split(":")]))
    log = Path(log_dir) / f"{name}.log"
    command = (f"cd {q(str(workdir))} && mkdir -p {q(str(log_dir))} && "
               f"PATH={q(path)} BATCHGEN_STATE_DIR={q(str(state_dir))} "
               f"{' '.join(q(str(a)) for a in executable)} submit {q(str(job_file))} --quiet "
               f">> {q(str(log))} 2>&1 {TAG}{name}")
    if "\n" in command:
        raise CronError(f"job {name!r}: a path contains a newline, which a crontab line cannot hold")
    # NOTE: cron turns an unescaped % into a newline (stdin for the command); \% passes a literal %.
    command = command.replace("%", "\\%")
    if len(command) > MAX_COMMAND:
        raise CronError(f"job {name!r}: the crontab command would be {len(command)} characters, over cron's "
                        f"limit of {MAX_COMMAND}; use shorter paths (working dir, job file, --log-dir)")
    return f"{validate_schedule(schedule)} {command}"


# ---- the crontab itself ---------------------------------------------------------------------------------------

def read_crontab(user: str | None = None) -> str:
    """The crontab's text ('' when the user has none)."""
    r = _crontab(["-l"], user)
    if r.returncode != 0:
        if "no crontab for" in r.stderr:
            return ""
        raise CronError(f"`crontab -l` failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def write_crontab(text: str, user: str | None = None) -> None:
    if text and not text.endswith("\n"):
        text += "\n"
    r = _crontab(["-"], user, stdin=text)
    if r.returncode != 0:
        raise CronError(f"`crontab -` refused the new crontab: {r.stderr.strip() or r.returncode}")


def _crontab(args: list[str], user: str | None, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["crontab", *(["-u", user] if user else []), *args]
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise CronError("the `crontab` command is not installed (Debian/Ubuntu: apt-get install cron)") from None


def parse(text: str) -> tuple[list[str], int, list[CronEntry]]:
    """Split a crontab into the user's lines, the index among them where batchgen's block goes (where it was,
    else the end), and batchgen's entries (tagged lines anywhere, in order)."""
    others, entries, at = [], [], None
    for line in text.splitlines():
        m = _TAG_RE.search(line)
        if line.strip() in (BEGIN, END) or m:
            at = len(others) if at is None else at
            if m:
                entries.append(_entry(m.group(1), line))
            continue
        others.append(line)
    return others, len(others) if at is None else at, entries


def _entry(name: str, line: str) -> CronEntry:
    body = line[: _TAG_RE.search(line).start()].strip()
    n = 1 if body.startswith("@") else 5
    parts = body.split(None, n)
    return CronEntry(name=name, schedule=" ".join(parts[:n]), command=" ".join(parts[n:]), line=line)


def render(others: list[str], at: int, entries: list[CronEntry]) -> str:
    block = [BEGIN, *(e.line for e in entries), END] if entries else []
    lines = others[:at] + block + others[at:]
    return "\n".join(lines) + "\n" if lines else ""


# ---- the API the CLI uses -------------------------------------------------------------------------------------

def install(jobs: Sequence[ScheduledJob], job_files: Sequence[str | Path] | None = None, dry_run: bool = False,
            *, workdir: str | Path | None = None, log_dir: str | Path | None = None,
            state_dir: str | Path | None = None, executable: Sequence[str] | None = None,
            user: str | None = None) -> list[CronEntry]:
    """Add or replace the crontab entry of every job that has a ``schedule``; other batchgen entries and every
    non-batchgen line stay. A job without a schedule loses its old entry, if any. Idempotent.

    Args:
        jobs: parsed jobs (``name``, ``schedule``, ``file``); ``job_files`` overrides their files, in order.
            A relative file is relative to the current directory (not ``workdir``).
        dry_run: change nothing; return the entries that would be written.
        workdir: where the run starts (job paths are relative to it); default the current directory.
        log_dir: default ``<state dir>/logs``. state_dir: see ``pipeline.history``.
        executable: argv prefix that starts batchgen; default ``batchgen_executable()``.
        user: edit this user's crontab (``crontab -u``; root only); defaults then use that user's home.
    Returns:
        the entries of the given jobs, in job order.
    """
    files = list(job_files) if job_files is not None else [j.file for j in jobs]
    if len(files) != len(jobs):
        raise ValueError("job_files must give one file per job")
    workdir = Path(workdir or os.getcwd()).absolute()
    try:
        home = pwd.getpwnam(user).pw_dir if user else None
    except KeyError:
        raise CronError(f"no user {user!r} on this machine") from None
    state = resolve_state_dir(state_dir, home=home)
    logs = Path(log_dir).absolute() if log_dir else state / "logs"
    exe = list(executable or batchgen_executable())
    new = {}
    for job, file in zip(jobs, files):
        if job.schedule:
            try:
                schedule = validate_schedule(job.schedule)
            except CronError as e:
                raise CronError(f"{job.file}: schedule: {e}") from None
            line = entry_line(job.name, schedule, Path(file).absolute(), workdir=workdir, log_dir=logs,
                              state_dir=state, executable=exe)
            new[job.name] = _entry(job.name, line)
    others, at, old = parse(read_crontab(user))
    given = {j.name for j in jobs}
    # NOTE: replaced entries keep their place, new ones go last, so a reinstall leaves the crontab unchanged.
    merged = [new.get(e.name, e) for e in old if e.name not in given or e.name in new]
    merged += [e for e in new.values() if e.name not in {o.name for o in old}]
    unique: dict[str, CronEntry] = {}
    for e in merged:                           # one entry per job, even if a line was copied by hand
        unique.setdefault(e.name, e)
    if not dry_run:
        write_crontab(render(others, at, list(unique.values())), user)
    return list(new.values())


def list_entries(user: str | None = None) -> list[CronEntry]:
    """batchgen's entries in the crontab, in crontab order."""
    return parse(read_crontab(user))[2]


def remove(names: Sequence[str] | None = None, dry_run: bool = False, *, user: str | None = None) -> list[CronEntry]:
    """Remove batchgen's entries for ``names`` (all of them when None); returns the entries removed."""
    others, at, entries = parse(read_crontab(user))
    gone = [e for e in entries if names is None or e.name in names]
    if gone and not dry_run:
        write_crontab(render(others, at, [e for e in entries if e not in gone]), user)
    return gone
