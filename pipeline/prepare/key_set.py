"""A set of strings held as sorted 16-byte digests: 16 bytes a member instead of a Python string in a set (~100-150
bytes). ``prepare`` keeps the committed row keys (and their ids) of an incremental run in two of these, so a cron
run over millions of rows does not hold every key as a Python object. Membership is by digest (blake2b, 128 bits:
two different strings share one with probability ~n / 2^128, as for the row keys' own content hashes)."""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np


def digests(strings: Iterable[str]) -> np.ndarray:
    """[n, 2] uint64: each string's 128-bit digest as (high, low) words."""
    buf = bytearray()
    for s in strings:
        buf += hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return np.frombuffer(bytes(buf), dtype=">u8").astype(np.uint64).reshape(-1, 2)


class KeySet:
    def __init__(self, parts: Iterable[np.ndarray] = ()):
        """From digests made batch by batch (``digests``), so only they are ever held."""
        parts = list(parts)
        d = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.uint64)
        order = np.lexsort((d[:, 1], d[:, 0]))
        self._hi, self._lo = d[order, 0].copy(), d[order, 1].copy()

    def __len__(self) -> int:
        return len(self._hi)

    def __bool__(self) -> bool:
        return len(self._hi) > 0

    def __contains__(self, s: str) -> bool:
        return bool(self.contains(digests([s]))[0]) if len(self._hi) else False

    def contains(self, d: np.ndarray) -> np.ndarray:
        """Membership of each digest (rows of ``digests(...)``)."""
        if not len(self._hi) or not len(d):
            return np.zeros(len(d), dtype=bool)
        hi, lo = d[:, 0], d[:, 1]
        left = np.searchsorted(self._hi, hi, side="left")
        right = np.searchsorted(self._hi, hi, side="right")
        one = right - left == 1                         # the high word matches once: the low word decides
        out = one & (self._lo[np.minimum(left, len(self._lo) - 1)] == lo)
        for i in np.nonzero(right - left > 1)[0]:       # high words repeated (~never): each candidate's low word
            out[i] = bool((self._lo[left[i]:right[i]] == lo[i]).any())
        return out

    def contains_all(self, strings: list[str]) -> np.ndarray:
        """Membership of each string (none hashed when the set is empty)."""
        return self.contains(digests(strings)) if len(self._hi) else np.zeros(len(strings), dtype=bool)


__all__ = ["KeySet", "digests"]
