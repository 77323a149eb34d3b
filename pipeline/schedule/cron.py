"""batchgen's entries in the user's crontab: validate schedules, install / list / remove, via the real ``crontab``.

batchgen owns one marked block; every entry in it ends with a ``# batchgen:<job>[,<job>...]`` tag (a shell
comment, so cron ignores it). Writes rebuild that block and leave every other line of the crontab as it was::

    MAILTO=me@example.com                                       <- the user's lines: never touched
    # BEGIN batchgen (managed by `batchgen cron`; edits here are overwritten)
    0 2 * * * cd /work && mkdir -p /logs && PATH=... /venv/bin/batchgen submit /work/jobs/a.yaml \
        /work/jobs/b.yaml --quiet >> /logs/a+b.log 2>&1 # batchgen:a,b          (one line in the crontab)
    # END batchgen

Jobs with the same schedule (and working directory) share **one** entry that submits them together, so jobs
firing at the same minute run in one process: one model load, one prefix cache across the jobs (their shared
system prompts and references are prefilled once), and no two processes fighting over the cores. Installing
a job whose schedule changed moves it to its new group; a group's line goes when its last job does.

An entry is self-contained, since cron runs it with ``PATH=/usr/bin:/bin`` and ``HOME`` from passwd, in
``$HOME``: it changes to the working directory (job paths are relative to it), sets ``PATH`` (the batchgen
executable's directory first) and ``BATCHGEN_STATE_DIR`` (so the run's history lands where ``batchgen status``
looks), runs the batchgen executable by absolute path on the absolute job file, and appends stdout and stderr
to ``<log dir>/<job>.log`` (``<job>+<job>.log`` for a group).
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
from pipeline.io.paths import resolve_state_dir

BEGIN = "# BEGIN batchgen (managed by `batchgen cron`; edits here are overwritten)"
END = "# END batchgen"
TAG = "# batchgen:"
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_TAG_RE = re.compile(rf"\s# batchgen:({_NAME}(?:,{_NAME})*)\s*$")
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
    """What ``install`` needs of a job (``pipeline.job.job_file.Job`` has it)."""
    name: str
    file: str
    schedule: str | None


@dataclass(frozen=True)
class CronEntry:
    names: tuple[str, ...]   # the jobs it submits together (from the tag), in submit order
    schedule: str            # the 5 fields, or an @macro
    command: str             # what cron runs
    line: str                # the crontab line as written

    @property
    def name(self) -> str:
        return ",".join(self.names)


@dataclass(frozen=True)
class _Command:
    """What one of our entry commands holds (parsed back, so a group can be rebuilt without its job files)."""
    workdir: str
    log_dir: str
    state_dir: str
    executable: tuple[str, ...]
    files: tuple[str, ...]


def _group_command(e: "CronEntry") -> _Command | None:
    """An entry's command parsed back, or None when it was edited out of our shape (one file per job)."""
    cmd = _parse_command(e.command)
    return cmd if cmd is not None and len(cmd.files) == len(e.names) else None


def _parse_command(command: str) -> _Command | None:
    """Our own command format (``entry_line``) back into its parts; None for a line edited out of shape."""
    try:
        toks = shlex.split(command.replace("\\%", "%"))
        if toks[:1] != ["cd"] or toks[2:5] != ["&&", "mkdir", "-p"] or toks[6] != "&&":
            return None
        at = next(i for i, t in enumerate(toks) if t.startswith("BATCHGEN_STATE_DIR="))
        submit = toks.index("submit", at)
        quiet = toks.index("--quiet", submit)
    except (ValueError, IndexError, StopIteration):
        return None
    return _Command(workdir=toks[1], log_dir=toks[5], state_dir=toks[at].split("=", 1)[1],
                    executable=tuple(toks[at + 1:submit]), files=tuple(toks[submit + 1:quiet]))


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
    interpreter), else this interpreter running ``-m batchgen``. Absolute paths; venv symlinks are kept (not
    resolved), so the venv's interpreter and packages are used."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "batchgen" and argv0.exists():
        return [os.path.abspath(argv0)]
    sibling = Path(sys.executable).parent / "batchgen"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    return [os.path.abspath(sys.executable), "-m", "batchgen"]


