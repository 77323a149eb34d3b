"""kv_cache_dtype: a bf16 KV cache under float32 activations (int8's): half the bytes per block, so twice the
blocks in the same memory; attention runs in bf16 (prefill and decode) and its outputs stay close to float32's;
invalid values and mismatches are clear errors."""
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.setup import setup_engine
from tests.model_utils import VOCAB, run_chunks, save_tiny, tiny_hf_model


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-kv-{request.param}")
    save_tiny(tiny_hf_model(request.param), path)
    return path


def test_values_checked():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="fp8")


def test_auto_follows_the_activations_and_bf16_doubles_the_blocks(tiny_dir):
    mem = 8 << 20
    f32 = setup_engine(EngineConfig(str(tiny_dir), "float32", kv_cache_memory=mem))
    bf16kv = setup_engine(EngineConfig(str(tiny_dir), "float32", kv_cache_memory=mem, kv_cache_dtype="bfloat16"))
    assert f32.config.kv_cache_dtype == "float32" and f32.kv_dtype == torch.float32
    assert bf16kv.config.kv_cache_dtype == "bfloat16" and bf16kv.kv_dtype == torch.bfloat16
    assert bf16kv.config.dtype == "float32"
    assert bf16kv.num_kv_blocks // 2 == f32.num_kv_blocks          # floor(budget / half the bytes)
    bf16 = setup_engine(EngineConfig(str(tiny_dir), "bfloat16", kv_cache_memory=mem))
    assert bf16.config.kv_cache_dtype == "bfloat16"


def test_bf16_cache_close_to_float32_in_prefill_chunks_and_decode(tiny_dir, monkeypatch, tmp_path):
    """Teacher-forced through chunked prefill (cached keys read back) and single-token decode steps."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=8 << 20)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, VOCAB, (150,), generator=g).tolist()
    chunks = [60, 40, 1, 1, 1, 47]
    ref = run_chunks(llm.model, seq, chunks, block_size=16)
    low = run_chunks(llm.model, seq, chunks, block_size=16, dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and not torch.equal(ref, low)          # the cache really was bf16
    lr, lo = F.log_softmax(ref, -1), F.log_softmax(low, -1)
    kl = (lr.exp() * (lr - lo)).sum(-1)
    assert kl.max() < 1e-3 and (lr.argmax(-1) == lo.argmax(-1)).float().mean() > 0.9, kl.max()


def test_engine_generates_with_a_bf16_cache(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=8 << 20)
    assert all(k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for k, v in llm.runner.kv_caches)
    assert llm.info.config.kv_cache_dtype == "bfloat16"
    prompts = [[5, 6, 7, 8] * 10 + [i + 9] for i in range(3)]               # a shared prefix: cache hits
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6, 6] and all(o.error is None for o in outs)
    assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("prefill", ["c", "torch"])
def test_float32_queries_read_a_bf16_cache_as_float32_without_the_bf16_kernel(tiny_dir, monkeypatch, tmp_path,
                                                                              prefill):
    """Without the bf16 attention kernel (AVX2-only builds), or with the ``attention`` family set to torch, float32
    queries read the bf16 cache as float32 and multiply in float32 (no CPU-flag rule: AMX is no exception). Only
    the stored keys/values are rounded, so the result stays within 1e-3 KL of the float32 cache."""
    import engine.attention.torch_backend as torch_backend
    import engine.kernels.gemm as gemm
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    if prefill == "c":
        monkeypatch.setattr(gemm, "bf16_gemm_ok", lambda: False)
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=8 << 20)
    seq = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    chunks = [60, 40, 1, 1, 1, 47]
    ref = F.log_softmax(run_chunks(llm.model, seq, chunks, block_size=16), -1)

    def wide(*a, **k):
        raise AssertionError("the bf16 kernel's prefill was taken")
    monkeypatch.setattr(torch_backend, "_prefill_wide", wide)
    low = run_chunks(llm.model, seq, chunks, block_size=16, dtype=torch.bfloat16, prefill=prefill)
    assert low.dtype == torch.float32
    kl = (ref.exp() * (ref - F.log_softmax(low, -1))).sum(-1)
    assert 0 < kl.abs().max() < 1e-3
