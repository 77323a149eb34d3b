"""`batchgen submit` leaves a trace next to its manifest that is self-consistent and that `batchgen report`
renders; the run lands in the history that `batchgen status` shows (tiny random Llama, real engine)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from batchgen.cli import main
from pipeline.run.trace import check_trace, read_run
from tests.test_cli import _real_job


def test_submit_writes_consistent_trace_and_report_renders(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=10)
    job = _real_job(tmp_path, "traced", data, tiny_llama_dir)
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output

    manifest = json.loads((tmp_path / "out/traced.parquet.manifest.json").read_text())
    run_dir = Path(manifest["trace"])
    assert run_dir.parent.name == "runs" and run_dir.parent.parent == tmp_path / "out/.traced.parquet.batchgen"
    assert f"batchgen report {run_dir}" in res.output             # the summary says how to see it
    assert not (run_dir.parent.parent / "current_run").exists()    # finished: the next run starts a new trace

    run = read_run(run_dir)
    assert run.num_requests == 10 and run.num_steps > 0
    assert check_trace(run) == []
    assert set(run.requests["job"]) == {"traced"}
    assert sorted(run.requests["row_id"]) == [f"doc-{i:04d}" for i in range(10)]
    assert sum(run.requests["cached_tokens"]) == manifest["this_run"]["cached_tokens"] > 0
    assert run.meta["phases"]["load_s"] > 0 and run.meta["model_config"]

    res = CliRunner().invoke(main, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    html = (run_dir / "report.html").read_text()
    assert "10 documents" in res.output and ("<img" in html or "<svg" in html)

    res = CliRunner().invoke(main, ["status", "traced"])
    assert res.exit_code == 0, res.output
    row = res.output.splitlines()[1].split()
    assert row[1] == "traced" and row[5] == "ok" and row[7:10] == ["10", "0", "0"], res.output


def test_interrupted_run_resumes_into_the_same_trace(tmp_path, make_docs_dataset, fake_llm_factory):
    """A stopped run keeps its trace; the resumed run appends a session to it (one axis for both)."""
    import pytest

    from pipeline.run.runner import Interrupted
    from tests.test_pipeline import run, write_job

    data = make_docs_dataset(n=20)
    job = write_job(tmp_path, "t2", data)
    with pytest.raises(Interrupted):
        run([job], fake_llm_factory, stop_after_rows=8, commit_interval_s=0.0)
    state = tmp_path / "out/.t2.parquet.batchgen"
    run_id = (state / "current_run").read_text()
    [report] = run([job], fake_llm_factory)
    assert report.trace_dir == state / "runs" / run_id
    meta = read_run(report.trace_dir).meta
    assert len(meta["sessions"]) == 2 and meta["num_requests"] == 20
    assert re.search(r"Trace: \S+runs/" + re.escape(run_id), report.summary)
