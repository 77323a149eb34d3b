"""The C kernels equal the pure-torch path in every build: native, AVX2 + FMA, AVX-512 without BF16, portable."""
import platform
import shutil

import pytest
import torch

import engine.kernels.attention as kernel_attention
import engine.kernels.binding as binding
import engine.kernels.build as kbuild
import engine.kernels.cpu_features as cpu_features
import engine.kernels.elementwise as elementwise
import engine.kernels.gemm as gemm
import engine.kernels.kv_write as kv_kernels
import engine.kernels.library as library
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import _decode
from engine.models.ops import TorchOps
from engine.models.select_ops import bind_ops

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


def _case(dtype, lens, hq, hkv, d, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // bs) for n in lens) + 5
    k = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    width = max(-(-n // bs) for n in lens) + 2                    # padded rows, like the runner's tables
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.full((len(lens), width), 10_000, dtype=torch.int32)   # padding would fault if read
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=None, query_start_loc=list(range(len(lens) + 1)), seq_lens=list(lens),
                             block_tables=tables, num_decode_seqs=len(lens), block_size=bs)
    return q, k, v, meta


SHAPES = [  # (hq, hkv, head_dim, block_size): fast path (G 1 to 8, D % 32 == 0) and portable fallbacks
    (4, 1, 256, 16), (8, 2, 64, 16), (8, 8, 32, 4), (16, 2, 128, 32), (6, 2, 64, 16), (4, 1, 48, 8), (4, 4, 64, 1),
    (4, 2, 64, 16), (14, 2, 64, 16), (12, 2, 128, 16), (5, 1, 64, 16)]     # G 7, 6 (Qwen2.5 0.5B, 1.5B), 5
LENS = [1, 2, 15, 16, 17, 100, 531]


def _x86_with(flag: str) -> bool:
    return platform.machine() in ("x86_64", "AMD64") and flag in cpu_features.cpuinfo_flags()


# Every build a CPU may get, forced by compile flags so each path is tested on any machine that can run it:
# name -> (flags, expected isa(), runnable here?). The AVX2 build is what an AVX2-only CPU gets from
# -march=native; the portable build is the reference.
BUILDS = {
    "native": (None, None, True),
    "avx2": (["-O3", "-mavx2", "-mfma", "-fopenmp"], "avx2", _x86_with("avx2") and _x86_with("fma")),
    "avx512-no-bf16": (["-O3", "-march=native", "-mno-avx512bf16", "-fopenmp"], "avx512",
                       _x86_with("avx512f") and _x86_with("avx512bw")),
    "portable": (["-O2"], "portable", True),
}


def build_libs(builds: dict, isa=library.isa) -> dict:
    """name -> library for every build this CPU can run; each build's ``isa(lib)`` is checked."""
    native = library.load()
    assert native is not None, library.unavailable_reason()
    out = {"native": native}
    for name, (flags, want, runnable) in builds.items():
        if flags is None or not runnable:
            continue
        lib = binding.open_library(kbuild.build(kbuild.compiler(), flag_sets=(flags,)))
        assert isa(lib) == want, (name, isa(lib))
        out[name] = lib
    return out


@pytest.fixture(scope="module")
def libs():
    return build_libs(BUILDS)


def _lib(libs, build):
    if build not in libs:
        pytest.skip(f"this CPU cannot run the {build} build")
    return libs[build]


@pytest.fixture
def use_build(libs, monkeypatch):
    """Route the module-level kernel calls (glu, rms_norm, ...) to one build."""
    def use(build):
        monkeypatch.setattr(library, "_lib", _lib(libs, build))
        monkeypatch.setattr(library, "_tried", True)
    return use


def test_native_build_matches_this_cpu(libs):
    """-march=native picks the widest path this CPU has."""
    isa = library.isa(libs["native"])
    flags = cpu_features.cpuinfo_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        assert isa == "portable"
    elif "avx512f" in flags:
        assert isa == ("avx512_bf16" if "avx512_bf16" in flags else "avx512")
    elif "avx2" in flags and "fma" in flags:
        assert isa == "avx2"
    else:
        assert isa == "portable"


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("window", [None, 7, 64])
def test_kernel_equals_torch_gather_path(libs, build, dtype, shape, window):
    hq, hkv, d, bs = shape
    lib = _lib(libs, build)
    q, k, v, meta = _case(dtype, LENS, hq, hkv, d, bs)
    scale = d ** -0.5
    lens = torch.tensor(LENS, dtype=torch.int32)
    ref = _decode(q, k, v, meta, window, scale, native=False).float()
    got = kernel_attention.call(lib, q, k, v, meta.block_tables, lens, window, scale).float()
    # float32: same math up to summation order. bf16: the torch path rounds q*scale and the probabilities to
    # bf16 before its matmuls; the kernel keeps float32 probabilities.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    if dtype == torch.float32:      # ... and every vector build against the portable C loops, the reference
        port = kernel_attention.call(libs["portable"], q, k, v, meta.block_tables, lens, window, scale).float()
        assert (got - port).abs().max().item() <= 2e-5 * max(1.0, port.abs().max().item())


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("window", [None, 7, 64])
def test_float32_queries_over_a_bf16_cache(libs, build, window):
    """kv_cache_dtype: bfloat16 under float32 activations: queries and outputs stay float32 (no rounding of the
    attention output to bf16), equal to the torch path that widens the cached keys and values."""
    lib = _lib(libs, build)
    q, k, v, meta = _case(torch.bfloat16, LENS, 4, 1, 256, 16, seed=7)
    q = q.float() * 1.5
    lens = torch.tensor(LENS, dtype=torch.int32)
    ref = _decode(q, k, v, meta, window, 0.0625, native=False)
    got = kernel_attention.call(lib, q, k, v, meta.block_tables, lens, window, 0.0625)
    assert got.dtype == torch.float32
    # the kernel's AVX512-BF16 scores round q to bf16 once; elsewhere it widens the cache like the torch path
    tol = 1e-2 if library.isa(lib) == "avx512_bf16" else 2e-5
    assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_rows_are_independent_of_the_batch(libs):
    """A sequence's output does not depend on which other sequences share the call (or on thread count)."""
    q, k, v, meta = _case(torch.bfloat16, LENS, 4, 1, 256, 16, seed=3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    full = kernel_attention.call(libs["native"], q, k, v, meta.block_tables, lens, 64, 0.0625)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in (0, 4, 6):
            one = kernel_attention.call(libs["native"], q[i:i + 1], k, v, meta.block_tables[i:i + 1], lens[i:i + 1],
                                   64, 0.0625)
            assert torch.equal(one[0], full[i])
    finally:
        torch.set_num_threads(threads)


def _shared_prefix_case(dtype, bs=16, seed=5):
    """Eleven sequences in three prefix groups: groups share their first blocks physically (as the prefix cache
    makes them), lengths differ (some end inside the shared blocks), and the batch order interleaves groups."""
    g = torch.Generator().manual_seed(seed)
    groups = {0: 9, 1: 4, 2: 1}                                   # group -> shared blocks
    lens = [150, 40, 144, 151, 70, 300, 16, 145, 17, 9, 149]     # sequence i is in group i % 3
    nblocks = 200
    k = torch.randn(nblocks, bs, 1, 256, generator=g).to(dtype)
    v = torch.randn(nblocks, bs, 1, 256, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    tables = torch.full((len(lens), 24), 10_000, dtype=torch.int32)
    used = sum(groups.values())
    starts = {0: 0, 1: 9, 2: 13}
    for i, n in enumerate(lens):
        grp, nb = i % 3, -(-n // bs)
        shared = min(groups[grp], nb)
        tables[i, :shared] = perm[starts[grp]:starts[grp] + shared]
        tables[i, shared:nb] = perm[used:used + nb - shared]
        used += nb - shared
    q = torch.randn(len(lens), 4, 256, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40, 512])
def test_shared_blocks_give_each_sequence_its_own_result(libs, build, dtype, window):
    """Sequences that share prefix blocks are walked block by block together (csrc/paged_decode/driver.h group_item):
    each one's output is bit-identical to computing it alone, at any thread count, and matches the torch path."""
    lib = _lib(libs, build)
    q, k, v, tables, lens = _shared_prefix_case(dtype)
    full = kernel_attention.call(lib, q, k, v, tables, lens, window, 0.0625)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for i in range(len(lens)):
                one = kernel_attention.call(lib, q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], window, 0.0625)
                assert torch.equal(one[0], full[i]), (nt, i)
    finally:
        torch.set_num_threads(threads)
    meta = AttentionMetadata(slot_mapping=None, query_start_loc=list(range(len(lens) + 1)),
                             seq_lens=lens.tolist(), block_tables=tables, num_decode_seqs=len(lens), block_size=16)
    ref = _decode(q, k, v, meta, window, 0.0625, native=False).float()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (full.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_unsupported_shapes_are_refused(libs):
    q, k, v, meta = _case(torch.float32, [5], 3, 2, 32, 4)          # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel_attention.call(libs["native"], q, k, v, meta.block_tables, torch.tensor([5], dtype=torch.int32), None,
                              1.0)


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    """A broken compiler leaves the engine on the torch path with a reason, never a crash."""
    monkeypatch.setattr(library, "_lib", None)
    monkeypatch.setattr(library, "_tried", False)
    monkeypatch.setattr(library, "_error", None)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    assert library.load() is None
    assert "build failed" in library.unavailable_reason()
    q, k, _, _ = _case(torch.float32, [5], 4, 1, 32, 4)
    assert not kernel_attention.supports(q, k)


def test_forced_flags_the_compiler_rejects_fall_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """BATCHGEN_KERNEL_FLAGS that do not compile: the log names them and the compiler's complaint, and the
    portable fallback flags build instead."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHGEN_KERNEL_FLAGS", "-O2 -mno-such-flag")
    sets = kbuild.default_flag_sets()
    assert sets[0] == ["-O2", "-mno-such-flag"] and sets[1:] == kbuild.FLAG_SETS[1:]
    with caplog.at_level("WARNING", logger="batchgen.engine"):
        lib = binding.open_library(kbuild.build(kbuild.compiler(), flag_sets=(sets[0], ["-O2"])))
    assert library.isa(lib) == "portable"
    assert any("-mno-such-flag" in r.getMessage() and "trying -O2" in r.getMessage() for r in caplog.records)


# ---- fused elementwise kernels and the prefill softmax: against the torch ops they replace, every build -------

def _close(got, ref, dtype, ulps=2):
    """bf16: within a couple of bf16 ulps of the float32 reference (torch rounds after every op; the kernels
    once). float32: float rounding (and exp's ~2e-7)."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape
    err = (got - ref).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), err.max()
        return
    assert (err <= ulps * 2.0 ** -7 * ref.abs() + 1e-6).float().mean().item() > 0.999, err.max()
    assert err.max().item() <= 4 * 2.0 ** -7 * ref.abs().max().item()


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
EVERY_BUILD = pytest.mark.parametrize("build", list(BUILDS))


@EVERY_BUILD
@DTYPES
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_glu_kernel(use_build, build, dtype, act):
    use_build(build)
    x = torch.randn(37, 2 * 96, generator=torch.Generator().manual_seed(0)).mul(3).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    fn = (lambda t: torch.nn.functional.gelu(t, approximate="tanh")) if act == "gelu_tanh" else torch.nn.functional.silu
    _close(elementwise.glu(x, act), fn(gate) * up, dtype)


@EVERY_BUILD
@DTYPES
def test_rms_norm_kernel_on_strided_heads_with_and_without_rope(use_build, build, dtype):
    use_build(build)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 3 * 64 + 2 * 64, generator=g).to(dtype)
    q = qkv[:, :192].view(9, 3, 64)                                  # strided rows, as inside the fused qkv output
    w = torch.randn(64, generator=g)
    ref = q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w
    _close(elementwise.rms_norm(q, w, 1e-6), ref, dtype)
    pos = torch.arange(100, 109, dtype=torch.float32)
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))[None]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    r = ref.to(dtype).float()
    rot = torch.cat((-r[..., 32:], r[..., :32]), -1)
    _close(elementwise.rms_norm(q, w, 1e-6, cos, sin), r * cos.float() + rot * sin.float(), dtype)
    before = qkv.clone()
    elementwise.rope_(q, cos, sin)                                   # in place, only q's columns
    xf = before[:, :192].view(9, 3, 64).float()
    _close(q, xf * cos.float() + torch.cat((-xf[..., 32:], xf[..., :32]), -1) * sin.float(), dtype)
    assert torch.equal(qkv[:, 192:], before[:, 192:])


