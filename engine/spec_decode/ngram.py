"""N-gram (prompt lookup) proposals for many requests at once: ``propose_batch(contexts, k, n_min, n_max)``.

A request's context is its prompt plus its output so far. The proposal for it is the up-to-``k`` tokens that
followed the most recent earlier occurrence of its last ``n`` tokens, for the longest ``n`` in
``[n_min, n_max]`` that occurs earlier (vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``). Summaries copy
spans of their document, which is in the prompt, so these drafts are often accepted.

``propose_reference`` is the same rule in plain Python: the tests hold the C version (csrc/ngram.c) to it, and
it serves when no kernel library builds.
"""
from __future__ import annotations

from typing import Sequence

import engine.kernels.library as library
import engine.kernels.ngram as kernel_ngram


def propose_reference(context: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    ctx = list(context)
    L = len(ctx)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ctx[L - n:]
        for p in range(L - n - 1, -1, -1):
            if ctx[p:p + n] == suffix:
                return ctx[p + n:p + n + k]
    return []


def propose_batch(contexts: Sequence[Sequence[int]], k: int, n_min: int = 2, n_max: int = 5,
                  lib=None) -> list[list[int]]:
    """One proposal (possibly empty) per context."""
    lib = lib or library.load()
    if lib is None or k <= 0:
        return [propose_reference(c, k, n_min, n_max) if k > 0 else [] for c in contexts]
    return kernel_ngram.propose_batch(lib, contexts, k, n_min, n_max)
