"""Torch attention backend over the paged KV cache: runs on any device (CPU included) and is the reference.

- Decode sequences (one query each) are batched: one gather of each sequence's visible KV blocks, one
  batched matmul pair. Memory-bound, so it reads only what each query needs (the window for sliding layers).
- Prefill chunks go one sequence at a time, tiled by queries (``PREFILL_TILE``): each tile multiplies only
  against the keys it can see (its window, up to its last query), as two batched matmuls with the GQA group
  folded into the rows (token-major, so MQA needs no copies) and a float32 softmax in between. Over a bf16 cache
  on AVX512-BF16 CPUs (``_prefill_wide``), and in float32 on AVX2 / AVX-512 builds, one C call does every head
  and tile of a chunk (csrc/prefill/).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import engine.kernels.attention as kernel_attention
import engine.kernels.elementwise as elementwise
import engine.kernels.gemm as gemm
import engine.quant.int8_kv as int8_kv
from engine.attention.backend import AttentionBackend
from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata

# Query rows per prefill tile. Small tiles keep a sliding layer's keys per tile near its window
# (tile + window - 1) and let a causal tile skip every key after its last query: faster than SDPA with an
# explicit band mask on the sliding layers and than SDPA's causal kernel on the global ones
# (docs/perf/code-notes-kernels.md).
PREFILL_TILE = 128
# The float32 C kernel (csrc/prefill/) takes every chunk where it builds, one token included, so a prompt's tokens
# get the same bits wherever it was cut: the torch tiles below order their sums otherwise, and sending short chunks
# there to save the kernel's key transpose would make a token depend on its chunk. The kernel everywhere costs
# nothing measurable end to end (docs/perf/code-notes-kernels.md).


class TorchAttentionBackend(AttentionBackend):
    """``native=None`` (default): decode attention uses the C kernel (``engine.kernels.attention``) when it can run the
    tensors and builds here; ``False``: always the pure-torch gather path (tests compare the two). ``prefill``: the
    ``attention`` kernel family's choice (engine.kernels.families) for prefill over a bf16 or int8 cache: "c" (bf16
    into float32 where the build has bf16 dot products) or "torch"; "sdpa" (what a GPU always takes; tests force it
    on the CPU): each chunk in one fused ``scaled_dot_product_attention`` call."""

    name = "torch"

    def __init__(self, native: bool | None = None, prefill: str = "c"):
        self.native = native is not False
        self.prefill = prefill

    def __repr__(self) -> str:
        return f"TorchAttentionBackend(native={self.native}, prefill={self.prefill!r})"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                window: int | None, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Writes k/v into the cache, returns [T, Hq, D]."""
        k_cache, v_cache = kv_cache                                  # [N_blocks, bs, Hkv, D]
        if k_cache.dtype == torch.int8:                              # [N_blocks, block bytes]: int8_kv's layout
            return _forward_int8(self.native, q, k, v, kv_cache, meta, window, scale, self.prefill == "c")
        low = k_cache.dtype
        # bf16 caches: prefill tiles multiply bf16 into float32 (csrc/bf16_gemm/) where that kernel is fast, so
        # scores and outputs are not rounded to bf16; float32 activations then keep a float32 output too.
        wide = (self.native and self.prefill == "c" and low == torch.bfloat16 and q.device.type == "cpu"
                and gemm.bf16_gemm_ok())
        # Elsewhere on the CPU float32 queries read a bf16 cache as float32 (the chunk's keys converted once,
        # float32 matmuls; decode reads the bf16 cache in place): torch's bf16 matmul is ~200x slower than
        # float32 without bf16 units. bf16 queries (bf16 activations) compute in bf16.
        upcast = not wide and low == torch.bfloat16 and q.dtype == torch.float32 and q.device.type == "cpu"
        if low != q.dtype and not (wide or upcast):   # attention in the cache's dtype, output cast back
            return self.forward(q.to(low), k.to(low), v.to(low), kv_cache, meta, window, scale).to(q.dtype)
        write_kv(kv_cache, k, v, meta.slot_mapping)      # converts to the cache's dtype as it stores
        nd = meta.num_decode_seqs
        if nd and nd == meta.num_seqs:  # a decode-only step: the kernel's output is the result (no copy into `out`)
            return _decode(q, k_cache, v_cache, meta, window, scale, self.native)
        if not wide:             # the per-sequence prefill below multiplies this step's k/v in the cache's dtype
            k, v = k.to(low), v.to(low)

        out = torch.empty_like(q)
        if nd:   # float32 queries over a bf16 cache: the kernel keeps them (and the output) float32
            out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, window, scale, self.native)
        qsl, bs = meta.query_start_loc, meta.block_size
        for i in range(nd, meta.num_seqs):
            s, e = qsl[i], qsl[i + 1]
            if wide:             # written in place: out rows s..e are contiguous
                _prefill_wide(q[s:e], k_cache, v_cache, meta.block_tables[i], meta.seq_lens[i], window, scale, bs,
                              out=out[s:e])
                continue
            out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[i],
                                meta.seq_lens[i], window, scale, bs, lambda key, fn, i=i: meta.memo((i, *key), fn),
                                self.native, sdpa=self.prefill == "sdpa" or q.device.type != "cpu")
        return out


