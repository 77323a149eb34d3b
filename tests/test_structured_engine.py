"""Structured outputs through the whole engine (tiny random models, float32): whatever a random model prefers, every
output matches its schema, regex, choice list or grammar; greedy constrained tokens do not depend on speculation,
the prefix cache, the token budget, preemption, or on checking the unconstrained choice first; a length cut gives
finish_reason length; a grammar that fails finishes only its own request."""
import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputError, StructuredOutputsParams, check_structured
from engine.structured.state import RequestGrammar
from tests.model_utils import VOCAB, save_tiny, tiny_hf_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "gating": "always"}

# Rising difficulty: an enum, bounded integers, an array with maxItems, nested objects with optional fields,
# string patterns.
SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["spam", "ham", "unsure"]}}, "required": ["label"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 12},
                                      "ok": {"type": "boolean"}},
     "required": ["score", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3,
                                               "minItems": 1}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "who": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["name"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["who"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
                                      "items": {"type": "array", "maxItems": 2, "items": {
                                          "type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
                                          "required": ["n"], "additionalProperties": False}}},
     "required": ["code", "items"], "additionalProperties": False},
]
PROMPTS = ["The quick brown fox", "Summaries of support tickets", "numbers 12345 and code", "naïve café"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured-llama")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured-gemma3")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


@pytest.fixture(scope="module")
def llm(llama_dir):
    # NOTE: speculation off here (its gating depends on the batch); the tests that speculate say so.
    return LLM(llama_dir, dtype="float32", block_size=4, speculative_config=None)


def _params(max_tokens=96, **constraint):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)


def _sampled(seed, max_tokens=96, **constraint):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=40, seed=seed, structured_outputs=constraint)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "bounded-int", "array-maxitems", "nested-optional",
                                                 "pattern"])
def test_every_output_valid_for_its_schema(llm, schema):
    params = [_params(json=schema)] * len(PROMPTS) + [_sampled(s, json=schema) for s in range(8)]
    outs = llm.generate(PROMPTS + [PROMPTS[s % 4] for s in range(8)], params)
    for o in outs:
        assert o.finish_reason == "stop" and o.error is None, (o.text, o.finish_reason, o.error)
        assert o.token_ids[-1] in llm.eos_token_ids                  # EOS once the grammar accepts, and only then
        jsonschema.validate(json.loads(o.text), schema)
        assert ": " not in o.text and ", " not in o.text and "\n" not in o.text     # compact
    assert sum(o.metrics.num_forced_tokens for o in outs) > 0       # keys, braces: forced, not sampled
    assert all(o.metrics.num_masks_applied > 0 and o.metrics.mask_time_s > 0 for o in outs)


def test_regex_choice_and_lark_grammar(llm):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/ | NUM\nNUM: /[0-9]/'
    cases = [(dict(regex=r"[a-z]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
             (dict(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
             (dict(grammar=lark), lambda t: re.fullmatch(r"\((?:[a-z]{1,3}|[0-9])(?:,(?:[a-z]{1,3}|[0-9]))*\)", t))]
    for constraint, ok in cases:
        params = [_params(**constraint)] * 2 + [_sampled(s, **constraint) for s in range(6)]
        for o in llm.generate([PROMPTS[i % 4] for i in range(8)], params):
            assert o.finish_reason == "stop" and ok(o.text), (constraint, o.text, o.finish_reason)


def _greedy_tokens(path, schema, **kw):
    llm = LLM(path, dtype="float32", block_size=4, **kw)
    outs = llm.generate(PROMPTS * 2, _params(max_tokens=48, json=schema))
    return llm, outs


@pytest.mark.parametrize("setting", [
    dict(speculative_config=SPEC),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),                              # prompts and forced chunks cut by the budget
    dict(speculative_config=SPEC, max_num_batched_tokens=9),
    dict(num_gpu_blocks_override=24, max_num_seqs=8),            # preemption: the pool holds ~3 sequences
])
def test_greedy_constrained_tokens_identical(gemma_dir, setting):
    schema = SCHEMAS[3]
    _, ref = _greedy_tokens(gemma_dir, schema)
    llm, outs = _greedy_tokens(gemma_dir, schema, **setting)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    if "speculative_config" in setting:
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0       # drafts were proposed and verified
    if "num_gpu_blocks_override" in setting:
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def _both_ways(llm, prompts, params):
    first = llm.generate(prompts, params)
    llm.runner.check_first = False
    try:
        always = llm.generate(prompts, params)
    finally:
        llm.runner.check_first = True
    return first, always


def test_sampling_with_speculation_stays_valid(gemma_dir):
    llm = LLM(gemma_dir, dtype="float32", block_size=4, speculative_config=SPEC)
    schema = SCHEMAS[3]
    outs = llm.generate([PROMPTS[s % 4] for s in range(8)], [_sampled(s, json=schema) for s in range(8)])
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
        jsonschema.validate(json.loads(o.text), schema)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_seeded_constrained_sampling_does_not_depend_on_the_batch(llm):
    schema = SCHEMAS[3]
    alone = llm.generate(PROMPTS[:1], _sampled(7, json=schema))[0]
    mixed = llm.generate(PROMPTS, [_sampled(7, json=schema), _sampled(1, json=schema), _params(json=schema),
                                   SamplingParams(max_tokens=20, temperature=0.9)])
    assert mixed[0].token_ids == alone.token_ids


def test_check_first_gives_the_tokens_of_always_masking(llm):
    first, always = _both_ways(llm, PROMPTS, _params(json=SCHEMAS[4]))
    assert [o.token_ids for o in first] == [o.token_ids for o in always]
    # always: one mask per sampled token; check-first: one per rejected choice (a random model's are mostly).
    sampled = sum(len(o.token_ids) - o.metrics.num_forced_tokens for o in always)
    assert sum(o.metrics.num_masks_applied for o in always) == sampled
    assert sum(o.metrics.num_masks_applied for o in first) <= sampled
    # Where the model's own choice fits the grammar, check-first builds no mask at all.
    free = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0))[0].text
    first, always = _both_ways(llm, PROMPTS[:1], _params(choice=[free, "zzz"]))
    assert first[0].text == always[0].text == free and first[0].token_ids == always[0].token_ids
    assert first[0].metrics.num_masks_applied == 0 < always[0].metrics.num_masks_applied


def test_int8_head_check_first_and_always_mask_agree(gemma_dir, monkeypatch):
    """With an int8 LM head a rejected greedy row reads only its allowed tokens' rows (CausalLM.logits_at): the
    same tokens as masking the whole head's logits every step."""
    llm = LLM(gemma_dir, quantization="int8", block_size=4, speculative_config=None)
    calls = []
    at = type(llm.model).logits_at
    monkeypatch.setattr(type(llm.model), "logits_at", lambda self, h, ids: calls.append(len(ids)) or at(self, h, ids))
    params = [_params(json=s) for s in SCHEMAS[:3]] + [_params(regex=r"[a-z]{2,5}-[0-9]{3}")]
    first, always = _both_ways(llm, PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in always]
    assert calls and all(o.finish_reason == "stop" for o in first)
    monkeypatch.setattr(type(llm.model), "logits_at", lambda self, h, ids: None)      # the whole head's logits
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in first]


