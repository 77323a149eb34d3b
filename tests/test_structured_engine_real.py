"""Structured outputs on the real default model (gemma-3-270m, its 262k vocabulary), short prompts: every output
valid; greedy constrained tokens the same with speculation on and another token budget."""
import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Ticket: my parcel arrived broken, I want my money back.\nJSON:",
           "Ticket: how do I reset my password?\nJSON:",
           "Review: great screen, poor battery. 3 stars.\nJSON:"]
SCHEMAS = [
    {"type": "object", "properties": {"topic": {"enum": ["refund", "account", "review", "other"]},
                                      "urgent": {"type": "boolean"}},
     "required": ["topic", "urgent"], "additionalProperties": False},
    {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "pros": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 2},
                                      "summary": {"type": "string", "maxLength": 30}},
     "required": ["stars", "pros"], "additionalProperties": False},
]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "gating": "always"}


@pytest.fixture(scope="module")
def llm():
    return LLM("gemma-3-270m", speculative_config=None)


def _params(schema, **kw):
    return SamplingParams(max_tokens=48, temperature=0.0, structured_outputs={"json": schema}, **kw)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum-bool", "int-array-string"])
def test_real_model_outputs_valid(llm, schema):
    params = [_params(schema)] * 3 + [SamplingParams(max_tokens=48, temperature=0.8, seed=s,
                                                     structured_outputs={"json": schema}) for s in range(3)]
    outs = llm.generate(PROMPTS * 2, params)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
        jsonschema.validate(json.loads(o.text), schema)
    assert all(o.metrics.num_forced_tokens > 0 for o in outs)


def test_real_model_regex_and_choice(llm):
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=8, temperature=0.0,
                                                 structured_outputs={"regex": r"[1-5] stars?"}),
                                  SamplingParams(max_tokens=8, temperature=0.0,
                                                 structured_outputs={"choice": ["refund", "account", "other"]}),
                                  SamplingParams(max_tokens=8, temperature=0.0,
                                                 structured_outputs={"choice": ["yes", "no"]})])
    assert re.fullmatch(r"[1-5] stars?", outs[0].text)
    assert outs[1].text in ("refund", "account", "other") and outs[2].text in ("yes", "no")


def test_real_model_greedy_identical_with_speculation_and_budget(llm):
    ref = [o.token_ids for o in llm.generate(PROMPTS, _params(SCHEMAS[1]))]
    other = LLM("gemma-3-270m", speculative_config=SPEC, max_num_batched_tokens=19)
    outs = other.generate(PROMPTS, _params(SCHEMAS[1]))
    assert [o.token_ids for o in outs] == ref


def test_real_model_check_first_same_tokens_as_masking_every_step(llm):
    first = [o.token_ids for o in llm.generate(PROMPTS, _params(SCHEMAS[1]))]
    llm.runner.check_first = False
    try:
        always = llm.generate(PROMPTS, _params(SCHEMAS[1]))
    finally:
        llm.runner.check_first = True
    assert [o.token_ids for o in always] == first
