"""Penalties (vLLM's repetition_penalty / frequency_penalty / presence_penalty) with and without structured outputs
(issue 40 C): the logits arithmetic against a plain-Python reference, the job keys, and on a tiny model: every
constrained output still valid, the penalties change tokens, a row's tokens the same alone and batched, and
check-first the same as always masking."""
import json
import random

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import Sampler, SamplingMetadata
from pipeline.job.job_file import load_job
from tests.model_utils import save_tiny, tiny_hf_model
from tests.test_structured_pipeline import inline, write_job

SCHEMA = {"type": "object", "properties": {
    "who": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3}},
    "required": ["who", "tags"], "additionalProperties": False}
PROMPTS = ["The quick brown fox", "Summaries of support tickets", "numbers 12345 and code", "naive cafe"]
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)


def _reference(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
               pres: float) -> list[float]:
    """vLLM's semantics, one logit at a time: repetition over prompt + output (positive / rep, negative * rep),
    then frequency and presence over the output only."""
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        n = output.count(tok)
        out.append(x - freq * n - pres * (n > 0))
    return out


def test_penalties_match_the_reference_row_by_row():
    rng = random.Random(0)
    vocab = 12
    params, prompts, outputs = [], [], []
    for i in range(6):
        kw = dict(repetition_penalty=rng.choice([1.0, 0.8, 1.5]), frequency_penalty=rng.choice([0.0, 0.5, -0.25]),
                  presence_penalty=rng.choice([0.0, 0.7]))
        params.append(SamplingParams(temperature=0.0, **kw) if i else SamplingParams(temperature=0.0))
        prompts.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 5))])
        outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 7))])
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    md = SamplingMetadata.build(params, outputs, prompts, [None] * 6, "cpu")
    got = Sampler.processed_logits(logits, md)
    for i, p in enumerate(params):
        want = _reference(logits[i].tolist(), prompts[i], outputs[i], p.repetition_penalty, p.frequency_penalty,
                          p.presence_penalty)
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-6), (i, p)
    assert torch.equal(got[0], logits[0])                      # the row without penalties is untouched


def test_penalties_are_job_keys_beside_structured_outputs(tmp_path, make_docs_dataset):
    path = write_job(tmp_path, make_docs_dataset(n=3), inline(SCHEMA),
                     generation="max_tokens: 64\n  repetition_penalty: 1.3\n  frequency_penalty: 0.4\n"
                                "  presence_penalty: 0.3")
    p = load_job(path).sampling_params
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.3, 0.4, 0.3)
    assert p.structured_outputs.schema == SCHEMA


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("penalties-llama")
    save_tiny(tiny_hf_model("llama"), path)
    return LLM(str(path), dtype="float32", block_size=4, speculative_config=None)


def _params(seed=None, **kw):
    sampling = dict(temperature=1.0, top_k=40, seed=seed) if seed is not None else dict(temperature=0.0)
    return SamplingParams(max_tokens=64, structured_outputs={"json": SCHEMA}, **sampling, **kw)


def test_constrained_outputs_stay_valid_with_penalties(llm):
    params = [_params(**PENALTIES)] * 4 + [_params(s, **PENALTIES) for s in range(4)]
    outs = llm.generate(PROMPTS + PROMPTS, params)
    for o in outs:
        assert o.finish_reason == "stop" and o.error is None, (o.text, o.error)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    plain = llm.generate(PROMPTS, [_params()] * 4)
    assert [o.token_ids for o in outs[:4]] != [o.token_ids for o in plain]        # the penalties do apply


def test_penalised_constrained_tokens_do_not_depend_on_the_batch(llm):
    alone = [llm.generate([PROMPTS[i]], p)[0].token_ids for i, p in enumerate((_params(**PENALTIES),
                                                                                _params(7, **PENALTIES)))]
    mixed = llm.generate(PROMPTS, [_params(**PENALTIES), _params(7, **PENALTIES), _params(),
                                   SamplingParams(max_tokens=20, temperature=0.9, presence_penalty=1.0)])
    batched = llm.generate([PROMPTS[2], PROMPTS[0]], [_params(1), _params(**PENALTIES)])
    assert mixed[0].token_ids == alone[0] and mixed[1].token_ids == alone[1] and batched[1].token_ids == alone[0]


def test_check_first_gives_the_tokens_of_always_masking_with_penalties(llm):
    params = [_params(**PENALTIES)] * 4
    first = llm.generate(PROMPTS, params)
    llm.runner.check_first = False
    try:
        always = llm.generate(PROMPTS, params)
    finally:
        llm.runner.check_first = True
    assert [o.token_ids for o in first] == [o.token_ids for o in always]
