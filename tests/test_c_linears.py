"""The ``linears`` kernel family: float linears' rows of output positions through the C few-row kernel
(csrc/small_m/), prompt rows through torch. The kernel's rows must be the same bits at every row count, on every
build (so a decode row does not depend on its step's other rows), and the engine must send exactly the output
positions' rows to it (and, under ``prefill_linears: c``, a prompt's rows too)."""
import pytest
import torch

import engine.kernels.gemm as gemm
import engine.kernels.library as library
import engine.models.linear as linear
from engine import LLM, SamplingParams
from engine.models.linear import Linear, invariant_linear, split_linear
from tests.model_utils import save_tiny, tiny_hf_model
from tests.test_cpu_kernels import BUILDS, _lib, libs  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(library.load() is None, reason="the C kernels")


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [100, 2500])            # 2,500: three column blocks (driver.h's KB)
def test_small_m_rows_are_the_same_bits_at_every_row_count(libs, build, dtype, k):
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(48, k, generator=g).to(dtype), torch.randn(37, k, generator=g).to(dtype)
    full = gemm.small_m_linear(x, w, lib=lib)
    for m in (*range(1, 14), 31, 47):
        for start in (0, 48 - m):
            assert torch.equal(gemm.small_m_linear(x[start:start + m], w, lib=lib), full[start:start + m]), (m, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm.small_m_linear(x, w, lib=lib), full)        # and at any thread count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("as_bf16", [False, True])
@pytest.mark.parametrize("k", [0, 1, 7, 896])
def test_panel_rows_are_one_fma_chain_the_same_bits_in_every_build(libs, build, as_bf16, k):
    """The panel kernel: every output is one float32 fused multiply-add chain over k in order (checked against a
    float64-exact replay of that chain), so every row count, row position, thread count and build (portable's
    fmaf, AVX2's vectors) gives the same bits; N past the last full panel (37 = 2 x 16 + 5) is right too."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(k + 7)
    x, w = torch.randn(200, k, generator=g), torch.randn(37, k, generator=g).to(torch.bfloat16).float()
    panels = gemm.panel_pack(w, as_bf16, lib=lib)
    assert panels.shape == (3, k, 16) and panels.dtype == (torch.bfloat16 if as_bf16 else torch.float32)
    assert torch.equal(gemm.panel_unpack(panels, 37, torch.empty(37 * k), lib=lib), w)
    full = gemm.panel_linear(x, panels, 37, lib=lib)
    chain = torch.zeros(200, 37, dtype=torch.float32)
    for j in range(k):                       # fma: the exact product plus the sum, rounded once (float64 holds both)
        chain = (x[:, j:j + 1].double() * w[:, j].double() + chain.double()).float()
    assert torch.equal(full, chain)
    for m in (1, 2, 5, 6, 7, 8, 13, 97):           # 200 rows: three of driver.h's row blocks; 896: two column blocks
        for start in (0, 200 - m):
            assert torch.equal(gemm.panel_linear(x[start:start + m], panels, 37, lib=lib), full[start:start + m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm.panel_linear(x, panels, 37, lib=lib), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("k", [7, 100, 2500])
def test_float32_rows_over_bf16_weights_are_the_float32_weights_bits(libs, build, k):
    """small_m_linear_f32_bf16w reads each bf16 weight as float32: the same bits as over the float32 copy."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(k + 1)
    x, w = torch.randn(11, k, generator=g), torch.randn(29, k, generator=g).to(torch.bfloat16)
    assert torch.equal(gemm.small_m_linear(x, w, lib=lib), gemm.small_m_linear(x, w.float(), lib=lib))


