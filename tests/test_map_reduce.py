"""on_too_long: map_reduce (pipeline/prepare/long_docs.py): a document longer than the context is summarized in chunks
under the row's cached head, then the chunk summaries are reduced (in levels when they do not fit at once);
resumable."""
from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.job.job_file import load_job
from pipeline.job.state import RunState
from pipeline.prepare.long_docs import pack, split_text
from pipeline.run.runner import Interrupted, RunOptions, run_jobs
from pipeline.run.trace import read_run
from tests.conftest import FakeLLM, _build_tiny_tokenizer, changed_options

TOK = _build_tiny_tokenizer(lite=True)
SENTENCES = [f"Sentence {i} says the customer asked about a refund for an order that arrived late." for i in range(60)]
LONG = "\n\n".join(" ".join(SENTENCES[p * 6:(p + 1) * 6]) for p in range(10))


def test_split_and_pack_keep_text_and_order():
    pieces = split_text(LONG)
    assert "".join(pieces) == LONG and len(pieces) == 60
    ids = [list(range(n)) for n in (5, 5, 12, 3)]
    assert pack(ids, room=10) == [list(range(5)) + list(range(5)), list(range(10)), [10, 11] + list(range(3))]


def _job(tmp_path, name, data, on_too_long="map_reduce", max_model_len=192, extra=""):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""name: {name}
input: {{path: {data}, id_column: id}}
prompt:
  system: "Summarize."
  reference: "Support policy: refunds within 30 days."
  document_column: document
  on_too_long: {on_too_long}
{extra}generation: {{max_tokens: 8}}
output: {{path: {tmp_path}/out/{name}.parquet}}
engine: {{max_model_len: {max_model_len}, max_num_seqs: 4}}
""")
    return load_job(path)


def _data(tmp_path, docs):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(len(docs))], "document": docs}), path)
    return path


def _factory(made):
    def factory(config):
        llm = FakeLLM(TOK, **changed_options(config))
        made.append(llm)
        return llm
    return factory


def _requests(report, row_id):
    r = read_run(report.trace_dir).requests
    return [i for i, rid in enumerate(r["row_id"]) if rid == row_id], r


def test_long_row_is_chunked_under_the_cached_head_then_reduced_once(tmp_path):
    short = ["The charger broke after a week; the customer wants a replacement.", "Where is my invoice?"]
    data = _data(tmp_path, [short[0], LONG, short[1]])
    made = []
    [report] = run_jobs([_job(tmp_path, "mr", data, max_model_len=256)], llm_factory=_factory(made),
                        options=RunOptions(quiet=True, record_history=False))
    out = pq.read_table(tmp_path / "out/mr.parquet").to_pylist()
    assert [r["id"] for r in out] == ["d0", "d1", "d2"]
    long = out[1]
    assert long["error"] is None and long["summary"].startswith("summary-") and long["num_chunks"] >= 3
    assert out[0]["num_chunks"] is None and out[2]["num_chunks"] is None
    idx, r = _requests(report, "d1")
    assert len(idx) == long["num_chunks"] + 1                       # every chunk, then one reduce
    assert all(r["prompt_tokens"][i] <= 256 - 8 for i in idx)      # each fits the context with max_tokens
    # each request reuses the row's head (system + reference) from the prefix cache
    assert all(r["cached_tokens"][i] >= 16 for i in idx)
    assert long["prompt_tokens"] == sum(r["prompt_tokens"][i] for i in idx)
    assert long["output_tokens"] == sum(r["output_tokens"][i] for i in idx)
    assert long["cached_tokens"] == sum(r["cached_tokens"][i] for i in idx)
    # rows that fit are exactly what on_too_long: error gives them
    [_] = run_jobs([_job(tmp_path, "err", data, on_too_long="error", max_model_len=256)], llm_factory=_factory([]),
                   options=RunOptions(quiet=True, record_history=False))
    ref = pq.read_table(tmp_path / "out/err.parquet").to_pylist()
    assert ref[1]["error"] is not None and "exceeds the model's context" in ref[1]["error"]
    for a, b in ((out[0], ref[0]), (out[2], ref[2])):
        assert {k: a[k] for k in ("summary", "prompt_tokens", "output_tokens", "error")} == \
            {k: b[k] for k in ("summary", "prompt_tokens", "output_tokens", "error")}
    assert report.jobs[0].computed == 3 and report.jobs[0].row_errors == 0


def test_row_ids_may_contain_the_part_key_separator(tmp_path):
    path = tmp_path / "tilde.parquet"
    pq.write_table(pa.table({"id": ["a~1", "b~2"], "document": [LONG, "Short."]}), path)
    [report] = run_jobs([_job(tmp_path, "tilde", path, max_model_len=256)], llm_factory=_factory([]),
                        options=RunOptions(quiet=True, record_history=False))
    long, short = pq.read_table(tmp_path / "out/tilde.parquet").to_pylist()
    assert long["id"] == "a~1" and long["num_chunks"] > 1 and long["error"] is None
    assert short["num_chunks"] is None and report.jobs[0].computed == 2
    idx, _ = _requests(report, "a~1")
    assert len(idx) == long["num_chunks"] + 1


def test_summaries_that_do_not_fit_are_reduced_in_levels(tmp_path):
    data = _data(tmp_path, [LONG * 3])
    [report] = run_jobs([_job(tmp_path, "deep", data, max_model_len=112,
                              extra="  reduce_template: \"Parts, in order:\\n{summaries}\"\n")],
                        llm_factory=_factory([]), options=RunOptions(quiet=True, record_history=False))
    [row] = pq.read_table(tmp_path / "out/deep.parquet").to_pylist()
    idx, r = _requests(report, "d0")
    n = row["num_chunks"]
    assert row["error"] is None and n >= 10
    assert len(idx) > n + 1                                          # at least one intermediate level
    assert all(r["prompt_tokens"][i] <= 112 - 8 for i in idx)
    keys = RunState(tmp_path / "out/deep.parquet", "deep").load_done().column("row_key").to_pylist()
    assert any("~r1." in k for k in keys) and sum("~c" in k for k in keys) == n


def test_kill_mid_row_then_resume_redoes_no_finished_chunk(tmp_path):
    data = _data(tmp_path, [LONG, LONG.replace("refund", "return")])
    made = []
    with pytest.raises(Interrupted):
        run_jobs([_job(tmp_path, "res", data, max_model_len=256)], llm_factory=_factory(made),
                 options=RunOptions(quiet=True, record_history=False, stop_after_rows=3, commit_interval_s=0))
    state = RunState(tmp_path / "out/res.parquet", "res")
    committed = [k for k in state.load_done().column("row_key").to_pylist() if "~c" in k]
    assert 3 <= len(committed)
    assert not (tmp_path / "out/res.parquet").exists()
    made2 = []
    [report] = run_jobs([_job(tmp_path, "res", data, max_model_len=256)], llm_factory=_factory(made2),
                        options=RunOptions(quiet=True, record_history=False))
    rows = pq.read_table(tmp_path / "out/res.parquet").to_pylist()
    total_chunks = sum(r["num_chunks"] for r in rows)
    keys = state.load_done().column("row_key").to_pylist()
    assert sum("~c" in k for k in keys) == total_chunks
    reduces = sum("~r" in k for k in keys) + 2                          # intermediate levels, then one per row
    assert len(made2[0].added) == total_chunks - len(committed) + reduces   # no committed chunk again
    # an uninterrupted run gives the same rows
    [_] = run_jobs([_job(tmp_path, "clean", data, max_model_len=256)], llm_factory=_factory([]),
                   options=RunOptions(quiet=True, record_history=False))
    clean = pq.read_table(tmp_path / "out/clean.parquet").to_pylist()
    stable = ("id", "summary", "num_chunks", "prompt_tokens", "output_tokens", "error")
    assert [{k: r[k] for k in stable} for r in rows] == [{k: r[k] for k in stable} for r in clean]


def test_on_the_tiny_model_chunks_fit_and_reuse_the_head(tmp_path, tiny_llama_dir):
    """The real engine (tiny Llama, max_model_len 256): every request of the long row fits the context, every
    chunk after the first hits the row's head in the prefix cache, and the row's metrics are the sums."""
    data = _data(tmp_path, [LONG, "A short document."])
    job = _job(tmp_path, "real", data, max_model_len=256)
    job = dataclasses.replace(job, model=tiny_llama_dir, engine_options=(*job.engine_options, "dtype", "block_size"),
                              engine=dataclasses.replace(job.engine, dtype="float32", block_size=16))
    [report] = run_jobs([job], options=RunOptions(quiet=True, record_history=False))
    long, short = pq.read_table(tmp_path / "out/real.parquet").to_pylist()
    assert long["num_chunks"] > 1 and long["error"] is None and short["num_chunks"] is None
    idx, r = _requests(report, "d0")
    assert len(idx) >= long["num_chunks"] + 1
    assert all(r["prompt_tokens"][i] + 8 <= 256 for i in idx)
    # one request (the first computed: the trace lists them as they finish) prefills the head; all others hit it
    cached = sorted(r["cached_tokens"][i] for i in idx)
    assert cached[0] < 16 <= cached[1]
    for col in ("prompt_tokens", "cached_tokens", "output_tokens"):
        assert long[col] == sum(r[col][i] for i in idx)
