"""A checkpoint's tensors by Hugging Face name, each read (or made up) only when it is asked for.

A loader copies one tensor at a time into the model it builds, so the whole checkpoint never sits in memory beside
that model: a Llama-3.1-8B checkpoint read into a dict of float32 tensors alone is 30 GB, more than the 24 GB
machines batchgen runs on (its int8 model is 8.5 GB).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch


class LazyWeights(Mapping):
    """``names`` in their order; ``weights[name]`` calls ``get(name)`` (a fresh tensor each time)."""

    def __init__(self, names: Iterable[str], get: Callable[[str], torch.Tensor]):
        self._names = list(dict.fromkeys(names))
        self._known = set(self._names)
        self._get = get

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known


__all__ = ["LazyWeights"]
