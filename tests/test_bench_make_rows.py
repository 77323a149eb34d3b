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
