"""The runner end to end on the fake engine: one row per input row, in order; resume; shared prefixes."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.job.job_file import load_job
from pipeline.job.state import job_dir_for
from pipeline.run.runner import Interrupted, RunOptions, run_jobs

COLUMNS = ["id", "category", "summary", "finish_reason", "prompt_tokens", "cached_tokens", "output_tokens",
           "queue_s", "prefill_s", "ttft_s", "tpot_s", "e2e_s", "error"]


def write_job(tmp_path, name, data, out=None, extra="", limit=None, system="You are a support analyst."):
    out = out or tmp_path / f"out/{name}.parquet"
    text = f"""name: {name}
input:
  path: {data}
  id_column: id
{f'  limit: {limit}' if limit else ''}
prompt:
  system: "{system}"
  reference_column: reference
  document_column: document
generation:
  max_tokens: 8
  temperature: 0.0
output:
  path: {out}
  include_columns: [id, category]
{extra}"""
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def run(paths, factory, **opts):
    return run_jobs([load_job(p) for p in paths], llm_factory=factory, options=RunOptions(quiet=True, **opts))


def test_one_row_per_input_in_order(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=30)
    job = write_job(tmp_path, "a", data)
    [report] = run([job], fake_llm_factory)
    t = pq.read_table(tmp_path / "out/a.parquet")
    assert t.column_names[:len(COLUMNS)] == COLUMNS and "row_key" in t.column_names
    assert t.column("id").to_pylist() == pq.read_table(data).column("id").to_pylist()
    assert t.column("error").null_count == 30
    m = json.loads((tmp_path / "out/a.parquet.manifest.json").read_text())
    assert m["rows"] == 30 and m["this_run"]["predicted_hit_rate"] == m["this_run"]["achieved_hit_rate"]
    assert report.plan.hit_rate > 0.3
    assert "achieved" in report.summary


def test_shuffled_input_gets_same_hits(tmp_path, make_docs_dataset, fake_llm_factory):
    a = make_docs_dataset("sorted.parquet", n=40)
    b = make_docs_dataset("shuffled.parquet", n=40, shuffle=True)
    [ra] = run([write_job(tmp_path, "s", a)], fake_llm_factory)
    [rb] = run([write_job(tmp_path, "h", b)], fake_llm_factory)
    ta, tb = pq.read_table(tmp_path / "out/s.parquet"), pq.read_table(tmp_path / "out/h.parquet")
    assert sum(ta.column("cached_tokens").to_pylist()) == sum(tb.column("cached_tokens").to_pylist())
    assert ra.plan.hit_rate == rb.plan.hit_rate
    assert tb.column("id").to_pylist() == pq.read_table(b).column("id").to_pylist()   # input order kept


def test_jobs_on_one_model_merge_their_engine_sections(tmp_path, make_docs_dataset):
    """The engine is built from one EngineConfig: what each job wrote (jobs agreeing where both write a key), the
    defaults elsewhere; two jobs writing different values for one key are refused, naming it, before any load."""
    from engine import EngineConfig
    from pipeline.problems import RunError
    data = make_docs_dataset(n=4)
    seen = []
    j1 = write_job(tmp_path, "one", data, extra="engine:\n  max_num_seqs: 4\n  block_size: 32\n")
    j2 = write_job(tmp_path, "two", data, extra="engine:\n  block_size: 32\n  speculative_config: off\n")
    class Seen(Exception):
        pass

    def factory(config):          # saw the config; stop there
        seen.append(config)
        raise Seen

    with pytest.raises(Seen):
        run([j1, j2], factory)
    assert seen == [EngineConfig("gemma-3-270m", max_num_seqs=4, block_size=32, speculative_config="off")]
    j3 = write_job(tmp_path, "three", data, extra="engine:\n  max_num_seqs: 8\n")
    with pytest.raises(RunError, match="three.yaml: engine.max_num_seqs is 8 but another job .* sets 4"):
        run([j1, j3], lambda config: pytest.fail("an engine was started"))


def test_cross_job_sharing_one_engine(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=12)
    j1, j2 = write_job(tmp_path, "one", data), write_job(tmp_path, "two", data)
    j2.write_text(j2.read_text().replace("temperature: 0.0", "temperature: 0.0\n  dedup: false"))
    [report] = run([j1, j2], fake_llm_factory)
    assert len(fake_llm_factory.made) == 1
    t2 = pq.read_table(tmp_path / "out/two.parquet")
    # Every prompt of the second job is a prompt of the first: all heads were computed by job one (the rows
    # themselves too: with dedup on, job two's would be copies of job one's, tests/test_dedup.py).
    assert report.plan.num_requests == 24
    assert (tmp_path / "out/one.parquet").exists() and t2.num_rows == 12


def test_resume_after_interrupt_and_rerun_does_nothing(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=30)
    job = write_job(tmp_path, "r", data)
    with pytest.raises(Interrupted):
        run([job], fake_llm_factory, stop_after_rows=10, commit_interval_s=0.0)
    assert not (tmp_path / "out/r.parquet").exists()
    [report] = run([job], fake_llm_factory)
    jr = report.jobs[0]
    assert jr.reused >= 10 and jr.computed == 30 - jr.reused
    t = pq.read_table(tmp_path / "out/r.parquet")
    keys = t.column("row_key").to_pylist()
    assert len(set(keys)) == 30 and t.column("summary").null_count == 0
    [again] = run([job], fake_llm_factory)
    assert again.jobs[0].up_to_date and again.jobs[0].computed == 0 and "up to date" in again.summary
    assert pq.read_table(tmp_path / "out/r.parquet").equals(t)


def test_changed_params_recompute(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=10)
    run([write_job(tmp_path, "c", data)], fake_llm_factory)
    [report] = run([write_job(tmp_path, "c", data, system="You are terse.")], fake_llm_factory)
    assert report.jobs[0].changed == 10 and report.jobs[0].computed == 10
    assert "recomputed because" in report.summary


def test_bad_rows_become_error_rows(tmp_path, make_docs_dataset, fake_llm_factory):
    from tests.conftest import make_docs
    rows = make_docs(8)
    rows[1]["document"] = None
    rows[3]["document"] = "   "
    rows[5]["document"] = "word " * 3000           # too long for max_model_len 4096 - but fake has 4096
    data = make_docs_dataset(rows=rows)
    job = write_job(tmp_path, "bad", data, extra="engine:\n  max_model_len: 512\n")
    [report] = run([job], fake_llm_factory)          # the fake takes the job's max_model_len: 512
    t = pq.read_table(tmp_path / "out/bad.parquet")
    errs = t.column("error").to_pylist()
    assert t.num_rows == 8
    assert "null" in errs[1] and "empty" in errs[3] and "context" in errs[5]
    assert [e is None for e in errs] == [True, False, True, False, True, False, True, True]
    assert "3 with errors" in report.summary


def test_lock_refuses_second_run(tmp_path, make_docs_dataset, fake_llm_factory):
    import fcntl
    import os

    from pipeline.problems import RunError
    data = make_docs_dataset(n=4)
    job = write_job(tmp_path, "l", data)
    sd = job_dir_for(tmp_path / "out/l.parquet")
    sd.mkdir(parents=True)
    fd = os.open(sd / "lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                 # held (as another run holds it), its pid written for humans
    os.write(fd, json.dumps({"pid": os.getppid(), "host": os.uname().nodename, "started": "x"}).encode())
    with pytest.raises(RunError, match=f"already running \\(pid {os.getppid()}"):
        run([job], fake_llm_factory)
    os.close(fd)                                   # its process ended: the kernel dropped the lock
    (sd / "lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename, "started": "x"}))
    run([job], fake_llm_factory)                   # stale lock of a dead process is taken over
    assert not (sd / "lock").exists()


@pytest.mark.parametrize("order", ["input", "shuffled"])
def test_unplanned_orders_give_the_same_rows(tmp_path, make_docs_dataset, fake_llm_factory, order):
    """The benchmark baselines (`submit --order input|shuffled`) change only the request order."""
    data = make_docs_dataset(n=24)
    planned = write_job(tmp_path, "p", data)
    other = write_job(tmp_path, "o", data)
    run([planned], fake_llm_factory)
    run([other], fake_llm_factory, order=order)
    a, b = pq.read_table(tmp_path / "out/p.parquet"), pq.read_table(tmp_path / "out/o.parquet")
    assert a.column("id").to_pylist() == b.column("id").to_pylist()
    assert a.column("summary").to_pylist() == b.column("summary").to_pylist()


@pytest.mark.parametrize("include", ["", "  include_columns: [category]\n", "  include_columns: [category, id]\n"])
def test_id_column_is_always_the_first_output_column(tmp_path, make_docs_dataset, fake_llm_factory, include):
    """With input.id_column set, every output row carries its id (first), whatever include_columns says."""
    data = make_docs_dataset(n=6)
    path = write_job(tmp_path, "a", data)
    path.write_text(path.read_text().replace("  include_columns: [id, category]\n", include))
    run([path], fake_llm_factory)
    t = pq.read_table(tmp_path / "out/a.parquet")
    assert t.column_names[0] == "id" and t.column_names.count("id") == 1
    assert t.column("id").to_pylist() == pq.read_table(data).column("id").to_pylist()
    assert ("category" in t.column_names) == ("category" in include)
    if "category" in include:
        assert t.column_names[1] == "category"


def test_input_as_a_pyarrow_fs_uri(tmp_path, make_docs_dataset, fake_llm_factory):
    """``input.path`` may be a URI that pyarrow.fs understands (file:// here; s3:// and gs:// the same way): a
    file, or a prefix of Parquet files read in name order; a URI with nothing there is a clear problem."""
    import pyarrow.parquet as pq

    from pipeline.problems import JobError
    from pipeline.run.validate import load_valid_jobs
    data = make_docs_dataset(n=12)
    run([write_job(tmp_path, "plain", data)], fake_llm_factory)
    ref = pq.read_table(tmp_path / "out/plain.parquet").column("summary").to_pylist()
    [report] = run([write_job(tmp_path, "uri", f"file://{data}")], fake_llm_factory)
    assert pq.read_table(tmp_path / "out/uri.parquet").column("summary").to_pylist() == ref
    shards = tmp_path / "shards"
    shards.mkdir()
    table = pq.read_table(data)
    pq.write_table(table.slice(0, 5), shards / "a.parquet")
    pq.write_table(table.slice(5), shards / "b.parquet")
    run([write_job(tmp_path, "dir", f"file://{shards}")], fake_llm_factory)
    assert pq.read_table(tmp_path / "out/dir.parquet").column("summary").to_pylist() == ref
    with pytest.raises(JobError, match="no such file or prefix"):
        load_valid_jobs([str(write_job(tmp_path, "gone", f"file://{tmp_path}/nothing/here"))])


def test_output_as_a_pyarrow_fs_uri(tmp_path, make_docs_dataset, fake_llm_factory, monkeypatch):
    """An output URI (file:// here; s3://, gs:// the same way) is assembled under the state dir, where its run
    state lives, then copied with its manifest to the URI; a rerun is up to date; a lost copy is copied again."""
    import pyarrow.parquet as pq
    data = make_docs_dataset(n=12)
    run([write_job(tmp_path, "plain", data)], fake_llm_factory)
    ref = pq.read_table(tmp_path / "out/plain.parquet").column("summary").to_pylist()
    remote = tmp_path / "bucket"
    for name, target in (("file", remote / "digest.parquet"), ("dir", remote / "shards")):
        job = write_job(tmp_path, name, data, out=f"file://{target}", extra="")
        [report] = run([job], fake_llm_factory)
        assert pq.read_table(target).column("summary").to_pylist() == ref
        assert json.loads(Path(f"{target}.manifest.json").read_text())["output"] == f"file://{target}"
        assert not (tmp_path / "out" / f"{name}.parquet").exists()
        [report] = run([job], fake_llm_factory)
        assert report.jobs[0].up_to_date
    (remote / "digest.parquet").unlink()
    [report] = run([write_job(tmp_path, "file", data, out=f"file://{remote / 'digest.parquet'}")], fake_llm_factory)
    assert report.jobs[0].up_to_date and pq.read_table(remote / "digest.parquet").num_rows == 12


def test_duplicate_rows_across_batch_boundaries_run_once(tmp_path, make_docs_dataset, fake_llm_factory):
    """Rendering runs one batch ahead of key bookkeeping (prepare's two stages): identical rows in different
    input batches still give one engine request, one output row per input row, and the same plan as one batch."""
    import pyarrow as pa
    rows = pq.read_table(make_docs_dataset(n=7)).to_pylist()
    rows = rows + rows[:4] + rows[2:5]                       # repeats land in later batches of 3
    data = tmp_path / "dups.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    extra = "engine: {max_num_seqs: 8}\n"
    small = write_job(tmp_path, "small", data, extra=extra)
    small.write_text(small.read_text().replace("  id_column: id\n",
                                               "  id_column: id\n  allow_duplicate_ids: true\n  batch_size: 3\n"))
    [rep] = run([small], fake_llm_factory)
    assert len(fake_llm_factory.made[-1].added) == 7
    t = pq.read_table(tmp_path / "out/small.parquet")
    assert t.column("id").to_pylist() == [r["id"] for r in rows] and t.column("error").null_count == len(rows)
    s = t.column("summary").to_pylist()
    assert s[7:11] == s[:4] and s[11:] == s[2:5]
    one = write_job(tmp_path, "one", data, out=tmp_path / "out/one.parquet", extra=extra)
    one.write_text(one.read_text().replace("  id_column: id\n", "  id_column: id\n  allow_duplicate_ids: true\n"))
    rep1 = run_jobs([load_job(one)], llm_factory=fake_llm_factory, options=RunOptions(quiet=True), dry_run=True)[0]
    assert (rep1.plan.prompt_tokens, rep1.plan.cached_tokens) == (rep.plan.prompt_tokens, rep.plan.cached_tokens)
