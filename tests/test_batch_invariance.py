"""A row's tokens do not depend on what else is in the batch, in the style of vLLM's determinism suite:
a needle prompt alone, then at random positions among 16-64 others, with token budgets 512 and 4096, speculation
on, a prefix-cache hit, and preemption forced by a tiny KV pool. At every output position the head's input row
(and its logits, where both runs computed them) must be the same bits, and the tokens identical, greedy and
seeded (temperature 0.8, top_p 0.95, a per-request seed), on every weight path (int8, bf16, float32) and KV cache
dtype (bf16, int8, float32). The last test injects a batch-dependent linear and shows the same checks catch it."""
import random

import pytest
import torch

import engine.kernels.library as library
from engine.kernels.cpu_features import has_amx
from tests.invariance import GREEDY, assert_same_row, mixed_params, others, run, seeded
from tests.model_utils import save_tiny, tiny_hf_model

pytestmark = pytest.mark.skipif(library.load() is None, reason="the C kernels (int8 weights, attention)")

BASE = dict(block_size=8, kv_cache_memory=16 << 20, speculative_config=None)
ENGINES = {
    "int8": dict(quantization="int8"),                         # the default's format: float32 act., bf16 KV
    "int8-int8kv": dict(quantization="int8", kv_cache_dtype="int8"),
    "bf16": dict(quantization="none", dtype="bfloat16"),
    "f32": dict(quantization="none", dtype="float32"),
    "f32-bf16kv": dict(quantization="none", dtype="float32", kv_cache_dtype="bfloat16"),
}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "gating": "always"}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-invariance")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


def _needles(shared):
    rng = random.Random(7)
    out = []
    for n in (41, 29):
        body = [rng.randrange(3, 300) for _ in range(n)]
        out.append(shared + body + body[:9])          # a repeat: n-gram drafts find matches
    return out


SHARED = [random.Random(5).randrange(3, 300) for _ in range(21)]
NEEDLES = _needles(SHARED)
NEEDLE_PARAMS = [GREEDY, seeded(1234)]


def _alone(gemma_dir, engine, monkeypatch):
    _, found, _ = run(gemma_dir, NEEDLES[:1], NEEDLE_PARAMS[:1], {**BASE, **engine}, monkeypatch)
    _, found2, _ = run(gemma_dir, NEEDLES[1:], NEEDLE_PARAMS[1:], {**BASE, **engine}, monkeypatch)
    return found + found2


def _crowd(seed):
    n = random.Random(seed).randrange(16, 65)
    return others(n, seed, shared=SHARED), mixed_params(n, seed)


@pytest.mark.parametrize("name", list(ENGINES))
def test_needle_alone_equals_needle_in_batches(gemma_dir, name, monkeypatch):
    engine = ENGINES[name]
    ref = _alone(gemma_dir, engine, monkeypatch)
    variants = [("batch", 1, {}), ("batch, token budget 512", 2, dict(max_num_batched_tokens=512)),
                ("batch, token budget 61", 3, dict(max_num_batched_tokens=61)),
                ("batch, speculation on", 4, dict(speculative_config=SPEC))]
    for what, seed, kw in variants:
        crowd, params = _crowd(seed)
        _, found, _ = run(gemma_dir, NEEDLES, NEEDLE_PARAMS, {**BASE, **engine, **kw}, monkeypatch, crowd, params,
                          seed=seed)
        for i, (r, g) in enumerate(zip(ref, found)):
            assert_same_row(r, g, f"{name}, {what}, needle {i}")


@pytest.mark.parametrize("name", list(ENGINES))
def test_prefix_cache_hit_and_preemption(gemma_dir, name, monkeypatch):
    engine = ENGINES[name]
    ref = _alone(gemma_dir, engine, monkeypatch)
    crowd, params = _crowd(11)
    _, found, outs = run(gemma_dir, NEEDLES, NEEDLE_PARAMS, {**BASE, **engine}, monkeypatch, crowd, params,
                         seed=11, repeat=2)
    assert all(o.num_cached_tokens >= len(SHARED) // 8 * 8 for o in outs)        # the second run hit the cache
    for i, (r, g) in enumerate(zip(ref, found)):
        assert_same_row(r, g, f"{name}, prefix-cache hit, needle {i}")
    # a pool of 40 blocks of 8 tokens for 16+ sequences of up to 100: running requests are preempted and recomputed
    tiny = {**BASE, **engine, "num_gpu_blocks_override": 40, "enable_prefix_caching": False}
    crowd, params = others(16, 12), mixed_params(16, 12)
    llm, found, outs = run(gemma_dir, NEEDLES, NEEDLE_PARAMS, tiny, monkeypatch, crowd, params, last=True)
    assert any(o.metrics.num_preemptions for o in outs), "the needles were not preempted"
    for i, (r, g) in enumerate(zip(ref, found)):
        assert_same_row(r, g, f"{name}, preemption, needle {i}")


def test_checks_catch_a_batch_dependent_linear(gemma_dir, monkeypatch):
    """Inverse: one o_proj that splits its reduction in two when the step has more than 8 rows (a split-K choice
    by shape, as torch's matmul makes): the same checks fail, so the suite can fail on any CPU."""
    engine = {**BASE, **ENGINES["f32"]}
    ref = _alone(gemma_dir, ENGINES["f32"], monkeypatch)
    from engine import LLM
    llm = LLM(gemma_dir, **engine)
    proj = llm.model.model.layers[1].self_attn.o_proj
    w = proj.compute_weight().detach()

    def split_k(x):
        if x.shape[0] <= 8:
            return x @ w.t()
        h = x.shape[1] // 2
        return x[:, :h] @ w[:, :h].t() + x[:, h:] @ w[:, h:].t()
    monkeypatch.setattr(proj, "forward", split_k)
    crowd, params = _crowd(1)
    _, found, _ = run(gemma_dir, NEEDLES, NEEDLE_PARAMS, engine, monkeypatch, crowd, params, seed=1, llm=llm)
    with pytest.raises(AssertionError, match="differs|tokens"):
        assert_same_row(ref[0], found[0], "injected split-K")
    torch.testing.assert_close(found[0][1][0]["hidden"], ref[0][1][0]["hidden"])   # only rounding apart


# bf16 on AMX: torch's oneDNN matmul gives a row other bits at some row counts beyond what the probe finds (after
# other tests' calls too): a known gap, docs/guide/determinism.md; the int8 default is not affected
_AMX_BF16 = pytest.mark.xfail(has_amx(), reason="bf16 on AMX: torch's matmul rows are not held invariant "
                                                "(docs/guide/determinism.md, known gap)", strict=False)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=_AMX_BF16)])
def test_float_linear_rows_equal_at_every_row_count(dtype):
    """engine.models.linear: each row of a padded call is the same bits as in a 64-row call, for 1-40 rows and at
    the model's shapes (plain torch is not, on the Zen 5 CI machine: docs/perf/zen5-epyc-determinism.md)."""
    from engine.models.linear import Linear, make_row_invariant
    g = torch.Generator().manual_seed(0)
    for k, n in [(640, 1536), (2048, 640), (64, 224)]:
        lin = Linear(k, n, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g))
        x = torch.randn(64, k, generator=g).to(dtype)
        make_row_invariant(lin)
        ref = lin(x)
        assert [m for m in range(1, 41) if not torch.equal(lin(x[:m]), ref[:m])] == []
