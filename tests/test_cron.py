"""batchgen's crontab entries, against the real ``crontab`` binary.

The crontab under test belongs to a throwaway user (``useradd`` + ``crontab -u``) when running as root, as in
CI; otherwise it is the current user's, saved first and restored after the tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.schedule import cron
from pipeline.schedule.cron import CronError

FOREIGN = "MAILTO=ops@example.com\n# nightly backup (not batchgen's)\n30 3 * * * /usr/local/bin/backup --all\n"


@pytest.fixture(scope="module")
def crontab_user():
    """The user whose crontab the tests edit: None (yourself) or a throwaway user."""
    assert shutil.which("crontab"), "the crontab command is missing: apt-get install cron (CI's setup does)"
    if os.geteuid() == 0 and shutil.which("useradd"):
        name = f"bgtest{uuid.uuid4().hex[:8]}"
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        try:
            yield name
        finally:
            subprocess.run(["crontab", "-u", name, "-r"], capture_output=True)
            subprocess.run(["userdel", name], capture_output=True)
    else:
        saved = cron.read_crontab()
        try:
            yield None
        finally:
            cron.write_crontab(saved)


@pytest.fixture
def crontab(crontab_user):
    """A crontab holding only the user's own (foreign) lines; yields the user."""
    cron.write_crontab(FOREIGN, crontab_user)
    return crontab_user


@dataclass(frozen=True)
class FakeJob:
    name: str
    file: str
    schedule: str | None


def _install(jobs, user, tmp_path, **kw):
    return cron.install(jobs, workdir=tmp_path, log_dir=tmp_path / "logs", state_dir=tmp_path / "state",
                        executable=["/opt/venv/bin/batchgen"], user=user, **kw)


@pytest.mark.parametrize("expr", ["0 2 * * *", "*/15 9-17 * * mon-fri", "0 0 1 jan,jul *", "@daily", "5 4 * * 7"])
def test_valid_schedules(expr):
    assert cron.validate_schedule(expr) == expr