@EVERY_BUILD
@DTYPES
def test_elementwise_rows_same_bits_in_a_small_call_and_a_split_one(use_build, build, dtype):
    """A call under csrc/elementwise.c's PAR_MIN_ELEMENTS runs on the calling thread (a decode step's few rows),
    a larger one splits its rows over the threads: a row's bits are the same either way, for every kernel."""
    use_build(build)
    g = torch.Generator().manual_seed(4)
    big, small = 600, 5                                               # 600 x 128 elements: split; 5 x 128: not
    x = torch.randn(big, 2, 64, generator=g).to(dtype)
    h = torch.randn(big, 128, generator=g).to(dtype)
    w, wo = torch.randn(64, generator=g), torch.randn(128, generator=g)
    emb = torch.randn(big, 1, 64, generator=g)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.get_num_threads() > 1 or pytest.skip("one thread: nothing is split")
    for part in (slice(0, small), slice(big - small, big)):
        assert torch.equal(elementwise.rms_norm(x, w, 1e-6, cos, sin)[part],
                           elementwise.rms_norm(x[part], w, 1e-6, cos[part], sin[part]))
        assert torch.equal(elementwise.glu(h, "silu")[part], elementwise.glu(h[part], "silu"))
        xo, out = elementwise.add_rms_norm(x.view(big, 128), h, wo, 1e-6, wo, 1e-5)
        xo_s, out_s = elementwise.add_rms_norm(x.view(big, 128)[part], h[part], wo, 1e-6, wo, 1e-5)
        assert torch.equal(xo[part], xo_s) and torch.equal(out[part], out_s)
        a, b = x.clone(), x[part].clone()
        assert torch.equal(elementwise.rope_(a, cos, sin)[part], elementwise.rope_(b, cos[part], sin[part]))


