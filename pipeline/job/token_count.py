"""Exact document token counts for dry runs (``batchgen plan``) without running the BPE over every document.

A SentencePiece-style BPE tokenizer (Gemma's, Llama 2's: spaces normalized to "▁", no pre-tokenizer that
splits) merges over the whole text, so the Rust tokenizer can cache nothing and a 100,000-row plan spends
most of its time there. But a merge can only join text across a boundary if some vocabulary token contains
the two characters on either side of it. Before each "▁" whose left neighbour is a character that never
precedes "▁" inside a token (for Gemma: anything but "▁" and ">", from the one token ">▁</"), no merge can
cross, so the BPE of the text is the concatenation of the BPE of its pieces. Pieces repeat (words), so each
distinct piece is tokenized once (in a batch, by the Rust tokenizer itself) and its count cached.

Added tokens are matched on the raw text before the BPE and split it into segments. One without a space in it
never spans a cut (cuts are only before spaces), so a piece's own encoding finds it exactly as the whole
text's does (Gemma's "\\n" x 1..31, "\\t" x 1..31, "<start_of_turn>", "<table>", ...); a document containing
the first character of an added token that holds a space is counted by the tokenizer itself.
``TokenCounter.for_tokenizer`` returns None for tokenizers this reasoning does not cover (then the caller
tokenizes as before); the tests compare every count with the tokenizer's own.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_SPACE = "▁"
CACHE_MAX = 1_000_000      # distinct pieces kept (cleared when full: memory stays flat in the number of rows)


class TokenCounter:
    def __init__(self, backend, no_split_after: set[str], fallback_chars: set[str]):
        self._encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # A piece: "▁"* then characters, where a character of no_split_after keeps a following "▁" run in the
        # piece; or a trailing "▁" run.
        keep = "".join(re.escape(c) for c in sorted(no_split_after))
        sp = re.escape(_SPACE)
        body = f"[^{sp}{keep}]" + (f"|[{keep}]{sp}*" if keep else "")
        self._pieces = re.compile(f"{sp}*(?:{body})+|{sp}+").findall
        self._keep = re.compile(f"[{keep}]").search if keep else None
        self._fallback_chars = tuple(sorted(fallback_chars))
        self._first: dict[str, int] = {}          # a document's first piece (no "▁" before it)
        self._rest: dict[str, int] = {}           # part p of a split document: the piece "▁" + p
        self._pieces_cache: dict[str, int] = {}   # whole pieces of the regex path

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "TokenCounter | None":
        """A counter for this (transformers fast) tokenizer, or None when its structure is not the one above."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            model, norm, pre = backend.model, backend.normalizer, backend.pre_tokenizer
            norm = json.loads(norm.__getstate__()) if norm is not None else None
            pre = json.loads(pre.__getstate__()) if pre is not None else None
            if (type(model).__name__ != "BPE" or model.dropout or model.ignore_merges
                    or model.continuing_subword_prefix or model.end_of_word_suffix):
                return None
            vocab = backend.get_vocab(with_added_tokens=False)
            added = list(backend.get_added_tokens_decoder().values())
        except Exception:        # NOTE: not a Rust tokenizer we can inspect: the caller tokenizes as before
            return None
        if norm != {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}:
            return None
        # A Split on " " after the normalizer replaced every " " splits nothing.
        if pre is not None and not (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}):
            return None
        no_split_after = set(re.findall(f"([^{_SPACE}\n])(?={_SPACE})", "\n".join(vocab)))
        if any("\n" + _SPACE in t for t in vocab if "\n" in t):
            no_split_after.add("\n")
        fallback = set()
        for a in added:
            c = a.content
            if not c or a.lstrip or a.rstrip or a.single_word:
                return None
            if " " in c or _SPACE in c:                 # could span a cut: such documents are tokenized
                fallback.add(c[0])
        return cls(backend, no_split_after, fallback)

    def lengths(self, documents: list[str]) -> list[int]:
        """Token counts (no special tokens), equal to ``len(tokenizer.encode(d, add_special_tokens=False))``."""
        out: list[int | None] = [None] * len(documents)
        slow, split, regex = [], [], []
        for i, d in enumerate(documents):
            if any(c in d for c in self._fallback_chars):
                slow.append(i)
            elif _SPACE in d or "  " in d or (self._keep is not None and self._keep(d)):
                regex.append((i, self._pieces(d.replace(" ", _SPACE))))
            else:
                split.append(i)
        if slow:
            for i, e in zip(slow, self._encode([documents[i] for i in slow], add_special_tokens=False)):
                out[i] = len(e)
        if len(self._first) + len(self._rest) + len(self._pieces_cache) > CACHE_MAX:
            self._first.clear(), self._rest.clear(), self._pieces_cache.clear()
        if split:
            for i, n in zip(split, self._split_lengths([documents[i] for i in split])):
                out[i] = int(n)
        if regex:
            cache = self._pieces_cache
            self._fill(cache, set().union(*(ps for _, ps in regex)).difference(cache), "")
            get = cache.__getitem__
            for i, ps in regex:
                out[i] = sum(map(get, ps))
        return out  # type: ignore[return-value]

    def _split_lengths(self, docs: list[str]) -> np.ndarray:
        """The common case (no "▁", no double space, no character that keeps a following space), in Arrow's
        C++ kernels: every " " starts a piece, so splitting at " " gives the pieces (after the first, each
        stands for "▁" + part)."""
        parts = pc.split_pattern(pa.array(docs, pa.large_string()), " ")
        flat, starts = pc.list_flatten(parts), parts.offsets.to_numpy()[:-1]    # every list has >= 1 part
        rest = self._lookup(self._rest, flat, _SPACE)
        firsts = flat.take(pa.array(starts))
        return np.add.reduceat(rest, starts) - rest[starts] + self._lookup(self._first, firsts, "")

    def _lookup(self, cache: dict[str, int], pieces: pa.Array, prefix: str) -> np.ndarray:
        """Counts of ``prefix + piece`` for every piece, the distinct ones not yet cached counted first."""
        uniq = pc.unique(pieces)
        keys = uniq.to_pylist()
        self._fill(cache, {k for k in keys if k not in cache}, prefix)
        counts = np.fromiter((cache[k] for k in keys), dtype=np.int64, count=len(keys))
        return counts[pc.index_in(pieces, value_set=uniq).to_numpy()]

    def _fill(self, cache: dict[str, int], missing: set[str], prefix: str) -> None:
        """Count the pieces ``prefix + p`` with the tokenizer itself, in one batch."""
        if missing:
            keys = list(missing)
            for p, e in zip(keys, self._encode([prefix + p for p in keys], add_special_tokens=False)):
                cache[p] = len(e)


@lru_cache(maxsize=4)
def counter_for(tokenizer) -> TokenCounter | None:
    """One counter (and its cache) per tokenizer object, built on first use (~0.5 s for a 262k vocabulary)."""
    return TokenCounter.for_tokenizer(tokenizer)


__all__ = ["TokenCounter", "counter_for"]
