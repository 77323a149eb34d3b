"""bf16 prefill attention with float32 products (csrc/bf16_gemm.c, torch_backend._prefill_wide): bf16 inputs,
float32 scores, softmax and output. Held to float32 attention over the same bf16-valued inputs, with chunks that
start at odd offsets and windows that cut tiles mid-pair, for MQA and GQA."""
import pytest
import torch

from engine import cpu_kernels
from engine.attention import torch_backend as tb
from tests.test_cpu_kernels import BUILDS, _lib, build_libs

pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler on PATH")


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
        got = cpu_kernels.bf16_gemm(a, cpu_kernels.pack_pairs(b), lib=lib)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
        wide = cpu_kernels.pack_pairs(torch.cat([b, b], 1))          # a column slice keeps the row stride
        assert torch.equal(cpu_kernels.bf16_gemm(a, wide[:, n:], n, lib=lib), got)


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
    got = tb._prefill_wide(q, flat_k[start:], flat_v[start:], k_cache, v_cache, table, seq_len, window, scale, bs)
    assert got.dtype == q_dtype
    qb = (q.float() * scale).bfloat16().float()                   # the one rounding of q the kernel makes
    ref = _reference(qb, flat_k, flat_v, torch.arange(start, seq_len), torch.arange(seq_len), window, 1.0)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 5e-3               # probabilities enter P.V in bf16
    assert (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
