"""kv_cache_dtype: int8 (engine/quant/int8_kv.py): the C writer gives the torch reference's bytes, decode and
prefill attention over an int8 cache equal the torch path over the dequantized rows in every build, shared blocks
give each sequence its own result, and the engine's greedy tokens are batch-invariant and near a float cache's."""
from __future__ import annotations

import pytest
import torch

import engine.kernels.attention as kernel_attention
import engine.kernels.build as kbuild
import engine.kernels.kv_write as kv_kernels
import engine.kernels.library as library
import engine.quant.int8_kv as int8_kv
from engine.attention.torch_backend import _decode
from tests.model_utils import save_tiny, tiny_hf_model
from tests.test_cpu_kernels import BUILDS, LENS, SHAPES, _case, _lib, _shared_prefix_case, build_libs

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def libs():
    return build_libs(BUILDS)


def _to_int8(k: torch.Tensor, v: torch.Tensor):
    """A float cache [N, bs, Hkv, D] pair as an int8 pair (quantized by the torch reference) and its dequantized
    float32 values: what every int8 kernel must compute with."""
    n, bs, hkv, d = k.shape
    pair = tuple(torch.zeros(int8_kv.pool_shape(n, bs, hkv, d), dtype=torch.int8) for _ in range(2))
    slots = torch.arange(n * bs)
    int8_kv.write(pair, k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), slots, bs)
    deq = tuple(int8_kv.dequantize_blocks(c, torch.arange(n), bs, hkv, d) for c in pair)
    return pair, deq


