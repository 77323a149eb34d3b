"""Inputs and outputs never overlap (issue 40 B): an output inside an input directory, equal to an input (through
symlinks too), matched by an input glob, or holding an input is refused before compute, naming both paths; a run
never writes into its input (before: the first run wrote beside the input documents, every later run failed on the
mixed schema)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import pipeline.run.runner
from batchgen.cli import main

JOB = """\
name: {name}
model: {model}
input:
  path: {data}
{fmt}  id_column: id
prompt:
  system: "You are helpful."
  reference_column: reference
output:
  path: {out}
"""


@pytest.fixture
def setup(tmp_path, make_docs_dataset, tiny_llama_dir):
    indir = tmp_path / "in"
    indir.mkdir()
    make_docs_dataset(name="in/docs.parquet", n=4)

    def job(out, data=indir, name="ov", fmt="") -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(JOB.format(name=name, model=tiny_llama_dir, data=data, out=out, fmt=fmt))
        return str(path)
    return tmp_path, indir, job


def _files(d: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def _refused(args, *needles) -> str:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    for n in needles:
        assert n in res.output, (n, res.output)
    return res.output


def test_output_inside_the_input_directory_is_refused_and_submit_writes_nothing(setup, fake_llm_factory,
                                                                               monkeypatch):
    tmp, indir, job = setup
    path = job(indir / "out.parquet")
    before = _files(indir)
    _refused(["validate", path], f"{path}:10: output.path", f"the output {indir / 'out.parquet'} overlaps the input "
             f"{indir}", "is inside the input directory")
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", fake_llm_factory)
    _refused(["submit", "-q", path], "overlaps the input")
    _refused(["submit", "-q", path], "overlaps the input")        # the second run is refused the same way
    assert _files(indir) == before and not fake_llm_factory.made


def test_symlinks_do_not_hide_an_overlap(setup):
    tmp, indir, job = setup
    (tmp / "link_to_in").symlink_to(indir)
    out = tmp / "link_to_in" / "sub" / "out"
    _refused(["validate", job(out)], f"the output {out} ({indir / 'sub' / 'out'}) overlaps", "inside the input")
    (tmp / "file_link.parquet").symlink_to(indir / "docs.parquet")
    _refused(["validate", job(tmp / "file_link.parquet", data=indir / "docs.parquet")], "overwrite the input")


def test_output_equal_to_the_input_directory_or_holding_the_input(setup):
    tmp, indir, job = setup
    _refused(["validate", job(indir)], "overwrite the input")
    _refused(["validate", job(tmp, data=indir / "docs.parquet")], f"the input lies inside {tmp}")


@pytest.mark.parametrize("pattern, out, refused", [
    ("in/*.parquet", "in/out.parquet", True),
    ("in/*.parquet", "in/sub/out.parquet", False),
    ("in/**/*.parquet", "in/sub/out.parquet", True),
    ("in/**/*.parquet", "in/shards", True),          # a directory output: its part files would match
    ("in/d*.parquet", "in/out.parquet", False),
])
def test_input_globs(setup, pattern, out, refused):
    tmp, indir, job = setup
    res = CliRunner().invoke(main, ["validate", job(tmp / out, data=tmp / pattern)])
    assert "Traceback" not in res.output
    assert (res.exit_code, "the input glob would match" in res.output) == ((2, True) if refused else (0, False)), \
        res.output


def test_datasets_and_openai_batch_inputs(setup):
    import datasets
    tmp, indir, job = setup
    ds_dir = tmp / "ds"
    datasets.Dataset.from_dict({"id": ["a"], "reference": ["r"], "document": ["d"]}).save_to_disk(str(ds_dir))
    _refused(["validate", job(ds_dir / "out.parquet", data=ds_dir)], "inside the input directory")
    jsonl = tmp / "requests.jsonl"
    jsonl.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    text = JOB.replace('prompt:\n  system: "You are helpful."\n  reference_column: reference\n', "")
    path = tmp / "ob.yaml"
    path.write_text(text.format(name="ob", model="x", data=jsonl, out=jsonl, fmt="  format: openai_batch\n")
                    .replace("  id_column: id\n", "") + "  format: openai_batch\n")
    _refused(["validate", str(path)], "overwrite the input")


def test_one_jobs_output_inside_another_jobs_input(setup):
    tmp, indir, job = setup
    other = tmp / "other_in"
    other.mkdir()
    os.link(indir / "docs.parquet", other / "docs.parquet")
    a = job(tmp / "out" / "a.parquet", name="a")
    b = job(other / "b.parquet", data=other, name="b")
    c = job(tmp / "out" / "c.parquet", data=other, name="c")
    res = CliRunner().invoke(main, ["validate", a, c])
    assert res.exit_code == 0, res.output                  # separate outputs, separate inputs
    b_out = _refused(["validate", a, b], f"{b}:10: output.path")
    assert b_out.count("overlaps") == 1
    a2 = job(other / "a.parquet", name="a")                 # a writes into b's input
    _refused(["validate", a2, c], f"{a2}:10: output.path", f"overlaps the input {other} of {c}")


def test_an_output_beside_an_input_file_is_fine(setup):
    tmp, indir, job = setup
    res = CliRunner().invoke(main, ["validate", job(indir / "out.parquet", data=indir / "docs.parquet")])
    assert res.exit_code == 0, res.output