def entry_line(names: str | Sequence[str], schedule: str, job_files: str | Path | Sequence[str | Path], *,
               workdir: str | Path, log_dir: str | Path, state_dir: str | Path, executable: Sequence[str]) -> str:
    """One crontab line submitting a job, or a group of jobs together (see the module docstring)."""
    names = [names] if isinstance(names, str) else list(names)
    files = [job_files] if isinstance(job_files, (str, Path)) else list(job_files)
    name = ",".join(names)
    q = shlex.quote
    exe_dir = os.path.dirname(executable[0])
    path = ":".join(dict.fromkeys([exe_dir, *BASE_PATH.split(":")]))
    log = Path(log_dir) / f"{'+'.join(names)}.log"
    command = (f"cd {q(str(workdir))} && mkdir -p {q(str(log_dir))} && "
               f"PATH={q(path)} BATCHGEN_STATE_DIR={q(str(state_dir))} "
               f"{' '.join(q(str(a)) for a in executable)} submit {' '.join(q(str(f)) for f in files)} --quiet "
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
    return CronEntry(names=tuple(name.split(",")), schedule=" ".join(parts[:n]), command=" ".join(parts[n:]),
                     line=line)


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
        log_dir: default ``<state dir>/logs``. state_dir: see ``pipeline.run.history``.
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
    new: dict[str, tuple[str, str, str]] = {}                   # job -> (schedule, workdir, absolute file)
    for job, file in zip(jobs, files):
        if job.schedule:
            try:
                schedule = validate_schedule(job.schedule)
            except CronError as e:
                raise CronError(f"{job.file}: schedule: {e}") from None
            new[job.name] = (schedule, str(workdir), str(Path(file).absolute()))
    others, at, old = parse(read_crontab(user))
    given = {j.name for j in jobs}
    new_keys = {(s, w) for s, w, _ in new.values()}
    # Every group is placed where its earliest member's old entry was (new groups last), so a reinstall
    # leaves the crontab unchanged and a job whose schedule changed keeps its place.
    kept: list[tuple[float, CronEntry]] = []
    groups: dict[tuple[str, str], list[tuple[float, str, str]]] = {}   # (schedule, workdir) -> (pos, name, file)
    seen: set[str] = set()
    first_pos: dict[str, int] = {}
    for pos, e in enumerate(old):
        names = [n for n in e.names if n not in seen]           # a line copied by hand: first one wins
        seen.update(e.names)
        first_pos.update((n, pos) for n in names)
        if not names:
            continue
        cmd = _group_command(e)
        key = (e.schedule, cmd.workdir) if cmd else None
        if not (set(names) & given) and key not in new_keys and len(names) == len(e.names):
            kept.append((pos, e))                               # untouched: stays as written
            continue
        if cmd is None:
            if set(names) & given:                              # edited out of shape: replaced, as one job
                continue
            kept.append((pos, e))
            continue
        for n, f in zip(e.names, cmd.files):
            if n in names and n not in given:
                groups.setdefault(key, []).append((pos, n, f))
    for n, (schedule, wd, f) in new.items():
        groups.setdefault((schedule, wd), []).append((first_pos.get(n, float("inf")), n, f))
    built: list[tuple[float, CronEntry]] = []
    for (schedule, wd), members in groups.items():
        names, files_ = [m[1] for m in members], [m[2] for m in members]
        line = entry_line(names, schedule, files_, workdir=wd, log_dir=logs, state_dir=state, executable=exe)
        built.append((min(m[0] for m in members), _entry(",".join(names), line)))
    order = sorted(kept + built, key=lambda pe: pe[0])          # stable: new groups keep install order
    if not dry_run:
        write_crontab(render(others, at, [e for _, e in order]), user)
    return [e for _, e in built if set(e.names) & set(new)]


def list_entries(user: str | None = None) -> list[CronEntry]:
    """batchgen's entries in the crontab, in crontab order."""
    return parse(read_crontab(user))[2]


def remove(names: Sequence[str] | None = None, dry_run: bool = False, *, user: str | None = None) -> list[CronEntry]:
    """Remove ``names`` (every batchgen entry when None) from their entries: a group keeps its other jobs and
    its line goes with its last one. Returns one entry per job removed (its schedule and old line)."""
    others, at, entries = parse(read_crontab(user))
    gone: list[CronEntry] = []
    remaining: list[CronEntry] = []
    for e in entries:
        drop = [n for n in e.names if names is None or n in names]
        gone += [CronEntry((n,), e.schedule, e.command, e.line) for n in drop]
        keep = [n for n in e.names if n not in drop]
        if not drop:
            remaining.append(e)
        elif keep:
            cmd = _group_command(e)
            if cmd is None:
                raise CronError(f"the crontab entry of {e.name} was edited by hand; remove it with `crontab -e`")
            files = [f for n, f in zip(e.names, cmd.files) if n in keep]
            line = entry_line(keep, e.schedule, files, workdir=cmd.workdir, log_dir=cmd.log_dir,
                              state_dir=cmd.state_dir, executable=cmd.executable)
            remaining.append(_entry(",".join(keep), line))
    if gone and not dry_run:
        write_crontab(render(others, at, remaining), user)
    return gone
