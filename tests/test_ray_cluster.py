"""`--ray` on a two-"node" Ray cluster (``ray.cluster_utils.Cluster``: two raylets of 1 CPU on this machine): one
replica per node, and the local run's rows."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.execute.ray.driver import RayOptions
from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs
from tests.test_pipeline import write_job
from tests.test_ray import ENGINE, SAME

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_one_replica_per_node_and_the_local_rows(two_nodes, tmp_path, make_docs_dataset, tiny_llama_dir,
                                                 monkeypatch):
    data = make_docs_dataset(n=24)
    extra = f"model: {tiny_llama_dir}\n" + ENGINE
    local = write_job(tmp_path, "local", data, extra=extra)
    run_jobs([load_job(local)], options=RunOptions(quiet=True, record_history=False))
    monkeypatch.setenv("BATCHGEN_RAY_FAULT", "step-delay:0.03")      # both replicas get work
    job = write_job(tmp_path, "dist", data, extra=extra)
    # no replica count: one per alive node; 1 CPU each
    run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False, ray=RayOptions()),
             echo=lambda *_: None)
    ref, out = pq.read_table(tmp_path / "out/local.parquet"), pq.read_table(tmp_path / "out/dist.parquet")
    assert out.select(SAME).to_pylist() == ref.select(SAME).to_pylist()
    dist = json.loads((tmp_path / "out/dist.parquet.manifest.json").read_text())["this_run"]["distributed"]
    assert dist["replicas"] == 2 and dist["address"] == "already initialized"
    nodes = {r["node"] for r in dist["per_replica"]}
    assert len(nodes) == 2 and all(r["rows"] > 0 for r in dist["per_replica"])
