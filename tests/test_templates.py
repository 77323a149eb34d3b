"""Prompt templates are parsed once, when the job file is read: only ``{name}`` fields; a format spec, a conversion
or an empty field is refused by validate / plan / submit with file:line and the field, never a traceback later
(issue 40 A)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.cli import main
from pipeline.job.job_file import PromptSpec, load_job
from pipeline.job.prompts import PromptRenderer
from pipeline.job.templates import TemplateError, parse_template
from pipeline.problems import JobError

JOB = """\
name: tpl
model: {model}
input:
  path: {data}
  id_column: id
prompt:
  system: "You are helpful."
  reference_column: reference
  template: {template}
{prompt_extra}generation:
  max_tokens: 8
output:
  path: {out}
"""


@pytest.fixture
def job_with(tmp_path, make_docs_dataset, tiny_llama_dir):
    data = make_docs_dataset(n=4)

    def make(template: str, prompt_extra: str = "") -> str:
        path = tmp_path / "job.yaml"
        quoted = '"' + template.replace("\\", "\\\\").replace('"', '\\"') + '"'
        path.write_text(JOB.format(model=tiny_llama_dir, data=data, out=tmp_path / "out.parquet",
                                   template=quoted, prompt_extra=prompt_extra))
        return str(path)
    return make


def _refused(args: list[str], *needles: str) -> str:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    for n in needles:
        assert n in res.output, (n, res.output)
    return res.output


@pytest.mark.parametrize("field, why", [
    ("{system:d}", "format specs (:d)"),
    ("{system:{reference}}", "format specs (:{reference})"),
    ("{system:>999999999}", "format specs (:>999999999)"),
    ("{system!z}", "conversions (!z)"),
    ("{system!r}", "conversions (!r)"),
    ("{system:}", "format specs (:)"),
    ("{}", "an empty field"),
])
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_format_specs_and_conversions_are_refused_with_file_line_and_field(job_with, command, field, why):
    path = job_with(f"Doc: {field} {{document}}")
    _refused([command, path], f"{path}:9: prompt.template: field {field} at character 6", why)


def test_a_malformed_template_is_refused_not_a_traceback(job_with):
    path = job_with("{document} and a lone {")
    _refused(["plan", path], f"{path}:9: prompt.template: not a valid template", "write literal braces as {{")


def test_chat_template_conversion_is_refused_before_the_chat_template_runs(job_with):
    path = job_with("{system!s} {document}", prompt_extra="  chat_template: true\n")
    _refused(["validate", path], "prompt.template: field {system!s}", "conversions (!s)")


def test_unknown_field_is_refused_with_the_known_names(job_with):
    path = job_with("{system} {zzqqxx} {document}")
    out = _refused(["validate", path], "placeholder {zzqqxx} at character 10")
    assert "known names: {system}, {reference}, {document}, {id}, {category}" in out
    path = job_with("{system} {categroy} {document}")
    _refused(["validate", path], "did you mean {category}?")


def test_escaped_braces_stay_literal_and_validate(job_with):
    path = job_with('Return {{"a": 1}} for {system}: {document}}}')
    res = CliRunner().invoke(main, ["validate", path])
    assert res.exit_code == 0, res.output
    row = {"document": "the doc", "reference": "ref", "id": "1"}
    rendered = PromptRenderer(load_job(path).prompt).render(row)
    assert (rendered.head, rendered.document, rendered.tail) == ('Return {"a": 1} for You are helpful.: ',
                                                                 "the doc", "}")


@pytest.mark.parametrize("reduce, needle", [
    ("{summaries:>5}", "field {summaries:>5} at character 1: format specs"),
    ("{summaries} {region}", "field {region} at character 13: unknown name; this template takes {summaries}"),
    ("{{summaries}}", "must contain the {summaries} placeholder"),
])
def test_reduce_template_takes_only_summaries(job_with, reduce, needle):
    path = job_with("{system} {document}", prompt_extra=f'  reduce_template: "{reduce}"\n')
    with pytest.raises(JobError) as ei:
        load_job(path)
    assert f"{path}:10: prompt.reduce_template: {needle}" in str(ei.value)


def test_parse_positions_and_fill():
    t = parse_template("a{{b}}{x}c {y} {x}")
    assert t.fields == ["x", "y", "x"]
    assert [(f.raw, f.at) for _, f in t.pieces if f] == [("{x}", 7), ("{y}", 12), ("{x}", 16)]
    assert t.fill({"x": "{0}", "y": "{y}"}) == "a{b}{0}c {y} {0}"       # values are never formatted again
    with pytest.raises(TemplateError, match=r"field \{x!r:>3\} at character 3: conversions"):
        parse_template("ab{x!r:>3}")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="{}:!ab .x[]0", max_size=24))
def test_any_text_parses_or_is_refused_like_str_format(text):
    """Every text is a TemplateError or renders exactly as ``str.format_map`` would with plain names."""
    try:
        t = parse_template(text)
    except TemplateError:
        return
    if all(n.isidentifier() for n in t.fields):
        values = {n: f"<{n}>" for n in t.fields}
        assert t.fill(values) == text.format_map(values)


def test_renderer_uses_the_parsed_template():
    spec = PromptSpec(system="S", template="{system}|{document}|{document}")
    r = PromptRenderer(spec).render({"document": "D"})
    assert (r.head, r.document, r.tail) == ("S|", "D", "|D")
