"""Scheduled runs over a growing dataset: a rerun computes only rows whose idempotency key has no result
yet, the output stays one row per current input row (deleted rows dropped, or kept on request), `batchgen
status` lists every run with its counts, and an overlapping run exits at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import main
from pipeline.run.trace import read_run
from tests.conftest import make_docs
from tests.test_pipeline import write_job
from tests.test_resume import ROOT, driver  # noqa: F401  (fixture)

STABLE = ["id", "category", "summary", "finish_reason", "prompt_tokens", "output_tokens", "error", "row_key"]


@pytest.fixture
def fake_engine(monkeypatch, fake_llm_factory):
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    return fake_llm_factory


def _submit(job):
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output
    return res.output


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_appended_rows_only_are_computed(tmp_path, fake_engine):
    rows = make_docs(15)
    data = tmp_path / "grows.parquet"
    _write(data, rows[:10])
    job = write_job(tmp_path, "nightly", data)
    _submit(job)
    assert len(fake_engine.made[-1].added) == 10

    _write(data, rows)                                   # the dataset gained 5 rows overnight
    out = _submit(job)
    assert len(fake_engine.made[-1].added) == 5          # engine requests: the new rows only
    assert "5 computed, 10 reused" in out
    t = pq.read_table(tmp_path / "out/nightly.parquet")
    assert t.column("id").to_pylist() == [r["id"] for r in rows]

    # The same as one run over all 15 rows, row for row.
    _submit(write_job(tmp_path, "once", data))
    ref = pq.read_table(tmp_path / "out/once.parquet")
    assert t.select(STABLE).to_pylist() == ref.select(STABLE).to_pylist()

    res = CliRunner().invoke(main, ["status", "nightly"])
    lines = res.output.splitlines()
    cells = [ln.split() for ln in lines[1:]]                  # status, then (after QUEUED) done/skipped/failed
    assert [c[5:6] + c[7:10] for c in cells] == [["ok", "5", "10", "0"], ["ok", "10", "0", "0"]], res.output

    _submit(job)                                         # nothing new: nothing computed
    assert len(fake_engine.made[-1].added) == 0


def test_deleted_rows_dropped_by_default_or_kept(tmp_path, fake_engine):
    rows = make_docs(12)
    data = tmp_path / "shrinks.parquet"
    _write(data, rows)
    drop = write_job(tmp_path, "drop", data)
    keep = write_job(tmp_path, "keep", data).read_text().replace(
        "  include_columns: [id, category]", "  include_columns: [id, category]\n  keep_deleted_rows: true")
    (tmp_path / "keep.yaml").write_text(keep)
    keep = tmp_path / "keep.yaml"
    _submit(drop), _submit(keep)
    before = pq.read_table(tmp_path / "out/keep.parquet")

    gone = {rows[2]["id"], rows[7]["id"]}
    now = [r for r in rows if r["id"] not in gone] + [make_docs(13)[12]]
    _write(data, now)
    out = _submit(drop)
    assert "2 no longer in the input dropped" in out and "1 computed" in out
    t = pq.read_table(tmp_path / "out/drop.parquet")
    assert t.column("id").to_pylist() == [r["id"] for r in now]

    out = _submit(keep)
    assert "2 no longer in the input kept" in out and "1 computed" in out
    t = pq.read_table(tmp_path / "out/keep.parquet")
    assert t.num_rows == 13 and t.column("id").to_pylist()[:11] == [r["id"] for r in now]
    old = {r["id"]: r for r in before.to_pylist()}
    assert t.slice(11).to_pylist() == [old[rows[2]["id"]], old[rows[7]["id"]]]   # last, results unchanged
    _submit(keep)                                                                 # stays kept
    assert pq.read_table(tmp_path / "out/keep.parquet").equals(t)

    _write(data, rows + [make_docs(13)[12]])             # they come back: input rows again, not recomputed
    out = _submit(keep)
    t = pq.read_table(tmp_path / "out/keep.parquet")
    assert t.column("id").to_pylist() == [r["id"] for r in rows] + ["doc-0012"] and "0 computed" in out


def test_overlapping_run_exits_at_once(tmp_path, make_docs_dataset, driver):  # noqa: F811
    """While a run holds the job's lock, a second one (cron firing again) refuses immediately."""
    job = write_job(tmp_path, "slow", make_docs_dataset(n=40))
    # ~20 steps of 1 s: the second run's start (Python, torch, pipeline imports) must fit inside the first run even
    # when other processes load the cores (0.2 s steps failed 3 of 3 times beside three busy loops); SIGTERM stops
    # the first run after its current step, so the test still takes seconds
    first = subprocess.Popen([sys.executable, str(driver), "submit", "-q", str(job)], cwd=ROOT, text=True,
                             env={**os.environ, "STEP_DELAY": "1.0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        spill = tmp_path / "out/.slow.parquet.batchgen/spill.arrow"
        deadline = time.time() + 60
        while time.time() < deadline and not spill.exists():
            time.sleep(0.05)
        assert spill.exists(), first.stderr.read() if first.poll() is not None else "first run did not start"
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, str(driver), "submit", "-q", str(job)], cwd=ROOT, text=True,
                                capture_output=True, timeout=60)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert "already running" in second.stderr and f"pid {first.pid}" in second.stderr
        assert time.monotonic() - t0 < 30
        assert first.poll() is None                         # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    from pipeline.run import history
    statuses = [(r.status, (r.error or "")[:40]) for r in history.recent_runs("slow")]
    assert statuses[0][0] == "interrupted" or statuses[1][0] == "interrupted"
    assert any(s == "failed" and "already running" in e for s, e in statuses)


