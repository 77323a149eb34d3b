"""Greedy tokens do not depend on how a prompt is chunked: token budgets, a prefix-cache hit that leaves one token,
speculation on or off. A prompt chunked at another place used to change a query's rounding three ways: the bf16
prefill kernel paired values from the chunk's first visible key (vdpbf16ps sums each pair before the running
total), a prompt's last token computed alone went through the decode kernel, and float32 chunks under 64 tokens
through torch tiles instead of the float32 kernel. On the real model 11 of 48 shared-prefix
sequences changed between token budgets 4096 and 2048, and 10 of 48 with speculation on; now none. The tiny
random model rarely turns such a difference into another token, so the last two tests compare the bits: the
logits through the attention backend, and the engine's hidden state behind each first token."""
import pytest
import torch

import engine.kernels.library as library
from bench.quality import sequence_logits
from engine import LLM, SamplingParams
from engine.kernels.qlinear import prompt_amx_ok
from engine.model_runner import ModelRunner
from engine.models.layers import CausalLM
from tests.model_utils import save_tiny, tiny_hf_model

pytestmark = pytest.mark.skipif(library.load() is None, reason="the C attention kernels do not build here")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "gating": "always"}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-chunks")        # sliding window 8: chunks start on both parities
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 200, (19,), generator=g).tolist()
    out = []
    for i, n in enumerate([37, 50, 23, 64, 9]):
        body = torch.randint(3, 200, (n,), generator=g).tolist()
        out.append(shared + body + body[:7] if i % 2 else body)      # repeats: n-gram drafts find matches
    return out


def _tokens(path, engine, **kw):
    llm = LLM(path, block_size=4, kv_cache_memory=8 << 20, **engine, **kw)
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.fixture
def first_hidden(monkeypatch):
    """{request id: the final hidden state its first token was chosen from}, recorded from every engine step."""
    seen, rows = {}, []
    greedy, execute = CausalLM.greedy_tokens, ModelRunner.execute

    def record_rows(model, hidden):
        rows.append(hidden.detach().clone())
        return greedy(model, hidden)

    def record_step(runner, out, requests):
        rows.clear()
        result = execute(runner, out, requests)
        if rows:                                 # a greedy step: its rows in the order of the result's requests
            for rid, h in zip(result, rows[0]):
                seen.setdefault(rid, h)
        return result
    monkeypatch.setattr(CausalLM, "greedy_tokens", record_rows)
    monkeypatch.setattr(ModelRunner, "execute", record_step)
    return seen


# int8 weights with float32 activations and a bf16 cache: the default's (the bf16 prefill kernel on AVX512-BF16,
# the float32 kernel over the converted cache on other builds). Our int8 matmul computes each row alone; float32
# and bf16 weights go through torch's matmul, whose rows can depend on how many there are (float32 did here on
# the tiny model: other bits for the same prompt chunked otherwise), so only int8 is held to the bit.
# int8 with its prompt rows on AMX-BF16 tiles (the int8_prompts family's "bf16"): a prompt position is always that
# path's, an output position the int8 dot products', however the steps are cut
AMX_PROMPTS = pytest.mark.skipif(not prompt_amx_ok(), reason="no AMX-BF16 tiles here for the int8 prompt rows")
ENGINES = [dict(quantization="int8", kv_cache_dtype="bfloat16"),
           dict(quantization="int8", kv_cache_dtype="int8"),        # the opt-in int8 cache: the same kernels' pairs
           pytest.param(dict(quantization="int8", kv_cache_dtype="bfloat16", kernels={"int8_prompts": "bf16"}),
                        marks=AMX_PROMPTS)]
IDS = ["int8", "int8-int8kv", "int8-amx-prompts"]


@pytest.mark.parametrize("engine", ENGINES, ids=IDS)
def test_token_budget_and_speculation_do_not_change_greedy_tokens(gemma_dir, engine):
    ref = _tokens(gemma_dir, engine, speculative_config=None)
    for kw in (dict(max_num_batched_tokens=7), dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=5),
               dict(speculative_config=SPEC), dict(speculative_config=SPEC, max_num_batched_tokens=11)):
        kw.setdefault("speculative_config", None)
        assert _tokens(gemma_dir, engine, **kw) == ref, kw


@pytest.mark.parametrize("engine", ENGINES, ids=IDS)
def test_prompt_cached_but_its_last_token(gemma_dir, engine):
    """The same prompts again: the prefix cache holds all but each one's last token, which is computed alone (a
    one-token prompt chunk, a prefill entry); the tokens equal the first run's and a cache-off run's."""
    llm = LLM(gemma_dir, block_size=4, kv_cache_memory=8 << 20, speculative_config=None, **engine)
    first = [o.token_ids for o in llm.generate(_prompts(), GREEDY)]
    again = llm.generate(_prompts(), GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == first
    assert _tokens(gemma_dir, engine, speculative_config=None, enable_prefix_caching=False) == first


@pytest.mark.parametrize("engine", ENGINES, ids=IDS)
def test_prefill_logits_bit_identical_however_chunked(gemma_dir, engine):
    """Through the attention backend: a 61-token prompt's logits, in one chunk or cut anywhere (chunks starting
    on odd and even positions past the window), are the same bits."""
    llm = LLM(gemma_dir, block_size=4, kv_cache_memory=8 << 20, speculative_config=None, **engine)
    seq = _prompts()[3][:61]
    kv = llm.runner.kv_caches[0][0].dtype
    ref = sequence_logits(llm.model, seq, [61], 4, dtype=kv)
    for chunks in ([20, 41], [21, 40], [9, 9, 43], [33, 27, 1], [60, 1]):
        got = sequence_logits(llm.model, seq, chunks, 4, dtype=kv)
        rows = 61 if chunks[-1] > 1 else 60              # the harness runs a last 1-token chunk as a decode step
        assert torch.equal(got[:rows], ref[:rows]), chunks


@pytest.mark.parametrize("engine", ENGINES, ids=IDS)
def test_last_prompt_token_alone_is_a_prefill(gemma_dir, engine, first_hidden):
    """The engine: a prompt cached but for its last token computes that token as a one-token prefill chunk, so the
    hidden state its first token comes from is the same bits as in a run that computed the whole prompt."""
    prompts = _prompts()
    llm = LLM(gemma_dir, block_size=4, kv_cache_memory=8 << 20, speculative_config=None, **engine)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    alone = [i for i, p in enumerate(prompts) if len(p) % 4 == 1]     # whole blocks cached: all but the last token
    assert alone and all(again[i].num_cached_tokens == len(prompts[i]) - 1 for i in alone)
    for a, b in zip(first, again):
        assert torch.equal(first_hidden[a.request_id], first_hidden[b.request_id]), a.request_id
