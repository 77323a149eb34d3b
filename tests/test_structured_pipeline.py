"""Structured outputs through the pipeline (pipeline/job/structured_output.py) on the fake engine: the job syntax and
its refusals before compute, typed Parquet columns of an object schema beside the raw JSON and ``json_error``,
invalid and cut-off rows as row errors while the batch goes on, resume, map_reduce (the schema on the final reduce
only), regex / choice staying text, and the manifest's counts."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from engine import SamplingParams
from pipeline.job.job_file import load_job
from pipeline.problems import JobError
from pipeline.run.runner import Interrupted, RunOptions, run_jobs
from tests.conftest import example_output

SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "returns", "devices"]},
        "title": {"type": "string", "maxLength": 40},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number"},
        "urgent": {"type": "boolean"},
        "points": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["category", "title", "score", "urgent", "points"],
}


def write_job(tmp_path, data, structured: str, name="ex", extra="", generation="max_tokens: 64", include="[id]"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""name: {name}
input: {{path: {data}, id_column: id}}
prompt:
  system: "Extract the fields."
  reference_column: reference
  document_column: document
generation:
  {generation}
  temperature: 0.0
  structured_outputs:
{structured}
output:
  path: {tmp_path}/out/{name}.parquet
  include_columns: {include}
{extra}""")
    return path


def inline(schema=SCHEMA) -> str:
    return f"    json: {json.dumps(schema)}"


def run(paths, factory, **opts):
    return run_jobs([load_job(p) for p in paths], llm_factory=factory,
                    options=RunOptions(quiet=True, record_history=False, **opts))


# ---- job syntax --------------------------------------------------------------------------------------------
def test_job_syntax_inline_file_regex_choice_grammar(tmp_path, make_docs_dataset):
    data = make_docs_dataset(n=3)
    job = load_job(write_job(tmp_path, data, inline()))
    assert job.sampling_params.structured_outputs.schema == SCHEMA
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas/ticket.json").write_text(json.dumps(SCHEMA))
    job = load_job(write_job(tmp_path, data, "    json: schemas/ticket.json", name="f"))   # relative to the job
    assert job.sampling_params.structured_outputs.schema == SCHEMA
    assert load_job(write_job(tmp_path, data, "    regex: '[0-9]{3}'", name="r")).sampling_params \
        .structured_outputs.regex == "[0-9]{3}"
    assert load_job(write_job(tmp_path, data, "    choice: ['yes', 'no']", name="c")).sampling_params \
        .structured_outputs.choice == ("yes", "no")
    with pytest.raises(JobError, match="quote them"):          # YAML 1.1 reads a bare yes / no as booleans
        load_job(write_job(tmp_path, data, "    choice: [yes, no]", name="c"))
    (tmp_path / "answer.lark").write_text('start: "yes" | "no"\n')
    so = load_job(write_job(tmp_path, data, "    grammar: answer.lark", name="g")).sampling_params.structured_outputs
    assert so.grammar == 'start: "yes" | "no"\n'


@pytest.mark.parametrize("structured, key, words", [
    ("    json: {type: objekt}", "generation.structured_outputs.json", ["not a valid JSON Schema", "type: 'objekt'"]),
    ("    json: missing.json", "generation.structured_outputs.json", ["cannot read the schema file"]),
    ("    regex: '[0-9'", "generation.structured_outputs.regex", ["does not compile"]),
    ("    choice: []", "generation.structured_outputs.choice", ["at least one"]),
    ("    regex: 'a'\n    choice: [a]", "generation.structured_outputs", ["exactly one of", "regex, choice"]),
    ("    json: 3", "generation.structured_outputs.json", ["a JSON Schema mapping or the path"]),
    ("    jsn: {}", "generation.structured_outputs.jsn", ["unknown key", "did you mean 'json'"]),
    (inline({"type": "object", "properties": {"summary": {"type": "string"}}}),
     "generation.structured_outputs.json", ["property 'summary'", "output column"]),
    (inline({"type": "object", "properties": {"finish_reason": {"type": "string"}}}),
     "generation.structured_outputs.json", ["property 'finish_reason'"]),
    (inline({"type": "object", "properties": {"category": {"type": "string"}}}),   # a passthrough column
     "generation.structured_outputs.json", ["property 'category'"]),
])
def test_bad_structured_outputs_refused_before_compute(tmp_path, make_docs_dataset, structured, key, words):
    path = write_job(tmp_path, make_docs_dataset(n=3), structured, include="[id, category]")
    with pytest.raises(JobError) as e:
        load_job(path)
    text = str(e.value)
    assert str(path) in text and key in text and all(w in text for w in words), text
    for cmd in ("validate", "plan", "submit"):       # the CLI says it too, before any model is loaded
        res = CliRunner().invoke(main, [cmd, str(path)])
        assert res.exit_code == 2 and key in res.output and words[0] in res.output, res.output


