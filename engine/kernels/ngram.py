"""N-gram proposals in C (csrc/ngram.c): many requests' contexts in one call (``engine.spec_decode.ngram`` holds the
rule and its plain-Python reference)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.kernels.binding import KernelLibrary


def propose_batch(lib: KernelLibrary, contexts: Sequence[Sequence[int]], k: int, n_min: int,
                  n_max: int) -> list[list[int]]:
    """One proposal (possibly empty) per context, k > 0."""
    lens = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=len(contexts))
    offsets = np.zeros(len(contexts) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate([np.asarray(c, dtype=np.int32) for c in contexts]) if contexts else np.zeros(0, np.int32)
    out = np.zeros((len(contexts), k), dtype=np.int32)
    counts = np.zeros(len(contexts), dtype=np.int32)
    lib.ngram_propose_batch(flat.ctypes.data, offsets.ctypes.data, len(contexts), n_min, n_max, k,
                            out.ctypes.data, counts.ctypes.data)
    return [out[i, :counts[i]].tolist() for i in range(len(contexts))]
