"""Speculative decoding through the whole engine (tiny random models, float32): greedy tokens identical with
speculation on and off across batch compositions, chunked prefill, prefix caching and preemption; stops never
overshoot; the prefix cache holds exactly the verified tokens' K/V; seeded sampling keeps its distribution."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import SpecConfig
from engine.errors import ConfigError
from tests.model_utils import VOCAB, save_tiny, tiny_hf_model

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
          "gating": "always"}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    save_tiny(tiny_hf_model(request.param), path)
    return str(path)


def _prompts(seed=0):
    """Prompts that repeat spans (as documents a summary copies from), some sharing a prefix."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (24,), generator=g).tolist()
    out = []
    for i, n in enumerate([6, 30, 11, 50, 3, 21]):
        span = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        body = span + torch.randint(3, VOCAB, (5,), generator=g).tolist() + span
        out.append(shared + body if i % 2 else body)
    return out


def _run(path, prompts, params, spec, one_by_one=False, steps=None, **kw):
    """``steps``: a list that collects every step's stats."""
    llm = LLM(path, dtype="float32", block_size=4, speculative_config=spec, **kw)
    on_step = None if steps is None else steps.append
    if one_by_one:
        outs = [llm.generate([p], params, on_step=on_step)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, on_step=on_step)
    return llm, outs


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("setting", [
    dict(),                                                  # everything in one batch
    dict(one_by_one=True),                                   # alone
    dict(max_num_batched_tokens=16),                         # chunked prefill, drafts share the budget
    dict(enable_prefix_caching=False),
    dict(num_gpu_blocks_override=40, max_num_seqs=6),        # preemption: the pool holds ~3 sequences
])
def test_greedy_identical_with_speculation(model_dir, setting):
    prompts = _prompts()
    _, off = _run(model_dir, prompts, GREEDY, None, **setting)
    steps = []
    _, on = _run(model_dir, prompts, GREEDY, ALWAYS, steps=steps, **setting)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    proposed = sum(o.metrics.num_draft_tokens for o in on)
    accepted = sum(o.metrics.num_accepted_tokens for o in on)
    assert proposed > 0 and 0 < accepted <= proposed            # it really speculated, and some were right
    assert sum(s.num_draft_tokens for s in steps) == proposed
    assert sum(s.num_accepted_tokens for s in steps) == accepted
    if "num_gpu_blocks_override" in setting:                 # drafts are dropped, never preempt anyone
        assert 0 < sum(o.metrics.num_preemptions for o in on) <= sum(o.metrics.num_preemptions for o in off)


def test_stops_never_overshoot(model_dir):
    prompts = _prompts(1)
    _, ref = _run(model_dir, prompts, GREEDY, None)
    # stop at a token / a string that greedy decoding reaches mid-way, and at max_tokens
    tok = ref[1].token_ids[7]
    text = ref[3].text[5:9] or ref[3].text
    for params in (SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tok], ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.0, stop=[text], ignore_eos=True),
                   SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)):
        _, off = _run(model_dir, prompts, params, None)
        _, on = _run(model_dir, prompts, params, ALWAYS)
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in on] == \
            [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in off]
        assert all(len(o.token_ids) <= params.max_tokens for o in on)


def test_prefix_cache_holds_verified_kv(model_dir):
    """After runs with rejected drafts, every cached block (by content hash) holds the same K/V as the run
    without speculation: rejected drafts never reach the prefix cache."""
    prompts = _prompts(2)
    a, _ = _run(model_dir, prompts, GREEDY, None)
    b, on = _run(model_dir, prompts, GREEDY, ALWAYS)
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in on) > 0   # rejections
    pa, pb = a.scheduler.kv_cache_manager.block_pool, b.scheduler.kv_cache_manager.block_pool
    common = set(pa._cached) & set(pb._cached)
    assert len(common) >= 0.9 * len(pa._cached) > 0
    for h in common:
        ia, ib = pa._cached[h].block_id, pb._cached[h].block_id
        for (ka, va), (kb, vb) in zip(a.runner.kv_caches, b.runner.kv_caches):
            assert torch.allclose(ka[ia], kb[ib], atol=1e-5) and torch.allclose(va[ia], vb[ib], atol=1e-5)


