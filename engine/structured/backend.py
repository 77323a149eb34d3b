"""The grammar backend interface: what the engine asks of a constraint library (llguidance today).

    backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)   # one per engine (tokenizer prepared once)
    grammar = backend.compile(params)          # cached per params.key; StructuredOutputError when unusable
    matcher = backend.new_matcher(grammar)     # one per request

A ``Matcher`` follows one request's output token by token. Token ids are the model's; ids the tokenizer does
not know are never allowed. EOS is not a grammar token here: the engine allows it exactly where
``is_accepting()``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch


class Matcher(Protocol):
    def validate(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a prefix) the grammar accepts from the current state; the state is unchanged."""

    def consume(self, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (and ``error`` set) when one is not allowed."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed."""

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out`` (int32 [ceil(vocab / 32)], bit i of word w: token 32w + i)."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model would choose (not consumed)."""

    def is_accepting(self) -> bool:
        """The output so far is a complete match: EOS may end it."""

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow."""

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (a grammar error met mid-way, a token it refused), or None."""


class Backend(Protocol):
    vocab_size: int

    def compile(self, params) -> Any:
        """The compiled grammar for ``StructuredOutputsParams``; raises StructuredOutputError."""

    def new_matcher(self, grammar: Any) -> Matcher: ...


class LRU:
    """A small least-recently-used map: compiled grammars per ``params.key`` (a job has a handful)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self.misses = 0

    def get(self, key, make: Callable[[], Any]):
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        value = self._items[key] = make()
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value
