"""Requests that take another's result instead of being computed (found by ``pipeline.prepare.dedup``): 16 bytes
a copy, nothing per other request."""
from __future__ import annotations

import numpy as np


class Copies:
    """Which requests take another's result: ``first[i]`` computes, ``copy[i]`` takes its result (request indices;
    sorted by ``first``, then ``copy``)."""

    def __init__(self, first: np.ndarray, copy: np.ndarray):
        by = np.lexsort((copy, first))
        self.first, self.copy = first[by], copy[by]
        self._sorted = np.sort(copy)

    def __len__(self) -> int:
        return len(self.copy)

    def of(self, request: int) -> np.ndarray:
        """The copies of ``request`` (request indices; none for most)."""
        a, b = np.searchsorted(self.first, [request, request + 1])
        return self.copy[a:b]

    def among(self, start: int, stop: int) -> np.ndarray:
        """Per request ``start``..``stop``-1: whether it is a copy."""
        a, b = np.searchsorted(self._sorted, [start, stop])
        out = np.zeros(stop - start, dtype=bool)
        out[self._sorted[a:b] - start] = True
        return out


NO_COPIES = Copies(np.zeros(0, np.int64), np.zeros(0, np.int64))


__all__ = ["Copies", "NO_COPIES"]