def test_collision_check_can_fail(tmp_path, make_docs_dataset):
    """The same schema with a free name passes (the refusal above is about the name)."""
    path = write_job(tmp_path, make_docs_dataset(n=3),
                     inline({"type": "object", "properties": {"summary_text": {"type": "string"}}}))
    assert load_job(path).sampling_params.structured_outputs is not None


# ---- typed output --------------------------------------------------------------------------------------------
def test_typed_columns_next_to_raw_json_and_json_error(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=12)
    [report] = run([write_job(tmp_path, data, inline())], fake_llm_factory)
    t = pq.read_table(tmp_path / "out/ex.parquet")
    s = t.schema
    assert t.column_names[:11] == ["id", "category", "title", "score", "confidence", "urgent", "points", "customer",
                                   "note", "summary", "json_error"]
    assert s.field("score").type == pa.int64() and s.field("confidence").type == pa.float64()
    assert s.field("urgent").type == pa.bool_() and s.field("title").type == pa.string()
    assert s.field("points").type == pa.list_(pa.field("item", pa.string(), nullable=False))
    cust = s.field("customer").type
    assert pa.types.is_struct(cust) and not cust.field("name").nullable and cust.field("age").nullable
    assert s.field("note").type == pa.string() and s.field("score").metadata[b"required"] == b"true"
    assert s.field("confidence").metadata[b"required"] == b"false"
    rows = t.to_pylist()
    assert all(r["json_error"] is None and r["error"] is None for r in rows)
    first = rows[0]
    assert json.loads(first["summary"])["score"] == first["score"] == 1
    assert first["points"] == ["x"] and first["customer"] == {"name": "x", "age": 1} and first["urgent"] is True
    m = json.loads((tmp_path / "out/ex.parquet.manifest.json").read_text())
    st = m["structured"]
    assert st["kind"] == "json" and st["valid_rows"] == 12 and st["invalid_rows"] == 0
    assert st["this_run"]["forced_tokens"] == 24 and st["this_run"]["masks_applied"] == 12
    assert st["this_run"]["mask_time_s"] == pytest.approx(0.012)


def test_invalid_and_cut_off_rows_get_json_error_and_the_batch_goes_on(tmp_path, make_docs_dataset,
                                                                      fake_llm_factory):
    data = make_docs_dataset(n=9)
    path = write_job(tmp_path, data, inline())
    calls = []

    def reply(params, ids):
        calls.append(params)
        n = len(calls) % 3
        if n == 1:
            return '{"category":"billing","title":"Late refund","score":9,"urgent":false,"points":[]}'   # score > 5
        if n == 2:
            return '{"category":"billing","title":"Late re', "length"                    # max_tokens cut it off
        return example_output(params)
    fake_llm_factory.structured = reply
    [report] = run([path], fake_llm_factory)
    rows = pq.read_table(tmp_path / "out/ex.parquet").to_pylist()
    assert len(rows) == 9 and all(r["error"] is None for r in rows)
    bad = [r for r in rows if r["json_error"]]
    assert len(bad) == 6 and all(r["score"] is None and r["title"] is None and r["category"] is None for r in bad)
    cut = [r for r in bad if r["finish_reason"] == "length"]
    assert len(cut) == 3 and all("cut off at max_tokens (64)" in r["json_error"] for r in cut)
    out_of_range = [r for r in bad if r["finish_reason"] == "stop"]
    assert all("9 is greater than the maximum of 5" in r["json_error"] and "score" in r["json_error"]
               for r in out_of_range)
    good = [r for r in rows if not r["json_error"]]
    assert len(good) == 3 and all(r["score"] == 1 for r in good)
    m = json.loads((tmp_path / "out/ex.parquet.manifest.json").read_text())
    assert m["structured"]["valid_rows"] == 3 and m["structured"]["invalid_rows"] == 6
    assert m["rows_with_error"] == 0 and report.jobs[0].row_errors == 0
    assert "3 valid JSON, 6 not (json_error says why)" in report.summary