def test_split_linear_sends_output_rows_to_the_kernel_and_the_rest_to_torch():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(9, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    kernel = gemm.small_m_linear(x, w) + b
    plain = invariant_linear(x, w, b)
    for n in (0, 1, 4, 9):
        y = split_linear(x, w, b, n)
        assert torch.equal(y[:n], kernel[:n]) and torch.equal(y[n:], invariant_linear(x[n:], w, b))
    mask = torch.tensor([False, True, True, False, True, False, False, False, True])
    y = split_linear(x, w, b, mask)
    assert torch.equal(y[mask], kernel[mask]) and torch.equal(y[~mask], invariant_linear(x[~mask], w, b))
    assert torch.equal(split_linear(x, w, b, torch.zeros(9, dtype=torch.bool)), plain)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-c-linears")
    save_tiny(tiny_hf_model("llama"), path)
    return str(path)


def _kernel_rows(monkeypatch) -> list[int]:
    """Rows the Linears send to the C kernel, one entry per call."""
    seen, real_small, real_panel = [], linear.small_m_linear, linear.panel_linear

    def spy_small(x, w, lib=None):
        seen.append(x.shape[0])
        return real_small(x, w, lib)

    def spy_panel(x, panels, n, lib=None):
        seen.append(x.shape[0])
        return real_panel(x, panels, n, lib)
    monkeypatch.setattr(linear, "small_m_linear", spy_small)
    monkeypatch.setattr(linear, "panel_linear", spy_panel)
    return seen


@pytest.mark.parametrize("impl", ["c", "torch"])
def test_the_engine_sends_exactly_the_decode_rows_to_the_c_linears(llama_dir, monkeypatch, impl):
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    llm = LLM(llama_dir, dtype="float32", quantization="none", kv_cache_dtype="float32", speculative_config="off",
              kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256, kernels={"linears": impl})
    assert (llm.model.step_rows is not None) == (impl == "c")
    linears = sum(type(m) is Linear for m in llm.model.modules())
    seen = _kernel_rows(monkeypatch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert seen == []                                  # a prompt's rows, its last one included, are torch's
    out = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    if impl == "torch":
        assert seen == []
        return
    # three decode steps of both sequences: every float Linear once per step with their two rows
    assert len(seen) == 3 * linears and set(seen) == {2}


def test_prefill_linears_c_sends_every_row_and_chunking_changes_no_bit(llama_dir, monkeypatch):
    """``prefill_linears: c``: a prompt's rows take the panel kernel too, every call whole (no torch rows), and a
    prompt's hidden states are the same bits however its prefill is chunked (each row one fma chain); the tokens are
    torch-prefill's."""
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    opts = dict(dtype="float32", quantization="none", kv_cache_dtype="float32", speculative_config="off",
                kv_cache_memory=16 << 20, max_num_seqs=8)
    prompts = [list(range(5, 45)), [12, 13, 14]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llms = {(p, budget): LLM(llama_dir, max_num_batched_tokens=budget,
                             kernels={"linears": "c", "prefill_linears": p}, **opts)
            for p, budget in (("c", 256), ("c", 16), ("torch", 256))}
    assert llms[("c", 256)].model.step_rows.prompts_too and not llms[("torch", 256)].model.step_rows.prompts_too
    linears = sum(type(m) is Linear for m in llms[("c", 256)].model.modules())
    seen = _kernel_rows(monkeypatch)
    llms[("c", 256)].generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert len(seen) == linears and seen[0] == 43               # one prefill step of both prompts, whole
    seen.clear()
    llms[("torch", 256)].generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert seen == []
    from engine.model_runner import ModelRunner
    hidden, real_tokens = {}, ModelRunner._tokens

    def spy(runner, rows, reqs, drafts):   # each request's sampled hidden state by its token count: any budget's
        for row, r in zip(rows, reqs):
            hidden[(key, r.prompt_token_ids[0], len(r.output_token_ids))] = row.clone()
        return real_tokens(runner, rows, reqs, drafts)
    monkeypatch.setattr(ModelRunner, "_tokens", spy)
    outs = {}
    for key, llm in llms.items():
        outs[key] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[("c", 256)] == outs[("c", 16)] == outs[("torch", 256)]
    firsts = [k[1:] for k in hidden if k[0] == ("c", 256)]
    assert len(firsts) == 8 and all(torch.equal(hidden[(("c", 256), *f)], hidden[(("c", 16), *f)]) for f in firsts)


def test_packed_weights_give_the_same_bits_as_float32(tmp_path, llama_dir, monkeypatch):
    """A bf16 checkpoint's weights widened to float32 are held as bf16 panels under the C linears (half the bytes
    decode streams); every output row and token is the same as with float32 panels. A weight with a value bf16
    cannot hold stays float32 (in float32 panels)."""
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    opts = dict(dtype="float32", quantization="none", kv_cache_dtype="float32", speculative_config="off",
                kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256)
    linears = lambda llm: [m for m in llm.model.modules() if type(m) is Linear]  # noqa: E731
    kept = linears(LLM(llama_dir, **opts))                                    # random float32 values: kept
    assert kept and all(m.packed and m.weight.dtype == torch.float32 and m.weight.dim() == 3 for m in kept)
    hf = tiny_hf_model("llama")
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())            # what a bf16 checkpoint holds
    bf16_dir = str(save_tiny(hf, tmp_path / "bf16-values").path)
    packed = LLM(bf16_dir, **opts)
    mods = linears(packed)
    assert mods and all(m.packed and m.weight.dtype == torch.bfloat16 for m in mods)
    monkeypatch.setattr(linear, "bf16_exact", lambda w: None)
    plain = LLM(bf16_dir, **opts)
    assert not any(m.weight.dtype == torch.bfloat16 for m in linears(plain))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 60))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for a, b in zip(packed.generate(prompts, params), plain.generate(prompts, params)):
        assert a.token_ids == b.token_ids
    g = torch.Generator().manual_seed(1)
    for m, p in zip(mods, linears(plain)):
        x = torch.randn(5, m.in_features, generator=g)
        for spec in (0, 2, 5):
            assert torch.equal(split_linear(x, m.weight, m.bias, spec, m.pad_to, m.tile, m.out_features),
                               split_linear(x, p.weight, p.bias, spec, p.pad_to, p.tile, p.out_features))


