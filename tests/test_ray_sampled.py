"""Ray == local for a sampled job (temperature 1.5, no seed: each row draws from its row seed, pipeline.plan.batch):
two replicas compute other batches than the local run, and every row comes out the same."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.execute.ray.driver import RayOptions
from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs
from tests.conftest import make_docs
from tests.test_pipeline import write_job
from tests.test_ray import ENGINE, SAME

ray = pytest.importorskip("ray")


def _job(tmp_path, name, data, model):
    path = write_job(tmp_path, name, data, extra=f"model: {model}\n" + ENGINE)
    path.write_text(path.read_text().replace("  temperature: 0.0", "  temperature: 1.5"))
    return load_job(path)


def test_sampled_rows_on_two_replicas_equal_a_local_run(tmp_path, tiny_llama_dir, monkeypatch):
    data = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(make_docs(24, 0, False)), data)
    run_jobs([_job(tmp_path, "local", data, tiny_llama_dir)], options=RunOptions(quiet=True, record_history=False))
    ref = pq.read_table(tmp_path / "out/local.parquet").select(SAME)
    assert len(set(ref.column("summary").to_pylist())) > 3                 # really sampling, row by row
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
             logging_level="WARNING")
    try:
        monkeypatch.setenv("BATCHGEN_RAY_FAULT", "step-delay:0.03")       # both replicas get work
        opts = RunOptions(quiet=True, record_history=False, commit_interval_s=0.0,
                          ray=RayOptions(replicas=2, num_cpus=1, threads=1))
        run_jobs([_job(tmp_path, "r", data, tiny_llama_dir)], options=opts, echo=lambda *_: None)
    finally:
        ray.shutdown()
    out = pq.read_table(tmp_path / "out/r.parquet").select(SAME)
    assert out.to_pylist() == ref.to_pylist()