def test_seeded_sampling_distribution_unchanged(model_dir):
    """Temperature 1 with a repeated-span prompt: the distribution of the 2nd and 3rd tokens (where drafts are
    verified) over 300 seeds is the same with speculation on and off (chi-square homogeneity, p > 1e-4)."""
    prompt = _prompts(3)[3]
    on_llm = LLM(model_dir, dtype="float32", block_size=4, speculative_config=ALWAYS)
    off_llm = LLM(model_dir, dtype="float32", block_size=4)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(300)]
    on = on_llm.generate([prompt] * 300, params)
    off = off_llm.generate([prompt] * 300, params)
    assert sum(o.metrics.num_draft_tokens for o in on) > 0
    for pos in (1, 2):
        a = torch.bincount(torch.tensor([o.token_ids[pos] for o in on]), minlength=VOCAB).double()
        b = torch.bincount(torch.tensor([o.token_ids[pos] for o in off]), minlength=VOCAB).double()
        keep = (a + b) >= 5                                        # pool rare tokens into one cell
        a = torch.cat([a[keep], a[~keep].sum()[None]])
        b = torch.cat([b[keep], b[~keep].sum()[None]])
        tot = a + b
        ea, eb = tot * a.sum() / tot.sum(), tot * b.sum() / tot.sum()
        ok = tot > 0
        stat = (((a - ea) ** 2 / ea)[ok].sum() + ((b - eb) ** 2 / eb)[ok].sum()).item()
        df = int(ok.sum()) - 1
        p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                    torch.tensor(stat / 2, dtype=torch.float64)).item()
        assert p > 1e-4, (pos, stat, df)


def test_config_and_gating_off_by_default(model_dir):
    assert SpecConfig.parse(None) is None and SpecConfig.parse("off") is None
    assert SpecConfig.parse("auto") == SpecConfig()
    for bad, msg in (({"method": "eagle"}, "only ngram"), ({"num_speculative_tokens": 0}, "1..16"),
                     ({"k": 3}, "unknown key"), ("on", "off, auto")):
        with pytest.raises(ConfigError, match=msg):
            LLM(model_dir, dtype="float32", speculative_config=bad)
    llm, outs = _run(model_dir, _prompts(), GREEDY, None)
    assert llm.scheduler.speculator is None and all(o.metrics.num_draft_tokens == 0 for o in outs)


def test_penalties_and_min_tokens_apply_at_every_draft_position(model_dir):
    """Repetition / presence / frequency penalties and min_tokens bans see the earlier drafts as outputs:
    greedy tokens are identical with speculation on and off."""
    prompts = _prompts(4)
    eos_like = _run(model_dir, prompts[:1], GREEDY, None)[1][0].token_ids[2]
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.02, presence_penalty=0.01,
                            frequency_penalty=0.005, min_tokens=6, stop_token_ids=[eos_like])
    _, off = _run(model_dir, prompts, params, None)
    _, on = _run(model_dir, prompts, params, ALWAYS)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.metrics.num_draft_tokens for o in on) > 0
    plain = _run(model_dir, prompts, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[eos_like]),
                 None)[1]
    assert [o.token_ids for o in plain] != [o.token_ids for o in off]     # the penalties / bans do change tokens


def test_greedy_drafts_and_bans_take_the_argmax(model_dir, monkeypatch):
    """Greedy without penalties takes the head's argmax (no [N, vocab] logits) with drafts to verify and with
    min_tokens bans: the same tokens as the sampler's path; logits only for single rows whose argmax is banned."""
    prompts = _prompts(4)
    eos_like = _run(model_dir, prompts[:1], GREEDY, None)[1][0].token_ids[2]    # greedy's 3rd token of prompt 0
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=6, stop_token_ids=[eos_like])
    from engine.models.layers import CausalLM
    rows = []
    real = CausalLM.compute_logits
    monkeypatch.setattr(CausalLM, "compute_logits", lambda self, h: rows.append(h.shape[0]) or real(self, h))
    _, fast = _run(model_dir, prompts, params, ALWAYS)
    assert sum(o.metrics.num_draft_tokens for o in fast) > 0
    assert rows and set(rows) == {1}                   # the banned argmax taken again, one row at a time
    monkeypatch.setattr("engine.model_runner._plain_greedy", lambda req: False)
    _, slow = _run(model_dir, prompts, params, ALWAYS)
    _, off = _run(model_dir, prompts, params, None)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow] == [o.token_ids for o in off]
    assert all(len(o.token_ids) >= 6 for o in fast)
