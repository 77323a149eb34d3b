"""The peers' copy of a ``load_format: dummy`` model: the same made-up weights batchgen computes with
(``engine.loader.dummy``), written once as a Hugging Face checkpoint (sharded safetensors + index + config.json)
for vLLM and OpenVINO to load.

    python -m bench.dummy_checkpoint bench/models/qwen2.5-0.5b-instruct OUT_DIR [--dtype bfloat16] [--seed 0]

Shards hold about 2 GB each and are written one at a time, so an 8B model needs one shard's memory, not 16 GB.
The directory has no tokenizer: prompts go in as token ids (vLLM's ``skip_tokenizer_init``).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from engine.loader.dummy import dummy_tensor, hf_shapes
from engine.models.config import ModelConfig

SHARD_BYTES = 2 << 30
MARK = "batchgen-dummy.json"        # what the directory was written from: config, dtype, seed


def _shards(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = itemsize * math.prod(shape)
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def write_checkpoint(config_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the checkpoint (idempotent: a directory already written from the same config, dtype and seed is
    kept). Returns ``out_dir``."""
    from safetensors.torch import save_file

    config_dir, out_dir = Path(config_dir), Path(out_dir)
    raw = json.loads((config_dir / "config.json").read_text())
    mark = {"config": raw, "dtype": str(dtype).removeprefix("torch."), "seed": seed}
    if (out_dir / MARK).is_file() and json.loads((out_dir / MARK).read_text()) == mark:
        return out_dir
    config = ModelConfig.from_hf(raw, source=str(config_dir / "config.json"))
    shapes = hf_shapes(config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups = _shards(shapes, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: dummy_tensor(config, n, shapes[n], seed).to(dtype).contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps({**raw, "torch_dtype": mark["dtype"]}, indent=2))
    (tmp / MARK).write_text(json.dumps(mark))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(write_checkpoint(a.config_dir, a.out_dir, getattr(torch, a.dtype), a.seed))


if __name__ == "__main__":
    main()
