"""Schema and grammar files resolve relative to the job file and stay in its folder (issue 40 C): a path that leaves
it (``..``, an absolute path elsewhere, a symlink out) is refused unless the job says ``allow_outside_files: true``;
messages about such files quote paths and positions, never the file's contents."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from pipeline.job.job_file import load_job
from pipeline.problems import JobError

SECRET = "SECRET-TOKEN-abc123"
JOB = """\
name: so
model: {model}
input:
  path: {data}
  id_column: id
prompt:
  system: "You are helpful."
  reference_column: reference
generation:
  max_tokens: 8
  structured_outputs:
    {so}
output:
  path: {out}
{extra}"""


@pytest.fixture
def make(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=4)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "elsewhere").mkdir()

    def job(so: str, extra: str = "") -> str:
        path = tmp_path / "jobs" / "job.yaml"
        path.write_text(JOB.format(model=tiny_llama_dir, data=data, out=tmp_path / "out.parquet", so=so,
                                   extra=extra))
        return str(path)
    return tmp_path, job


def _problem(path: str) -> str:
    with pytest.raises(JobError) as ei:
        load_job(path)
    return str(ei.value)


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_a_schema_file_outside_the_job_folder_is_refused_unless_allowed(make, where):
    tmp, job = make
    (tmp / "elsewhere" / "x.json").write_text(json.dumps(SCHEMA))
    written = {"dotdot": "../elsewhere/x.json", "absolute": str(tmp / "elsewhere" / "x.json"),
               "symlink": "link.json"}[where]
    (tmp / "jobs" / "link.json").symlink_to(tmp / "elsewhere" / "x.json")
    path = job(f"json: {written}")
    msg = _problem(path)
    assert f"{path}:12: generation.structured_outputs.json: the schema file {written} resolves to " \
           f"{tmp / 'elsewhere' / 'x.json'}, outside the job file's folder {tmp / 'jobs'}" in msg
    assert "allow_outside_files: true" in msg
    allowed = load_job(job(f"json: {written}", extra="allow_outside_files: true\n"))
    assert json.loads(allowed.sampling_params.structured_outputs.json) == SCHEMA


def test_a_grammar_file_outside_is_refused_through_the_cli(make):
    tmp, job = make
    (tmp / "elsewhere" / "g.lark").write_text(f"{SECRET} is here\n")
    path = job(f"grammar: {tmp / 'elsewhere' / 'g.lark'}")
    for command in ("validate", "plan"):
        res = CliRunner().invoke(main, [command, path])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert "outside the job file's folder" in res.output and SECRET not in res.output


@pytest.mark.parametrize("so, content", [
    ("grammar: bad.lark", f"{SECRET} is here\nline two\n"),
    ("json: bad.json", json.dumps({"type": "object", "properties": {"a": {"type": SECRET}}})),
    ("json: bad.json", '{"type": "object", "properties": {"a": "' + SECRET),
    ("json: bad.json", b"\xff" + SECRET.encode()),
])
def test_messages_about_a_file_never_show_its_contents(make, so, content):
    """Before: the grammar engine's message quoted the file ('SECRET-TOKEN-abc123 ' ^ 'is here...')."""
    tmp, job = make
    target = tmp / "jobs" / so.split(": ")[1]
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    path = job(so)
    res = CliRunner().invoke(main, ["validate", path])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert SECRET not in res.output and "SECRET" not in res.output, res.output
    assert f"{path}:12: generation.structured_outputs." in res.output and so.split(": ")[1] in res.output


def test_inline_schema_errors_still_name_the_keyword(make):
    tmp, job = make
    msg = _problem(job("json: {type: objekt}"))
    assert "not a valid JSON Schema" in msg and "type: 'objekt'" in msg       # the keyword's path, inline text


def test_a_fifo_or_directory_is_not_read(make):
    import os
    tmp, job = make
    os.mkfifo(tmp / "jobs" / "pipe.json")
    assert "not a regular file" in _problem(job("json: pipe.json"))      # never blocks on a read
    (tmp / "jobs" / "d.json").mkdir()
    assert "not a regular file" in _problem(job("json: d.json"))