def _forward_int8(native: bool, q, k, v, kv_cache, meta: AttentionMetadata, window: int | None,
                  scale: float, c_prefill: bool = True) -> torch.Tensor:
    """``forward`` over an int8 cache (engine.quant.int8_kv). Every key and value is read back quantized, this
    step's too, so a sequence attends to the same values whether its prefix was cached, chunked or computed now.
    Decode: the C kernel reads the int8 rows in place (each group of 32 dequantized into the bf16 dot products on
    AVX512-BF16, into a float32 tile elsewhere). Prefill: the chunk's visible rows dequantized into the bf16
    kernel's operands (``pack_kv_i8``) where that kernel runs, else gathered to float32 (the float32 kernel or
    torch's tiles)."""
    k_cache, v_cache = kv_cache
    hkv, d, bs = k.shape[1], k.shape[2], meta.block_size
    fast = native and kernel_attention.int8_kv_ok(q)
    write_kv(kv_cache, k, v, meta.slot_mapping)               # int8_kv.store: the same bytes from C or torch
    nd = meta.num_decode_seqs

    def decode(qd):
        if fast:
            lens = meta.memo(("decode_lens",), lambda: torch.tensor(meta.seq_lens[:nd], dtype=torch.int32))
            return kernel_attention.paged_decode_i8(qd, k_cache, v_cache, meta.block_tables[:nd], lens, window, scale,
                                               hkv, bs)
        return _decode(qd, k_cache, v_cache, meta, window, scale, hkv=hkv,
                       fetch=lambda cache, blocks: int8_kv.dequantize_blocks(cache, blocks, bs, hkv, d))

    if nd and nd == meta.num_seqs:
        return decode(q)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode(q[:nd])
    wide = fast and c_prefill and gemm.bf16_gemm_ok()

    def pack(kc, vc, table, lo, hi):
        return kernel_attention.pack_kv_i8(kc, vc, table, lo, hi, bs, hkv, d)
    qsl = meta.query_start_loc
    for i in range(nd, meta.num_seqs):
        s, e = qsl[i], qsl[i + 1]
        seq_len, table = meta.seq_lens[i], meta.block_tables[i]
        if wide:
            _prefill_wide(q[s:e], k_cache, v_cache, table, seq_len, window, scale, bs, out=out[s:e], pack=pack)
            continue
        base = _first_key(seq_len - (e - s), window)

        def gather(lo, table=table, seq_len=seq_len):
            return (int8_kv.gather_range(k_cache, table, lo, seq_len, bs, hkv, d),
                    int8_kv.gather_range(v_cache, table, lo, seq_len, bs, hkv, d))
        chunk = (*gather(base), base, gather)
        out[s:e] = _prefill(q[s:e], None, None, None, None, table, seq_len, window, scale, bs, native=native,
                            chunk=chunk)
    return out


def _first_key(start: int, window: int | None) -> int:
    """The first key position any query of a chunk starting at ``start`` sees."""
    return max(0, start - window + 1) if window else 0


def _chunk_keys(k_new, v_new, k_cache, v_cache, table, seq_len: int, n: int, window: int | None, bs: int):
    """The keys and values a chunk's queries can see, [S, Hkv, D], and the position of the first."""
    start = seq_len - n
    lo_all = _first_key(start, window)
    if lo_all >= start:
        return k_new, v_new, start
    return (_gather_range(k_cache, table, lo_all, seq_len, bs), _gather_range(v_cache, table, lo_all, seq_len, bs),
            lo_all)


