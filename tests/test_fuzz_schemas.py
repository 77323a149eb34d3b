"""Fuzz (issue 40): random JSON Schemas through the plan-time check (jsonschema + the grammar compiler,
llguidance) and the column typer. An invalid schema is a clean ``StructuredOutputError``; for one that passes,
random instances valid for it get no ``json_error`` and come back from their typed columns unchanged."""
import copy
import json
import string

import pyarrow as pa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import StructuredOutputError, StructuredOutputsParams, check_structured
from pipeline.job.structured_output import json_error, output_fields, typed_columns, typed_values

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=6)
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(string.ascii_letters, max_size=5),
                     st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: x + 0.5 if x.is_integer() else x))


# ---- schemas -------------------------------------------------------------------------------------------------
@st.composite
def _bounds(draw, lo_key: str, hi_key: str, lo: int, hi: int) -> dict:
    a, b = sorted(draw(st.tuples(st.integers(lo, hi), st.integers(lo, hi))))
    return {k: v for k, v in ((lo_key, a), (hi_key, b)) if draw(st.booleans())}


_LEAVES = st.one_of(
    st.builds(lambda b: {"type": "string", **b}, _bounds("minLength", "maxLength", 0, 6)),
    st.builds(lambda b: {"type": "integer", **b}, _bounds("minimum", "maximum", -50, 50)),
    st.builds(lambda b: {"type": "number", **b}, _bounds("minimum", "maximum", -50, 50)),
    st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({}),
    st.builds(lambda v: {"enum": v}, st.lists(_SCALARS, min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda v: {"const": v}, _SCALARS),
)


@st.composite
def _object(draw, children, typed: bool) -> dict:
    props = draw(st.dictionaries(_NAMES, children, min_size=1, max_size=4))
    required = [n for n in props if draw(st.booleans())]
    return {**({"type": "object"} if typed else {}), "properties": props,
            **({"required": required} if required else {})}


_ONE_TYPE = ("string", "integer", "number", "boolean", "array", "object")


def _extend(children):
    return st.one_of(
        st.builds(lambda i, b: {"type": "array", "items": i, **b}, children, _bounds("minItems", "maxItems", 0, 3)),
        _object(children, typed=True),
        _object(children, typed=False),                          # properties without type: any value
        st.builds(lambda cs: {"anyOf": cs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda c: {**c, "type": [c["type"], "null"]} if c.get("type") in _ONE_TYPE else c,
                  children),
    )


SCHEMAS = st.recursive(_LEAVES, _extend, max_leaves=8).map(
    lambda s: s if s.get("type") == "object" or "properties" in s else {"type": "object", "properties": {"v": s}})

_DAMAGE = st.sampled_from([("type", "strng"), ("type", ["string", "strng"]), ("minimum", "x"), ("required", "a"),
                           ("maxItems", -1), ("properties", [1]), ("items", 3), ("anyOf", []), ("enum", "a"),
                           ("minLength", 1.5)])


@st.composite
def damaged(draw) -> tuple[dict, str]:
    """A valid schema with one keyword of one of its subschemas made invalid; (schema, that keyword)."""
    schema = copy.deepcopy(draw(SCHEMAS))           # NOTE: st.just hands out one dict; never damage it
    nodes = []

    def walk(node):
        nodes.append(node)
        for sub in list(node.get("properties", {}).values()) + node.get("anyOf", []) + [node.get("items")]:
            if isinstance(sub, dict):
                walk(sub)
    walk(schema)
    key, value = draw(_DAMAGE)
    draw(st.sampled_from(nodes))[key] = value
    return schema, key


# ---- instances ----------------------------------------------------------------------------------------------
_ANY = st.recursive(_SCALARS, lambda c: st.one_of(st.lists(c, max_size=2),
                                                  st.dictionaries(_NAMES, c, max_size=2)), max_leaves=4)

_NOT_OBJECT = _ANY.filter(lambda v: not isinstance(v, dict))


def instance(draw, s: dict):
    """A value valid for ``s`` (the subset SCHEMAS writes)."""
    if "anyOf" in s:
        return instance(draw, draw(st.sampled_from(s["anyOf"])))
    if "enum" in s:
        return draw(st.sampled_from(s["enum"]))
    if "const" in s:
        return s["const"]
    t = s.get("type")
    if isinstance(t, list):
        t = draw(st.sampled_from(t))
    if t is None:
        if "properties" not in s:
            return draw(_ANY)
        return _object_instance(draw, s) if draw(st.booleans()) else draw(_NOT_OBJECT)
    if t == "string":
        return draw(st.text(min_size=s.get("minLength", 0), max_size=s.get("maxLength", 8)))
    if t == "integer":
        return draw(st.integers(s.get("minimum", -(1 << 63)), s.get("maximum", (1 << 63) - 1)))
    if t == "number":
        return draw(st.one_of(st.integers(s.get("minimum", -10**9), s.get("maximum", 10**9)),
                              st.floats(s.get("minimum"), s.get("maximum"), allow_nan=False, allow_infinity=False)))
    if t == "array":
        return [instance(draw, s["items"]) for _ in range(draw(st.integers(s.get("minItems", 0),
                                                                           s.get("maxItems", 3))))]
    if t == "object":
        return _object_instance(draw, s)
    return {"boolean": lambda: draw(st.booleans()), "null": lambda: None}[t]()


def _object_instance(draw, s: dict) -> dict:
    required = set(s.get("required", ()))
    return {n: instance(draw, sub) for n, sub in s["properties"].items() if n in required or draw(st.booleans())}


def _decoded(value, f: pa.Field):
    """A typed column's value back as the JSON value it was made from."""
    if value is None:
        return None
    if f.metadata and f.metadata.get(b"json") == b"true":
        return json.loads(value)
    if pa.types.is_list(f.type):
        return [_decoded(v, f.type.value_field) for v in value]
    if pa.types.is_struct(f.type):
        return {f.type.field(i).name: _decoded(value.get(f.type.field(i).name), f.type.field(i))
                for i in range(f.type.num_fields)}
    return value


def _expected(value, f: pa.Field):
    """The JSON value as its column holds it: absent properties of a struct are null."""
    if value is None or (f.metadata and f.metadata.get(b"json") == b"true"):
        return value
    if pa.types.is_list(f.type):
        return [_expected(v, f.type.value_field) for v in value]
    if pa.types.is_struct(f.type):
        return {f.type.field(i).name: _expected(value.get(f.type.field(i).name), f.type.field(i))
                for i in range(f.type.num_fields)}
    return value


# ---- the properties ----------------------------------------------------------------------------------------
@_SETTINGS
@given(SCHEMAS, st.data())
def test_valid_instances_get_no_json_error_and_round_trip(schema, data):
    params = StructuredOutputsParams(json=schema)
    try:
        check_structured(params)
    except StructuredOutputError:
        event("refused")
        return                          # a clean refusal (a construct the grammar compiler does not take)
    event("checked")
    fields = output_fields(schema)
    assert fields, schema
    values = [instance(data.draw, schema) for _ in range(3)]
    texts = [json.dumps(v) for v in values]
    errors = [json_error(t, "stop", params, fields) for t in texts]
    assert errors == [None] * len(texts), (schema, texts, errors)
    cols = typed_columns(texts, errors, fields)
    rows = pa.Table.from_arrays(cols, schema=pa.schema(fields)).to_pylist()
    for value, row in zip(values, rows):
        typed_values(value, fields)
        got = {f.name: _decoded(row[f.name], f) for f in fields}
        want = {f.name: _expected(value.get(f.name), f) if isinstance(value, dict) else None for f in fields}
        assert got == want, (schema, value)


@settings(max_examples=200, deadline=None)
@given(damaged())
def test_damaged_schemas_are_refused_naming_the_keyword(damage):
    schema, key = damage
    try:
        params = StructuredOutputsParams(json=schema)
        check_structured(params)
    except StructuredOutputError as e:
        assert "structured_outputs.json" in str(e)
        if "not a valid JSON Schema" in str(e):
            assert e.keyword == key and f"{key}:" in str(e), (schema, str(e))
    else:
        raise AssertionError(f"accepted a damaged schema: {schema}")
    output_fields(schema)                # the typer never fails on a damaged schema either
