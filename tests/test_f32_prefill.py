"""float32 prefill attention in one C call (csrc/prefill/, ``kernel_attention.prefill_attention_f32``): every vector
build against float32 attention computed by torch, for MQA and GQA, windows that cut tiles, chunks after cached
context and key counts that are not a multiple of the kernel's column tile; and the engine's routing to it."""
import pytest
import torch

import engine.kernels.attention as kernel_attention
import engine.kernels.build as kbuild
from engine.attention import torch_backend as tb
from tests.test_bf16_prefill import _reference
from tests.test_cpu_kernels import BUILDS, _lib, build_libs

pytestmark = pytest.mark.skipif(kbuild.compiler() is None, reason="no C compiler on PATH")


@pytest.fixture(scope="module")
def libs():
    return build_libs(BUILDS)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 64), (8, 2, 32), (2, 2, 64)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("k_start,q_start,n", [(0, 0, 301), (0, 133, 150), (40, 269, 1), (3, 90, 37)])
def test_fused_f32_prefill_equals_float32_attention(libs, build, hq, hkv, d, window, k_start, q_start, n):
    """Summation order differs from torch's matmuls only: within 2e-5 of the output's scale. The portable build
    (plain loops; the engine routes it to torch instead) is held to the same bound."""
    lib = _lib(libs, build)
    if d % lib.prefill_f32_cols():
        pytest.skip("head_dim is not a multiple of this build's column tile")
    g = torch.Generator().manual_seed(n + hq + d)
    S = q_start + n - k_start
    keys, vals = torch.randn(S, hkv, d, generator=g), torch.randn(S, hkv, d, generator=g)
    qs = torch.randn(n, hq, d, generator=g) * 0.5
    got = kernel_attention.prefill_attention_f32(qs, keys, vals, q_start, k_start, window, lib=lib)
    ref = _reference(qs, keys, vals, torch.arange(q_start, q_start + n), torch.arange(k_start, k_start + S),
                     window, 1.0)
    assert got.dtype == torch.float32 and got.shape == qs.shape
    assert (got - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


def test_prefill_routes_float32_chunks_to_the_kernel(monkeypatch):
    """Every chunk, one token included, takes the C kernel where it serves it (the torch tiles order their sums
    otherwise, so a prompt's tokens would depend on where it was cut); its attention is the reference's."""
    if not kernel_attention.prefill_f32_ok(torch.empty(1, 1, 64)):
        pytest.skip("this build has no float32 prefill kernel")
    calls = []
    real = kernel_attention.prefill_attention_f32

    def spy(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)
    monkeypatch.setattr(kernel_attention, "prefill_attention_f32", spy)
    g = torch.Generator().manual_seed(3)
    bs, hkv, d = 16, 1, 64
    k_cache, v_cache = torch.randn(40, bs, hkv, d, generator=g), torch.randn(40, bs, hkv, d, generator=g)
    table = torch.arange(40, dtype=torch.int32)
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    for n in (1, 63, 64, 300):
        seq_len = 200 + n
        q = torch.randn(n, 4, d, generator=g)
        got = tb._prefill(q, flat_k[200:seq_len], flat_v[200:seq_len], k_cache, v_cache, table, seq_len, 64, 0.125,
                          bs, native=True)
        ref = _reference(q * 0.125, flat_k[:seq_len], flat_v[:seq_len], torch.arange(200, seq_len),
                         torch.arange(seq_len), 64, 1.0)
        assert (got - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())
    assert calls == [1, 63, 64, 300]