def _prefill(q, k_new, v_new, k_cache, v_cache, table, seq_len: int, window: int | None, scale: float, bs: int,
             memo=lambda key, fn: fn(), native: bool = False, chunk=None, sdpa: bool = False):
    """One sequence's chunk. q: [n, Hq, D] at positions [seq_len - n, seq_len); k/v_new: [n, Hkv, D]. ``chunk``:
    the visible keys and values [S, Hkv, D], the first one's position, already gathered (an int8 cache), and
    ``gather(lo)`` for them from another first position.

        keys:  lo_all ........... start ......... seq_len
               | cached context   | this chunk    |
    The cache is read only when some query's window reaches back before this chunk. ``sdpa`` (a GPU's, or the
    attention family's "sdpa"): one ``scaled_dot_product_attention`` call for the chunk instead of the tiles.
    """
    n, hq, d = q.shape
    start = seq_len - n
    qs = q * scale                                               # fold the scale into q once
    if native and kernel_attention.prefill_f32_ok(q):                 # every head and tile in one C call
        # the keys from a position aligned to the kernel's column tile, whatever the chunk: its column tiles (and the
        # softmax's vector lanes) then sit at the same absolute positions for every chunking, so a query's sums are
        # the same bits however its prompt was cut; the keys before the window are masked like any invisible one
        base = _first_key(start, window) // kernel_attention.prefill_f32_cols() * kernel_attention.prefill_f32_cols()
        if chunk is not None:                                    # an int8 cache: dequantized from base
            keys, vals = (chunk[0], chunk[1]) if chunk[2] == base else chunk[3](base)
        else:
            keys, vals = _gather_range(k_cache, table, base, seq_len, bs), _gather_range(v_cache, table, base, seq_len,
                                                                                         bs)
        return kernel_attention.prefill_attention_f32(qs, keys, vals, start, base, window)   # (converts a bf16 cache)
    keys, vals, base = chunk[:3] if chunk else _chunk_keys(k_new, v_new, k_cache, v_cache, table, seq_len, n, window,
                                                            bs)
    hkv = keys.shape[1]
    g = hq // hkv
    keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    if sdpa:
        return _prefill_sdpa(q, keys, vals, base, start, window, scale, memo)
    fused_softmax = native and elementwise.elementwise_ok(q)
    out = torch.empty_like(q)
    for ts in range(start, seq_len, PREFILL_TILE):                # absolute query positions [ts, te)
        te = min(ts + PREFILL_TILE, seq_len)
        t = te - ts
        lo = max(base, ts - window + 1) if window else base
        kk, vv = keys[lo - base:te - base], vals[lo - base:te - base]          # [S', Hkv, D]
        # Rows are (token, head-in-group), token-major.
        if hkv == 1:   # MQA: plain 2-D matmuls against contiguous key rows, no copies
            scores = F.linear(qs[ts - start:te - start].reshape(t * g, d), kk.view(-1, d)).view(t, g, -1)
        else:
            qt = qs[ts - start:te - start].view(t, hkv, g, d).transpose(0, 1).reshape(hkv, t * g, d)
            scores = torch.bmm(qt, kk.permute(1, 2, 0)).view(hkv, t, g, -1)
        if fused_softmax:
            probs = elementwise.masked_softmax_(scores, t, g, ts, lo, window)
        else:
            hide = memo(("hide", window, ts), lambda: _tile_mask(ts, te, lo, window, q.device))  # shared by layers
            scores.masked_fill_(hide, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if hkv == 1:
            o = torch.mm(probs.view(t * g, -1), vv.view(-1, d)).view(t, hq, d)
        else:
            o = torch.bmm(probs.view(hkv, t * g, -1), vv.transpose(0, 1))       # [Hkv, t*G, D]
            o = o.view(hkv, t, g, d).transpose(0, 1).reshape(t, hq, d)
        out[ts - start:te - start] = o
    return out


def _prefill_sdpa(q, keys, vals, base: int, start: int, window: int | None, scale: float, memo) -> torch.Tensor:
    """A chunk's attention in one fused call (flash / memory-efficient kernels on CUDA: one launch a layer where the
    tiles took dozens): q [n, Hq, D] at positions [start, start + n), keys and values [S, Hkv, D] from ``base``; the
    mask hides keys after a query and outside its window. Grouped heads are expanded (the fused kernels take equal
    head counts with a mask)."""
    n, hq, d = q.shape
    g = hq // keys.shape[1]
    if g > 1:
        keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)
    s = keys.shape[0]

    def mask():
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]
        k_pos = torch.arange(base, base + s, device=q.device)[None, :]
        seen = k_pos <= q_pos
        return seen & (q_pos - k_pos < window) if window else seen
    visible = memo(("sdpa_mask", window, start, n, base, s), mask)           # shared by the layers
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         vals.transpose(0, 1)[None], attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)


