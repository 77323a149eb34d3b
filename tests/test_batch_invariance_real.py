"""Batch invariance on the real default model (gemma-3-270m, the default format: int8 weights, float32 activations,
a bf16 KV cache) with short prompts: two needles (greedy, and seeded at temperature 0.8 / top_p 0.95) alone, then
among 16 others with a small token budget and speculation on: the same bits at every output position."""
import random

import pytest

import engine.kernels.library as library
from engine import LLM
from tests.invariance import GREEDY, assert_same_row, mixed_params, run, seeded

pytestmark = [pytest.mark.slow, pytest.mark.skipif(library.load() is None, reason="the C kernels")]

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "gating": "always"}


def _prompts(n, seed, shared):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rng.randrange(1000, 20000) for _ in range(rng.randrange(4, 24))]
        out.append([2] + shared + body + body[:5])
    return out


def test_default_model_needles_alone_equal_needles_in_a_batch(monkeypatch):
    shared = [random.Random(1).randrange(1000, 20000) for _ in range(20)]
    needles, crowd = _prompts(2, 2, shared), _prompts(16, 3, shared)
    params = [GREEDY, seeded(99)]
    llm = LLM("gemma-3-270m", speculative_config=None, kv_cache_memory=64 << 20)
    assert llm.config.quantization == "int8" or pytest.skip("not the int8 default on this CPU")
    ref = [run("", [n], [p], {}, monkeypatch, llm=llm)[1][0] for n, p in zip(needles, params)]
    _, found, _ = run("", needles, params, {}, monkeypatch, crowd, mixed_params(16, 4), seed=5, llm=llm)
    for i, (r, g) in enumerate(zip(ref, found)):
        assert_same_row(r, g, f"batch, needle {i}")
    other = LLM("gemma-3-270m", speculative_config=SPEC, max_num_batched_tokens=64, kv_cache_memory=64 << 20)
    _, found, _ = run("", needles, params, {}, monkeypatch, crowd, mixed_params(16, 6), seed=7, llm=other)
    for i, (r, g) in enumerate(zip(ref, found)):
        assert_same_row(r, g, f"token budget 64 + speculation, needle {i}")
