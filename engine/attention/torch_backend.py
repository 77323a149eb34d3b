"""Torch attention backend over the paged KV cache: runs on any device (CPU included) and is the reference.

- Decode sequences (one query each) are batched: one gather of each sequence's window of keys/values, one
  batched matmul pair. Memory-bound, so it reads only what each query needs (the window for sliding layers).
- Prefill chunks go one sequence at a time through scaled_dot_product_attention. A chunk with no cached
  context that fits its window uses the plain causal kernel. Otherwise queries are tiled by the window so a
  sliding layer attends to at most ~2 windows of keys per tile instead of masking a full square.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                window: int | None, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Writes k/v into the cache, returns [T, Hq, D]."""
        k_cache, v_cache = kv_cache                                  # [N_blocks, bs, Hkv, D]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)           # [N_blocks * bs, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

        out = torch.empty_like(q)
        nd = meta.num_decode_seqs
        if nd:
            out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, window, scale)
        qsl, bs = meta.query_start_loc, meta.block_size
        for i in range(nd, meta.num_seqs):
            s, e = qsl[i], qsl[i + 1]
            seq_len = meta.seq_lens[i]
            start = seq_len - (e - s)
            if start == 0 and (window is None or e - s <= window):
                out[s:e] = _sdpa(q[s:e], k[s:e], v[s:e], None, scale, causal=True)
                continue
            table = meta.block_tables[i]
            tile = window or (e - s)
            for ts in range(start, seq_len, tile):                 # absolute query positions [ts, te)
                te = min(ts + tile, seq_len)
                lo = max(0, ts - window + 1) if window else 0
                kk = _gather_range(k_cache, table, lo, te, bs)     # [te-lo, Hkv, D]
                vv = _gather_range(v_cache, table, lo, te, bs)
                q_pos = torch.arange(ts, te, device=q.device)[:, None]
                k_pos = torch.arange(lo, te, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if window:
                    mask &= k_pos > q_pos - window
                r0 = s + ts - start
                out[r0:r0 + te - ts] = _sdpa(q[r0:r0 + te - ts], kk, vv, mask, scale, causal=False)
        return out


def _sdpa(q, k, v, mask, scale, causal):
    # q: [L, Hq, D], k/v: [S, Hkv, D] -> [L, Hq, D]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
        v.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


def _gather_range(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int, bs: int) -> torch.Tensor:
    """Positions [lo, hi) of one sequence, from whole blocks: [hi-lo, Hkv, D]."""
    b0, b1 = lo // bs, (hi - 1) // bs + 1
    blocks = cache.index_select(0, table[b0:b1].long())          # [nb, bs, Hkv, D]
    flat = blocks.reshape(-1, *cache.shape[2:])
    off = lo - b0 * bs
    return flat[off:off + hi - lo]


def _decode_gather_index(meta: AttentionMetadata, window: int | None, device):
    """Whole blocks [Bd * NB] covering every decode sequence's visible keys, and a validity mask [Bd, NB*bs].

    Gathering whole blocks (contiguous block_size * Hkv * D rows) is far cheaper than gathering token by
    token. Shared by all layers with the same window.
    """
    nd, bs = meta.num_decode_seqs, meta.block_size
    lens = torch.tensor(meta.seq_lens[:nd], device=device)
    lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    first = lo // bs
    last = (lens - 1) // bs                                       # inclusive
    width = int((last - first).max()) + 1
    logical = torch.minimum(first[:, None] + torch.arange(width, device=device)[None, :], last[:, None])
    phys = meta.block_tables[:nd].long().gather(1, logical)      # [Bd, NB]
    pos = first[:, None] * bs + torch.arange(width * bs, device=device)[None, :]
    valid = (pos >= lo[:, None]) & (pos < lens[:, None])          # [Bd, NB*bs]
    return phys.reshape(-1), valid


def _decode(q, k_cache, v_cache, meta, window, scale):
    """One query per sequence. q: [Bd, Hq, D] -> [Bd, Hq, D]."""
    blocks, valid = meta.memo(("decode", window), lambda: _decode_gather_index(meta, window, q.device))
    bd, hq, d = q.shape
    hkv = k_cache.shape[2]
    L = valid.shape[1]
    kk = k_cache.index_select(0, blocks).view(bd, L, hkv, d).to(q.dtype)   # [Bd, L, Hkv, D]
    vv = v_cache.index_select(0, blocks).view(bd, L, hkv, d).to(q.dtype)
    qq = q.view(bd, hkv, hq // hkv, d)                            # [Bd, Hkv, G, D]
    scores = torch.matmul(qq, kk.permute(0, 2, 3, 1)).float() * scale  # [Bd, Hkv, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, vv.transpose(1, 2)).reshape(bd, hq, d)