def test_resume_keeps_the_typed_schema(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=20)
    path = write_job(tmp_path, data, inline(), extra="engine: {max_num_seqs: 2}\n")
    with pytest.raises(Interrupted):
        run([path], fake_llm_factory, stop_after_rows=6, commit_interval_s=0.0)
    run([path], fake_llm_factory)
    t = pq.read_table(tmp_path / "out/ex.parquet")
    assert t.num_rows == 20 and t.column("score").type == pa.int64() and t.column("score").null_count == 0
    # an incremental run (more input rows) reuses the committed ones and gives the same schema
    more = make_docs_dataset(n=24)
    assert more == data
    [again] = run([path], fake_llm_factory)
    t2 = pq.read_table(tmp_path / "out/ex.parquet")
    assert [(f.name, f.type, f.metadata) for f in t2.schema] == [(f.name, f.type, f.metadata) for f in t.schema]
    assert t2.num_rows == 24 and again.jobs[0].reused == 20 and t2.column("score").null_count == 0


def test_regex_and_choice_stay_text(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=4)
    run([write_job(tmp_path, data, "    choice: [refund, replacement, other]", name="c")], fake_llm_factory)
    t = pq.read_table(tmp_path / "out/c.parquet")
    assert t.column("summary").to_pylist() == ["refund"] * 4 and t.column("json_error").null_count == 4
    assert "refund" not in t.column_names
    m = json.loads((tmp_path / "out/c.parquet.manifest.json").read_text())
    assert m["structured"]["kind"] == "choice" and "valid_rows" not in m["structured"]


def test_map_reduce_applies_the_schema_to_the_final_reduce_only(tmp_path, fake_llm_factory):
    long = "\n\n".join(" ".join(f"Sentence {p}.{i} says the customer asked about a refund for an order."
                                for i in range(6)) for p in range(10))
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "reference": ["Policy."] * 2, "document": ["short one", long]}), data)
    schema = {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}
    path = write_job(tmp_path, data, inline(schema), generation="max_tokens: 8",
                     extra="engine: {max_model_len: 192, max_num_seqs: 4}\n")
    path.write_text(path.read_text().replace("  document_column: document\n",
                                             "  document_column: document\n  on_too_long: map_reduce\n"))
    [report] = run([path], fake_llm_factory)
    rows = pq.read_table(tmp_path / "out/ex.parquet").to_pylist()
    assert rows[1]["num_chunks"] > 1 and rows[1]["topic"] == "x" and rows[1]["json_error"] is None
    assert rows[0]["topic"] == "x"
    llm = fake_llm_factory.made[0]
    # the fake's finished requests: one per chunk without a schema, then the constrained final reduce
    m = json.loads((tmp_path / "out/ex.parquet.manifest.json").read_text())
    assert m["structured"]["this_run"]["rows_checked"] == 2
    assert m["structured"]["this_run"]["forced_tokens"] == 4         # 2 per constrained request: 2 requests
    assert llm.steps > 0


def test_sampling_params_carry_the_schema_to_the_engine(tmp_path, make_docs_dataset, fake_llm_factory):
    data = make_docs_dataset(n=3)
    seen = []
    fake_llm_factory.structured = lambda params, ids: (seen.append(params), example_output(params))[1]
    run([write_job(tmp_path, data, inline())], fake_llm_factory)
    assert len(seen) == 3 and all(isinstance(p, SamplingParams) and p.structured_outputs.schema == SCHEMA
                                  for p in seen)


def test_sample_extraction_job_validates(monkeypatch):
    """jobs/extract-fields.yaml: its schema file is read relative to the job file; `batchgen validate` passes."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    job = load_job("jobs/extract-fields.yaml")
    assert [f for f in job.sampling_params.structured_outputs.schema["required"]] == \
        ["category", "title", "key_points", "urgent", "severity"]
    res = CliRunner().invoke(main, ["validate", "jobs/extract-fields.yaml"])
    assert res.exit_code == 0, res.output


def test_trace_and_report_count_forced_tokens_and_masks(tmp_path, make_docs_dataset, fake_llm_factory):
    from pipeline.report import render_report
    from pipeline.run.trace import read_run

    [report] = run([write_job(tmp_path, make_docs_dataset(n=5), inline())], fake_llm_factory)
    r = read_run(report.trace_dir).requests
    assert r["forced_tokens"] == [2] * 5 and r["masks_applied"] == [1] * 5 and sum(r["mask_s"]) == pytest.approx(0.005)
    doc = render_report([report.trace_dir]).read_text()
    assert "structured outputs: 10 forced tokens" in doc and "5 full masks applied" in doc
