"""Every kind of bad job fails before compute with one clear message (exit 2, no traceback) naming the file,
key or column, and an existing valid output at the job's output path is left exactly as it was. Faults while
writing (a full disk) stop the run clearly, keep what was committed, and a rerun resumes."""
from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import main
from tests.test_pipeline import write_job

REAL_FACTORY = pipeline.run.runner.default_llm_factory


def _snapshot(out_dir: Path) -> dict:
    return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.rglob("*")) if p.is_file() and "runs" not in p.parts}


def _set(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# (case id, how to break the good job file: (text, ctx) -> text, what the message must say)
CASES = [
    ("yaml-syntax", lambda t, c: t + "prompt: [unclosed\n", ["YAML syntax error", "bad.yaml:"]),
    ("unknown-key", lambda t, c: t + "outptu: {}\n", ["outptu: unknown key", "did you mean 'output'"]),
    ("missing-key", lambda t, c: t.replace("name: good\n", ""), ["name: missing required key"]),
    ("wrong-type", lambda t, c: _set(t, "max_tokens: 8", "max_tokens: eight"),
     ["generation.max_tokens", "expected an integer"]),
    ("bad-enum", lambda t, c: _set(t, "  document_column: document\n",
                                   "  document_column: document\n  on_too_long: cut\n"),
     ["prompt.on_too_long", "error, truncate_document"]),
    ("input-matches-nothing", lambda t, c: _set(t, str(c["data"]), str(c["tmp"] / "nothing" / "*.parquet")),
     ["input.path", "matches no files"]),
    ("corrupt-parquet", lambda t, c: _set(t, str(c["data"]), str(c["corrupt"])),
     ["input.path", "not a readable Parquet file"]),
    ("missing-column", lambda t, c: _set(t, "document_column: document", "document_column: body"),
     ["prompt.document_column", "'body' is not in the input"]),
    ("bad-placeholder", lambda t, c: _set(t, "  document_column: document\n",
                                          "  document_column: document\n  template: '{system} {regoin} {document}'\n"),
     ["prompt.template", "{regoin}", "did you mean {region}"]),
    ("output-not-writable", lambda t, c: _set(t, str(c["out"]), str(c["tmp"] / "a_file" / "x.parquet")),
     ["output.path", "cannot write under"]),
    ("output-is-input", lambda t, c: _set(t, str(c["out"]), str(c["data"])), ["output.path", "overwrite the input"]),
    ("model-missing", lambda t, c: t + "model: /nonexistent/model-dir\n", ["model", "/nonexistent/model-dir",
                                                                          "no such file or directory"]),
    ("bad-cron", lambda t, c: t + 'schedule: "0 25 * * *"\n', ["schedule", "hour"]),
    ("engine-setting", lambda t, c: t + "engine:\n  block_size: 12\n", ["engine.block_size", "power of two"]),
    ("engine-unknown", lambda t, c: t + "engine:\n  max_num_seq: 4\n", ["engine.max_num_seq", "did you mean"]),
    # These need the model's config and the machine (no weights): found by validation, with the file and line.
    ("unsupported-architecture", lambda t, c: t + f"model: {c['foo_model']}\n",
     ["bad.yaml:", ": model:", "unsupported architecture 'FooForCausalLM'"]),
    ("kv-pool-under-one-block", lambda t, c: t + f"model: {c['tiny']}\nengine:\n  kv_cache_memory: 1\n",
     ["bad.yaml:", ": engine:", "smaller than one block"]),
    ("kv-pool-under-one-block-per-seq",
     lambda t, c: t + f"model: {c['tiny']}\nengine:\n  num_gpu_blocks_override: 2\n  max_num_seqs: 8\n",
     ["bad.yaml", "less than one block per sequence", "max_num_seqs 8"]),
    ("kv-pool-over-memory", lambda t, c: t + f"model: {c['tiny']}\nengine:\n  kv_cache_memory: {2**50}\n",
     ["exceeds the memory available"]),
]


@pytest.fixture
def good_output(tmp_path, make_docs_dataset, fake_llm_factory, monkeypatch, tiny_llama_dir):
    """A valid output of job ``good`` (fake engine), and what the bad variants need."""
    import pyarrow as pa

    from tests.conftest import make_docs
    rows = [{**r, "region": "EU"} for r in make_docs(8)]
    data = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    job = write_job(tmp_path, "good", data)
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    res = CliRunner().invoke(main, ["submit", "-q", str(job)])
    assert res.exit_code == 0, res.output
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet at all PAR1")
    (tmp_path / "a_file").write_text("x")
    foo = tmp_path / "foo_model"
    shutil.copytree(tiny_llama_dir, foo)
    cfg = json.loads((foo / "config.json").read_text())
    (foo / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    return {"tmp": tmp_path, "job": job, "data": data, "out": tmp_path / "out/good.parquet", "corrupt": corrupt,
            "foo_model": foo, "tiny": tiny_llama_dir}


@pytest.mark.parametrize("case,mutate,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_job_fails_clearly_and_leaves_output_alone(good_output, monkeypatch, case, mutate, expected):
    c = good_output
    if case in ("unsupported-architecture",) or case.startswith("kv-pool"):
        monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", REAL_FACTORY)
    before = _snapshot(c["tmp"] / "out")
    bad = c["tmp"] / "bad.yaml"
    bad.write_text(mutate(c["job"].read_text(), c))
    res = CliRunner().invoke(main, ["submit", "-q", str(bad)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    for want in expected:
        assert want in res.output, (want, res.output)
    assert _snapshot(c["tmp"] / "out") == before
    assert pq.read_table(c["out"]).num_rows == 8


def test_same_output_path_for_two_jobs(good_output):
    c = good_output
    other = c["tmp"] / "other.yaml"
    other.write_text(c["job"].read_text().replace("name: good", "name: other"))
    before = _snapshot(c["tmp"] / "out")
    res = CliRunner().invoke(main, ["submit", "-q", str(c["job"]), str(other)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "other.yaml" in res.output and "also the output of" in res.output and "own output path" in res.output
    assert _snapshot(c["tmp"] / "out") == before


def test_disk_full_while_writing_then_resume(good_output, monkeypatch):
    """ENOSPC at the third part-file write: clear message, the earlier output and committed parts intact;
    after space is freed the rerun resumes (committed rows are not recomputed)."""
    import pyarrow.parquet as pq_mod
    c = good_output
    changed = c["job"].read_text().replace("You are a support analyst.", "You are terse.") \
        + "engine:\n  max_num_seqs: 2\n"
    c["job"].write_text(changed)                                   # every row must be computed again
    before = _snapshot(c["tmp"] / "out")
    real = pq_mod.ParquetWriter.write_table          # every Parquet write goes through it
    calls = [0]

    def full_disk(self, table, *a, **kw):
        calls[0] += 1
        if calls[0] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, table, *a, **kw)

    monkeypatch.setattr(pq_mod.ParquetWriter, "write_table", full_disk)
    res = CliRunner().invoke(main, ["submit", "-q", "--commit-every", "0", str(c["job"])])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "No space left on device" in res.output and "run the same command again" in res.output
    after = _snapshot(c["tmp"] / "out")
    assert {k: v for k, v in after.items() if k in before} == before   # output + manifest untouched
    assert pq.read_table(c["out"]).num_rows == 8
    from pipeline.job.state import RunState
    committed = RunState(c["out"], "good").load_done().num_rows
    assert 0 < committed < 16                                       # some new rows made it (plus the old 8)

    monkeypatch.setattr(pq_mod.ParquetWriter, "write_table", real)  # space freed
    res = CliRunner().invoke(main, ["submit", "-q", str(c["job"])])
    assert res.exit_code == 0, res.output
    assert "reused from earlier runs" in res.output
    t = pq.read_table(c["out"])
    assert t.num_rows == 8 and t.column("error").null_count == 8
    from pipeline.run import history
    statuses = [r.status for r in history.recent_runs("good")]
    assert statuses[:2] == ["ok", "failed"]
