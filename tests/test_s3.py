"""Object storage for real: jobs read ``s3://`` inputs and write ``s3://`` outputs through an S3 server on
127.0.0.1 (moto's), configured the standard way (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` in the environment, as pyarrow and boto3 read them): a run, an
incremental run, a sharded output replaced whole (the manifest, written last, is the commit), and a run killed
with SIGKILL then resumed."""
from __future__ import annotations

import io
import json
import signal
import uuid
from types import SimpleNamespace

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from pipeline.io import publish
from tests.conftest import make_docs
from tests.test_pipeline import run, write_job
from tests.test_resume import STABLE, _run, driver  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    bucket = f"batchgen-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)

    def put(key: str, rows: list[dict]) -> str:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        return f"s3://{bucket}/{key}"

    def get(key: str) -> pa.Table:
        return pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=key)["Body"].read()))

    def keys(prefix: str) -> list[str]:
        """The objects under ``prefix``, without pyarrow's directory markers (empty objects named ``dir/``)."""
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
                      if not o["Key"].endswith("/"))

    def manifest(key: str) -> dict:
        return json.loads(client.get_object(Bucket=bucket, Key=key + ".manifest.json")["Body"].read())

    return SimpleNamespace(client=client, bucket=bucket, env=env, put=put, get=get, keys=keys, manifest=manifest,
                           uri=lambda key: f"s3://{bucket}/{key}")


def _local_reference(tmp_path, rows, fake_llm_factory) -> list[dict]:
    data = tmp_path / "local.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    run([write_job(tmp_path, "local", data)], fake_llm_factory)
    return pq.read_table(tmp_path / "out/local.parquet").select(STABLE[:-1]).to_pylist()


def test_s3_input_and_output_equal_a_local_run(tmp_path, s3, fake_llm_factory):
    rows = make_docs(20)
    src = s3.put("in/docs.parquet", rows)
    [report] = run([write_job(tmp_path, "remote", src, out=s3.uri("out/remote.parquet"))], fake_llm_factory)
    assert report.jobs[0].computed == 20
    assert s3.get("out/remote.parquet").select(STABLE[:-1]).to_pylist() == \
        _local_reference(tmp_path, rows, fake_llm_factory)
    m = s3.manifest("out/remote.parquet")
    assert m["output"] == s3.uri("out/remote.parquet") and m["rows"] == 20


def test_incremental_run_on_s3_computes_only_new_rows(tmp_path, s3, fake_llm_factory):
    rows = make_docs(15)
    src = s3.put("in/grows.parquet", rows[:10])
    job = write_job(tmp_path, "nightly", src, out=s3.uri("out/nightly.parquet"))
    run([job], fake_llm_factory)
    s3.put("in/grows.parquet", rows)                           # the object gained 5 rows overnight
    [report] = run([job], fake_llm_factory)
    assert (report.jobs[0].computed, report.jobs[0].reused) == (5, 10)
    assert len(fake_llm_factory.made[-1].added) == 5
    out = s3.get("out/nightly.parquet")
    assert out.column("id").to_pylist() == [r["id"] for r in rows]


def test_a_prefix_of_shards_in_and_a_sharded_output_replaced_whole(tmp_path, s3, fake_llm_factory, monkeypatch):
    rows = make_docs(30)
    for i in range(3):                                         # an input prefix of three objects
        s3.put(f"in/set/part-{i}.parquet", rows[10 * i:10 * i + 10])
    job = write_job(tmp_path, "sharded", s3.uri("in/set/"), out=s3.uri("out/sharded"),
                    extra="  rows_per_shard: 8\n")
    run([job], fake_llm_factory)
    first = s3.manifest("out/sharded")
    assert first["rows"] == 30 and len(first["files"]) == 4
    assert s3.keys("out/sharded/") == [f"out/sharded/{f}" for f in first["files"]]

    # The input shrinks to one object. At the commit (the new manifest's write) both outputs' shards are there
    # whole: a reader of the old manifest's files, or of the new one's, reads one output; after it only the new.
    seen = {}
    real = publish.write_manifest

    def commit(fs, key, data):
        seen["before"] = s3.keys("out/sharded/")
        real(fs, key, data)
    monkeypatch.setattr(publish, "write_manifest", commit)
    for i in (1, 2):
        s3.client.delete_object(Bucket=s3.bucket, Key=f"in/set/part-{i}.parquet")
    run([job], fake_llm_factory)
    second = s3.manifest("out/sharded")
    assert second["rows"] == 10 and len(second["files"]) == 2 and not set(second["files"]) & set(first["files"])
    assert seen["before"] == sorted(f"out/sharded/{f}" for f in first["files"] + second["files"])
    assert s3.keys("out/sharded/") == [f"out/sharded/{f}" for f in second["files"]]
    ids = pa.concat_tables([s3.get(f"out/sharded/{f}") for f in second["files"]]).column("id").to_pylist()
    assert ids == [r["id"] for r in rows[:10]]


def test_kill9_during_an_s3_run_then_resume_gives_every_row_once(tmp_path, s3, driver, fake_llm_factory):  # noqa: F811
    rows = make_docs(30)
    src = s3.put("in/docs.parquet", rows)
    job = write_job(tmp_path, "killed", src, out=s3.uri("out/killed.parquet"))
    p = _run(driver, job, env={"KILL_AT_STEP": "3", **s3.env}, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert s3.keys("out/killed") == []                          # nothing published from a dead run
    p = _run(driver, job, env=s3.env)
    assert "reused from earlier runs" in p.stdout
    out = s3.get("out/killed.parquet")
    assert out.num_rows == 30 and len(set(out.column("row_key").to_pylist())) == 30
    ref = _local_reference(tmp_path, rows, fake_llm_factory)
    assert out.select(STABLE[:-1]).to_pylist() == ref
