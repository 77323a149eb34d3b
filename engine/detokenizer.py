"""Incremental detokenization of one request's output, and stop-string detection.

Each step decodes only a short sliding window of token ids, not the whole output (O(new tokens) per step):

    window ids:   [ prefix_offset ........ read_offset ......... new ]
                    |-- already emitted --|-- not emitted yet ------|
    new text = decode(window) minus decode(window[:read_offset])

Text is held back while the window decodes to a trailing U+FFFD, i.e. a multi-byte UTF-8 character split
across tokens, so ``text`` never holds half a character. The prefix tokens give the decoder context
(e.g. SentencePiece's leading-space handling), so the pieces join up to ``tokenizer.decode(output_ids)``.

NOTE: the window starts at the first *output* token (the prompt is not used as context), so that the final
text equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` exactly, as the pipeline expects.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive; stops at the first stop string.

    Usage::

        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        for token_id in ...:
            if detok.append(token_id):      # a stop string was hit; detok.text ends at it
                break
        text = detok.flush()                 # on finish: also emits bytes still held back (see flush)
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.stop_reason: str | None = None
        self.finished = False
        self._skip_special = params.skip_special_tokens
        self._window: list[int] = []      # output ids from prefix_offset on
        self._read_offset = 0             # into _window: ids before it are already emitted
        self._prefix_text = ""            # decode(_window[:_read_offset])
        self._chunks: list[str] = []      # emitted text pieces; joined lazily by .text
        self._text_cache: str | None = ""
        self._stops = params.stop
        # The last (longest stop - 1) emitted chars: enough to find a stop string spanning a token boundary.
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""

    @property
    def text(self) -> str:
        """Output text so far: no half characters, nothing from the stop string on (unless
        ``include_stop_str_in_output``, then up to the stop string's end)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    def append(self, token_id: int) -> bool:
        """Add one output token; returns True when a stop string was hit (then further appends are ignored)."""
        if self.finished:
            return True
        self._window.append(int(token_id))
        full = self._decode(self._window)
        if full.endswith(_REPLACEMENT_CHAR) or len(full) < len(self._prefix_text):
            return False                  # mid-character (or a decoder quirk): wait for more tokens
        new_text = full[len(self._prefix_text):]
        if not new_text:
            self._read_offset = len(self._window)   # e.g. a skipped special token: nothing to emit
            return False
        # Slide the window: what was "unread" becomes the prefix for the next decode.
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window) if self._window else ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Call when the request finishes for another reason (EOS, length): emits text still held back
        (a trailing incomplete character then shows as U+FFFD, as in a full decode). Returns ``text``."""
        if not self.finished and len(self._window) > self._read_offset:
            full = self._decode(self._window)
            if len(full) > len(self._prefix_text):
                self._emit(full[len(self._prefix_text):])
            self._window.clear()
            self._read_offset = 0
            self._prefix_text = ""
        self.finished = True
        return self.text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def _emit(self, new_text: str) -> bool:
        """Append ``new_text``; on a stop string, keep text only up to it and return True."""
        if not self._stops:
            self._push(new_text)
            return False
        searched = self._tail + new_text
        hit = self._find_stop(searched)
        if hit is None:
            self._push(new_text)
            self._tail = searched[-self._tail_len:] if self._tail_len else ""
            return False
        start, stop = hit
        end = start + len(stop) if self.params.include_stop_str_in_output else start
        # `searched` begins len(_tail) chars before new_text; those chars are already in the emitted text.
        cut = end - len(self._tail)
        if cut >= 0:
            self._push(new_text[:cut])
        else:
            text = self.text
            self._chunks = [text[:len(text) + cut]]
            self._text_cache = None
        self.stop_reason = stop
        self.finished = True
        return True

    def _find_stop(self, searched: str) -> tuple[int, str] | None:
        """The stop string that completes first in ``searched`` (earliest end; ties -> earliest start)."""
        best = None
        for stop in self._stops:
            start = searched.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start)
            if best is None or key < best[0]:
                best = (key, start, stop)
        return None if best is None else (best[1], best[2])

    def _push(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._text_cache = None
