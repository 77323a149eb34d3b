"""OpenAI Batch ``body.response_format`` (json_schema, json_object, text) as per-request structured outputs, on the
fake engine: a bad schema is its line's error while the other lines go on; the JSON comes back as
``message.content``; a length cut is a response with ``finish_reason: length``; every line validates with the
``openai`` package's types. Plus the row check and the column types (pipeline/job/structured_output.py) as units."""
from __future__ import annotations

import copy
import json

import pyarrow as pa
import pytest

from engine import SamplingParams, StructuredOutputsParams
from pipeline.io.openai_batch import read_output
from pipeline.job.job_file import load_job
from pipeline.job.structured_output import json_error, output_fields, typed_columns
from pipeline.run.runner import RunOptions, run_jobs
from tests.conftest import FakeLLM, changed_options, example_output

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"product": {"type": "string"}, "refund": {"type": "boolean"}},
          "required": ["product", "refund"], "additionalProperties": False}


def req(cid, text, **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "system", "content": "Extract."},
                                                           {"role": "user", "content": text}], **body}})


def schema_format(schema=SCHEMA, name="ticket"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


LINES = [
    req("s1", "My charger broke, refund please.", response_format=schema_format()),
    req("s2", "Screen cracked.", response_format=schema_format()),
    req("o1", "Anything as JSON.", response_format={"type": "json_object"}),
    req("t1", "Plain text.", response_format={"type": "text"}),
    req("bad", "Broken schema.", response_format=schema_format({"type": "object", "required": "product"})),
    req("kind", "Unknown type.", response_format={"type": "xml"}),
    req("cut", "Cut me off.", response_format=schema_format(), max_tokens=3),
]


@pytest.fixture
def chat_factory(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATE
    made = []

    def reply(params, ids):
        factory.seen.append(params)
        if params.max_tokens == 3:
            return '{"product":"scr', "length"
        return example_output(params)

    def factory(config):
        llm = FakeLLM(tok, structured=reply, **changed_options(config))
        made.append(llm)
        return llm
    factory.made, factory.seen = made, []
    return factory


def test_response_format_round_trip_with_openai_types(tmp_path, chat_factory):
    from openai.types.batch_error import BatchError
    from openai.types.chat import ChatCompletion
    from openai.types.shared_params import ResponseFormatJSONObject, ResponseFormatJSONSchema, ResponseFormatText
    from pydantic import TypeAdapter

    # what the lines send is OpenAI's own request shape
    TypeAdapter(ResponseFormatJSONSchema).validate_python(schema_format())
    TypeAdapter(ResponseFormatJSONObject).validate_python({"type": "json_object"})
    TypeAdapter(ResponseFormatText).validate_python({"type": "text"})

    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "out/results.jsonl"
    job = tmp_path / "ob.yaml"
    job.write_text(f"name: ob\ninput: {{path: {data}, format: openai_batch}}\n"
                   f"generation: {{max_tokens: 32, temperature: 0.0}}\n"
                   f"output: {{path: {out}, format: openai_batch}}\n")
    [report] = run_jobs([load_job(job)], llm_factory=chat_factory,
                        options=RunOptions(quiet=True, record_history=False))
    lines = {ln["custom_id"]: ln for ln in read_output(out)}
    assert list(lines) == ["s1", "s2", "o1", "t1", "bad", "kind", "cut"]
    for ln in lines.values():
        assert set(ln) == {"id", "custom_id", "response", "error"}
        if ln["response"]:
            ChatCompletion.model_validate(ln["response"]["body"])
        else:
            BatchError.model_validate(ln["error"])
    content = {k: v["response"]["body"]["choices"][0]["message"]["content"] for k, v in lines.items()
               if v["response"]}
    assert json.loads(content["s1"]) == {"product": "x", "refund": True}
    assert json.loads(content["o1"]) == {"answer": "yes"} and content["t1"].startswith("summary-")
    errors = {k: v["error"]["message"] for k, v in lines.items() if v["error"]}
    assert set(errors) == {"bad", "kind"}
    assert "body.response_format.json_schema.schema" in errors["bad"]
    assert "required: 'product' is not of type 'array' (keyword 'required')" in errors["bad"]   # the schema's path
    assert "body.response_format.type must be" in errors["kind"]
    cut = lines["cut"]["response"]["body"]["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '{"product":"scr'
    # the engine saw each line's own constraint (the text line none)
    assert sorted(p.structured_outputs.kind for p in chat_factory.seen) == ["json", "json", "json", "json_object"]
    m = json.loads((tmp_path / "out/results.jsonl.manifest.json").read_text())
    assert m["structured"]["kind"] == "per request" and m["structured"]["this_run"]["rows_checked"] == 4
    assert m["structured"]["this_run"]["valid_rows"] == 3


# ---- units ---------------------------------------------------------------------------------------------------
def _params(schema):
    return StructuredOutputsParams(json=schema)


def test_json_error_says_why():
    p = _params(SCHEMA)
    assert json_error('{"product":"a","refund":false}', "stop", p) is None
    assert "not valid JSON" in json_error('{"product":', "stop", p)
    assert "cut off at max_tokens (7)" in json_error('{"product":', "length", p, max_tokens=7)
    msg = json_error('{"product":"a"}', "stop", p)
    assert "'refund' is a required property" in msg and "keyword 'required'" in msg
    assert "at refund" in json_error('{"product":"a","refund":"no"}', "stop", p)
    big = _params({"type": "object", "properties": {"n": {"type": "integer"}}})
    fields = output_fields({"type": "object", "properties": {"n": {"type": "integer"}}})
    assert "does not fit a 64-bit integer" in json_error('{"n":%d}' % (1 << 70), "stop", big, fields)
    obj = StructuredOutputsParams(json_object=True)
    assert json_error("[1]", "stop", obj).startswith("not a JSON object") and json_error("{}", "stop", obj) is None
    assert json_error("anything", "stop", StructuredOutputsParams(regex="a+")) is None      # regex stays text
    assert json_error("anything", "stop", None) is None


def test_column_types_of_harder_schemas():
    schema = {
        "type": "object",
        "$defs": {"addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "properties": {
            "home": {"$ref": "#/$defs/addr"},
            "mixed": {"anyOf": [{"type": "string"}, {"type": "integer"}]},     # no one type: its JSON text
            "amount": {"type": ["number", "null"]},
            "count": {"type": "integer", "minimum": 0},
            "ratio": {"type": ["integer", "number"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "free": {"type": "object"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
    }
    f = {x.name: x.type for x in output_fields(schema)}
    assert f["home"] == pa.struct([pa.field("city", pa.string(), nullable=False)])
    assert f["mixed"] == pa.string() and f["amount"] == pa.float64() and f["count"] == pa.int64()
    assert f["ratio"] == pa.float64() and f["free"] == pa.string() and f["code"] == pa.string()
    assert f["tags"] == pa.list_(pa.field("item", pa.string(), nullable=False))
    assert f["matrix"] == pa.list_(pa.field("item", pa.list_(pa.field("item", pa.int64(), nullable=False)),
                                            nullable=False))
    fields = output_fields(schema)
    row = {"home": {"city": "Oslo"}, "mixed": 3, "amount": None, "count": 2.0, "ratio": 1, "tags": ["a"],
           "matrix": [[1, 2]], "free": {"k": [1]}, "code": "ABC"}
    cols = typed_columns([json.dumps(row), json.dumps(row), None], [None, "bad", None], fields)
    got = pa.Table.from_arrays(cols, schema=pa.schema(fields)).to_pylist()
    assert got[0] == {**row, "mixed": "3", "count": 2, "ratio": 1.0, "free": '{"k":[1]}'}
    assert all(v is None for v in got[1].values()) and all(v is None for v in got[2].values())
    assert output_fields({"type": "array", "items": {"type": "string"}}) == []          # not an object: text
    assert output_fields(None) == []


def test_sampling_params_accept_a_response_format_schema():
    p = SamplingParams(structured_outputs=_params(SCHEMA))
    assert json.loads(example_output(p)) == {"product": "x", "refund": True}
