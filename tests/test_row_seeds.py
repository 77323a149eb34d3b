"""A sampled job's rows draw from seeds of their own (pipeline.plan.batch.row_seed: the job's seed mixed with the row
key): on the real engine (tiny random Llama), a row's summary is the same whatever else ran with it (another
max_num_seqs, the input shuffled and grown), and rows under one job seed are not all alike."""
from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.job.job_file import load_job
from pipeline.plan.batch import row_seed
from pipeline.run.runner import RunOptions, run_jobs
from tests.conftest import make_docs
from tests.test_pipeline import write_job


def test_row_seed_mixes_seed_and_key():
    assert row_seed(7, "doc-1#ab") == row_seed(7, "doc-1#ab") < 2 ** 63
    assert len({row_seed(7, "doc-1#ab"), row_seed(7, "doc-2#ab"), row_seed(8, "doc-1#ab")}) == 3
    assert row_seed(None, "doc-1#ab") == row_seed(0, "doc-1#ab")


def _run(tmp_path, name, rows, model, seqs, seed_line=""):
    data = tmp_path / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    job = write_job(tmp_path, name, data, extra=f"model: {model}\nengine:\n  max_num_seqs: {seqs}\n")
    job.write_text(job.read_text().replace("  temperature: 0.0", f"  temperature: 1.5\n{seed_line}"))
    run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    t = pq.read_table(tmp_path / f"out/{name}.parquet").to_pylist()
    return {r["id"]: (r["summary"], r["row_key"]) for r in t}


def test_sampled_rows_do_not_depend_on_the_batch(tmp_path, tiny_llama_dir):
    rows = make_docs(14)
    a = _run(tmp_path, "a", rows[:10], tiny_llama_dir, 2)
    grown = rows[:]
    random.Random(1).shuffle(grown)
    b = _run(tmp_path, "b", grown, tiny_llama_dir, 8)
    assert {k: a[k] for k in a} == {k: b[k] for k in a}
    assert len({s for s, _ in a.values()}) > 3                        # each row its own draws
    seeded = _run(tmp_path, "c", rows[:10], tiny_llama_dir, 4, "  seed: 5\n")
    assert len({s for s, _ in seeded.values()}) > 3 and seeded != a
