"""Our tokenizers vs transformers' GGUF tokenizer: same ids, round-trips, a fast cache, chat templates."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import gguf
import pytest

import engine.tokenizer as tokmod
from engine.loader.resolve import ModelSource, resolve_model
from engine.tokenizer import load_tokenizer

FIXED = [
    "", " ", "  ", "\n", "\n\n\n", "\t\t x", "Hello world", "Hello  world  ", " leading space", "trailing space ",
    "The quick brown fox jumps over the lazy dog.", "naïve café — déjà vu", "Ünïcödé ÀÉÎÕÜ ß ø å",
    "日本語のテキストです。", "中文文本，包含标点。", "한국어 문장입니다", "Привет, мир!", "مرحبا بالعالم", "שלום עולם",
    "हिन्दी पाठ", "ภาษาไทย", "🤗🚀✨ emoji 👩‍👩‍👧‍👦 family 🏳️‍🌈 flag", "😀😃😄😁😆😅😂🤣", "ﬁ ﬂ ligatures ½ ² ℃",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "SELECT * FROM t WHERE a = 'b' AND c <> 3;", "<html><body class=\"x\">&amp;</body></html>",
    "{\"key\": [1, 2.5, -3e10, null, true]}", "3.14159 2718281828 1,000,000 -42 0x1F 1e-9",
    "12345678901234567890", "2024-01-31T12:34:56Z", "a\u200bb\u200dc\ufeffd", "tab\tsep\tvalues\n1\t2\t3",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>inline special<eos>", "<unk> <pad> <mask>",
    "\r\n windows \r\n line endings", "    indented\n        more", "a" * 300, "ab " * 100, "!!!???...,,,;;;",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Program Files\\x", "~`@#$%^&*()_+-=[]{}|",
]
POOL = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789     \n\t.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`"
        "éèêëàâäôöûüçñßøåæœ日本語中文한국어ÄÖÜ🤗🚀😀👍🏽❤️\u200b\u00a0")


def _corpus() -> list[str]:
    rng = random.Random(1234)
    out = list(FIXED)
    for _ in range(260):
        n = rng.randint(1, 80)
        out.append("".join(rng.choice(POOL) for _ in range(n)))
    words = [w for s in FIXED for w in s.split()]
    for _ in range(60):
        out.append(rng.choice(["", " ", "  "]).join(rng.choice(words) for _ in range(rng.randint(1, 12))))
    return out


CORPUS = _corpus()


@pytest.fixture(scope="module")
def default_source():
    return resolve_model("gemma-3-270m")


@pytest.fixture(scope="module")
def reference(default_source):
    """transformers' own GGUF tokenizer (the slow conversion, ~15-25 s here)."""
    from transformers import AutoTokenizer
    path = default_source.path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(default_source, reference, tmp_path_factory):
    """Our loader, fresh (cache empty) then cached, with the cache in a temp dir.

    The fresh path runs exactly transformers' conversion, so it is handed the reference result instead of
    converting a second time (~20 s); what we test is everything around it and the cache round trip.
    """
    cache = tmp_path_factory.mktemp("cache")
    calls = []
    real_convert = tokmod.convert_gguf_tokenizer

    def convert_reusing_reference(path):
        from transformers import AutoTokenizer
        calls.append(path)
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: reference)
            return real_convert(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHGEN_CACHE_DIR", str(cache))
        mp.setattr(tokmod, "convert_gguf_tokenizer", convert_reusing_reference)
        fresh = load_tokenizer(default_source)
        assert len(calls) == 1
        t = time.perf_counter()
        cached = load_tokenizer(default_source)
        cached_s = time.perf_counter() - t
        assert len(calls) == 1, "second load must come from the cache"
    return {"fresh": fresh, "cached": cached, "cached_s": cached_s, "cache_dir": cache}


def test_cache_written_and_fast(ours):
    dirs = [d for d in (ours["cache_dir"] / "tokenizers").iterdir() if d.is_dir()]
    assert len(dirs) == 1 and (dirs[0] / "tokenizer.json").is_file()
    assert len(dirs[0].name) == 64                      # the model identity
    # ~0.6 s on an idle machine (a 262k vocab, 515k merges); generous bound for a busy shared one
    assert ours["cached_s"] < 5.0, f"cached tokenizer load took {ours['cached_s']:.2f}s"


@pytest.mark.parametrize("which", ["fresh", "cached"])
def test_ids_match_transformers(ours, reference, which):
    tok = ours[which]
    mismatches = []
    for s in CORPUS:
        for special in (True, False):
            a = tok(s, add_special_tokens=special)["input_ids"]
            b = reference(s, add_special_tokens=special)["input_ids"]
            if a != b:
                mismatches.append((s, special, a, b))
    assert not mismatches, mismatches[:3]
    batch = tok(CORPUS[:50])["input_ids"]
    assert batch == reference(CORPUS[:50])["input_ids"]


def test_special_tokens_and_bos(ours, reference):
    tok = ours["cached"]
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert tok("hi")["input_ids"][0] == 2                # Gemma adds BOS
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert len(tok) == len(reference) == 262144
    assert tok.all_special_ids == reference.all_special_ids


def test_decode_round_trips(ours, reference):
    tok = ours["cached"]
    for s in CORPUS:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s
        assert tok.decode(ids) == reference.decode(ids)
        with_bos = tok(s)["input_ids"]
        assert tok.decode(with_bos, skip_special_tokens=True) == reference.decode(with_bos, skip_special_tokens=True)


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch, default_source, reference):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    from engine.loader.resolve import model_identity
    d = tmp_path / "tokenizers" / model_identity(default_source)
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text("{broken")
    (d / tokmod._MARKER).write_text(tokmod._CACHE_VERSION)
    monkeypatch.setattr(tokmod, "convert_gguf_tokenizer", lambda path: reference)
    tok = load_tokenizer(default_source)
    assert tok is reference
    assert json.loads((d / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_hf_dir_tokenizer(tmp_path, reference):
    reference.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    tok = load_tokenizer(ModelSource(kind="hf", path=tmp_path, name="x"))
    for s in CORPUS[:40]:
        assert tok(s)["input_ids"] == reference(s)["input_ids"]


# ---- a GGUF that carries a chat template ------------------------------------------------------------------
def _byte_level_gguf(path: Path, template: str | None) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = list(bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt", "he", "Ġthe"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(2)
    w.add_bos_token_id(0)
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_chat_template_survives_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path / "tiny.gguf"
    _byte_level_gguf(path, template)
    src = ModelSource(kind="gguf", path=path, name="tiny")
    msgs = [{"role": "user", "content": "the the"}]
    expect = "<|im_start|>user\nthe the<|im_end|>\n<|im_start|>assistant\n"
    for _ in range(2):                                   # fresh, then cached
        tok = load_tokenizer(src)
        assert tok.chat_template == template
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == expect
        ids = tok(" the the", add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids) == ["Ġthe", "Ġthe"] and tok.decode(ids) == " the the"


def test_default_model_gets_gemma_chat_template():
    """The default GGUF ships no chat template; Gemma's turn format is supplied."""
    from engine.loader import resolve_model
    from engine.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model("gemma-3-270m"))
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Summarize: hi "}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nSummarize: hi<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_prompt_renderer_batch_ids_equal_transformers(ours, reference):
    """PromptRenderer.document_ids goes straight to the Rust tokenizer: the same ids as transformers' own call."""
    from pipeline.job.job_file import PromptSpec
    from pipeline.job.prompts import PromptRenderer
    r = PromptRenderer(PromptSpec(document_column="document"), ours["cached"])
    docs = CORPUS + ["", "  leading spaces", "émoji 🙂 and\nnewlines\n\n"]
    assert r.document_ids(docs) == list(reference(docs, add_special_tokens=False)["input_ids"])