def test_a_rejected_argmax_leads_to_a_mask(llm):
    free = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0))[0]
    text = llm.tokenizer.decode(free.token_ids)
    pattern = "[0-9]{3}" if not text[:1].isdigit() else "[a-z]{3}"     # the argmax cannot start it
    out = llm.generate(PROMPTS[:1], _params(regex=pattern))[0]
    assert re.fullmatch(pattern, out.text) and out.token_ids[0] != free.token_ids[0]
    assert out.metrics.num_masks_applied >= 1


def test_without_the_check_outputs_break(llm, monkeypatch):
    """The injected fault: a check that accepts every token lets the model's own choice through."""
    monkeypatch.setattr(RequestGrammar, "allows", lambda self, token: True)
    outs = llm.generate(PROMPTS, _params(max_tokens=12, regex="[0-9]{3}"))
    assert not all(re.fullmatch("[0-9]{3}", o.text) for o in outs)


def test_truncated_json_finishes_with_length_and_the_batch_goes_on(llm):
    schema = SCHEMAS[3]
    outs = llm.generate(PROMPTS[:2], [_params(max_tokens=5, json=schema), _params(json=schema)])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(outs[0].text)
    assert outs[1].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[1].text), schema)


def test_output_complete_at_max_tokens_is_a_stop(llm):
    out = llm.generate(PROMPTS[:1], _params(max_tokens=1, choice=["x"]))[0]      # one token, then its EOS
    assert out.text == "x" and out.finish_reason == "stop" and len(out.token_ids) == 1


def test_unsupported_keyword_refused_naming_it(llm):
    bad = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(StructuredOutputError, match="uniqueItems") as e:
        check_structured(bad)
    assert e.value.keyword == "uniqueItems"
    with pytest.raises(StructuredOutputError, match="look-around"):
        check_structured(StructuredOutputsParams(regex="(?=a)b"))
    # In the engine: that request finishes with its error before any compute; the others run.
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=8, structured_outputs=bad), _params(choice=["x"])])
    assert outs[0].finish_reason == "error" and "uniqueItems" in outs[0].error and not outs[0].token_ids
    assert outs[1].finish_reason == "stop" and outs[1].text == "x"


def test_grammar_error_midway_fails_only_that_request(llm):
    llm.add_request("bad", PROMPTS[0], _params(json=SCHEMAS[1]))
    llm.add_request("good", PROMPTS[1], _params(json=SCHEMAS[1]))
    llm._requests["bad"].grammar.matcher.consume = lambda tokens: False     # the fault: a matcher that fails
    llm._requests["bad"].grammar.matcher.__class__ = type("Failing", (type(llm._requests["bad"].grammar.matcher),),
                                                          {"error": property(lambda self: "injected failure")})
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()[0]})
    assert outs["bad"].finish_reason == "error" and "injected failure" in outs["bad"].error
    assert outs["good"].finish_reason == "stop"
    jsonschema.validate(json.loads(outs["good"].text), SCHEMAS[1])


def test_forced_tokens_enter_as_one_chunk(llama_dir):
    llm = LLM(llama_dir, dtype="float32", block_size=4, speculative_config=None)
    steps = []
    out = llm.generate(PROMPTS[:1], _params(json=SCHEMAS[3]), on_step=steps.append)[0]
    forced = out.metrics.num_forced_tokens
    assert forced >= len('{"who":{"name":"')                          # the tiny tokenizer: about a byte a token
    # One step per sampled token (the first comes with the prompt), not one per forced token.
    assert len(steps) == len(out.token_ids) - forced
    assert any(s.num_prefill_tokens > 1 and s.num_decode_tokens == 0 for s in steps[1:])


def test_ids_the_tokenizer_lacks_are_never_allowed(llm):
    llm.add_request("r", PROMPTS[0], _params(json=SCHEMAS[0]))
    grammar = llm._requests["r"].grammar
    allowed = grammar.allowed()
    assert allowed.shape == (VOCAB,) and not allowed[len(llm.tokenizer):].any() and allowed.any()
    llm.abort_request("r")
    llm.step()
