"""bf16 prefill attention with float32 products (csrc/bf16_gemm/, csrc/prefill/, torch_backend._prefill_wide):
bf16 inputs, float32 scores, softmax and output. Held to float32 attention over the same bf16-valued inputs, with
chunks that start at odd offsets and windows that cut tiles mid-pair, for MQA and GQA; the fused kernel also to
the same tiles composed from bf16_gemm and masked_softmax_, bit for bit, in every build."""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import engine.kernels.attention as kernel_attention
import engine.kernels.build as kbuild
import engine.kernels.elementwise as elementwise
import engine.kernels.gemm as gemm
import engine.kernels.library as library
from engine.attention import torch_backend as tb
from tests.test_cpu_kernels import BUILDS, _lib, build_libs

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def libs():
    return build_libs(BUILDS)


def _reference(q, keys, vals, positions, key_positions, window, scale):
    """Float32 attention of q [n, Hq, D] over keys/vals [S, Hkv, D] at the given positions."""
    hq, hkv = q.shape[1], keys.shape[1]
    kk = keys.float().repeat_interleave(hq // hkv, 1)
    vv = vals.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("nhd,shd->hns", q.float() * scale, kk)
    qp, kp = positions[:, None], key_positions[None, :]
    hide = kp > qp
    if window:
        hide |= kp <= qp - window
    p = torch.softmax(s.masked_fill(hide, float("-inf")), -1)
    return torch.einsum("hns,shd->nhd", p, vv)


@pytest.mark.parametrize("build", list(BUILDS))
def test_gemm_matches_float32_products(libs, build):
    """Every build: the AVX512-BF16 micro-kernel where the build has it, the portable loops elsewhere (the
    engine uses the kernel only where it is fast: ``bf16_gemm_ok``)."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 2, 1), (9, 6, 17), (37, 256, 33), (130, 98, 300)):
        a = torch.randn(m, k, generator=g).bfloat16()
        b = torch.randn(k, n, generator=g).bfloat16()
        ref = a.float() @ b.float()
        got = gemm.bf16_gemm(a, gemm.pack_pairs(b), lib=lib)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
        wide = gemm.pack_pairs(torch.cat([b, b], 1))          # a column slice keeps the row stride
        assert torch.equal(gemm.bf16_gemm(a, wide[:, n:], n, lib=lib), got)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2)])
@pytest.mark.parametrize("window", [None, 37, 300])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,n", [(0, 301), (133, 150), (270, 1)])
def test_wide_prefill_equals_float32_attention(hq, hkv, window, q_dtype, start, n):
    """With the loaded build (the portable loops where it has no AVX512-BF16: slow, still exact enough)."""
    g = torch.Generator().manual_seed(1)
    d, bs = 64, 16
    seq_len = start + n
    nblocks = -(-seq_len // bs) + 2
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    table = torch.randperm(nblocks, generator=g)[:-(-seq_len // bs)].to(torch.int32)
    flat_k = k_cache[table.long()].reshape(-1, hkv, d)[:seq_len]
    flat_v = v_cache[table.long()].reshape(-1, hkv, d)[:seq_len]
    q = (torch.randn(n, hq, d, generator=g) * 2).to(q_dtype)
    scale = d ** -0.5
    got = tb._prefill_wide(q, k_cache, v_cache, table, seq_len, window, scale, bs)
    assert got.dtype == q_dtype
    qb = (q.float() * scale).bfloat16().float()                   # the one rounding of q the kernel makes
    ref = _reference(qb, flat_k, flat_v, torch.arange(start, seq_len), torch.arange(seq_len), window, 1.0)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 5e-3               # probabilities enter P.V in bf16
    assert (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def _composed(qs, kp, vp, q_start, k_start, window, tile=128):
    """The fused kernel's arithmetic from its pieces, 128-query tiles per KV head: bf16_gemm, masked_softmax_,
    probabilities cast to bf16, bf16_gemm (the engine's previous prefill path)."""
    n, hq, d = qs.shape
    hkv = kp.shape[0]
    g = hq // hkv
    out = torch.empty(n, hq, d)
    for h in range(hkv):
        for t0 in range(0, n, tile):
            ts, te = q_start + t0, min(q_start + t0 + tile, q_start + n)
            lo = max(k_start, ts - window + 1) if window else k_start
            j0 = (lo - k_start) // 32 * 32        # csrc/prefill/driver.h PREFILL_BF16_ALIGN
            j1 = te - k_start + ((te - k_start - j0) & 1)
            qt = qs[t0:t0 + te - ts, h * g:(h + 1) * g].reshape(-1, d)
            scores = gemm.bf16_gemm(qt, kp[h][:, j0:j1])
            probs = elementwise.masked_softmax_(scores, te - ts, g, ts, k_start + j0, window).to(torch.bfloat16)
            o = gemm.bf16_gemm(probs, vp[h][j0 // 2:j1 // 2])
            out[t0:t0 + te - ts, h * g:(h + 1) * g] = o.view(te - ts, g, d)
    return out


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("k_start,q_start,n", [(0, 0, 301), (0, 133, 150), (40, 269, 1), (3, 90, 37)])
def test_fused_prefill_equals_its_composed_tiles(libs, build, hq, hkv, window, k_start, q_start, n):
    """Tile sizes differ (the kernel's adapt to the thread count), the sums do not: a tile's extra key columns
    carry probability 0, which adds exact zeros. bf16 output: the float32 result rounded once."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(n + hq)
    d = 64
    S = q_start + n - k_start
    S += S & 1
    keys = torch.randn(S, hkv, d, generator=g).bfloat16()
    vals = torch.randn(S, hkv, d, generator=g).bfloat16()
    kp = torch.stack([gemm.pack_pairs(keys[:, h].t()) for h in range(hkv)])
    vp = torch.stack([gemm.pack_pairs(vals[:, h]) for h in range(hkv)])
    qs = (torch.randn(n, hq, d, generator=g) * 0.5).bfloat16()
    with mock.patch.object(library, "_lib", lib), mock.patch.object(library, "_tried", True):
        ref = _composed(qs, kp, vp, q_start, k_start, window)
        got = kernel_attention.prefill_attention(qs, kp, vp, q_start, k_start, window, torch.float32, lib=lib)
        half = kernel_attention.prefill_attention(qs, kp, vp, q_start, k_start, window, torch.bfloat16, lib=lib)
    if kernel_attention.prefill_online_softmax(d, lib):   # AMX: online softmax (tests/test_amx_flash.py), not tiles
        exact = _reference(qs, keys, vals, torch.arange(q_start, q_start + n), torch.arange(k_start, k_start + S),
                           window, 1.0)
        assert (got - exact).abs().max() <= 1e-2 * max(1.0, exact.abs().max().item())
        assert torch.equal(half, got.bfloat16())
        return
    assert torch.equal(got, ref)
    assert torch.equal(half, ref.bfloat16())


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 16), (5, 38), (17, 120)])
def test_pack_kv_equals_pack_pairs_of_the_gathered_keys(libs, build, hkv, lo, hi):
    """The paged cache packed in C equals torch's gather + pad + pack_pairs, word for word (odd counts padded
    with a zero key; ranges that start and end mid-block; scattered blocks)."""
    lib = _lib(libs, build)
    g = torch.Generator().manual_seed(hi + hkv)
    bs, d = 16, 64
    nblocks = -(-hi // bs) + 3
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    table = torch.randperm(nblocks, generator=g)[:-(-hi // bs)].to(torch.int32)
    keys = k_cache[table.long()].reshape(-1, hkv, d)[lo:hi]
    vals = v_cache[table.long()].reshape(-1, hkv, d)[lo:hi]
    if keys.shape[0] & 1:
        keys, vals = F.pad(keys, (0, 0, 0, 0, 0, 1)), F.pad(vals, (0, 0, 0, 0, 0, 1))
    kp, vp = kernel_attention.pack_kv(k_cache, v_cache, table, lo, hi, lib=lib)
    assert torch.equal(kp, torch.stack([gemm.pack_pairs(keys[:, h].t()) for h in range(hkv)]))
    assert torch.equal(vp, torch.stack([gemm.pack_pairs(vals[:, h]) for h in range(hkv)]))
