"""Run history in SQLite: start/finish, ordering, state dir resolution, schema version, concurrent writers."""
from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest

from pipeline.run import history
from pipeline.run.history import HistoryError


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_start_finish_and_recent_runs(state):
    a = history.start_run("digest", {"model": "gemma-3-270m", "input": "in.parquet"})
    history.finish_run(a, "ok", rows_done=200, rows_skipped=0, rows_failed=2, tokens_per_s=812.5,
                       cache_hit_rate=0.71, trace_path="out/trace.json", report_path="out/manifest.json")
    b = history.start_run("digest", {"model": "gemma-3-270m"})
    history.finish_run(b, "failed", rows_done=5, rows_skipped=200, error="disk full writing out/part-3.parquet")
    c = history.start_run("other", None)

    runs = history.recent_runs()
    assert [r.id for r in runs] == [c, b, a]                       # newest first
    assert (state / "history.sqlite").is_file()
    first = runs[2]
    assert (first.job, first.status, first.rows_done, first.rows_skipped, first.rows_failed) == \
        ("digest", "ok", 200, 0, 2)
    assert first.tokens_per_s == 812.5 and first.cache_hit_rate == 0.71
    assert first.report_path == "out/manifest.json" and first.config["input"] == "in.parquet"
    assert first.duration_s is not None and first.duration_s >= 0
    assert runs[1].error.startswith("disk full") and runs[0].status == "running"

    assert [r.id for r in history.recent_runs("digest")] == [b, a]
    assert [r.id for r in history.recent_runs(limit=1)] == [c]
    assert history.get_run(b).status == "failed"


def test_state_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHGEN_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert history.resolve_state_dir() == tmp_path / ".local/state/batchgen"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert history.resolve_state_dir() == tmp_path / "xdg/batchgen"
    # another user's home (cron --user): this user's XDG_STATE_HOME does not apply
    assert history.resolve_state_dir(home="/home/other") == Path("/home/other/.local/state/batchgen")
    monkeypatch.setenv("BATCHGEN_STATE_DIR", str(tmp_path / "env"))
    assert history.resolve_state_dir() == tmp_path / "env"
    assert history.resolve_state_dir(tmp_path / "arg") == tmp_path / "arg"


def test_no_database_is_empty_and_bad_calls_are_clear(state):
    assert history.recent_runs() == []
    assert not (state / "history.sqlite").exists()                # reading creates nothing
    with pytest.raises(ValueError, match="ok, failed, interrupted"):
        history.finish_run(1, "done")
    with pytest.raises(HistoryError, match="no run with id 99"):
        history.finish_run(99, "ok")


def test_newer_schema_is_refused(state):
    history.start_run("j")
    with sqlite3.connect(state / "history.sqlite") as conn:
        conn.execute(f"PRAGMA user_version = {history.SCHEMA_VERSION + 1}")
    with pytest.raises(HistoryError, match="newer than this batchgen"):
        history.recent_runs()


def test_dead_running_run_is_reported_as_died(state):
    run_id = history.start_run("j")
    with sqlite3.connect(state / "history.sqlite") as conn:
        conn.execute("UPDATE runs SET pid = ? WHERE id = ?", (2**22 + 12345, run_id))   # no such process
    run = history.get_run(run_id)
    assert run.status == "died" and "killed" in run.error


def _writer(state_dir: str, job: str, n: int, start=None) -> None:
    if start is not None:
        start.wait(30)                      # every process sets up the new database at the same moment
    for i in range(n):
        run_id = history.start_run(job, {"i": i}, state_dir=state_dir)
        history.finish_run(run_id, "ok", rows_done=i, state_dir=state_dir)


def test_concurrent_processes(tmp_path):
    """Several processes create the database together (the first-time setup race), then write side by side."""
    ctx = multiprocessing.get_context("fork")
    for round_ in range(4):
        state_dir = tmp_path / f"round{round_}"
        start = ctx.Barrier(8)
        procs = [ctx.Process(target=_writer, args=(str(state_dir), f"job{k}", 4, start)) for k in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 8, f"round {round_}"
        runs = history.recent_runs(limit=100, state_dir=state_dir)
        assert len(runs) == 32 and all(r.status == "ok" for r in runs)
        with sqlite3.connect(state_dir / "history.sqlite") as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_first_setup_waits_for_another_writer_of_the_new_file(state):
    """SQLite refuses ``PRAGMA journal_mode = WAL`` at once (no busy wait) while another connection holds the new,
    still rollback-journal file: the setup retries until it is done instead of failing 'database is locked'."""
    state.mkdir(parents=True)
    reader = sqlite3.connect(state / "history.sqlite", isolation_level=None, check_same_thread=False)
    reader.execute("BEGIN IMMEDIATE")                # as another process's first write: rollback mode, reserved
    reader.execute("CREATE TABLE other (x)")
    timer = threading.Timer(0.3, lambda: reader.execute("COMMIT"))
    timer.start()
    try:
        run_id = history.start_run("j")
    finally:
        timer.join()
        reader.close()
    assert [r.id for r in history.recent_runs()] == [run_id]


@pytest.mark.parametrize("edit", ["pid = 'abc'", "started_at = 'yesterday'", "job = x'ff'", "rows_done = 1.5",
                                  "status = 'done'"])
def test_a_row_of_the_wrong_type_is_skipped_with_a_warning_naming_the_file_row_and_field(state, edit, caplog):
    """SQLite keeps whatever a damaged or hand-edited file holds: a row is validated field by field when read."""
    ids = [history.start_run("j", {"model": "m"}) for _ in range(3)]
    with sqlite3.connect(state / "history.sqlite") as conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute(f"UPDATE runs SET {edit} WHERE id = ?", (ids[1],))
    with caplog.at_level("WARNING", logger="batchgen.pipeline"):
        runs = history.recent_runs()
    assert [r.id for r in runs] == [ids[2], ids[0]]
    field = edit.split()[0]
    assert f"run history {state / 'history.sqlite'}: run {ids[1]} is unusable ({field} must be" in caplog.text
    with pytest.raises(HistoryError, match=f"run {ids[1]} is unusable"):
        history.get_run(ids[1])


def test_a_config_that_is_not_an_object_is_kept_as_a_summary(state):
    run_id = history.start_run("j")
    with sqlite3.connect(state / "history.sqlite") as conn:
        conn.execute("UPDATE runs SET config = '[1, 2]' WHERE id = ?", (run_id,))
    assert history.get_run(run_id).config == {"summary": [1, 2]}


def test_a_truncated_database_is_a_history_error_naming_the_file(state):
    for i in range(40):
        history.start_run("j", {"padding": "x" * 400, "i": i})
    path = state / "history.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(HistoryError, match=f"run history {path} is unusable"):
        history.recent_runs()