def test_a_packed_head_gives_the_same_tokens_and_logits(tmp_path, monkeypatch):
    """The float head (a tied embedding here) held as bf16 under the C head kernel: the same logits bits and
    tokens as its float32 copy, lookups still float32 rows; the engine says its weights are bf16-held."""
    import engine.models.select_ops as select_ops
    from engine.models.layers import Embedding
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    hf = tiny_hf_model("gemma3")                         # tied embeddings
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    path = str(save_tiny(hf, tmp_path / "gemma-bf16-values").path)
    opts = dict(dtype="float32", quantization="none", kv_cache_dtype="float32", speculative_config="off",
                kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256, kernels={"lm_head": "c"})
    packed = LLM(path, **opts)
    emb = packed.model.model.embed_tokens
    assert type(emb) is Embedding and emb.packed and emb.weight.dtype == torch.bfloat16 and emb.weight.dim() == 3
    assert packed.info.bf16_held_weights and packed.info.to_dict()["bf16_held_weights"]
    ids = torch.arange(emb.num_embeddings)                    # every row
    assert torch.equal(emb(ids), emb.compute_weight()) and emb(ids).dtype == torch.float32
    assert torch.equal(emb(ids[[7, 3, 3]]), emb.compute_weight()[[7, 3, 3]])
    assert packed.model.state_dict()["model.embed_tokens.weight"].shape == (emb.num_embeddings, emb.embedding_dim)
    monkeypatch.setattr(select_ops, "bf16_exact", lambda w: None)
    monkeypatch.setattr(linear, "bf16_exact", lambda w: None)
    plain = LLM(path, **opts)                                 # float32 panels
    assert plain.model.model.embed_tokens.weight.dtype == torch.float32 and not plain.info.bf16_held_weights
    assert torch.equal(plain.model.model.embed_tokens(ids), emb(ids))
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for a, b in zip(packed.generate(prompts, params), plain.generate(prompts, params)):
        assert a.token_ids == b.token_ids
    h = torch.randn(3, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(packed.model.compute_logits(h), plain.model.compute_logits(h))
