"""A run on the real engine (tiny random Llama, the default dtype, seeded sampling: every row the job's seed),
killed with SIGKILL after some engine steps and resumed, gives the rows an uninterrupted run gives: the resumed
rows are computed in other batches than before, so this holds only because a row's tokens do not depend on its
batch."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq

from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs
from tests.test_pipeline import write_job
from tests.test_resume import ROOT, STABLE

DRIVER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import engine.llm
    kill_step = int(os.environ.get("KILL_AT_STEP", "0"))
    step, steps = engine.llm.LLM.step, [0]
    def counted(self):
        steps[0] += 1
        if steps[0] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self)
    engine.llm.LLM.step = counted
    from batchgen.cli import main
    main(sys.argv[1:])
""")


def _job(tmp_path, name, data, model):
    path = write_job(tmp_path, name, data, extra=f"model: {model}\nengine:\n  max_num_seqs: 3\n"
                                                  "  max_num_batched_tokens: 96\n")
    # seeded sampling instead of write_job's greedy generation
    path.write_text(path.read_text().replace("  temperature: 0.0", "  temperature: 1.5\n  top_p: 0.95\n  seed: 7"))
    return path


def test_killed_and_resumed_equals_uninterrupted(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=12)
    run_jobs([load_job(_job(tmp_path, "ref", data, tiny_llama_dir))],
             options=RunOptions(quiet=True, record_history=False))
    ref = pq.read_table(tmp_path / "out/ref.parquet").select(STABLE)

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT)))
    job = _job(tmp_path, "k", data, tiny_llama_dir)

    def submit(env):
        return subprocess.run([sys.executable, str(driver), "submit", "-q", "--commit-every", "0", str(job)],
                              capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=300)
    p = submit({"KILL_AT_STEP": "20"})
    assert p.returncode == -signal.SIGKILL, p.stderr
    p = submit({})
    assert p.returncode == 0, p.stderr
    assert "reused from earlier runs" in p.stdout
    out = pq.read_table(tmp_path / "out/k.parquet").select(STABLE)
    assert out.to_pylist() == ref.to_pylist()
