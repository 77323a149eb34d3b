"""The flash-attn backend's metadata, checked on CPU: it is called with a plain-torch stand-in that implements
``flash_attn_varlen_func``'s paged contract, and must equal the torch backend on mixed prefill/decode batches
with cached prefixes and sliding windows (no GPU has been lent to run the real kernel)."""
from __future__ import annotations

import pytest
import torch

from engine.attention.flash_backend import FLASH_BLOCK_SIZE, FlashAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend


def varlen_standin(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                   causal=False, window_size=(-1, -1), softcap=0.0, block_table=None, **unsupported):
    """flash_attn_varlen_func (flash-attn 2, paged KV) in float32 torch.

    q [total_q, Hq, D]; k/v the paged caches [num_blocks, page, Hkv, D] when ``block_table`` [B, max_blocks]
    int32 is given; cu_seqlens_q/k [B+1] int32. Causal masks align bottom-right (query i of a q_len chunk sits at
    key position k_len - q_len + i); ``window_size=(left, right)`` keeps keys in [pos - left, pos + right]
    (-1: unbounded).
    """
    assert not unsupported, unsupported
    assert block_table is not None and block_table.dtype == torch.int32
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert k.shape[1] % 256 == 0, "flash-attn 2 pages in multiples of 256"
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qe - qs <= max_seqlen_q and k_len <= max_seqlen_k and qe - qs <= k_len
        nblk = -(-k_len // k.shape[1])
        blocks = block_table[b, :nblk].long()
        keys = k[blocks].reshape(-1, hkv, d)[:k_len].repeat_interleave(hq // hkv, dim=1).float()
        vals = v[blocks].reshape(-1, hkv, d)[:k_len].repeat_interleave(hq // hkv, dim=1).float()
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(k_len - (qe - qs), k_len)[:, None]
        kpos = torch.arange(k_len)[None, :]
        keep = torch.ones(qe - qs, k_len, dtype=torch.bool)
        if causal:
            keep &= kpos <= qpos
        left, right = window_size
        if left >= 0:
            keep &= kpos >= qpos - left
        if right >= 0:
            keep &= kpos <= qpos + right
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vals).to(q.dtype)
    return out


# (context already cached, new tokens this step): two decodes first, then a chunk after a cached prefix that
# spans pages, and a fresh prompt
SEQS = [(299, 1), (40, 1), (420, 100), (0, 37)]


def _batch(hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = FLASH_BLOCK_SIZE
    nblocks = sum(-(-(c + n) // bs) for c, n in SEQS) + 2
    perm = torch.randperm(nblocks, generator=g)
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    width = max(-(-(c + n) // bs) for c, n in SEQS)
    tables = torch.zeros(len(SEQS), width, dtype=torch.int32)
    slots, qsl, lens, used = [], [0], [], 0
    for i, (c, n) in enumerate(SEQS):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
        lens.append(c + n)
    T = qsl[-1]
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)

    def meta():
        return AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=list(qsl), seq_lens=list(lens),
                                 block_tables=tables, num_decode_seqs=2, block_size=bs)
    return q, k, v, (k_cache, v_cache), meta


@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (2, 2)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("window", [None, 7, 300])
def test_flash_backend_equals_torch_backend_on_mixed_batches(heads, window):
    hq, hkv = heads
    q, k, v, cache, meta = _batch(hq, hkv, 32)
    scale = 0.17
    ref_cache = tuple(c.clone() for c in cache)
    ref = TorchAttentionBackend(native=False).forward(q, k, v, ref_cache, meta(), window, scale)
    flash = FlashAttentionBackend(varlen=varlen_standin)
    m = meta()
    flash.prepare(m)
    assert m.cu_seqlens_k_t.tolist() == [0, 300, 341, 861, 898]
    got = flash.forward(q, k, v, cache, m, window, scale)
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])   # same K/V writes
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_flash_block_size():
    flash = FlashAttentionBackend(varlen=varlen_standin)
    assert [flash.block_size_for(b) for b in (16, 256, 512)] == [256, 256, 512]
    assert TorchAttentionBackend().block_size_for(16) == 16


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_engine_with_flash_backend_gives_the_torch_backends_tokens(arch, tmp_path):
    """Whole engine steps (chunked prefill, prefix hits across pages, decode, sampled-rows metadata) with the
    flash backend's metadata: the same greedy tokens as the torch backend."""
    from engine import LLM, SamplingParams
    from engine.model_runner import bind_kv_caches
    from tests.model_utils import save_tiny, tiny_hf_model
    save_tiny(tiny_hf_model(arch), tmp_path)
    shared = [(7 * i) % 190 + 3 for i in range(520)]               # two full 256-token pages, shared
    prompts = [shared + [(11 * i + j) % 190 + 3 for i in range(30 + 9 * j)] for j in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("torch", "flash"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=256, num_gpu_blocks_override=12,
                  max_num_batched_tokens=300)
        if name == "flash":
            llm.runner.backend = FlashAttentionBackend(varlen=varlen_standin)
            bind_kv_caches(llm.model, llm.runner.kv_caches, llm.runner.backend)
        first = llm.generate([prompts[0]], params)                 # caches the shared pages
        rest = llm.generate(prompts[1:], params)
        assert all(o.num_cached_tokens == 512 for o in rest)
        outs[name] = [o.token_ids for o in first + rest]
    assert outs["flash"] == outs["torch"]
