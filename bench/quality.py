"""How faithful bf16 and int8 are to float32, measured teacher-forced on real text (the quantization bar).

    batchgen bench --quality [--model M] [--positions 2000]

Each variant (float32 / bfloat16 / int8 weights with float32 activations, with its KV cache and attention in
float32 or, ``kv_cache_dtype: bfloat16``, in bf16 / int8 with bf16 activations) runs
the same token sequences (the sample documents under their system prompt and reference) through the model in
one prefill per sequence; at every position we compare its next-token distribution with float32's: top-1
agreement and mean KL(fp32 || variant). The bar int8 must meet: top-1 agreement >= bf16's and mean KL <= 2x
bf16's.
"""
from __future__ import annotations

import gc
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

import engine.quant.int8_kv as int8_kv
from engine import LLM
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model_runner import bind_kv_caches

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "documents.parquet"
# (name, dtype, quantization, kv_cache_dtype[, kernels]); the int8 variants' prompt rows (every position here: the
# sequences are teacher-forced) through the int8 dot products unless a variant names the int8_prompts family
_DOT = {"int8_prompts": "int8"}
VARIANTS = (("float32", "float32", "none", "auto"), ("bfloat16", "bfloat16", "none", "auto"),
            ("int8 (fp32 act.)", "float32", "int8", "float32", _DOT),
            ("int8 (fp32 act., bf16 KV)", "float32", "int8", "bfloat16", _DOT),
            ("int8 (fp32 act., int8 KV)", "float32", "int8", "int8", _DOT),
            ("int8 (bf16 act.)", "bfloat16", "int8", "auto", _DOT))
# where the CPU has AMX-BF16: int8 weights whose prompt rows multiply bf16 activations by the bf16-dequantized
# weights (engine.kernels.families int8_prompts "bf16"); teacher-forced, every position is a prompt row
AMX_PROMPTS = ("int8 (bf16 prompt rows, bf16 KV)", "float32", "int8", "bfloat16", {"int8_prompts": "bf16"})


def variants_here() -> tuple:
    """VARIANTS, plus the AMX prompt rows' where they run."""
    from engine.kernels.qlinear import prompt_amx_ok
    return VARIANTS + ((AMX_PROMPTS,) if prompt_amx_ok() else ())


def bind_cache(model, num_blocks: int, block_size: int, dtype=torch.float32, native: bool | None = None,
               prefill: str = "c"):
    """A fresh zeroed paged KV cache for ``model`` (tests and teacher-forced measurements); ``prefill``: the
    attention family's implementation (engine.kernels.families)."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    if dtype == torch.int8:                       # kv_cache_dtype: int8 (engine.quant.int8_kv)
        shape = int8_kv.pool_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.model.layers]
    bind_kv_caches(model, caches, TorchAttentionBackend(native, prefill))


@torch.inference_mode()
def sequence_logits(model, token_ids: list[int], chunks: list[int], block_size: int = 4,
                    block_ids: list[int] | None = None, native: bool | None = None,
                    dtype: torch.dtype = torch.float32, prefill: str = "c") -> torch.Tensor:
    """Feed one sequence in chunks of the given sizes through a fresh paged cache; return logits [T, V].

    block_ids: the physical blocks of the sequence (default: a shuffled table, to exercise indirection).
    native: False forces the pure-torch decode attention (default: the C kernel where it builds).
    """
    n = len(token_ids)
    assert sum(chunks) == n
    nblocks = -(-n // block_size)
    if block_ids is None:
        g = torch.Generator().manual_seed(1)
        block_ids = torch.randperm(nblocks + 3, generator=g)[:nblocks].tolist()
    bind_cache(model, max(block_ids) + 1, block_size, dtype=dtype, native=native, prefill=prefill)
    out = []
    start = 0
    for c in chunks:
        pos = list(range(start, start + c))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in pos]),
            query_start_loc=[0, c], seq_lens=[start + c],
            block_tables=torch.tensor([block_ids], dtype=torch.int32),
            num_decode_seqs=1 if c == 1 else 0, block_size=block_size)
        h = model(torch.tensor(token_ids[start:start + c]), torch.tensor(pos), meta)
        out.append(model.compute_logits(h))
        start += c
    return torch.cat(out)


def sample_sequences(tokenizer, positions: int, max_len: int = 700) -> list[list[int]]:
    """Sample documents under their system prompt and reference, each cut at max_len tokens, >= positions."""
    seqs, total = [], 0
    for r in pq.read_table(SAMPLE).to_pylist():
        text = f"{r['system']}\n\nReference:\n{r['reference']}\n\nDocument:\n{r['document']}\n\nSummary:"
        seqs.append(tokenizer.encode(text)[:max_len])
        total += len(seqs[-1])
        if total >= positions:
            break
    return seqs


def measure(model: str = "gemma-3-270m", positions: int = 2000, variants=None, log=print) -> dict:
    """{variant: {"top1": ..., "kl": ..., "positions": ...}}; the first variant (float32) is the reference.

    Every variant's engine is loaded at once and each sequence goes through all of them before the next, so
    memory holds one sequence's distributions (~0.7 GB at 700 positions of a 262k vocabulary), not all of them
    (~1 GB per 1,000 positions): 20,000+ positions fit."""
    variants = variants if variants is not None else variants_here()
    llms = [LLM(model, dtype=dtype, quantization=quant, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                kernels=dict(kernels[0]) if kernels else None)
            for _, dtype, quant, kv, *kernels in variants]
    seqs = sample_sequences(llms[0].get_tokenizer(), positions)
    stats = {name: [0, 0.0, 0] for name, *_ in variants[1:]}          # agree, KL sum, positions

    def logprobs(llm, s):
        kv_dtype = llm.runner.kv_caches[0][0].dtype
        return F.log_softmax(sequence_logits(llm.model, s, [len(s)], 16, dtype=kv_dtype).float(), -1)

    for s in seqs:
        ref = logprobs(llms[0], s)
        p_ref, top_ref = ref.exp(), ref.argmax(-1)
        for (name, *_), llm in zip(variants[1:], llms[1:]):
            lp = logprobs(llm, s)
            st = stats[name]
            st[0] += int((top_ref == lp.argmax(-1)).sum())
            st[1] += float((p_ref * (ref - lp)).sum())
            st[2] += ref.shape[0]
            del lp
        del ref, p_ref
    results = {}
    for (name, *_), llm in zip(variants[1:], llms[1:]):
        agree, kl, n = stats[name]
        results[name] = {"top1": agree / n, "kl": kl / n, "positions": int(n),
                         "weight_mb": round(llm.info.weight_bytes / 1e6, 1)}
        log(f"{name:26s} top-1 agreement {agree / n:.4f}  mean KL {kl / n:.6f}  weights "
            f"{llm.info.weight_bytes / 1e6:.0f} MB")
    del llms
    gc.collect()
    return results


def meets_bar(results: dict, int8: str = "int8 (fp32 act.)") -> bool:
    b, q = results["bfloat16"], results[int8]
    return q["top1"] >= b["top1"] and q["kl"] <= 2 * b["kl"]
