"""Job files: parsing, did-you-mean, file/key/line in every message; validate catches each bad-job kind."""

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from pipeline.job.job_file import DEFAULT_TEMPLATE, load_job
from pipeline.problems import JobError

GOOD = """\
name: demo
input:
  path: {data}
  id_column: id
prompt:
  system: "You are helpful."
  reference_column: reference
generation:
  max_tokens: 8
  temperature: 0.0
  stop: "\\n\\n"
output:
  path: {out}
  include_columns: [id]
"""


@pytest.fixture
def good(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=4)
    text = GOOD.format(data=data, out=tmp_path / "out.parquet") + f"model: {tiny_llama_dir}\n"
    return tmp_path, text


def write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parses_defaults(good):
    tmp_path, text = good
    job = load_job(write(tmp_path, text))
    assert job.name == "demo" and job.input.format == "parquet" and job.prompt.template == DEFAULT_TEMPLATE
    assert job.sampling_params.stop == ("\n\n",) and job.output.include_columns == ("id",)
    assert job.line("prompt.reference_column") == 7


def test_unknown_key_did_you_mean_with_line(good):
    tmp_path, text = good
    p = write(tmp_path, text.replace("  id_column: id", "  id_colum: id"))
    with pytest.raises(JobError) as ei:
        load_job(p)
    msg = str(ei.value)
    assert f"{p}:4: input.id_colum: unknown key (did you mean 'id_column'?)" in msg


def test_every_problem_reported(good):
    tmp_path, text = good
    bad = text.replace("name: demo\n", "").replace("max_tokens: 8", "max_tokens: many").replace(
        "temperature: 0.0", "temprature: 0.0")
    with pytest.raises(JobError) as ei:
        load_job(write(tmp_path, bad))
    keys = {p.key for p in ei.value.problems}
    assert {"name", "generation.max_tokens", "generation.temprature"} <= keys


BAD_CASES = [
    # (what to change, key that must be named, words in the message)
    (lambda t: t.replace("name: demo", "name: [demo"), None, "YAML syntax error"),
    (lambda t: t.replace("  id_column: id", "  id_column: ident"), "input.id_column", "not in the input"),
    (lambda t: t.replace("  reference_column: reference", "  reference_column: refrence"),
     "prompt.reference_column", "did you mean 'reference'"),
    (lambda t: t.replace("{data}", "/nonexistent/*.parquet"), "input.path", "matches no files"),
    (lambda t: t + "  \n", None, None),  # still fine
    (lambda t: t.replace('  system: "You are helpful."', '  system: "x"\n  template: "{system} {nope} {document}"'),
     "prompt.template", "placeholder {nope}"),
    (lambda t: t.replace('  system: "You are helpful."', '  template: "{system} only"'), "prompt.template",
     "{document}"),
    (lambda t: t.replace("max_tokens: 8", "max_tokens: 0"), "generation.max_tokens", "max_tokens must be >= 1"),
    (lambda t: t + "schedule: \"61 * * * *\"\n", "schedule", "not a valid cron"),
    (lambda t: t + "engine:\n  block_size: 3\n", "engine.block_size", "power of two"),
    (lambda t: t.replace("model: ", "model: /nope/"), "model", "no such file"),
    (lambda t: t.replace("{out}", "{data}/out.parquet"), "output.path", "not a writable directory"),
    (lambda t: t.replace("include_columns: [id]", "include_columns: [id, summary]"), "output.include_columns",
     "not in the input"),
]


@pytest.mark.parametrize("change, key, needle", BAD_CASES)
def test_validate_table(good, make_docs_dataset, change, key, needle):
    tmp_path, text = good
    data = make_docs_dataset(n=4)
    text = text.replace(str(data), "{data}").replace(str(tmp_path / "out.parquet"), "{out}")
    text = change(text).replace("{data}", str(data)).replace("{out}", str(tmp_path / "out.parquet"))
    p = write(tmp_path, text)
    res = CliRunner().invoke(main, ["validate", str(p)])
    if needle is None:
        assert res.exit_code == 0, res.output
        return
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and str(p) in res.output
    if key:
        assert f": {key}:" in res.output, res.output
    assert needle in res.output, res.output


def test_two_jobs_same_output_and_name(good):
    tmp_path, text = good
    a, b = write(tmp_path, text, "a.yaml"), write(tmp_path, text, "b.yaml")
    res = CliRunner().invoke(main, ["validate", str(a), str(b)])
    assert res.exit_code == 2
    assert "also used by" in res.output and "also the output of" in res.output


def test_engine_switch_or_mapping_settings(good):
    """speculative_config takes off / auto (YAML's bare off is false) or a mapping, kept as a SpecConfig (or None);
    a bad one names the key."""
    from engine.config import SpecConfig
    from pipeline.job.job_file import JobError
    tmp_path, text = good
    for value, want in (("off", None), ("auto", SpecConfig()), ("{num_speculative_tokens: 6, gating: always}",
                                                              SpecConfig(num_speculative_tokens=6, gating="always"))):
        job = load_job(write(tmp_path, text + f"engine:\n  speculative_config: {value}\n"))
        assert job.engine.speculative_config == want and job.engine_options == ("speculative_config",)
    with pytest.raises(JobError, match=r"engine.speculative_config: .*num_speculative_tokens must be in 1..16"):
        load_job(write(tmp_path, text + "engine:\n  speculative_config: {num_speculative_tokens: 40}\n"))
    with pytest.raises(JobError, match=r"engine.speculative_config: expected off, auto or a mapping"):
        load_job(write(tmp_path, text + "engine:\n  speculative_config: 3\n"))
