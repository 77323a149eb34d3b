"""The engine core end to end on tiny random models: batching, chunked prefill, prefix caching and
preemption never change greedy tokens; cached prefixes are really skipped; seeded sampling is stable."""
import pytest
import torch

from engine import LLM, SamplingParams
from tests.model_utils import VOCAB, save_tiny, tiny_hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    out = []
    for i, n in enumerate([5, 17, 64, 1, 33, 120, 9, 48]):
        tail = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


def _llm(path, **kw):
    return LLM(path, dtype="float32", block_size=4, **kw)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = _llm(llama_dir, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in _prompts()]


@pytest.mark.parametrize("budget", [7, 32, 4096])
@pytest.mark.parametrize("caching", [True, False])
def test_batched_greedy_equals_single(llama_dir, reference, budget, caching):
    llm = _llm(llama_dir, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    steps = []
    outs = llm.generate(_prompts(), GREEDY, on_step=steps.append)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert [s.step for s in steps] == list(range(len(steps)))
    if budget == 7:  # prompts longer than the budget were split across steps
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)


def test_engine_without_the_c_kernels_gives_the_same_tokens(llama_dir, reference, monkeypatch):
    """No C compiler (or BATCHGEN_CPU_KERNELS=0): the engine runs on the torch path, same greedy tokens."""
    import engine.kernels.attention as kernel_attention
    import engine.kernels.library as library
    monkeypatch.setattr(library, "_lib", None)
    monkeypatch.setattr(library, "_tried", True)
    monkeypatch.setattr(library, "_error", "disabled for this test")
    llm = _llm(llama_dir, max_num_batched_tokens=32)
    assert not kernel_attention.supports(torch.zeros(1, 4, 16), torch.zeros(1, 4, 2, 16))
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == reference


def test_preemption_keeps_results(llama_dir, reference):
    # 14 blocks of 4 tokens: far too few for 8 sequences of up to 172 tokens at once.
    llm = _llm(llama_dir, num_gpu_blocks_override=48, max_num_batched_tokens=64)
    steps = []
    outs = llm.generate(_prompts(), GREEDY, on_step=steps.append)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(s.num_preemptions for s in steps) > 0
    assert [o.token_ids for o in outs] == reference


def test_prompt_that_can_never_fit_is_an_error_not_a_hang(llama_dir):
    llm = _llm(llama_dir, num_gpu_blocks_override=8)
    outs = llm.generate([list(range(3, 100)), [5, 6, 7]], GREEDY)
    assert outs[0].finish_reason == "error" and outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 12


def test_shared_prefix_is_computed_once(llama_dir):
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, VOCAB, (1000,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (50,), generator=g).tolist() for _ in range(5)]
    llm = LLM(llama_dir, dtype="float32", block_size=16, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    steps = []
    first = llm.generate(prompts[:1], params, on_step=steps.append)[0]
    assert first.finish_reason == "length"
    rest = llm.generate(prompts[1:], params, on_step=steps.append)
    full_blocks = 1000 // 16 * 16
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [full_blocks] * 4
    computed = sum(s.num_prefill_tokens for s in steps)
    assert computed == 5 * 1050 - 4 * full_blocks
    # and the cache changes nothing
    cold = LLM(llama_dir, dtype="float32", block_size=16, enable_prefix_caching=False)
    assert [o.token_ids for o in cold.generate(prompts[1:], params)] == [o.token_ids for o in rest]


def test_seeded_sampling_is_independent_of_batch(llama_dir):
    prompts = _prompts(3)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    llm = _llm(llama_dir)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    mixed = llm.generate(prompts[3:6] + [prompts[0]], [other, other, other, seeded])[-1].token_ids
    assert alone == mixed
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=99,
                                                     ignore_eos=True))[0].token_ids != alone


def _hf_greedy(hf, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_gemma3_sliding_window_with_cached_prefix_matches_transformers(gemma_dir):
    """Window 8, prompts of 30+ tokens sharing a 20-token prefix: second request reuses cached blocks."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 9)]
    llm = _llm(gemma_dir, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert outs[1].num_cached_tokens == 20
    for p, o in zip(prompts, outs):
        assert o.token_ids == _hf_greedy(hf, p, 8)


def test_stop_strings_and_text(llama_dir):
    llm = _llm(llama_dir)
    base = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)
    assert base.prompt_token_ids[0] == tok.bos_token_id
    clean = [c for c in base.text if c != "\ufffd"]   # a random model emits partial UTF-8 too
    assert clean, base.text
    stop = clean[0]
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                               stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    assert len(out.token_ids) < len(base.token_ids)
