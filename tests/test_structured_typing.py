"""Typed columns from what a JSON Schema admits (issue 40): a row valid for the schema never gets a json_error,
and nothing the model answers ends in a traceback."""
import json

import pyarrow as pa

from engine import StructuredOutputsParams
from pipeline.job.structured_output import JSON_TEXT, json_error, output_fields, typed_columns


def _rows(schema: dict, texts: list[str]) -> tuple[list, list[dict]]:
    """(json_error per text, the typed columns' rows as assembled)."""
    params, fields = StructuredOutputsParams(json=schema), output_fields(schema)
    errors = [json_error(t, "stop", params, fields) for t in texts]
    cols = typed_columns(texts, errors, fields)
    return errors, pa.Table.from_arrays(cols, schema=pa.schema(fields)).to_pylist()


def test_properties_without_type_is_any_value_as_json_text():
    """A sub-schema with ``properties`` but no ``type`` admits any value: its column is JSON text, not a struct
    (on main a number got 'does not fit a struct' and null columns)."""
    schema = {"type": "object", "properties": {"a": {"properties": {"x": {"type": "integer"}}}}, "required": ["a"]}
    (field,) = output_fields(schema)
    assert field.type == pa.string() and field.metadata[b"json"] == b"true"
    errors, rows = _rows(schema, ['{"a":1.5}', '{"a":{"x":3}}', '{"a":"hi"}', '{"a":null}'])
    assert errors == [None] * 4
    assert [r["a"] for r in rows] == ["1.5", '{"x":3}', '"hi"', None]


def test_top_level_without_type_admits_other_values_without_a_traceback():
    """On main: AttributeError ('float' object has no attribute 'get') from the whole submit."""
    schema = {"properties": {"a": {"type": "integer"}}}
    assert [(f.name, f.type) for f in output_fields(schema)] == [("a", pa.int64())]
    errors, rows = _rows(schema, ["1.5", "null", '"x"', "[1]", '{"a":2}'])
    assert errors == [None] * 5
    assert [r["a"] for r in rows] == [None, None, None, None, 2]
    nullable = {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}}
    assert _rows(nullable, ["null"]) == ([None], [{"a": None}])
    assert output_fields({"type": "array", "properties": {"a": {}}}) == []        # admits no object: no columns


def test_unions_are_json_text_unless_one_plain_type():
    schema = {"type": "object", "properties": {
        "mixed": {"type": ["string", "integer"]},
        "maybe": {"type": ["integer", "null"]},
        "num": {"type": ["integer", "number"]},
        "pick": {"enum": ["a", 1]},
        "tuple": {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
        "free": {},
    }}
    f = {x.name: x for x in output_fields(schema)}
    assert f["maybe"].type == pa.int64() and f["num"].type == pa.float64() and not f["maybe"].metadata.get(b"json")
    assert all(f[k].type == pa.string() and f[k].metadata[b"json"] == b"true"
               for k in ("mixed", "pick", "tuple", "free"))
    row = {"mixed": "1", "maybe": None, "num": 2, "pick": "a", "tuple": ["s", 1], "free": True}
    errors, rows = _rows(schema, [json.dumps(row), json.dumps({**row, "mixed": 1, "pick": 1})])
    assert errors == [None, None]
    assert rows[0] == {"mixed": '"1"', "maybe": None, "num": 2.0, "pick": '"a"', "tuple": '["s",1]', "free": "true"}
    assert rows[1]["mixed"] == "1" and rows[1]["pick"] == "1"          # a string and a number stay apart


def test_nested_json_text_fields_carry_metadata():
    schema = {"type": "object", "properties": {"s": {"type": "object", "properties": {"any": {}}},
                                               "l": {"type": "array", "items": {"anyOf": [{"type": "string"}]}}}}
    f = {x.name: x.type for x in output_fields(schema)}
    assert f["s"].field(0).metadata == {b"json": b"true"} and f["l"].value_field.metadata == {b"json": b"true"}
    assert JSON_TEXT == {"json": "true"}
    errors, rows = _rows(schema, ['{"s":{"any":[1,{}]},"l":["x"]}'])
    assert errors == [None] and rows == [{"s": {"any": "[1,{}]"}, "l": ['"x"']}]


def test_values_beyond_the_column_and_deep_nesting_are_clean_json_errors():
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "i": {"type": "integer"}}}
    params, fields = StructuredOutputsParams(json=schema), output_fields(schema)
    assert "does not fit a double column" in json_error('{"n":1%s}' % ("0" * 400), "stop", params, fields)
    assert "does not fit a 64-bit integer" in json_error('{"i":%d}' % (1 << 64), "stop", params, fields)
    assert json_error("[" * 100000 + "]" * 100000, "stop", params, fields) == "not valid JSON (nested too deeply)"


def test_damaged_schema_parts_do_not_break_typing():
    """``properties`` that is not a mapping, an unhashable ``type`` list, a ``required`` that is not a list."""
    for schema in ({"type": "object", "properties": {"a": {"type": "object", "properties": [1]}}},
                   {"type": "object", "properties": {"a": {"type": [{"x": 1}]}}},
                   {"type": "object", "properties": {"a": {"type": "integer"}}, "required": "a"}):
        fields = output_fields(schema)
        assert [f.name for f in fields] == ["a"]
        assert typed_columns(['{"a":1}'], [None], fields)[0].to_pylist() in (["1"], [1])