def test_old_run_traces_are_pruned_to_keep_runs(tmp_path, fake_engine):
    """A daily job keeps only its newest `output.keep_runs` traces (they grow with the rows)."""
    data = tmp_path / "grows.parquet"
    job = write_job(tmp_path, "pruned", data, extra="  keep_runs: 2\n")
    runs_dir = tmp_path / "out" / ".pruned.parquet.batchgen" / "runs"
    seen = []
    for i in range(4):
        _write(data, make_docs(3 + i))                   # one new row per run
        _submit(job)
        seen.append(sorted(p.name for p in runs_dir.iterdir()))
    assert [len(s) for s in seen] == [1, 2, 2, 2]
    # Run ids have one-second resolution and are reused once deleted, so follow the traces by their contents.
    docs = {p.name: len(read_run(p).requests["request_id"]) for p in runs_dir.iterdir()}
    assert sorted(docs.values()) == [1, 1]                # the last two runs each computed its one new row
    newest = max(runs_dir.iterdir(), key=lambda p: (p / "run.json").stat().st_mtime_ns)
    res = CliRunner().invoke(main, ["report", str(newest), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output


def test_keep_runs_must_be_positive(tmp_path):
    from pipeline.job.job_file import JobError, load_jobs
    job = write_job(tmp_path, "bad", tmp_path / "x.parquet", extra="  keep_runs: 0\n")
    with pytest.raises(JobError, match="output.keep_runs"):
        load_jobs([job])


def test_deleted_rows_kept_from_a_sharded_output(tmp_path, fake_engine):
    """keep_deleted_rows reads the previous output shard by shard (never whole) and keeps the right rows."""
    from pipeline.io.tables import read_output
    rows = make_docs(10)
    data = tmp_path / "shrinks.parquet"
    _write(data, rows)
    job = write_job(tmp_path, "shards", data, out=tmp_path / "out/shards",
                    extra="  rows_per_shard: 3\n  keep_deleted_rows: true\n")
    _submit(job)
    assert len(list((tmp_path / "out/shards").glob("part-*.parquet"))) == 4
    gone = [rows[1]["id"], rows[8]["id"]]
    now = [r for r in rows if r["id"] not in gone]
    _write(data, now)
    assert "2 no longer in the input kept" in _submit(job)
    assert read_output(tmp_path / "out/shards").column("id").to_pylist() == [r["id"] for r in now] + gone
