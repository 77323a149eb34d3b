"""Hugging Face checkpoint directories: ``*.safetensors``, single file or sharded with an index."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loader.lazy_weights import LazyWeights


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index}: shard files missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def lazy_safetensors_weights(path: Path, dtype: torch.dtype, device="cpu") -> LazyWeights:
    """The checkpoint's tensors, each read from its (memory-mapped) file in ``dtype`` when asked for."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files: dict[str, object] = {}
    where: dict[str, Path] = {}
    for f in safetensors_files(Path(path)):
        try:
            files[str(f)] = handle = safe_open(str(f), framework="pt", device="cpu")
            where.update((name, f) for name in handle.keys())
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None

    def get(name: str) -> torch.Tensor:
        f = where[name]
        try:
            return files[str(f)].get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({e})") from None
    return LazyWeights(where, get)


def load_safetensors_weights(path: Path, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at once (tests; loading goes through ``lazy_safetensors_weights``)."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(Path(path)):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    weights[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None
    return weights
