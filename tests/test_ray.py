"""`batchgen submit --ray`: engine replicas as Ray actors on a local Ray instance (2 CPU actors of 1 thread, the
tiny Llama): same rows as a local run, whole prefix groups per replica, every row exactly once when an actor is
killed, exits from inside, keeps dying on one unit, or when the driver itself is SIGKILLed and rerun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.execute.ray.driver import RayOptions, replica_name
from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs
from tests.test_pipeline import write_job
from tests.test_s3 import s3, s3_endpoint  # noqa: F401  (fixtures)

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
ENGINE = "engine:\n  dtype: float32\n  block_size: 16\n  max_num_seqs: 4\n  max_num_batched_tokens: 512\n"
SAME = ["id", "category", "summary", "finish_reason", "prompt_tokens", "output_tokens", "error", "row_key"]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module: 2 CPUs, a small object store, no dashboard."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
             logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, tiny_llama_dir):
    """The same job run in-process (no Ray): the rows every distributed run must reproduce."""
    import pyarrow as pa

    from tests.conftest import make_docs
    tmp = tmp_path_factory.mktemp("ray_ref")
    data = tmp / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(make_docs(32, 0, False)), data)
    job = write_job(tmp, "ref", data, extra=f"model: {tiny_llama_dir}\n" + ENGINE)
    run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    return data, pq.read_table(tmp / "out/ref.parquet")


def _ray_run(tmp_path, data, tiny_llama_dir, name="r", **ray_opts):
    job = write_job(tmp_path, name, data, extra=f"model: {tiny_llama_dir}\n" + ENGINE)
    opts = RunOptions(quiet=True, record_history=False, commit_interval_s=0.0,
                      ray=RayOptions(replicas=2, num_cpus=1, threads=1, **ray_opts))
    [report] = run_jobs([load_job(job)], options=opts, echo=lambda *_: None)
    out = pq.read_table(tmp_path / f"out/{name}.parquet")
    manifest = json.loads((tmp_path / f"out/{name}.parquet.manifest.json").read_text())
    return report, out, manifest


def _same_rows(out, ref):
    assert out.num_rows == ref.num_rows and len(set(out.column("row_key").to_pylist())) == out.num_rows
    assert out.select(SAME).to_pylist() == ref.select(SAME).to_pylist()


def test_two_replicas_equal_a_local_run_and_keep_groups_whole(ray_local, tmp_path, tiny_llama_dir, local_reference,
                                                              monkeypatch):
    data, ref = local_reference
    monkeypatch.setenv("BATCHGEN_RAY_FAULT", "step-delay:0.03")     # long enough that both replicas get work
    report, out, manifest = _ray_run(tmp_path, data, tiny_llama_dir)
    _same_rows(out, ref)
    dist = manifest["this_run"]["distributed"]
    assert dist["replicas"] == 2 and dist["restarts"] == 0
    # every prefix group was prefilled on exactly one replica, unless an idle replica took some of its chunks
    # (pipeline.execute.ray.assign: "split"); and both replicas computed
    for g, n in dist["prefix_prefills"].items():
        assert n == 1 or (int(g) in dist["split_groups"] and n == 2), dist
    assert dist["groups_on_more_than_one_replica"] <= len(dist["split_groups"])
    per = {r["replica"]: r for r in dist["per_replica"]}
    assert sorted(per) == [0, 1] and all(r["rows"] > 0 and r["load_s"] > 0 for r in per.values())
    assert sum(r["rows"] for r in per.values()) == out.num_rows
    assert sum(r["groups"] for r in per.values()) == sum(dist["prefix_prefills"].values())
    assert manifest["this_run"]["computed"] == out.num_rows and manifest["model"]["cpu_kernels"] != \
        "not loaded (planning only)"
    trace = json.loads((report.trace_dir / "run.json").read_text())
    assert trace["distributed"]["replicas"] == 2
    from pipeline.report import render_report
    from pipeline.run.trace import check_trace, read_run
    assert check_trace(read_run(report.trace_dir)) == []      # steps of both replicas, requests of both
    page = render_report([report.trace_dir]).read_text()
    assert "Ray replicas" in page and page.count(f"pid {per[1]['pid']}") == 1


def _kill_when_committed(tmp_path, name, rows, what):
    """A thread: once ``rows`` part files are committed, ``what()``."""
    parts = tmp_path / f"out/.{name}.parquet.batchgen/parts"

    def watch():
        deadline = time.time() + 120
        while time.time() < deadline:
            if parts.is_dir() and len(list(parts.glob("*.parquet"))) >= rows:
                what()
                return
            time.sleep(0.02)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_ray_kill_of_a_replica_mid_run_loses_no_row(ray_local, tmp_path, tiny_llama_dir, local_reference,
                                                   monkeypatch):
    data, ref = local_reference
    monkeypatch.setenv("BATCHGEN_RAY_FAULT", "step-delay:0.03")
    killed = []

    def kill():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        runs = [int(n.split("-")[2]) for n in names if n.startswith(f"batchgen-{os.getpid()}-")]
        actor = ray.get_actor(replica_name(0, 0, max(runs)))         # this run's: the latest execution
        ray.kill(actor)
        killed.append(True)
    t = _kill_when_committed(tmp_path, "r", 2, kill)
    _, out, manifest = _ray_run(tmp_path, data, tiny_llama_dir)
    t.join(timeout=5)
    assert killed
    _same_rows(out, ref)
    dist = manifest["this_run"]["distributed"]
    assert dist["restarts"] == 1
    assert [(r["replica"], r["incarnation"]) for r in dist["per_replica"] if r["died"]] == [(0, 0)]


def test_replica_exiting_from_inside_is_replaced_and_every_row_comes_once(ray_local, tmp_path, tiny_llama_dir,
                                                                         local_reference, monkeypatch):
    data, ref = local_reference
    # the replica that is handed plan position 12 of 32 calls os._exit (once: the retry of that row succeeds)
    monkeypatch.setenv("BATCHGEN_RAY_FAULT", f"exit-once-on:12:{tmp_path / 'exited'}")
    _, out, manifest = _ray_run(tmp_path, data, tiny_llama_dir)
    _same_rows(out, ref)
    dist = manifest["this_run"]["distributed"]
    assert (tmp_path / "exited").exists()
    assert dist["restarts"] == 1 and len([r for r in dist["per_replica"] if r["died"]]) == 1


def test_a_request_that_keeps_killing_replicas_fails_its_row_only(ray_local, tmp_path, tiny_llama_dir,
                                                                          local_reference, monkeypatch):
    data, ref = local_reference
    monkeypatch.setenv("BATCHGEN_RAY_FAULT", "exit-on:5")
    _, out, manifest = _ray_run(tmp_path, data, tiny_llama_dir, max_tries=2)
    assert out.num_rows == ref.num_rows and len(set(out.column("row_key").to_pylist())) == out.num_rows
    errors = [e for e in out.column("error").to_pylist() if e]
    # position 5's chunk runs alone, is halved until position 5 is alone, which is given up after 2 deaths:
    # exactly one row fails; every other row is as locally
    assert len(errors) == 1 and "Ray replica died 2 times" in errors[0]
    good = [i for i, e in enumerate(out.column("error").to_pylist()) if not e]
    assert [out.select(SAME).to_pylist()[i] for i in good] == [ref.select(SAME).to_pylist()[i] for i in good]
    assert manifest["this_run"]["distributed"]["restarts"] >= 3


def test_sigkill_of_the_driver_then_rerun_resumes(tmp_path, tiny_llama_dir, local_reference):
    """The driver (a `batchgen submit --ray` process with its own local Ray) is SIGKILLed after some rows are
    committed; the same command again computes only the rest, and the output equals the local run's."""
    data, ref = local_reference
    job = write_job(tmp_path, "k", data, extra=f"model: {tiny_llama_dir}\n" + ENGINE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHGEN_RAY_FAULT": "step-delay:0.02"}
    cmd = [sys.executable, "-c", "from batchgen.cli import main; main()", "submit", "-q", "--commit-every", "0",
           "--ray", "--replicas", "2", "--replica-cpus", "1", str(job)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    parts = tmp_path / "out/.k.parquet.batchgen/parts"
    deadline = time.time() + 180
    while time.time() < deadline and not (parts.is_dir() and len(list(parts.glob("*.parquet"))) >= 2):
        time.sleep(0.05)
        assert proc.poll() is None, proc.stdout.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    os.killpg(proc.pid, signal.SIGKILL)       # its Ray instance's processes, like a lost machine's
    assert not (tmp_path / "out/k.parquet").exists()
    r = subprocess.run(cmd, env={**env, "BATCHGEN_RAY_FAULT": ""}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((tmp_path / "out/k.parquet.manifest.json").read_text())["this_run"]
    assert manifest["reused"] >= 2 and manifest["reused"] + manifest["computed"] == ref.num_rows
    _same_rows(pq.read_table(tmp_path / "out/k.parquet"), ref)


def test_ray_flag_without_ray_says_how_to_get_it(tmp_path, make_docs_dataset, monkeypatch):
    from click.testing import CliRunner

    from batchgen.cli import main
    job = write_job(tmp_path, "x", make_docs_dataset(n=2))
    monkeypatch.setitem(sys.modules, "ray", None)           # as if not installed
    r = CliRunner().invoke(main, ["submit", "--ray", str(job)])
    assert r.exit_code == 2 and "pip install -e '.[ray]'" in r.output
    assert not (tmp_path / "out").exists()


def test_map_reduce_on_ray_equals_local_and_keeps_replicas_between_levels(ray_local, tmp_path, tiny_llama_dir):
    """on_too_long: map_reduce runs a plan per reduce level; on Ray the same replicas serve them all (loaded once,
    caches kept), with the local run's chunks and rows."""
    import pyarrow as pa

    from tests.test_map_reduce import LONG
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "document": [LONG, "A short one."]}), data)

    def job(name):
        p = tmp_path / f"{name}.yaml"
        p.write_text(f"name: {name}\nmodel: {tiny_llama_dir}\ninput: {{path: {data}, id_column: id}}\n"
                     "prompt: {system: Summarize., reference: Policy., document_column: document, "
                     "on_too_long: map_reduce}\ngeneration: {max_tokens: 8}\n"
                     f"output: {{path: {tmp_path}/out/{name}.parquet}}\n"
                     "engine: {max_model_len: 256, dtype: float32, max_num_seqs: 4}\n")
        return load_job(p)
    run_jobs([job("loc")], options=RunOptions(quiet=True, record_history=False))
    opts = RunOptions(quiet=True, record_history=False, ray=RayOptions(replicas=2, num_cpus=1, threads=1))
    run_jobs([job("dist")], options=opts, echo=lambda *_: None)
    # NOTE: not the summaries: a chunk of ~200 tokens on the random tiny model has greedy near-ties that a
    # different batch composition (other rows beside it on a replica) can flip; the structure must be the same.
    cols = ["id", "num_chunks", "error"]
    a, b = pq.read_table(tmp_path / "out/loc.parquet"), pq.read_table(tmp_path / "out/dist.parquet")
    assert a.select(cols).to_pylist() == b.select(cols).to_pylist() and a.column("num_chunks")[0].as_py() > 1
    assert all(b.column("summary").to_pylist())
    dist = json.loads((tmp_path / "out/dist.parquet.manifest.json").read_text())["this_run"]["distributed"]
    assert dist["plans"] == 2 and len(dist["per_replica"]) == 2 and dist["restarts"] == 0


def test_two_replicas_read_from_and_write_to_s3(ray_local, tmp_path, tiny_llama_dir, local_reference, s3):
    """An s3:// input and output on Ray (the local S3 server of tests/test_s3.py): the driver reads and publishes,
    the replicas compute; the published rows equal the local run's."""
    data, ref = local_reference
    src = s3.put("in/docs.parquet", pq.read_table(data).to_pylist())
    job = write_job(tmp_path, "s3ray", src, out=s3.uri("out/s3ray.parquet"),
                    extra=f"model: {tiny_llama_dir}\n" + ENGINE)
    opts = RunOptions(quiet=True, record_history=False, commit_interval_s=0.0,
                      ray=RayOptions(replicas=2, num_cpus=1, threads=1))
    run_jobs([load_job(job)], options=opts, echo=lambda *_: None)
    _same_rows(s3.get("out/s3ray.parquet"), ref)
    assert s3.manifest("out/s3ray.parquet")["this_run"]["distributed"]["replicas"] == 2
