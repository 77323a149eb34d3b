"""The manifest records the engine's invariance fingerprint (engine.invariance), and an incremental run that keeps
rows computed under another fingerprint says so: a warning on stderr and ``invariance.changed`` in the manifest."""
from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import main
from engine.invariance import invariance
from tests.conftest import FakeLLM, make_docs
from tests.test_pipeline import write_job


def _parts(threads):
    return {"model": "fake-identity", "weights": "int8", "threads": threads}


@pytest.fixture
def engine_threads(monkeypatch, fake_llm_factory):
    """The fake engine's invariance fingerprint follows ``state["threads"]``."""
    state = {"threads": 2}
    info = FakeLLM.info.fget

    def with_invariance(self):
        parts = _parts(state["threads"])
        return dataclasses.replace(info(self), invariance={**parts, "fingerprint": f"fp-{state['threads']}"})
    monkeypatch.setattr(FakeLLM, "info", property(with_invariance))
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    return state


def _submit(job):
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output
    return res


def test_manifest_records_fingerprint_and_a_change_is_reported(tmp_path, engine_threads):
    rows = make_docs(12)
    data = tmp_path / "grows.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:8]), data)
    job = write_job(tmp_path, "nightly", data)
    manifest = tmp_path / "out/nightly.parquet.manifest.json"
    res = _submit(job)
    inv = json.loads(manifest.read_text())["invariance"]
    assert inv["fingerprint"] == "fp-2" and inv["output_fingerprints"] == ["fp-2"] and "changed" not in inv
    assert inv["parts"]["threads"] == 2 and "another invariance fingerprint" not in res.stderr

    pq.write_table(pa.Table.from_pylist(rows[:10]), data)       # new rows, same fingerprint: nothing to say
    res = _submit(job)
    assert "changed" not in json.loads(manifest.read_text())["invariance"]

    engine_threads["threads"] = 4                                # the next run computes with another thread count
    pq.write_table(pa.Table.from_pylist(rows), data)
    res = _submit(job)
    inv = json.loads(manifest.read_text())["invariance"]
    assert inv["changed"] == {"previous": "fp-2", "reused_rows": 10, "differs_in": ["threads"]}
    assert inv["output_fingerprints"] == ["fp-2", "fp-4"]
    assert "10 rows were kept from a run under another invariance fingerprint" in res.stderr


def test_engine_fingerprint_parts():
    a = invariance("id", "int8", "float32", "bfloat16", "cpu", True)
    assert {"model", "weights", "kernel_build", "threads", "cpu", "deterministic"} <= set(a)
    assert a == invariance("id", "int8", "float32", "bfloat16", "cpu", True)
    assert a["fingerprint"] != invariance("id", "none", "float32", "bfloat16", "cpu", True)["fingerprint"]
    assert a["fingerprint"] != invariance("id", "int8", "float32", "bfloat16", "cpu", False)["fingerprint"]


def test_engine_info_carries_the_fingerprint(tiny_llama_dir):
    from engine import LLM
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20)
    inv = llm.info.invariance
    assert inv["weights"] == "none" and inv["dtype"] == "float32" and inv["deterministic"] is True
    assert inv == invariance(llm.info.identity, "none", "float32", llm.config.kv_cache_dtype, "cpu", True)
    assert llm.info.to_dict()["invariance"]["fingerprint"] == inv["fingerprint"]
    from engine.models.linear import Linear, pad_targets
    lins = [m for m in llm.model.modules() if type(m) is Linear]
    assert lins and all(m.pad_to == pad_targets(m.compute_weight()) for m in lins)
    assert llm.model.model.layers[0].ops.deterministic
    fast = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=4 << 20, deterministic=False)
    assert all(m.pad_to == () and not m.tile for m in fast.model.modules() if type(m) is Linear)
    assert not fast.model.model.layers[0].ops.deterministic
    assert fast.info.invariance["fingerprint"] != inv["fingerprint"]
