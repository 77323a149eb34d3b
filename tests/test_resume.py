"""Exactly-once: kill -9 a run at several points (between steps, mid part-file write), resume, and get the
same output as an uninterrupted run, row for row, no duplicates; SIGTERM stops gracefully and resumes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.test_pipeline import write_job

ROOT = Path(__file__).resolve().parents[1]
STABLE = ["id", "category", "summary", "finish_reason", "prompt_tokens", "output_tokens", "error", "row_key"]

DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import pipeline.run.runner, pipeline.job.state
    from tests import conftest

    kill_step = int(os.environ.get("KILL_AT_STEP", "0"))
    kill_write = int(os.environ.get("KILL_AT_WRITE", "0"))
    delay = float(os.environ.get("STEP_DELAY", "0"))

    class Slow(conftest.FakeLLM):
        def step(self):
            out = super().step()
            if kill_step and self.steps == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(delay)
            return out

    pipeline.run.runner.default_llm_factory = lambda config: Slow(TOK, max_num_seqs=2,
                                                                 **conftest.changed_options(config))
    real_write = pipeline.job.state.write_parquet_atomic
    writes = [0]
    def write(table, path):
        writes[0] += 1
        if writes[0] == kill_write:     # die with a temp file half-written, before the rename
            import pyarrow.parquet as pq
            tmp = path.with_name("." + path.name + ".tmp-dead")
            with open(tmp, "wb") as fh:
                fh.write(b"PAR1 half")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(table, path)
    pipeline.job.state.write_parquet_atomic = write
    from batchgen.cli import main
    main(sys.argv[1:])
""")


@pytest.fixture
def driver(tmp_path):
    path = tmp_path / "driver.py"
    code = DRIVER.format(root=str(ROOT)).replace(
        "from tests import conftest\n",
        "from tests import conftest\nimport pytest\n"
        "TOK = conftest._build_tiny_tokenizer(lite=True)\n")
    path.write_text(code)
    return path


def _run(driver, job, env=None, check=True):
    p = subprocess.run([sys.executable, str(driver), "submit", "-q", "--commit-every", "0", str(job)],
                       capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, cwd=ROOT, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_kill9_at_many_points_then_resume_equals_uninterrupted(tmp_path, make_docs_dataset, driver):
    data = make_docs_dataset(n=40)
    from tests.conftest import FakeLLM, _build_tiny_tokenizer, changed_options
    from tests.test_pipeline import run
    tok = _build_tiny_tokenizer(lite=True)
    run([write_job(tmp_path, "ref", data)], lambda config: FakeLLM(tok, max_num_seqs=2, **changed_options(config)))
    ref = pq.read_table(tmp_path / "out/ref.parquet").select(STABLE)

    job = write_job(tmp_path, "k", data, out=tmp_path / "out/k.parquet")
    # Each run commits after every step; kill points: after a step, or inside the n-th part write.
    kills = [{"KILL_AT_STEP": "2"}, {"KILL_AT_WRITE": "2"}, {"KILL_AT_STEP": "3"}, {"KILL_AT_WRITE": "1"},
             {"KILL_AT_STEP": "4"}, {"KILL_AT_WRITE": "3"}]
    for env in kills:
        p = _run(driver, job, env, check=False)
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert not (tmp_path / "out/k.parquet").exists()
    p = _run(driver, job)
    assert "reused from earlier runs" in p.stdout and "up to date" not in p.stdout
    out = pq.read_table(tmp_path / "out/k.parquet")
    assert out.num_rows == 40 and len(set(out.column("row_key").to_pylist())) == 40
    assert out.select(STABLE).to_pylist() == [
        {**r, "row_key": r["row_key"]} for r in ref.to_pylist()]


def test_sigterm_stops_gracefully_and_resumes(tmp_path, make_docs_dataset, driver):
    data = make_docs_dataset(n=40)
    job = write_job(tmp_path, "t", data)
    proc = subprocess.Popen([sys.executable, str(driver), "submit", "-q", str(job)], cwd=ROOT, text=True,
                            env={**os.environ, "STEP_DELAY": "0.1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    spill = tmp_path / "out/.t.parquet.batchgen/spill.arrow"
    deadline = time.time() + 60
    while time.time() < deadline and not spill.exists():
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "run the same command again" in err.lower() and "Traceback" not in err
    assert not (tmp_path / "out/.t.parquet.batchgen/lock").exists()
    p = _run(driver, job)
    assert "reused from earlier runs" in p.stdout
    out = pq.read_table(tmp_path / "out/t.parquet")
    assert out.num_rows == 40 and out.column("summary").null_count == 0
