"""`batchgen cron …` and `batchgen status` through click's CliRunner (real crontab, throwaway user as root)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchgen.schedule_cmd import commands
from pipeline.run import history
from pipeline.schedule import cron
from tests.test_cron import FOREIGN, crontab, crontab_user  # noqa: F401  (fixtures)

JOB = """\
name: {name}
input:
  path: data/{name}.parquet
  id_column: id
prompt:
  system: "Summarize."
  document_column: document
output:
  path: out/{name}.parquet
{schedule}"""


@click.group()
def batchgen():
    """Stands in for batchgen.cli's group, which adds the same commands."""


for _command in commands:
    batchgen.add_command(_command)


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    return lambda *args: runner.invoke(batchgen, [str(a) for a in args], catch_exceptions=False)


def _as(user):
    return ["--user", user] if user else []


def _job(tmp_path, name, schedule=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(JOB.format(name=name, schedule=f'schedule: "{schedule}"\n' if schedule else ""))
    return path


def test_cron_install_list_remove(run, crontab, tmp_path):
    a, b = _job(tmp_path, "digest", "0 2 * * *"), _job(tmp_path, "faq", "*/30 * * * *")
    plain = _job(tmp_path, "adhoc")

    r = run("cron", "install", a, b, plain, "--dry-run", *_as(crontab))
    assert r.exit_code == 0, r.output
    assert f"submit {a} --quiet" in r.output and "# batchgen:faq" in r.output
    assert "adhoc: no schedule" in r.output and "crontab not changed" in r.output
    assert cron.read_crontab(crontab) == FOREIGN

    for _ in range(2):                                            # idempotent
        r = run("cron", "install", a, b, plain, *_as(crontab))
        assert r.exit_code == 0, r.output
        assert "digest: installed '0 2 * * *'" in r.output
    text = cron.read_crontab(crontab)
    assert text.startswith(FOREIGN) and text.count("# batchgen:") == 2
    assert f"cd {tmp_path} && " in text and f"{tmp_path}/state/logs/digest.log" in text

    r = run("cron", "list", *_as(crontab))
    lines = r.output.splitlines()
    assert lines[0].split() == ["JOBS", "SCHEDULE", "NEXT", "RUN"]
    assert lines[1].startswith("digest") and "0 2 * * *" in lines[1] and lines[2].startswith("faq")

    r = run("cron", "remove", a, "ghost", *_as(crontab))        # a job file or a name
    assert "digest: removed '0 2 * * *'" in r.output and "ghost: no batchgen entry" in r.output
    assert [e.name for e in cron.list_entries(crontab)] == ["faq"]
    r = run("cron", "remove", *_as(crontab))
    assert "faq: removed" in r.output and cron.read_crontab(crontab) == FOREIGN
    assert "no batchgen entries" in run("cron", "list", *_as(crontab)).output


def test_cron_install_invalid_schedule_is_a_clear_error(run, crontab, tmp_path):
    bad = _job(tmp_path, "bad", "0 2 * *")
    r = run("cron", "install", bad, *_as(crontab))
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"batchgen: {bad}:10: schedule: schedule '0 2 * *' has 4 fields" in r.output
    assert cron.read_crontab(crontab) == FOREIGN


def test_status_lists_runs_with_counts_and_errors(run, tmp_path):
    assert "no runs recorded" in run("status").output
    ok = history.start_run("digest", {"model": "gemma-3-270m"})
    history.finish_run(ok, "ok", rows_done=200, rows_skipped=0, rows_failed=3, tokens_per_s=845.25,
                       cache_hit_rate=0.724, queued_s=12.5, engine_s=40.0)
    failed = history.start_run("digest", {"model": "gemma-3-270m"})
    history.finish_run(failed, "failed", rows_done=12, rows_skipped=200, rows_failed=0, tokens_per_s=90.0,
                       cache_hit_rate=0.5, error="disk full while writing out/digest.parquet/part-00003\nmore")
    other = history.start_run("faq")
    history.set_phase(other, "queued")

    r = run("status")
    assert r.exit_code == 0, r.output
    header, *rows = r.output.splitlines()
    assert header.split() == ["ID", "JOB", "START", "DURATION", "STATUS", "QUEUED", "DONE", "SKIPPED", "FAILED",
                              "TOK/S", "HIT", "ERROR"]
    assert [row.split()[0] for row in rows] == [str(other), str(failed), str(ok)]        # newest first
    cells = {int(row.split()[0]): row.split() for row in rows}
    # id job date time duration status queued done skipped failed tok/s hit error...
    assert cells[ok][5:12] == ["ok", "12.5s", "200", "0", "3", "845.2", "72%"] and len(cells[ok]) == 12
    assert cells[failed][5:12] == ["failed", "-", "12", "200", "0", "90.0", "50%"]
    assert rows[1].endswith("disk full while writing out/digest.parquet/part-00003")
    assert cells[other][5:12] == ["queued", "-", "-", "-", "-", "-", "-"]          # waiting for the machine
    assert history.get_run(ok).engine_s == 40.0

    r = run("status", "digest", "-n", "1")
    assert len(r.output.splitlines()) == 2 and str(failed) == r.output.splitlines()[1].split()[0]
    assert "no runs of nope" in run("status", "nope").output


def test_plugged_into_batchgen():
    from batchgen.cli import main

    assert main.commands["cron"] is commands[0] and main.commands["status"] is commands[1]


def test_installed_entry_runs_real_batchgen_under_cron_environment(run, crontab, tmp_path):
    """The line written for the real executable works with cron's bare environment: it reaches `batchgen
    submit` (here failing fast: the job's input is missing) and the message lands in the job's log."""
    job = _job(tmp_path, "digest", "0 2 * * *")
    assert run("cron", "install", job, *_as(crontab)).exit_code == 0
    (entry,) = cron.list_entries(crontab)
    command = entry.line.split(None, 5)[5].replace("\\%", "%")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHELL": "/bin/sh",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}     # a checkout that is not pip-installed
    subprocess.run(["/bin/sh", "-c", command], env=env, cwd="/", timeout=120)
    log = (tmp_path / "state" / "logs" / "digest.log").read_text()
    assert "batchgen:" in log and "data/digest.parquet" in log and "Traceback" not in log, log