@pytest.mark.parametrize("expr, message", [
    ("0 2 * *", "has 4 fields; a cron expression has 5"),
    ("0 2 * * * *", "has 6 fields"),
    ("0 25 * * *", "check the hour (0-23) field"),
    ("61 2 * * *", "check the minute (0-59) field"),
    ("0 2 L * *", "check the day-of-month"),          # Quartz syntax: croniter takes it, cron does not
    ("0 2 * * 5#2", "check the day-of-week"),
    ("0 2 * foo *", "check the month"),
    ("@reboot", "unknown schedule macro"),
    ("", "must be a cron expression"),
])
def test_invalid_schedules(expr, message):
    with pytest.raises(CronError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cron.validate_schedule(expr)


def test_install_list_reinstall_remove(crontab, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = FakeJob("digest", "jobs/digest.yaml", "0 2 * * *"), FakeJob("faq", str(tmp_path / "faq.yaml"), "@hourly")
    _install([a, b], crontab, tmp_path)
    text = cron.read_crontab(crontab)
    assert text.startswith(FOREIGN) and text.count(cron.BEGIN) == 1 and text.count(cron.END) == 1
    entries = cron.list_entries(crontab)
    assert [(e.name, e.schedule) for e in entries] == [("digest", "0 2 * * *"), ("faq", "@hourly")]
    line = entries[0].line
    assert line.startswith("0 2 * * * cd ") and line.endswith("# batchgen:digest")
    assert f"cd {tmp_path} && " in line                                    # absolute working dir
    assert f"/opt/venv/bin/batchgen submit {tmp_path}/jobs/digest.yaml --quiet" in line
    assert f">> {tmp_path}/logs/digest.log 2>&1" in line
    assert "PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin" in line
    assert f"BATCHGEN_STATE_DIR={tmp_path}/state" in line

    # reinstall: same crontab, no duplicates; a changed schedule replaces the entry in place
    _install([a, b], crontab, tmp_path)
    assert cron.read_crontab(crontab) == text
    _install([FakeJob("digest", a.file, "15 1 * * *")], crontab, tmp_path)
    assert [(e.name, e.schedule) for e in cron.list_entries(crontab)] == [("digest", "15 1 * * *"), ("faq", "@hourly")]
    assert cron.read_crontab(crontab).count("# batchgen:") == 2

    # lines the user adds around our block survive later writes, in place
    cron.write_crontab("SHELL=/bin/bash\n" + cron.read_crontab(crontab) + "0 5 * * 1 echo weekly\n", crontab)
    _install([a], crontab, tmp_path)
    text = cron.read_crontab(crontab)
    assert text.startswith("SHELL=/bin/bash\n" + FOREIGN + cron.BEGIN) and text.endswith(
        cron.END + "\n0 5 * * 1 echo weekly\n")

    # remove one, then all: only our lines go
    assert [e.name for e in cron.remove(["faq"], user=crontab)] == ["faq"]
    assert [e.name for e in cron.list_entries(crontab)] == ["digest"]
    assert cron.remove(["nope"], user=crontab) == []
    assert [e.name for e in cron.remove(user=crontab)] == ["digest"]
    assert cron.read_crontab(crontab) == "SHELL=/bin/bash\n" + FOREIGN + "0 5 * * 1 echo weekly\n"


def test_duplicated_entries_are_collapsed(crontab, tmp_path):
    a, b = _install([FakeJob("a", "a.yaml", "0 2 * * *"), FakeJob("b", "b.yaml", "0 3 * * *")], crontab, tmp_path)
    cron.write_crontab(cron.read_crontab(crontab) + a.line + "\n", crontab)      # copied by hand
    assert [e.name for e in cron.list_entries(crontab)] == ["a", "b", "a"]
    _install([FakeJob("a", "a.yaml", "0 4 * * *")], crontab, tmp_path)
    assert [(e.name, e.schedule) for e in cron.list_entries(crontab)] == [("a", "0 4 * * *"), ("b", "0 3 * * *")]


def test_job_without_schedule_loses_its_entry(crontab, tmp_path):
    _install([FakeJob("a", "a.yaml", "0 2 * * *"), FakeJob("b", "b.yaml", "0 3 * * *")], crontab, tmp_path)
    assert _install([FakeJob("a", "a.yaml", None)], crontab, tmp_path) == []
    assert [e.name for e in cron.list_entries(crontab)] == ["b"]


def test_dry_run_writes_nothing(crontab, tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")                 # a relative job file is relative to the cwd
    entries = _install([FakeJob("digest", "d.yaml", "0 2 * * *")], crontab, tmp_path, dry_run=True)
    assert [e.name for e in entries] == ["digest"]
    assert f"cd {tmp_path} && " in entries[0].line and f"submit {tmp_path}/elsewhere/d.yaml" in entries[0].line
    assert cron.read_crontab(crontab) == FOREIGN
    _install([FakeJob("digest", "d.yaml", "0 2 * * *")], crontab, tmp_path)
    assert [e.name for e in cron.remove(dry_run=True, user=crontab)] == ["digest"]
    assert [e.name for e in cron.list_entries(crontab)] == ["digest"]


def test_invalid_schedule_changes_nothing(crontab, tmp_path):
    with pytest.raises(CronError, match=r"bad.yaml: schedule: .*check the hour"):
        _install([FakeJob("ok", "ok.yaml", "0 2 * * *"), FakeJob("bad", "bad.yaml", "0 24 * * *")], crontab, tmp_path)
    assert cron.read_crontab(crontab) == FOREIGN


def test_percent_is_escaped_and_long_commands_refused(crontab, tmp_path):
    (entry,) = _install([FakeJob("pct", "100%/job.yaml", "0 2 * * *")], crontab, tmp_path)
    assert "100\\%/job.yaml" in entry.line and cron.list_entries(crontab)[0].line == entry.line
    with pytest.raises(CronError, match="over cron's limit"):
        _install([FakeJob("long", "x" * 900 + ".yaml", "0 2 * * *")], crontab, tmp_path)


def test_entry_runs_in_a_cron_like_environment(tmp_path):
    """Run an entry's command the way cron does (sh, bare PATH, HOME elsewhere): it reaches the executable
    with the job file, in the working dir, with PATH and the state dir set, and logs to the job's log."""
    fake = tmp_path / "bin" / "batchgen"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args=$*"\necho "cwd=$(pwd)"\necho "path=$PATH"\n'
                    'echo "state=$BATCHGEN_STATE_DIR"\necho oops >&2\n')
    fake.chmod(0o755)
    (tmp_path / "work").mkdir()
    line = cron.entry_line("digest", "0 2 * * *", tmp_path / "work/jobs/d.yaml", workdir=tmp_path / "work",
                           log_dir=tmp_path / "logs", state_dir=tmp_path / "state", executable=[str(fake)])
    command = line.split(None, 5)[5].replace("\\%", "%")
    subprocess.run(["/bin/sh", "-c", command], env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
                   cwd="/", check=True)
    log = (tmp_path / "logs" / "digest.log").read_text().splitlines()
    assert log[0] == f"args=submit {tmp_path}/work/jobs/d.yaml --quiet"
    assert log[1] == f"cwd={tmp_path}/work"
    assert log[2].startswith(f"path={fake.parent}:")
    assert log[3] == f"state={tmp_path}/state" and log[4] == "oops"


def test_default_executable_is_absolute():
    exe = cron.batchgen_executable()
    assert Path(exe[0]).is_absolute() and Path(exe[0]).exists()
    assert exe[1:] in ([], ["-m", "batchgen"])


def test_same_schedule_jobs_share_one_entry(crontab, tmp_path, monkeypatch):
    """Jobs firing at the same time are submitted together (one process, one prefix cache); a schedule change
    moves a job between groups; a group's line goes only with its last job."""
    monkeypatch.chdir(tmp_path)
    a, b, c = (FakeJob("a", "a.yaml", "0 2 * * *"), FakeJob("b", "b.yaml", "0 2 * * *"),
               FakeJob("c", "c.yaml", "@hourly"))
    entries = _install([a, b, c], crontab, tmp_path)
    assert [(e.names, e.schedule) for e in entries] == [(("a", "b"), "0 2 * * *"), (("c",), "@hourly")]
    listed = cron.list_entries(crontab)
    assert [e.names for e in listed] == [("a", "b"), ("c",)]
    line = listed[0].line
    assert f"submit {tmp_path}/a.yaml {tmp_path}/b.yaml --quiet" in line
    assert f">> {tmp_path}/logs/a+b.log 2>&1" in line and line.endswith("# batchgen:a,b")
    text = cron.read_crontab(crontab)
    _install([a, b, c], crontab, tmp_path)
    assert cron.read_crontab(crontab) == text                              # reinstall: unchanged

    # installing one job of a group alone keeps the group whole; a new job on that schedule joins it
    _install([b], crontab, tmp_path)
    assert cron.read_crontab(crontab) == text
    _install([FakeJob("d", "d.yaml", "0 2 * * *")], crontab, tmp_path)
    assert [e.names for e in cron.list_entries(crontab)] == [("a", "b", "d"), ("c",)]

    # b's schedule changes: it leaves the 02:00 group and joins the hourly one
    _install([FakeJob("b", "b.yaml", "@hourly")], crontab, tmp_path)
    got = [(e.names, e.schedule) for e in cron.list_entries(crontab)]
    assert got == [(("a", "d"), "0 2 * * *"), (("c", "b"), "@hourly")]
    assert f"submit {tmp_path}/c.yaml {tmp_path}/b.yaml --quiet" in cron.list_entries(crontab)[1].line

    # removal: the group line stays while it has a job
    assert [e.name for e in cron.remove(["a"], user=crontab)] == ["a"]
    assert [e.names for e in cron.list_entries(crontab)] == [("d",), ("c", "b")]
    assert f">> {tmp_path}/logs/d.log" in cron.list_entries(crontab)[0].line
    assert [e.name for e in cron.remove(["d"], user=crontab)] == ["d"]
    assert [e.names for e in cron.list_entries(crontab)] == [("c", "b")]
    assert cron.read_crontab(crontab).startswith(FOREIGN)
    assert sorted(e.name for e in cron.remove(user=crontab)) == ["b", "c"]
    assert cron.read_crontab(crontab) == FOREIGN


def test_group_entry_runs_both_jobs(tmp_path):
    fake = tmp_path / "bin" / "batchgen"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args=$*"\n')
    fake.chmod(0o755)
    (tmp_path / "work").mkdir()
    line = cron.entry_line(["a", "b"], "0 2 * * *", [tmp_path / "x 1.yaml", tmp_path / "b.yaml"],
                           workdir=tmp_path / "work", log_dir=tmp_path / "logs", state_dir=tmp_path / "state",
                           executable=[str(fake)])
    subprocess.run(["/bin/sh", "-c", line.split(None, 5)[5]], env={"PATH": "/usr/bin:/bin"}, cwd="/", check=True)
    assert (tmp_path / "logs" / "a+b.log").read_text() == f"args=submit {tmp_path}/x 1.yaml {tmp_path}/b.yaml --quiet\n"
    parsed = cron._parse_command(line.split(None, 5)[5].rsplit(" # batchgen:", 1)[0])
    assert parsed.files == (f"{tmp_path}/x 1.yaml", f"{tmp_path}/b.yaml") and parsed.workdir == f"{tmp_path}/work"
