"""bench/make_rows.py: the planner's large input (written in row groups) and its job file."""
from __future__ import annotations

import pyarrow.parquet as pq

from bench.make_rows import GROUPS, write_job, write_rows
from pipeline.job.job_file import load_job


def test_rows_prefixes_duplicates_and_job(tmp_path):
    data = write_rows(1000, tmp_path, duplicates=0.3)
    t = pq.read_table(data)
    assert t.num_rows == 1000 and len(set(t.column("id").to_pylist())) == 1000
    assert len(set(t.column("reference").to_pylist())) == GROUPS
    docs = list(zip(t.column("reference").to_pylist(), t.column("document").to_pylist()))
    assert 0.25 < 1 - len(set(docs)) / len(docs) < 0.35        # ~30 % repeat an earlier row's document
    assert write_rows(1000, tmp_path / "again", duplicates=0.3).read_bytes() == data.read_bytes()   # seeded
    job = load_job(write_job(tmp_path, data))
    assert job.input.path == str(data) and job.generation["max_tokens"] == 4


def test_the_pipeline_runs_every_row_through_the_engine_double(tmp_path):
    """bench/pipeline_double.py: a make_rows job through the whole pipeline with the engine double (the default
    model's tokenizer, no weights): one output row per input row, 30 % of them copies of a computed twin."""
    from bench.pipeline_double import main
    data = write_rows(300, tmp_path, duplicates=0.3)
    assert main([str(write_job(tmp_path, data))]) == 0
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.num_rows == 300 and out.column("id").to_pylist() == pq.read_table(data).column("id").to_pylist()
    assert all(s.startswith("summary-") for s in out.column("summary").to_pylist())
