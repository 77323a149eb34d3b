"""The llguidance backend: the tokenizer it needs, compiled grammars (validated), a matcher per request.

llguidance needs every token's bytes and a trie over them ("preparing the tokenizer"): seconds for a 262k
vocabulary. It is done once per tokenizer and process (``prepared_tokenizer``) and the token bytes are kept on
disk beside the tokenizer cache (``<cache>/tokenizers/<model identity>/llguidance-*.npz``): llguidance cannot
serialise its tokenizer, but from the cached bytes it builds it without parsing ``tokenizer.json`` again.
Figures: docs/perf/zen5-epyc-structured.md.
"""
from __future__ import annotations

import copy
import os
import tempfile
import threading
import weakref
from pathlib import Path

import llguidance as llg
import numpy as np
import torch

from engine.cache_root import tokenizers_dir
from engine.structured.backend import LRU
from engine.structured.llguidance_grammar import grammar_problem, grammar_text
from engine.structured.params import StructuredOutputError, StructuredOutputsParams, check_structured

_CACHE_FORMAT = "1"


def validate(params: StructuredOutputsParams, tokenizer: llg.LLTokenizer | None = None) -> str:
    """The grammar text once llguidance accepts it; else StructuredOutputError (naming the keyword)."""
    try:
        grammar = grammar_text(params)
    except ValueError as e:
        raise StructuredOutputError(f"structured_outputs.{params.kind}: {e}") from None
    problem = grammar_problem(grammar, tokenizer)
    if problem is not None:
        message, keyword = problem
        raise StructuredOutputError(f"structured_outputs.{params.kind}: {message}", keyword=keyword)
    return grammar


class LLGuidanceMatcher:
    """engine.structured.backend.Matcher over an ``llguidance.LLMatcher``."""

    def __init__(self, matcher: llg.LLMatcher):
        self._m = matcher

    def validate(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens)

    def consume(self, tokens: list[int]) -> bool:
        return self._m.consume_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


class LLGuidanceBackend:
    """One per engine: the prepared tokenizer and the compiled grammars (a matcher per ``params.key``, copied
    for each request: copying is cheaper than compiling)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_key: str | None = None):
        self.vocab_size = vocab_size
        self.ll_tokenizer = prepared_tokenizer(tokenizer, vocab_size, eos_token_ids, cache_key)
        self._compiled = LRU()

    def compile(self, params: StructuredOutputsParams) -> llg.LLMatcher:
        """Checked (``check_structured``, then llguidance with this tokenizer) and compiled once per ``params.key``."""
        def make():
            check_structured(params)
            grammar = validate(params, self.ll_tokenizer)
            matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise StructuredOutputError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
            return matcher
        return self._compiled.get(params.key, make)

    def new_matcher(self, grammar: llg.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(grammar.deep_copy())


# ---- the prepared tokenizer ------------------------------------------------------------------------------
_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def prepared_tokenizer(tokenizer, vocab_size: int, eos_token_ids, cache_key: str | None = None) -> llg.LLTokenizer:
    """llguidance's tokenizer for ``tokenizer`` (a transformers fast tokenizer) over ``vocab_size`` ids (the
    model's; ids past the tokenizer's are never allowed). Once per tokenizer object in a process; with
    ``cache_key`` (the model identity) the token bytes come from, or go to, the disk cache."""
    eos = _eos(tokenizer, eos_token_ids)
    with _lock:
        per_tok = _prepared.setdefault(tokenizer, {})
        key = (vocab_size, eos)
        if key not in per_tok:
            per_tok[key] = _prepare(tokenizer, vocab_size, eos, cache_key)
        return per_tok[key]


def _eos(tokenizer, eos_token_ids) -> int:
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return int(min(eos_token_ids))


def _cache_file(cache_key: str, vocab_size: int) -> Path:
    return tokenizers_dir() / cache_key / f"llguidance-{_CACHE_FORMAT}-{vocab_size}.npz"


def _prepare(tokenizer, vocab_size: int, eos: int, cache_key: str | None) -> llg.LLTokenizer:
    path = _cache_file(cache_key, vocab_size) if cache_key else None
    if path is not None and path.is_file():
        try:
            with np.load(path) as z:
                blob, offsets, special = z["blob"].tobytes(), z["offsets"], z["special"].tolist()
            tokens = [blob[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
            # NOTE: built from token bytes llguidance ignores n_vocab: ids the tokenizer lacks become special
            # tokens no grammar names, so never allowed.
            special += range(len(tokens), vocab_size)
            tokens += [b"<[batchgen-no-token-%d]>" % i for i in range(len(tokens), vocab_size)]
            return llg.LLTokenizer(_Wrapper(tokenizer, tokens, special, eos))
        except Exception:                    # NOTE: a damaged cache is rebuilt, never fatal
            path.unlink(missing_ok=True)
    backend = copy.copy(tokenizer.backend_tokenizer)    # padding and truncation off on a copy, the caller's kept
    backend.no_padding()
    backend.no_truncation()
    ll_tok = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if path is not None:
        _save(ll_tok, len(tokenizer), path)
    return ll_tok


def _save(ll_tok: llg.LLTokenizer, num_tokens: int, path: Path) -> None:
    n = min(num_tokens, ll_tok.vocab_size)
    tokens = [ll_tok.decode_bytes([i]) for i in range(n)]
    special = np.array([i for i in range(n) if ll_tok.is_special_token(i)], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(t) for t in tokens])
    blob = np.frombuffer(b"".join(tokens), dtype=np.uint8)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, blob=blob, offsets=offsets, special=special)
        os.replace(tmp, path)
    except OSError:
        pass                                 # NOTE: an unwritable cache only costs speed


class _Wrapper:
    """What ``llguidance.LLTokenizer`` takes instead of tokenizer.json: token bytes, special ids, an encoder."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, tokens: list[bytes], special: list[int], eos: int):
        self.tokens, self.special_token_ids, self.eos_token_id = tokens, special, eos
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = tokenizer.backend_tokenizer.encode

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text, add_special_tokens=False).ids
