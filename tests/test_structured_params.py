"""StructuredOutputsParams: exactly one constraint, stored hashable, checked before compute."""
import pytest

from engine import SamplingParams, StructuredOutputError, StructuredOutputsParams, check_structured


def test_exactly_one_kind():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputError, match="json, regex"):
        StructuredOutputsParams(regex="a+", choice=["x"])
    assert StructuredOutputsParams(choice=["yes", "no"]).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_json_stored_canonical_and_hashable():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = StructuredOutputsParams(json='{"properties": {"b": {"type": "integer"}, "a": {}}, "type": "object"}')
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert a.schema["properties"]["b"] == {"type": "integer"}
    assert hash(SamplingParams(structured_outputs=a)) == hash(SamplingParams(structured_outputs=b))


def test_property_order_is_kept():
    """JSON is generated in the schema's property order, so two orders are two constraints."""
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "integer", "minimum": 0},
                                                                       "a": {}}})
    b = StructuredOutputsParams(json={"type": "object", "properties": {"a": {},
                                                                       "b": {"minimum": 0, "type": "integer"}}})
    assert list(a.schema["properties"]) == ["b", "a"] and list(b.schema["properties"]) == ["a", "b"]
    assert a != b and a.key != b.key
    assert a.schema["properties"]["b"] == b.schema["properties"]["b"]
    # A property named "properties" is a property like any other: its schema's keys are sorted.
    c = StructuredOutputsParams(json={"properties": {"properties": {"type": "string", "maxLength": 3}}})
    assert list(c.schema["properties"]["properties"]) == ["maxLength", "type"]


def test_sampling_params_accepts_a_mapping():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("a", "b"))


@pytest.mark.parametrize("kwargs, match, keyword", [
    # issue 40: the schema path and keyword at fault, not the meta-schema's anyOf
    ({"json": {"type": "object", "properties": {"n": {"type": "integr"}}}},
     "properties.n.type: 'integr' is not valid under any", "type"),
    ({"json": {"properties": {"a": {"anyOf": [{"type": "string"}, {"type": 7}]}}}},
     r"properties.a.anyOf\[1\].type: 7 is not valid", "type"),
    ({"json": {"properties": {"type": {"minimum": "x"}}}}, "properties.type.minimum: 'x' is not of type", "minimum"),
    ({"json": {"type": "object", "maxProperties": -1}}, "maxProperties: -1 is less", "maxProperties"),
    ({"regex": "a(b"}, "does not compile", None),
    ({"choice": []}, "at least one", None),
    ({"grammar": "  "}, "empty", None),
])
def test_check_refuses(kwargs, match, keyword):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(StructuredOutputError, match=match) as e:
        check_structured(params)
    assert e.value.keyword == keyword


def test_check_accepts_valid():
    for p in (StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}}),
              StructuredOutputsParams(regex=r"\d{3}"), StructuredOutputsParams(choice=["a"]),
              StructuredOutputsParams(grammar='start: "a"')):
        check_structured(p)
