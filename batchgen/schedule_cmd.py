"""The scheduling commands: ``batchgen cron install|list|remove`` and ``batchgen status``.

``batchgen.cli`` adds ``commands`` to the ``batchgen`` group. The commands are thin: crontab work is in
``pipeline.schedule.cron``, run history in ``pipeline.run.history``.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import click
from croniter import croniter

from engine import BatchgenError
from pipeline.job.job_file import load_jobs
from pipeline.problems import JobError
from pipeline.run import admission, history
from pipeline.schedule import cron

_user_option = click.option("--user", metavar="USER", default=None,
                            help="Edit USER's crontab instead of yours (root only, like `crontab -u`).")
_dry_run_option = click.option("--dry-run", is_flag=True, help="Print what would change; write nothing.")


def _load_jobs(files: list[str]):
    """Parse job files, and check their schedules (each problem with its file and YAML line)."""
    jobs = load_jobs(files)
    problems = []
    for job in jobs:
        if job.schedule is not None:
            try:
                cron.validate_schedule(job.schedule)
            except cron.CronError as e:
                problems.append(job.problem("schedule", str(e)))
    if problems:
        raise JobError(problems)
    return jobs


EXIT_USER_ERROR = 2     # as batchgen.cli


@contextmanager
def _user_errors():
    """Show batchgen's errors as one message on stderr and exit 2, without a traceback (as batchgen.cli)."""
    try:
        yield
    except BatchgenError as e:
        click.echo(f"batchgen: {e}", err=True)
        sys.exit(EXIT_USER_ERROR)


@click.group("cron")
def cron_group():
    """Run scheduled jobs from your crontab (jobs with a `schedule:` key)."""


@cron_group.command("install")
@click.argument("job_files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--workdir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory the runs start in (job paths are relative to it). Default: the current one.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Where each job's <job>.log goes. Default: <state dir>/logs.")
@_dry_run_option
@_user_option
def cron_install(job_files, workdir, log_dir, dry_run, user):
    """Add or update the crontab entries of the scheduled jobs in JOB_FILES: one entry per schedule, submitting
    every job on it together (one process: one model load, one shared prefix cache).

    Re-running replaces batchgen's own entries (a job whose schedule changed moves to its new group); other
    crontab lines are never touched. A job without a schedule is skipped (and its old entry, if any, removed).
    """
    with _user_errors():
        jobs = _load_jobs(list(job_files))
        entries = cron.install(jobs, dry_run=dry_run, workdir=workdir, log_dir=log_dir, user=user)
    if dry_run:
        for e in entries:
            click.echo(e.line)
    by_name = {n: e for e in entries for n in e.names}
    for job in jobs:
        if job.name not in by_name:
            click.echo(f"{job.name}: no schedule in {job.file}; " + ("skipped" if dry_run else "not scheduled"),
                       err=True)
        elif not dry_run:
            e = by_name[job.name]
            together = [n for n in e.names if n != job.name]
            click.echo(f"{job.name}: installed '{e.schedule}' (next run {_next(e)})"
                       + (f", submitted together with {', '.join(together)}" if together else ""))
    if dry_run:
        click.echo("(dry run: crontab not changed)", err=True)


@cron_group.command("list")
@click.option("-v", "--verbose", is_flag=True, help="Also print each crontab line.")
@_user_option
def cron_list(verbose, user):
    """Show batchgen's crontab entries."""
    with _user_errors():
        entries = cron.list_entries(user)
    if not entries:
        click.echo("no batchgen entries in the crontab")
        return
    click.echo(_table(["JOBS", "SCHEDULE", "NEXT RUN"],
                      [[", ".join(e.names), e.schedule, _next(e)] for e in entries]))
    if verbose:
        for e in entries:
            click.echo(e.line)


@cron_group.command("remove")
@click.argument("jobs", nargs=-1, metavar="[JOB|JOB_FILE]...")
@_dry_run_option
@_user_option
def cron_remove(jobs, dry_run, user):
    """Remove the crontab entries of JOBs (job names or files); with no JOB, all of batchgen's entries."""
    with _user_errors():
        names = [_job_name(j) for j in jobs] or None
        gone = cron.remove(names, dry_run=dry_run, user=user)
    for e in gone:
        click.echo(f"{e.name}: {'would remove' if dry_run else 'removed'} '{e.schedule}'")
    for name in names or []:
        if name not in {e.name for e in gone}:
            click.echo(f"{name}: no batchgen entry in the crontab", err=True)
    if not gone and names is None:
        click.echo("no batchgen entries in the crontab")


def _job_name(arg: str) -> str:
    if arg.endswith((".yaml", ".yml")) and Path(arg).is_file():
        return _load_jobs([arg])[0].name
    return arg


def _next(entry: cron.CronEntry) -> str:

    return datetime.fromtimestamp(croniter(entry.schedule, time.time()).get_next(float)).strftime("%Y-%m-%d %H:%M")


@click.command("status")
@click.argument("job", required=False)
@click.option("-n", "--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="How many runs to show.")
def status_cmd(job, limit):
    """Show this machine's computing and queued runs, then recent runs (newest first), of JOB or of every job."""
    with _user_errors():
        runs = history.recent_runs(job, limit)
        busy, waiting = admission.holder(), admission.queue()
    if busy is not None:
        click.echo(f"machine: computing {busy.describe()}")
    for i, w in enumerate(waiting, 1):
        click.echo(f"machine: queued #{i} {w.describe()}")
    if not runs:
        click.echo(f"no runs{f' of {job}' if job else ''} recorded in {history.db_path()}")
        return
    rows = [[str(r.id), r.job, _when(r.started_at), _duration(r.duration_s), _status(r), _duration(r.queued_s),
             _num(r.rows_done), _num(r.rows_skipped), _num(r.rows_failed),
             "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
             "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.0%}",
             _first_line(r.error)] for r in runs]
    click.echo(_table(["ID", "JOB", "START", "DURATION", "STATUS", "QUEUED", "DONE", "SKIPPED", "FAILED", "TOK/S",
                       "HIT", "ERROR"], rows))


def _status(r: history.HistoryRun) -> str:
    """'running' shows its phase: queued (waiting for the machine) or computing."""
    return r.phase if r.status == "running" and r.phase else r.status


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows])


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _num(n: int | None) -> str:
    return "-" if n is None else str(n)


def _first_line(error: str | None, width: int = 100) -> str:
    if not error:
        return ""
    line = error.strip().splitlines()[0]
    return line if len(line) <= width else line[: width - 1] + "…"


commands = [cron_group, status_cmd]