def _prefill_wide(q, k_cache, v_cache, table, seq_len: int, window: int | None, scale: float, bs: int,
                  out: torch.Tensor | None = None, pack=kernel_attention.pack_kv):
    """``_prefill`` for a bf16 cache with both products in float32 (``engine.kernels.attention.prefill_attention``:
    bf16 dot products into float32, csrc/prefill/): q [n, Hq, D] in bf16 or float32 (scaled, then rounded to bf16
    once), keys and values as cached; scores, softmax and the output in float32 (returned in q's dtype, into ``out``
    when given). The visible keys and values are packed once, straight from the cache (``pack(k_cache, v_cache,
    table, lo, hi)``: by default ``engine.kernels.attention.pack_kv``, an int8 cache passes ``pack_kv_i8``; the
    chunk's own keys and values are already written there); the kernel tiles the queries, each tile's keys starting
    at an even offset (value pairs) with the extra key at either end masked like any invisible one."""
    n = q.shape[0]
    start = seq_len - n
    # keys from a multiple of 32 whatever the chunk (csrc/prefill/driver.h PREFILL_BF16_ALIGN): vdpbf16ps sums each
    # value pair before the running total and AMX's TDPBF16PS sums 16 pairs in its own order, so a pair or chunk
    # boundary that moved with the chunk's start changed a query's rounding (the same prompt chunked otherwise gave
    # other greedy tokens); the keys before the first visible one are masked like any invisible key
    base = _first_key(start, window) // 32 * 32
    kp, vp = pack(k_cache, v_cache, table, base, seq_len)
    qs = (q * scale).to(torch.bfloat16).contiguous()
    return kernel_attention.prefill_attention(qs, kp, vp, start, base, window, q.dtype, out=out)


def _tile_mask(ts: int, te: int, lo: int, window: int | None, device) -> torch.Tensor:
    """[t, 1, te-lo] True where key position k is hidden from query position q (k > q, or out of window)."""
    q_pos = torch.arange(ts, te, device=device)[:, None]
    k_pos = torch.arange(lo, te, device=device)[None, :]
    hide = k_pos > q_pos
    if window:
        hide |= k_pos <= q_pos - window
    return hide[:, None, :]


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


def _decode(q, k_cache, v_cache, meta, window, scale, native: bool = False, hkv: int | None = None, fetch=None):
    """One query per sequence. q: [Bd, Hq, D] -> [Bd, Hq, D].

    Rows of the two batched matmuls are (sequence, KV head): with one KV head (MQA) every reshape is a view and
    the keys enter the first matmul as a transposed view (no copy beyond the block gather). ``fetch(cache, blocks)``
    -> [len(blocks), bs, Hkv, D]: how whole blocks are read (default: index_select; an int8 cache dequantizes).
    """
    bd, hq, d = q.shape
    if native and kernel_attention.supports(q, k_cache):   # reads K/V in place: no gather copy
        lens = meta.memo(("decode_lens",), lambda: torch.tensor(meta.seq_lens[:bd], dtype=torch.int32))
        return kernel_attention.paged_decode(q, k_cache, v_cache, meta.block_tables[:bd], lens, window, scale)
    blocks, valid = meta.memo(("decode", window), lambda: _decode_gather_index(meta, window, q.device))
    hkv = hkv or k_cache.shape[2]
    fetch = fetch or (lambda cache, idx: cache.index_select(0, idx))
    g = hq // hkv
    L = valid.shape[1]
    kk = fetch(k_cache, blocks).view(bd, L, hkv, d).transpose(1, 2).reshape(bd * hkv, L, d)
    vv = fetch(v_cache, blocks).view(bd, L, hkv, d).transpose(1, 2).reshape(bd * hkv, L, d)
    qq = (q * scale).view(bd * hkv, g, d)
    scores = torch.bmm(qq, kk.to(q.dtype).transpose(1, 2))      # [Bd*Hkv, G, L]
    hide = meta.memo(("decode_hide", window, hkv), lambda: (~valid).repeat_interleave(hkv, 0)[:, None, :])
    scores.masked_fill_(hide, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, vv.to(q.dtype)).view(bd, hq, d)
