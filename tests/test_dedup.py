"""Identical requests computed once (pipeline.prepare.dedup): rows whose prompt and parameters are equal are planned
once and each gets the result; the output equals the one computed without merging, row for row."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
from click.testing import CliRunner

from batchgen.cli import main
from engine import SamplingParams
from pipeline.prepare.dedup import Dedup, content_digest
from tests.conftest import make_docs
from tests.test_cli import fake_engine  # noqa: F401  (fixture)
from tests.test_pipeline import run, write_job

SAME = ["id", "category", "summary", "finish_reason", "prompt_tokens", "output_tokens", "error"]


def test_the_index_knows_each_contents_first_request():
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    a = content_digest(0, "a document", "\n\nSummary:", greedy)
    assert a == content_digest(0, "a document", "\n\nSummary:", SamplingParams(max_tokens=8, temperature=0.0))
    others = {content_digest(1, "a document", "\n\nSummary:", greedy),          # another head
              content_digest(0, "a document ", "\n\nSummary:", greedy),
              content_digest(0, "a document", "\n\nSummary: ", greedy),
              content_digest(0, "a doc", "ument\n\nSummary:", greedy),           # the same text, cut elsewhere
              content_digest(0, "a document", "\n\nSummary:", SamplingParams(max_tokens=9, temperature=0.0))}
    assert a not in others and len(others) == 5
    assert content_digest(0, "a document", "", SamplingParams(temperature=0.7, seed=1)) is None   # sampled
    d = Dedup()
    d.add(a, 0, 3)
    d.add(a, 2, 9)                                                     # job 2's row 9: a copy of job 0's row 3
    x = content_digest(0, "x", "", greedy)
    d.add(x, 2, 0)
    d.add(x, 1, 2 ** 35)                                               # added later, but the earlier request
    copies = d.resolve([0, 10, 2 ** 36, 2 ** 36 + 20])
    assert len(copies) == 2
    assert copies.of(3).tolist() == [2 ** 36 + 9] and copies.of(10 + 2 ** 35).tolist() == [2 ** 36]
    assert copies.of(2 ** 36 + 9).tolist() == [] and copies.among(2 ** 36, 2 ** 36 + 10).tolist() == \
        [True] + [False] * 8 + [True]


def test_resolving_finds_every_repeat_across_the_disk_parts():
    """Many contents (more than the memory buffer, over every on-disk part): each repeat names the content's
    lowest request, whatever order the digests came in."""
    import pipeline.prepare.dedup as dedup
    rng = np.random.default_rng(0)
    n = 3 * dedup._BUFFER
    content = rng.integers(0, n // 2, size=n)                          # about half the requests repeat one
    digests = [hashlib.blake2b(str(c).encode(), digest_size=16).digest() for c in range(n // 2)]
    d = Dedup()
    for r in rng.permutation(n).tolist():
        d.add(digests[content[r]], 0, r)
    copies = d.resolve([0, n])
    first_of = {}
    for r, c in enumerate(content.tolist()):
        first_of.setdefault(c, r)
    expected = {r: first_of[c] for r, c in enumerate(content.tolist()) if first_of[c] != r}
    assert len(copies) == len(expected)
    assert dict(zip(copies.copy.tolist(), copies.first.tolist())) == expected
    mask = copies.among(0, n)
    assert mask.sum() == len(expected) and all(mask[r] for r in expected)


def _rows_with_copies(n_unique=14, n_copies=6):
    """``n_unique`` documents, then ``n_copies`` rows repeating some of them under new ids (30 % of 20 rows)."""
    rows = make_docs(n_unique)
    copies = [dict(rows[(3 * i) % n_unique], id=f"again-{i}") for i in range(n_copies)]
    return rows + copies


def _job(tmp_path, name, data, dedup=True, temperature=0.0):
    path = write_job(tmp_path, name, data)
    text = path.read_text().replace("temperature: 0.0", f"temperature: {temperature}\n  seed: 7"
                                    + ("" if dedup else "\n  dedup: false"))
    path.write_text(text)
    return path


def _table(tmp_path, name):
    return pq.read_table(tmp_path / f"out/{name}.parquet").select(SAME).to_pylist()


def _manifest(tmp_path, name):
    return json.loads((tmp_path / f"out/{name}.parquet.manifest.json").read_text())


def test_duplicate_rows_are_computed_once_with_the_same_output(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(rows=_rows_with_copies())
    [merged] = run([_job(tmp_path, "merged", data)], fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 14            # 30 % of the rows were not computed
    [alone] = run([_job(tmp_path, "alone", data, dedup=False)], fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 20

    assert _table(tmp_path, "merged") == _table(tmp_path, "alone")     # row for row
    jr = merged.jobs[0]
    assert (jr.planned_copies, jr.dedup_rows, jr.computed) == (6, 6, 20)
    assert jr.dedup_prompt_tokens == jr.planned_copy_tokens > 0
    d = _manifest(tmp_path, "merged")["this_run"]["deduplicated"]
    assert d["rows"] == 6 and d["prompt_tokens_saved"] == jr.dedup_prompt_tokens and d["output_tokens_saved"] > 0
    assert _manifest(tmp_path, "alone")["this_run"]["deduplicated"]["rows"] == 0
    assert alone.jobs[0].planned_copies == 0


def test_sampled_rows_are_never_merged(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(rows=_rows_with_copies())
    [report] = run([_job(tmp_path, "sampled", data, temperature=0.7)], fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 20           # each row draws from its own seed
    assert report.jobs[0].dedup_rows == 0


def test_jobs_submitted_together_share_their_identical_rows(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(rows=make_docs(10))
    [report] = run([_job(tmp_path, "first", data), _job(tmp_path, "second", data)], fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 10
    assert [jr.dedup_rows for jr in report.jobs] == [0, 10]
    assert _table(tmp_path, "first") == _table(tmp_path, "second")
    # a job that turns it off neither takes another job's results nor lends its own
    [report] = run([_job(tmp_path, "third", data, dedup=False), _job(tmp_path, "fourth", data)],
                   fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 20


def test_plan_reports_the_duplicates(tmp_path, make_docs_dataset, fake_engine):  # noqa: F811
    data = make_docs_dataset(rows=_rows_with_copies())
    res = CliRunner().invoke(main, ["plan", str(_job(tmp_path, "planned", data))])
    assert res.exit_code == 0, res.output
    assert "6 identical to another row (computed once:" in res.output
    assert "14 to compute" in res.output


def test_a_stopped_run_resumes_to_every_row_once(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(rows=_rows_with_copies())
    job = _job(tmp_path, "resumed", data)
    try:
        run([job], fake_llm_factory, stop_after_rows=5)
    except Exception:                # Interrupted: finished rows are committed
        pass
    run([job], fake_llm_factory)
    [ref] = run([_job(tmp_path, "whole", data, dedup=False)], fake_llm_factory)
    got = _table(tmp_path, "resumed")
    assert [r["id"] for r in got] == [r["id"] for r in _table(tmp_path, "whole")]
    assert got == _table(tmp_path, "whole")


def test_on_the_real_engine_the_copies_equal_computed_rows(tmp_path, make_docs_dataset, tiny_llama_dir):
    """The copies' results are what the engine gives those rows computed among the others (batch invariance)."""
    data = make_docs_dataset(rows=_rows_with_copies(8, 3))
    engine = (f"model: {tiny_llama_dir}\nengine:\n  dtype: float32\n  max_num_seqs: 4\n  max_num_batched_tokens: 256\n"
              "  max_model_len: 1024\n  num_gpu_blocks_override: 64\n")
    for name, dedup in (("merged", True), ("alone", False)):
        path = _job(tmp_path, name, data, dedup=dedup)
        path.write_text(path.read_text() + engine)
        res = CliRunner().invoke(main, ["submit", "-q", str(path)])
        assert res.exit_code == 0, res.output
    assert _manifest(tmp_path, "merged")["this_run"]["deduplicated"]["rows"] == 3
    merged, alone = _table(tmp_path, "merged"), _table(tmp_path, "alone")
    assert merged == alone and all(r["summary"] for r in merged)