@EVERY_BUILD
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=["from_f32", "from_bf16"])
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16], ids=["to_f32", "to_bf16"])
@pytest.mark.parametrize("tokens", [5, 300])               # one thread; split over threads
def test_kv_write_equals_index_copy(use_build, build, src, cache, tokens):
    """The C cache write stores exactly what .to(cache dtype) + index_copy_ stored: strided k (inside a fused
    qkv row) and a dense v, any slots, every build; a slot outside the cache raises instead of writing."""
    from engine.attention.cache import write_kv
    use_build(build)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 4 * 64 + 2 * 2 * 64, generator=g).mul(3).to(src)
    k = qkv[:, 256:384].view(tokens, 2, 64)                         # token stride 512: a view into qkv
    v = qkv[:, 384:].reshape(tokens, 2, 64).clone()                 # dense
    kc, vc = torch.zeros(40, 16, 2, 64, dtype=cache), torch.zeros(40, 16, 2, 64, dtype=cache)
    slots = torch.randperm(640, generator=g)[:tokens]
    assert kv_kernels.kv_write_ok(k, v, kc, slots)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, 2, 64).index_copy_(0, slots, k.to(cache))
    want_v.view(-1, 2, 64).index_copy_(0, slots, v.to(cache))
    write_kv((kc, vc), k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    bad = slots.clone()
    bad[-1] = 640
    with pytest.raises(IndexError):
        write_kv((kc, vc), k, v, bad)
    assert torch.equal(kc, want_k)                                  # nothing written


@EVERY_BUILD
@DTYPES
@pytest.mark.parametrize("h_norm, out_norm", [(True, True), (False, True), (True, False)])
def test_add_rms_norm_equals_norm_add_norm(use_build, build, dtype, h_norm, out_norm):
    """The fused residual add (Gemma's sandwich norms, Llama's post-attention norm) is bit for bit the three
    passes it replaces: rms_norm(h), torch's add, rms_norm of the sum; and those are the float32 math."""
    use_build(build)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, 96, generator=g).to(dtype)
    h = torch.randn(13, 96, generator=g).mul(7).to(dtype)
    wh, wo = torch.randn(96, generator=g), torch.randn(96, generator=g)
    xo, out = elementwise.add_rms_norm(x, h, wh if h_norm else None, 1e-6, wo if out_norm else None, 1e-5)
    hn = elementwise.rms_norm(h, wh, 1e-6) if h_norm else h
    assert torch.equal(xo, x + hn)
    if not out_norm:
        assert out is None
        return
    assert torch.equal(out, elementwise.rms_norm(x + hn, wo, 1e-5))
    s = (x + hn).float()
    _close(out, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * wo, dtype)


