"""IncrementalDetokenizer with tiny tokenizers trained here (no download): a byte-level BPE and a
SentencePiece-style one (metaspace + byte fallback + leading-space strip)."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 👋🌍 Café naïve résumé.",
    "東京は日本の首都です。我喜欢学习中文。",
    "Summaries: END of document. STOP here.",
    "emoji 🎉🎉 party 🚀 rocket, then ### done",
]
TEXTS = SENTENCES + ["Brand new words: 🤖 robots ドキュメント 요약 ", "a🎉b東c"]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    # Llama-2 style: "▁" for spaces, unknown characters as <0xNN> byte tokens, first leading space stripped.
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    ascii_alphabet = [chr(c) for c in range(32, 127)] + ["▁"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"], show_progress=False,
                                  initial_alphabet=ascii_alphabet, limit_alphabet=len(ascii_alphabet))
    tok.train_from_iterator(SENTENCES, trainer)
    # The <0xNN> byte tokens are ordinary vocabulary (not special), as in real SentencePiece models.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token="<eos>", unk_token="<unk>")


TOKENIZERS = ["byte_bpe", "sentencepiece_like"]


def run(tokenizer, ids, params=None):
    """Feed ids one at a time; return the detokenizer and the text seen after each append."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params or SamplingParams())
    seen = []
    for token_id in ids:
        stopped = detok.append(token_id)
        seen.append(detok.text)
        if stopped:
            break
    detok.flush()
    return detok, seen


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_equals_full_decode(name, skip_special, request):
    tokenizer = request.getfixturevalue(name)
    params = SamplingParams(skip_special_tokens=skip_special)
    eos = tokenizer.eos_token_id
    for text in TEXTS + [" ".join(TEXTS)]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Special tokens in the middle (at a character boundary) and at the end.
        mid = next(k for k in range(len(ids) // 2, len(ids) + 1) if "\ufffd" not in tokenizer.decode(ids[:k]))
        ids = ids[:mid] + [eos] + ids[mid:] + [eos]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
        detok, seen = run(tokenizer, ids, params)
        assert detok.text == expected
        for partial in seen:                               # never half a character, always a prefix
            assert "\ufffd" not in partial
            assert expected.startswith(partial)
    if skip_special:
        assert "<eos>" not in detok.text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_split_across_tokens(name, request):
    tokenizer = request.getfixturevalue(name)
    text = "a🎉b東c🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)                            # the tokenizer really splits characters into bytes
    _, seen = run(tokenizer, ids)
    # Each step shows only whole characters: the visible text grows through exactly these prefixes.
    assert set(seen) <= {text[:i] for i in range(len(text) + 1)}
    assert seen[-1] == text


def test_stop_string_spanning_tokens_is_truncated(byte_bpe):
    text = "Summaries: END of document. STOP here."
    ids = byte_bpe.encode(text)
    stop = "document. ST"
    # The stop string is not one token: it is completed across several appends.
    assert not any(stop in byte_bpe.decode([i]) for i in ids)
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=[stop, "never"]))
    assert detok.text == "Summaries: END of "
    assert detok.stop_reason == stop
    assert detok.finished


def test_include_stop_str_in_output(byte_bpe):
    ids = byte_bpe.encode("Summaries: END of document. STOP here.")
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=["END"], include_stop_str_in_output=True))
    assert detok.text == "Summaries: END"
    assert detok.stop_reason == "END"


def test_stop_returns_true_once_and_ignores_later_tokens(byte_bpe):
    ids = byte_bpe.encode("Hello world! 👋🌍 Café")
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=["world"]))
    results = [detok.append(i) for i in ids]
    assert results.count(True) == len(results) - results.index(True)   # True from the hit on
    assert detok.text == "Hello "
    assert detok.flush() == "Hello "


def test_stop_string_with_multibyte_characters(byte_bpe):
    text = "東京は日本の首都です。我喜欢学习中文。"
    ids = byte_bpe.encode(text)
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=["首都"]))
    assert detok.text == "東京は日本の"
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=["首都"], include_stop_str_in_output=True))
    assert detok.text == "東京は日本の首都"


def test_first_completed_stop_wins(byte_bpe):
    ids = byte_bpe.encode("The quick brown fox jumps")
    detok, _ = run(byte_bpe, ids, SamplingParams(stop=["brown fox", "quick"]))
    assert (detok.text, detok.stop_reason) == ("The ", "quick")


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_texts_match_full_decode_truncated_at_stop(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    pieces = "The fox 👋 東京 Café ### END 🎉 요약 dog. ".split(" ") + ["🚀🚀", "naïve", "é"]
    for _ in range(30):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        stop = rng.choice(["END", "🎉", "fox 👋", "##", "é"])
        include = rng.random() < 0.5
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        cut = full.find(stop)
        expected = full if cut < 0 else full[:cut + (len(stop) if include else 0)]
        detok, _ = run(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include))
        assert detok.text == expected, (text, stop)
        assert detok.stop_reason == (None if cut < 0 else stop)


def test_flush_emits_a_trailing_incomplete_character(byte_bpe):
    ids = byte_bpe.encode("ok 🎉", add_special_tokens=False)[:-1]    # cut the emoji's last byte off
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams())
    for i in ids:
        detok.append(i)
    assert detok.text in ("ok", "ok ")                     # the half character is held back...
    assert detok.flush() == byte_bpe.decode(ids)           # ...until the request finishes
    assert detok.text.endswith("\ufffd")


def test_window_stays_small_for_long_outputs(byte_bpe):
    ids = byte_bpe.encode(" ".join(TEXTS * 20), add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams())
    longest = 0
    for i in ids:
        detok.append(i)
        longest = max(longest, len(detok._window))
    assert len(ids) > 1000 and longest <= 16               # O(new tokens) decoding, not the whole output
    assert detok.flush() == byte_bpe.decode(ids)
