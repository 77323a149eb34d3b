"""pipeline.job.token_count: the dry run's document token counts equal the tokenizer's own, on the default model's
tokenizer (sample documents and adversarial text), with a cold and a warm cache, and a tokenizer outside the
reasoning falls back to tokenizing."""
import random

import pyarrow.parquet as pq
import pytest

from pipeline.job import token_count
from pipeline.job.prompts import PromptRenderer
from pipeline.job.token_count import TokenCounter
from tests.model_utils import tiny_tokenizer


@pytest.fixture(scope="module")
def gemma():
    from engine.setup import PlanningEngine
    return PlanningEngine("gemma-3-270m").tokenizer


def _truth(tok, docs):
    return [len(tok.encode(d, add_special_tokens=False)) for d in docs]


def _adversarial(n: int, seed: int = 0) -> list[str]:
    """Short strings over what the reasoning has to get right: spaces and runs of them, "▁" typed by the user,
    ">" (Gemma's one "X▁" token is ">▁</"), newline and tab runs and "<table>"-like text (added tokens, matched
    before the BPE), multi-byte text and emoji (byte fallback)."""
    rng = random.Random(seed)
    alphabet = list("ab >▁\n\t<x[]") + [" ", "  ", "\n\n", "é", "中", "🙂", "\r", ">▁</", "</td>", "\u00a0",
                                        "the", " word", "\n" * 40, "\t" * 33, "-> ", ".", "<start_of_turn>", "<table> ",
                                        "[multimodal]", "> </"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def test_gemma_tokenizer_structure_is_recognised(gemma):
    c = TokenCounter.for_tokenizer(gemma)
    assert c is not None
    assert c._keep.__self__.pattern == "[>]"             # from the vocabulary's one "X▁" token, ">▁</"
    assert c._fallback_chars == ()                       # no added token holds a space


def test_counts_equal_the_tokenizer_on_sample_and_adversarial_text(gemma):
    rows = pq.read_table("sample_data/documents.parquet").to_pylist()
    docs = [r["document"] for r in rows] + [r["reference"] for r in rows][:20] + _adversarial(3000)
    c = TokenCounter.for_tokenizer(gemma)
    truth = _truth(gemma, docs)
    assert c.lengths(docs) == truth                      # cold cache
    assert c.lengths(docs) == truth                      # every piece cached
    assert c.lengths(list(reversed(docs))) == truth[::-1]
    assert c.lengths([]) == []


def test_counts_stay_exact_when_the_cache_is_cleared(gemma, monkeypatch):
    monkeypatch.setattr(token_count, "CACHE_MAX", 50)
    c = TokenCounter.for_tokenizer(gemma)
    docs = _adversarial(400, seed=1)
    truth = _truth(gemma, docs)
    for i in range(0, 400, 100):
        assert c.lengths(docs[i:i + 100]) == truth[i:i + 100]
    assert len(c._first) + len(c._rest) + len(c._pieces_cache) <= 50 + 400


def test_other_tokenizers_are_tokenized_as_before():
    tok = tiny_tokenizer()                                # byte-level BPE: not the structure above
    assert TokenCounter.for_tokenizer(tok) is None
    docs = ["hello world", "  two  spaces ", "", "ünïcode"]
    from pipeline.job.job_file import PromptSpec
    r = PromptRenderer(PromptSpec(), tok)
    assert r.document_lengths(docs) == [len(ids) for ids in r.document_ids(docs)] == _truth(tok, docs)
