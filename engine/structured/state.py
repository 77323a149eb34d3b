"""One request's grammar state (``Request.grammar``), kept in step with its output tokens.

The matcher has consumed exactly the request's output tokens (``sync`` restores that after anything cut them:
a stop string, a length limit in the middle of forced tokens). A preempted request keeps its outputs and its
matcher, so recomputing its KV changes nothing here. EOS is never consumed: it ends the request, and is allowed
exactly where the grammar accepts.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engine.structured.backend import Matcher


class RequestGrammar:
    def __init__(self, matcher: Matcher, vocab_size: int, eos_token_ids):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = tuple(int(t) for t in eos_token_ids)
        self._seen: list[int] = []     # the output tokens the matcher has seen (EOS among them is not consumed)
        self.num_masks_applied = 0
        self.mask_time_s = 0.0
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    @property
    def error(self) -> str | None:
        return self.matcher.error

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to exactly ``output_token_ids`` (normally a no-op)."""
        n = len(output_token_ids)
        if len(self._seen) > n:
            self.matcher.rollback(sum(1 for t in self._seen[n:] if t not in self.eos))
            del self._seen[n:]
        if len(self._seen) < n:
            self.advance(output_token_ids[len(self._seen):], forced=False)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (the check made before any mask is built)."""
        if token in self.eos:
            return self.matcher.is_accepting()
        return token < self.vocab_size and self.matcher.validate([token]) == 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (speculation's drafts) the grammar allows in a row; a draft stops at EOS."""
        n = 0
        while n < len(tokens) and tokens[n] not in self.eos:
            n += 1
        return self.matcher.validate(list(tokens[:n])) if n else 0

    def fill(self) -> None:
        """Compute the mask of the allowed next tokens (one full mask: counted), EOS where the grammar accepts."""
        t0 = time.perf_counter()
        self.matcher.fill_bitmask(self._bitmask)
        words = self._bitmask.numpy().view(np.uint32)           # shares the tensor's memory
        accepting = self.matcher.is_accepting()
        for e in self.eos:
            bit = np.uint32(1 << (e & 31))
            words[e >> 5] = (words[e >> 5] | bit) if accepting else (words[e >> 5] & ~bit)
        self.num_masks_applied += 1
        self.mask_time_s += time.perf_counter() - t0

    def allowed(self, fill: bool = True) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (``fill=False``: the mask of the last ``fill``)."""
        if fill:
            self.fill()
        t0 = time.perf_counter()
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:self.vocab_size]
        allowed = torch.from_numpy(bits.view(np.bool_).copy())
        self.mask_time_s += time.perf_counter() - t0
        return allowed

    def allowed_ids(self, limit: int) -> torch.Tensor | None:
        """The last ``fill``'s allowed token ids (ascending int64), or None when there are more than ``limit``."""
        words = self._bitmask.numpy().view(np.uint32)
        nonzero = np.flatnonzero(words)
        if len(nonzero) > limit:
            return None
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32).view(np.bool_)
        ids = (nonzero[:, None] * 32 + np.arange(32))[bits]
        ids = ids[ids < self.vocab_size]
        return None if len(ids) > limit else torch.from_numpy(ids.astype(np.int64))

    def advance(self, tokens: list[int], forced: bool = True) -> list[int]:
        """Consume ``tokens`` (the step's chosen ones). Returns the tokens the grammar forces after them (already
        consumed; EOS when nothing else can follow), [] when ``forced`` is off or after an error or EOS."""
        for t in tokens:
            self._seen.append(int(t))
            if t in self.eos:
                return []
            if not self.matcher.consume([int(t)]):
                return []
        if not forced or self.matcher.error:
            return []
        out = [] if self.matcher.is_stopped() else [int(t) for t in self.matcher.forced_tokens()]
        if out and not self.matcher.consume(out):
            return []
        if self.matcher.is_stopped():
            out.append(self.eos[0])
        self._seen.extend(out)
        return out
