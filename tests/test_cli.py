"""`batchgen submit / plan / validate` through click's CliRunner: on the fake engine (fast) and on the real
engine with a tiny random Llama (predicted hit rate == achieved; shuffled input == sorted input)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import main
from tests.test_pipeline import COLUMNS, write_job


@pytest.fixture
def fake_engine(monkeypatch, fake_llm_factory):
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    monkeypatch.setattr(pipeline.run.runner, "planning_llm_factory", fake_llm_factory)
    return fake_llm_factory


def test_submit_plan_validate_on_fake(tmp_path, make_docs_dataset, fake_engine):
    data = make_docs_dataset(n=20)
    a, b = write_job(tmp_path, "a", data), write_job(tmp_path, "b", data, limit=7)
    r = CliRunner()
    res = r.invoke(main, ["plan", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "27 documents" in res.output and "predicted cache hit rate" in res.output
    res = r.invoke(main, ["submit", "--quiet", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "cache hit rate" in res.output and "achieved" in res.output
    ta, tb = pq.read_table(tmp_path / "out/a.parquet"), pq.read_table(tmp_path / "out/b.parquet")
    assert ta.num_rows == 20 and tb.num_rows == 7 and ta.column_names[:len(COLUMNS)] == COLUMNS
    res = r.invoke(main, ["submit", "--quiet", str(a), str(b)])
    assert res.exit_code == 0 and res.output.count("up to date") == 2


def test_submit_bad_job_no_traceback(tmp_path, make_docs_dataset, fake_engine):
    data = make_docs_dataset(n=3)
    job = write_job(tmp_path, "x", data, extra="bogus: 1\n")
    res = CliRunner().invoke(main, ["submit", str(job)])
    assert res.exit_code == 2 and "bogus: unknown key" in res.output and "Traceback" not in res.output


def test_duplicate_ids_fail_before_compute(tmp_path, make_docs_dataset, fake_engine):
    from tests.conftest import make_docs
    rows = make_docs(4)
    rows[2]["id"] = rows[0]["id"]
    job = write_job(tmp_path, "d", make_docs_dataset(rows=rows))
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 2 and "appears more than once" in res.output
    assert not (tmp_path / "out/d.parquet").exists()


def test_datasets_input_and_sharded_output(tmp_path, fake_engine):
    import datasets

    from tests.conftest import make_docs
    ds_dir = tmp_path / "ds"
    datasets.Dataset.from_list(make_docs(15)).save_to_disk(str(ds_dir))
    job = write_job(tmp_path, "ds", ds_dir, out=tmp_path / "out/ds_dir",
                    extra="").read_text().replace("  include_columns: [id, category]",
                                                  "  include_columns: [id, category]\n  rows_per_shard: 4")
    (tmp_path / "ds.yaml").write_text(job)
    res = CliRunner().invoke(main, ["submit", "-q", str(tmp_path / "ds.yaml")])
    assert res.exit_code == 0, res.output
    shards = sorted((tmp_path / "out/ds_dir").glob("part-*.parquet"))
    assert len(shards) == 4
    from pipeline.io.tables import read_output
    assert read_output(tmp_path / "out/ds_dir").column("id").to_pylist() == [r["id"] for r in make_docs(15)]


# ---- the real engine on a tiny random Llama ---------------------------------------------------------
ENGINE = "engine:\n  dtype: float32\n  block_size: 16\n  max_num_seqs: 4\n  max_num_batched_tokens: 512\n"


def _real_job(tmp_path, name, data, model):
    p = write_job(tmp_path, name, data, extra=f"model: {model}\n" + ENGINE)
    return p


def test_real_engine_predicted_equals_achieved(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=12)
    job = _real_job(tmp_path, "real", data, tiny_llama_dir)
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output
    t = pq.read_table(tmp_path / "out/real.parquet")
    assert t.column("id").to_pylist() == pq.read_table(data).column("id").to_pylist()
    assert t.column("error").null_count == 12 and t.column_names[:len(COLUMNS)] == COLUMNS
    m = json.loads((tmp_path / "out/real.parquet.manifest.json").read_text())["this_run"]
    assert m["predicted_hit_rate"] > 0.3
    assert m["predicted_hit_rate"] == m["achieved_hit_rate"]


def test_real_engine_shuffled_equals_sorted(tmp_path, make_docs_dataset, tiny_llama_dir):
    a = make_docs_dataset("sorted.parquet", n=12)
    b = make_docs_dataset("shuffled.parquet", n=12, shuffle=True)
    ja, jb = _real_job(tmp_path, "sa", a, tiny_llama_dir), _real_job(tmp_path, "sb", b, tiny_llama_dir)
    for j in (ja, jb):
        res = CliRunner().invoke(main, ["submit", "-q", str(j)])
        assert res.exit_code == 0, res.output
    ta, tb = pq.read_table(tmp_path / "out/sa.parquet"), pq.read_table(tmp_path / "out/sb.parquet")
    by_id_a = dict(zip(ta.column("id").to_pylist(), ta.column("summary").to_pylist()))
    by_id_b = dict(zip(tb.column("id").to_pylist(), tb.column("summary").to_pylist()))
    assert by_id_a == by_id_b                                      # greedy: same text whatever the order
    assert sum(ta.column("cached_tokens").to_pylist()) == sum(tb.column("cached_tokens").to_pylist())


def test_prefix_caching_off_plans_no_hits(tmp_path, make_docs_dataset, fake_engine):
    """A job with the engine's prefix cache off: the plan predicts no cached token (none is achieved), and no
    request waits for a provider."""
    data = make_docs_dataset(n=12)
    job = write_job(tmp_path, "nocache", data, extra="engine:\n  enable_prefix_caching: false\n")
    res = CliRunner().invoke(main, ["plan", str(job)])
    assert res.exit_code == 0, res.output
    assert "predicted cache hit rate 0.0%" in res.output
    res = CliRunner().invoke(main, ["submit", "--quiet", str(job)])
    assert res.exit_code == 0, res.output
    assert "0.0% achieved vs 0.0% predicted" in res.output
