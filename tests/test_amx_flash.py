"""Prefill attention items on AMX tiles with the softmax online over blocks of 32 keys (csrc/bf16_gemm/amx_flash.h):
as close to exact attention as the two-product form, and a query's bits depend on its query, keys and values only,
never on how its prompt was chunked, which rows shared its tile or how far back the packed keys start."""
import pytest
import torch

import engine.kernels.attention as kernel_attention
from engine.kernels import library
from engine.kernels.gemm import pack_pairs

lib = library.load()
pytestmark = pytest.mark.skipif(lib is None or not kernel_attention.prefill_online_softmax(64, lib),
                                reason="no AMX tiles here: prefill attention runs its two-product form")
# (query heads, KV heads, head_dim): Qwen2.5-0.5B (groups of 7 rows straddle the 16-row tiles), Qwen2.5-1.5B
# (128: half the output in L1), gemma-3-270m (256)
HEADS = [(14, 2, 64), (12, 2, 128), (4, 1, 256)]


def _operands(seq, seed, heads=HEADS[0]):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(seq, hkv, d, generator=g).bfloat16()
    vals = torch.randn(seq, hkv, d, generator=g).bfloat16()
    qs = (torch.randn(seq, hq, d, generator=g) * (0.4 * (64 / d) ** 0.5)).bfloat16()
    return qs, keys, vals


def _run(qs, keys, vals, q_start, n, k_start, window):
    """queries [q_start, q_start + n) over keys [k_start, q_start + n), as the engine packs them"""
    hi, (_, hkv, d) = q_start + n, keys.shape
    s = (hi - k_start + 1) // 2 * 2
    k = torch.zeros(s, hkv, d, dtype=torch.bfloat16)
    v = torch.zeros(s, hkv, d, dtype=torch.bfloat16)
    k[:hi - k_start], v[:hi - k_start] = keys[k_start:hi], vals[k_start:hi]
    kp = torch.stack([pack_pairs(k[:, h].t()) for h in range(hkv)])
    vp = torch.stack([pack_pairs(v[:, h]) for h in range(hkv)])
    return kernel_attention.prefill_attention(qs[q_start:hi].contiguous(), kp, vp, q_start, k_start, window,
                                              torch.float32)


def _exact(qs, keys, vals, window):
    seq, g = qs.shape[0], qs.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, 1)
    v = vals.double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,shd->hns", qs.double(), k)
    pos = torch.arange(seq)
    hide = pos[None, :] > pos[:, None]
    if window:
        hide |= pos[None, :] <= pos[:, None] - window
    return torch.einsum("hns,shd->nhd", torch.softmax(s.masked_fill(hide, float("-inf")), -1), v)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 45, 300])
def test_online_softmax_is_attention(heads, window):
    qs, keys, vals = _operands(530, 3, heads)
    got = _run(qs, keys, vals, 0, 530, 0, window)
    ref = _exact(qs, keys, vals, window)
    assert (got.double() - ref).abs().max().item() <= 1e-2 * max(1.0, ref.abs().max().item())   # P.V in bf16


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 45])
@pytest.mark.parametrize("cuts", [(1,), (17, 200), (64, 65, 300), (333,)])
def test_a_querys_bits_do_not_depend_on_the_chunking(heads, window, cuts):
    qs, keys, vals = _operands(420, 5, heads)
    whole = _run(qs, keys, vals, 0, 420, 0, window)
    bounds = [0, *cuts, 420]
    for lo, hi in zip(bounds, bounds[1:]):
        first = 0 if not window else max(0, lo - window + 1) // 32 * 32      # _prefill_wide's base
        assert torch.equal(_run(qs, keys, vals, lo, hi - lo, first, window), whole[lo:hi])


def test_a_later_key_start_on_a_multiple_of_32_changes_nothing():
    qs, keys, vals = _operands(400, 7)
    full = _run(qs, keys, vals, 300, 100, 0, 60)              # keys packed from 0 (all before 241 invisible)
    assert torch.equal(_run(qs, keys, vals, 300, 100, 224, 60), full)
    assert torch.equal(_run(qs, keys, vals, 300, 100, 192, 60), full)


@pytest.mark.parametrize("heads", HEADS)
def test_one_token_and_a_rescaled_maximum(heads):
    """A key far above the earlier ones (the reference maximum moves mid-row) and a one-token chunk."""
    qs, keys, vals = _operands(200, 9, heads)
    keys[150:152] = (qs[150:152, ::heads[0] // heads[1]].float() * 40).bfloat16()   # scores ~ 40x the others
    got = _run(qs, keys, vals, 0, 200, 0, None)
    ref = _exact(qs, keys, vals, None)
    assert (got.double() - ref).abs().max().item() <= 1e-2 * max(1.0, ref.abs().max().item())
    assert torch.equal(_run(qs, keys, vals, 199, 1, 0, None), got[199:])
