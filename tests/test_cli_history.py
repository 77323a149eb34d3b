"""Run history through the CLI: every submit is a row in `batchgen status` — ok, failed (bad job file, held
lock, fail-fast) or interrupted — with its counts and error; the plug-in commands are registered once each."""
from __future__ import annotations

import fcntl
import json
import os

from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import PLUGINS, main
from pipeline.job.state import job_dir_for
from pipeline.run import history
from tests.test_pipeline import write_job


def _status(*args):
    res = CliRunner().invoke(main, ["status", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_ok_and_failed_runs_are_recorded(tmp_path, make_docs_dataset, fake_llm_factory, monkeypatch):
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    data = make_docs_dataset(n=6)
    good = write_job(tmp_path, "hist", data)
    assert CliRunner().invoke(main, ["submit", "-q", str(good)]).exit_code == 0

    bad = write_job(tmp_path, "hist", data, extra='schedule: "61 2 * * *"\n')      # same job, broken schedule
    res = CliRunner().invoke(main, ["submit", "-q", str(bad)])
    assert res.exit_code == 2 and "schedule" in res.output and "Traceback" not in res.output

    garbled = tmp_path / "garbled.yaml"
    garbled.write_text("name: [unclosed\n")
    assert CliRunner().invoke(main, ["submit", "-q", str(garbled)]).exit_code == 2

    runs = history.recent_runs()
    assert [(r.job, r.status) for r in runs] == [("garbled", "failed"), ("hist", "failed"), ("hist", "ok")]
    assert "61 2 * * *" in runs[1].error and "YAML syntax error" in runs[0].error
    ok = runs[2]
    assert (ok.rows_done, ok.rows_skipped, ok.rows_failed) == (6, 0, 0) and ok.cache_hit_rate > 0
    assert ok.trace_path and os.path.isdir(ok.trace_path)
    assert json.loads(open(ok.report_path).read())["job"] == "hist"
    lines = _status("hist").splitlines()
    assert [ln.split()[5] for ln in lines[1:]] == ["failed", "ok"]
    assert "schedule: schedule '61" in lines[1]                    # the error's first line, in the table


def test_lock_held_is_a_failed_run_and_engine_never_loads(tmp_path, make_docs_dataset, fake_llm_factory,
                                                          monkeypatch):
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    job = write_job(tmp_path, "busy", make_docs_dataset(n=3))
    sd = job_dir_for(tmp_path / "out/busy.parquet")
    sd.mkdir(parents=True)
    fd = os.open(sd / "lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                          # held, as by another run
    try:
        res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    finally:
        os.close(fd)
    assert res.exit_code == 2 and "already running" in res.output
    assert fake_llm_factory.made == []                      # refused before the model load
    [r] = history.recent_runs("busy")
    assert r.status == "failed" and "already running" in r.error


def test_fail_fast_row_error_is_a_failed_run(tmp_path, make_docs_dataset, fake_llm_factory, monkeypatch):
    from tests.conftest import make_docs
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    rows = make_docs(5)
    rows[3]["document"] = None
    job = write_job(tmp_path, "ff", make_docs_dataset(rows=rows))
    res = CliRunner().invoke(main, ["submit", "-q", "--fail-fast", str(job)])
    assert res.exit_code == 2 and "fail-fast" in res.output
    [r] = history.recent_runs("ff")
    assert r.status == "failed" and "is null" in r.error and r.rows_failed == 1


def test_plugins_register_each_command_once():
    assert "bench_cmd" in PLUGINS and "status_cmd" not in PLUGINS
    names = list(main.commands)
    assert len(names) == len(set(names))
    for cmd in ("submit", "plan", "validate", "status", "cron", "report", "calibrate"):
        assert cmd in main.commands
    res = CliRunner().invoke(main, ["--help"])
    assert res.output.count(" status ") == 1
