"""The real default model (gemma-3-270m Q4_K_M GGUF): our engine vs transformers loading the same file.

Reference: transformers' own GGUF reader and dequantization (load_gguf_checkpoint) into its Gemma3ForCausalLM,
float32 on both sides. The prompt is longer than the 512-token sliding window.
Tolerance: max |logit diff| <= 2e-3 * max |logit| (Q4_K_M weights dequantized identically; float32 math).
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import bind_kv_caches
from tests.model_utils import hf_from_gguf, hf_greedy, run_chunks
from tests.test_gguf_loader import _copy_without_vocab

pytestmark = pytest.mark.slow

TEXT = ("Maintenance report for pump station 4. On Monday the north pump tripped twice after the pressure "
        "sensor reported values above 9 bar. The technician replaced the seal kit, flushed the intake and "
        "recalibrated the sensor; the pump then ran for six hours without a fault. ") * 12


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    llm = LLM("gemma-3-270m", dtype="float32", quantization="none", max_num_batched_tokens=256)   # the float path
    slim = tmp_path_factory.mktemp("gguf") / "slim.gguf"
    _copy_without_vocab(llm.source.path, slim)
    hf = hf_from_gguf(slim)
    return llm, hf


def test_logits_match_transformers(engines):
    llm, hf = engines
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) > 600                      # beyond the 512-token window
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # our model, prefilled in chunks over its paged cache (a cached prefix for the later chunks)
    ours = run_chunks(llm.model, ids, [300, len(ids) - 300], block_size=16)
    tol = 2e-3 * ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= tol
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_32_greedy_tokens_identical(engines):
    llm, hf = engines
    bind_kv_caches(llm.model, llm.runner.kv_caches, llm.backend)   # run_chunks rebound the caches
    ids = llm.get_tokenizer().encode(TEXT)[:200]
    ours = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, ids, 32)