def test_quantize_rounds_each_row_to_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0
    q, s = int8_kv.quantize(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert s.shape == (7, 3, 2) and torch.equal(q[2, 1], torch.zeros(64, dtype=torch.int8))
    assert (s[2, 1] == 0).all()
    step = s.repeat_interleave(32, -1)
    err = (q.float() * step - x).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()                     # within half a step of each group's grid
    top = q.view(7, 3, 2, 32).abs().amax(-1)
    assert torch.equal(top[s > 0], torch.full_like(top[s > 0], 127))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,d,bs", [(1, 256, 16), (2, 64, 4), (4, 32, 1)])
def test_writer_equals_the_torch_reference(libs, build, src, hkv, d, bs):
    """kv_write_*_i8 and int8_kv.write store the same bytes (quants and scales), strided sources included."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(3)
    nblocks, t = 30, 23
    qkv = (torch.randn(t, 3 * hkv * d, generator=g) * 4).to(src)
    k = qkv[:, :hkv * d].view(t, hkv, d)                  # rows inside a fused qkv output: token stride 3 Hkv D
    v = qkv[:, 2 * hkv * d:].view(t, hkv, d)
    slots = torch.randperm(nblocks * bs, generator=g)[:t]
    shape = int8_kv.pool_shape(nblocks, bs, hkv, d)
    got = (torch.full(shape, 7, dtype=torch.int8), torch.full(shape, 7, dtype=torch.int8))
    ref = (got[0].clone(), got[1].clone())
    kv_kernels.kv_write_i8(got, k, v, slots, bs, lib=lib)
    int8_kv.write(ref, k, v, slots, bs)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(IndexError):
        kv_kernels.kv_write_i8(got, k, v, torch.full((t,), nblocks * bs), bs, lib=lib)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("window", [None, 7, 64])
def test_decode_equals_the_torch_path_over_dequantized_rows(libs, build, qdtype, shape, window):
    hq, hkv, d, bs = shape
    if not int8_kv.supported(d):
        pytest.skip(f"int8 caches need head_dim a multiple of {int8_kv.GROUP}")
    lib = _lib(libs, build)
    q, k, v, meta = _case(torch.float32, LENS, hq, hkv, d, bs)
    (k8, v8), (kd, vd) = _to_int8(k, v)
    q = q.to(qdtype)
    scale = d ** -0.5
    lens = torch.tensor(LENS, dtype=torch.int32)
    ref = _decode(q.float(), kd, vd, meta, window, scale, native=False)
    got = kernel_attention.paged_decode_i8(q, k8, v8, meta.block_tables, lens, window, scale, hkv, bs, lib=lib)
    assert got.dtype == qdtype
    # the AVX512-BF16 paths round q and the probabilities to bf16 (the quants are exact in bf16); bf16 outputs
    # round once more
    exact = library.isa(lib) != "avx512_bf16" and qdtype == torch.float32
    tol = 2e-5 if exact else 3e-2
    assert (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    # the torch path of the backend reads an int8 pair the same way
    fetch = lambda c, b: int8_kv.dequantize_blocks(c, b, bs, hkv, d)          # noqa: E731
    ref8 = _decode(q.float(), k8, v8, meta, window, scale, hkv=hkv, fetch=fetch)
    assert torch.equal(ref8, ref)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("window", [None, 40, 512])
def test_shared_blocks_give_each_sequence_its_own_result(libs, build, window):
    lib = _lib(libs, build)
    q, k, v, tables, lens = _shared_prefix_case(torch.float32)
    (k8, v8), _ = _to_int8(k, v)
    full = kernel_attention.paged_decode_i8(q, k8, v8, tables, lens, window, 0.0625, 1, 16, lib=lib)
    for i in range(len(lens)):
        one = kernel_attention.paged_decode_i8(q[i:i + 1], k8, v8, tables[i:i + 1], lens[i:i + 1], window, 0.0625,
                                               1, 16, lib=lib)
        assert torch.equal(one[0], full[i]), i


@pytest.mark.parametrize("build", list(BUILDS))
def test_pack_equals_dequantize_then_round_to_bf16(libs, build):
    """pack_kv_i8 gives pack_kv's words for the dequantized rows rounded to bf16 (what the bf16 prefill kernel
    multiplies), padding key included."""
    lib = _lib(libs, build)
    q, k, v, meta = _case(torch.float32, [531], 4, 2, 64, 16)
    (k8, v8), (kd, vd) = _to_int8(k, v)
    table = meta.block_tables[0]
    for lo, hi in ((0, 531), (17, 530), (100, 101)):
        got = kernel_attention.pack_kv_i8(k8, v8, table, lo, hi, 16, 2, 64, lib=lib)
        want = kernel_attention.pack_kv(kd.to(torch.bfloat16).contiguous(), vd.to(torch.bfloat16).contiguous(), table,
                                   lo, hi, lib=lib)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lo, hi)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8kv_gemma3")
    save_tiny(tiny_hf_model("gemma3"), path)
    return str(path)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_engine_tokens_batched_equal_alone_and_near_a_float_cache(gemma_dir, quantization):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [[1 + (7 * i + j) % 50 for j in range(37 + 5 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12)
    # prefix caching off: with it, each "alone" run would reuse the batched run's blocks and compute its prompt in
    # other chunks (other tile boundaries, other float rounding) — a different question from batch invariance
    llm = LLM(gemma_dir, dtype="float32", quantization=quantization, kv_cache_dtype="int8", block_size=4,
              kv_cache_memory=8 << 20, enable_prefix_caching=False)
    assert llm.runner.kv_caches[0][0].dtype == torch.int8
    assert llm.runner.kv_caches[0][0].shape[1] == 4 * (32 + 4)       # tiny gemma3: 1 KV head x 32, one scale
    batched = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert batched == alone
    ref = LLM(gemma_dir, dtype="float32", quantization=quantization, kv_cache_dtype="bfloat16", block_size=4,
              kv_cache_memory=8 << 20)
    near = [o.token_ids for o in ref.generate(prompts, sp)]
    same = sum(a == b for x, y in zip(batched, near) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, near))                        # a random tiny model: near, not equal


def test_engine_int8_cache_native_equals_the_torch_reference(gemma_dir, monkeypatch):
    """The same logits from the C kernels and from the pure-torch path over the same int8 cache (prefill in chunks,
    then decode)."""
    from bench.quality import sequence_logits
    from engine.llm import LLM

    llm = LLM(gemma_dir, dtype="float32", kv_cache_dtype="int8", block_size=4, kv_cache_memory=8 << 20)
    tokens = [1 + (5 * j) % 60 for j in range(40)]
    chunks = [17, 9, 1, 1, 12]
    got = sequence_logits(llm.model, tokens, chunks, 4, dtype=torch.int8)
    ref = sequence_logits(llm.model, tokens, chunks, 4, dtype=torch.int8, native=False)
    assert (got - ref).abs().max().item() <= 2e-2 * max(1.0, ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_kv_block_bytes_and_config():
    from engine.config import EngineConfig
    from engine.errors import ConfigError
    from engine.memory import kv_block_bytes

    class M:
        num_hidden_layers, num_key_value_heads, head_dim = 18, 1, 256
    assert kv_block_bytes(M, 16, torch.int8) == 2 * 18 * 16 * (256 + 4 * 256 // 32)
    assert kv_block_bytes(M, 16, torch.bfloat16) == 2 * 18 * 16 * 256 * 2
    EngineConfig(model="x", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="int8"):
        EngineConfig(model="x", kv_cache_dtype="fp8")


def test_head_dim_off_the_group_is_refused_by_name(tmp_path):
    from engine.errors import ConfigError
    from engine.llm import LLM

    save_tiny(tiny_hf_model("llama"), tmp_path)                       # head_dim 64 / 4 = 16
    with pytest.raises(ConfigError, match="head_dim a multiple of 32"):
        LLM(str(tmp_path), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=8 << 20)


def test_a_key_shift_leaves_attention_unchanged(gemma_dir):
    """softmax(q.(k - m)) = softmax(q.k): a float32 cache with every layer's keys shifted gives the same logits."""
    from bench.quality import sequence_logits
    from engine.llm import LLM

    llm = LLM(gemma_dir, dtype="float32", kv_cache_dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    attns = [layer.self_attn for layer in llm.model.model.layers]
    assert all(a.key_shift is None for a in attns)                     # only int8 caches calibrate
    tokens = [1 + (5 * j) % 60 for j in range(30)]
    ref = sequence_logits(llm.model, tokens, [13, 1, 16], 4)
    g = torch.Generator().manual_seed(0)
    for a in attns:
        a.key_shift = 3 * torch.randn(a.num_kv_heads, a.head_dim, generator=g)
    got = sequence_logits(llm.model, tokens, [13, 1, 16], 4)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_int8_engines_calibrate_the_same_shifts(gemma_dir):
    import engine.attention.key_shift as key_shift
    from engine.llm import LLM

    shifts = []
    for _ in range(2):
        llm = LLM(gemma_dir, dtype="float32", kv_cache_dtype="int8", block_size=4, kv_cache_memory=8 << 20)
        attns = [layer.self_attn for layer in llm.model.model.layers]
        assert all(a.key_shift is not None and a.key_shift.shape == (1, 32) for a in attns)
        assert all(not isinstance(a.backend, key_shift._MeanKeys) and a.kv_cache[0].dtype == torch.int8
                   for a in attns)                                        # the engine's caches and backend are back
        shifts.append([a.key_shift for a in attns])
    assert all(torch.equal(x, y) for x, y in zip(*shifts))                # deterministic: the same text every load
    assert any(x.abs().max() > 0 for x in shifts[0])