@EVERY_BUILD
@DTYPES
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("outer", [1, 2])
def test_masked_softmax_kernel(use_build, build, dtype, window, outer):
    use_build(build)
    t, g, S, q_start, k_start = 6, 3, 14, 20, 9                      # queries 20..25 over keys 9..22
    scores = torch.randn(outer, t, g, S, generator=torch.Generator().manual_seed(2)).mul(4).to(dtype)
    qp = torch.arange(q_start, q_start + t)[:, None, None]
    kp = torch.arange(k_start, k_start + S)[None, None, :]
    hide = (kp > qp) | ((kp <= qp - window) if window else torch.zeros_like(kp > qp))
    ref = torch.softmax(scores.float().masked_fill(hide, float("-inf")), dim=-1)
    got = elementwise.masked_softmax_(scores.clone(), t, g, q_start, k_start, window)
    assert torch.equal(got.float()[hide.expand_as(got)], torch.zeros(int(hide.expand_as(got).sum())))
    _close(got, ref, dtype, ulps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_model_with_kernels_matches_the_torch_path(arch, dtype, tmp_path, monkeypatch):
    """Whole tiny model (chunked prefill + decode): every kernel on vs the pure-torch path."""
    from tests.model_utils import load_ours, run_chunks, save_tiny, tiny_hf_model
    ours = load_ours(save_tiny(tiny_hf_model(arch), tmp_path), dtype)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    chunks = [7, 20, 1, 1, 10, 1]
    with_kernels = run_chunks(ours, ids, chunks).float()
    monkeypatch.setattr(elementwise, "elementwise_ok", lambda x: False)      # the attention backend's softmax
    bind_ops(ours, ops=TorchOps())
    torch_only = run_chunks(ours, ids, chunks, native=False).float()
    if dtype == torch.float32:
        assert (with_kernels - torch_only).abs().max().item() <= 1e-4 * torch_only.abs().max().item()
        assert torch.equal(with_kernels.argmax(-1), torch_only.argmax(-1))
        return
    assert (with_kernels - torch_only).abs().max().item() <= 0.05 * torch_only.abs().max().item()
    assert (with_kernels.argmax(-1) == torch_only.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(1, 640, 300), (4, 64, 33), (7, 100, 50), (16, 640, 97), (3, 20, 5)])
def test_small_m_linear_every_build(libs, build, dtype, m, k, n):
    """The few-row matmul (the decode-time LM head) against float64: float32 accumulation error, plus one
    bf16 rounding of the output."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    y = gemm.small_m_linear(x, w, lib=lib)
    ref = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    bound = 1e-6 * mag + (2.0 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert y.dtype == dtype and ((y.double() - ref).abs() <= bound + 1e-6).all()
