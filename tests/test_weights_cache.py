"""The converted-weights cache: a second load maps what the first converted, bit for bit; damage is detected
and rebuilt; concurrent loaders both succeed."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loader import load_model, load_model_config, weights_cache
from engine.loader.resolve import ModelSource, model_identity
from tests.model_utils import run_chunks
from tests.test_gguf_loader import _tiny, _write_gguf

IDS = [5, 9, 17, 3, 33, 8, 21, 40, 2, 11, 60, 7]


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> ModelSource:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHGEN_WEIGHTS_CACHE", raising=False)
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama", _tiny("llama", tie=False), ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)])
    return ModelSource(kind="gguf", path=path, name="tiny-llama")


def _load(src, dtype=torch.float32):
    return load_model(src, load_model_config(src), dtype, "cpu")


def _logits(model):
    return run_chunks(model, IDS, [5, 4, 1, 1, 1])


def _cache_file(src, dtype=torch.float32) -> Path:
    return weights_cache.cache_path(model_identity(src), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_second_load_maps_the_cache_and_gives_identical_logits(tiny_gguf, dtype):
    first, how = _load(tiny_gguf, dtype)
    assert how == "converted" and _cache_file(tiny_gguf, dtype).is_file()
    second, how = _load(tiny_gguf, dtype)
    assert how == "cached"
    a, b = dict(first.state_dict()), dict(second.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == dtype for k in a)
    assert torch.equal(_logits(first), _logits(second))


def test_dtypes_have_separate_entries(tiny_gguf):
    _load(tiny_gguf, torch.float32)
    _load(tiny_gguf, torch.bfloat16)
    assert _cache_file(tiny_gguf, torch.float32) != _cache_file(tiny_gguf, torch.bfloat16)
    assert len(list(weights_cache.cache_dir().glob("*.safetensors"))) == 2


def _edit_header(data: bytearray, edit) -> bytearray:
    """``data`` (a safetensors file) with ``edit`` applied to its JSON header, the header's length kept."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + n]))
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    return data[:8] + new + b" " * (n - len(new)) + data[8 + n:]


def _retype(header: dict) -> None:          # a float32 tensor said to be int32: the same bytes, crc and shape
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and len(v["shape"]) == 2)
    header[name]["dtype"] = "I32"


def _reshape(header: dict) -> None:         # a matrix's shape transposed: the same bytes and crc
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2
                and v["shape"][0] != v["shape"][1])
    header[name]["shape"] = header[name]["shape"][::-1]


HEADER_EDITS = {"retyped": _retype, "reshaped": _reshape,
                "old format": lambda h: h["__metadata__"].update(batchgen_format="1"),
                "no crc": lambda h: h["__metadata__"].pop(next(k for k in h["__metadata__"] if k.startswith("crc")))}


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "empty", "garbage", *HEADER_EDITS])
def test_damaged_cache_is_detected_and_rebuilt(tiny_gguf, damage, caplog):
    model, _ = _load(tiny_gguf)
    want = _logits(model)
    path = _cache_file(tiny_gguf)
    data = bytearray(path.read_bytes())
    if damage == "flip-a-byte":
        data[-100] ^= 0x40                                     # inside the last tensor's bytes
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage in HEADER_EDITS:
        data = _edit_header(data, HEADER_EDITS[damage])
    else:
        data = bytearray(b"not a safetensors file" * 10)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="batchgen.engine"):
        again, how = _load(tiny_gguf)
    assert how == "converted"
    assert any(f"weights cache {path} is damaged" in r.getMessage() for r in caplog.records)
    assert torch.equal(_logits(again), want)
    assert _load(tiny_gguf)[1] == "cached"                     # the rebuilt file is whole


def test_two_processes_loading_at_once_both_succeed(tiny_gguf, tmp_path):
    script = (
        "import sys, torch\n"
        "from engine.loader import load_model, load_model_config\n"
        "from engine.loader.resolve import ModelSource\n"
        "src = ModelSource(kind='gguf', path=__import__('pathlib').Path(sys.argv[1]), name='tiny')\n"
        "m, how = load_model(src, load_model_config(src), torch.float32, 'cpu')\n"
        "s = sum(float(p.double().sum()) for p in m.state_dict().values())\n"
        "print(how, repr(s))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tiny_gguf.path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    sums = {out.split()[1] for out, _ in results}
    assert len(sums) == 1                                      # both got the same weights
    assert {out.split()[0] for out, _ in results} <= {"converted", "cached"}
    assert _load(tiny_gguf)[1] == "cached"                     # and left one whole file
    assert not list(weights_cache.cache_dir().glob("*.tmp"))


def test_disabled_by_environment(tiny_gguf, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WEIGHTS_CACHE", "0")
    assert _load(tiny_gguf)[1] == "direct"
    assert not weights_cache.cache_dir().exists()


def test_old_entries_are_pruned(tiny_gguf, monkeypatch):
    root = weights_cache.cache_dir()
    root.mkdir(parents=True)
    for i in range(weights_cache.MAX_ENTRIES + 2):
        (root / f"old{i}.safetensors").write_bytes(b"x")
        os.utime(root / f"old{i}.safetensors", (1000 + i, 1000 + i))
    _load(tiny_gguf)
    left = sorted(p.name for p in root.glob("*.safetensors"))
    assert len(left) == weights_cache.MAX_ENTRIES and _cache_file(tiny_gguf).name in left
    assert "old0.safetensors" not in left                      # the least recently used went first


def test_an_upgrade_deletes_this_models_entries_made_by_other_code(tiny_gguf, monkeypatch):
    """Another engine version (the code hash differs) converts the model again into a new entry; the old one, which
    no version that code makes will read, is deleted at once, while another model's and another dtype's stay."""
    _load(tiny_gguf, torch.float32)
    _load(tiny_gguf, torch.bfloat16)
    old, old_bf16 = _cache_file(tiny_gguf, torch.float32), _cache_file(tiny_gguf, torch.bfloat16)
    other = weights_cache.cache_dir() / "another-model.safetensors"
    weights_cache.store(other, {"w": torch.zeros(4)}, entry="another model")
    monkeypatch.setattr(weights_cache, "_code_hash", lambda: "an upgraded engine")
    new = _cache_file(tiny_gguf, torch.float32)
    assert new != old
    assert _load(tiny_gguf, torch.float32)[1] == "converted"
    left = {p.name for p in weights_cache.cache_dir().glob("*.safetensors")}
    assert new.name in left and old.name not in left
    assert other.name in left and old_bf16.name in left         # another model, another dtype: left to the count
    meta, meta_bf16 = weights_cache._metadata(new), weights_cache._metadata(old_bf16)
    assert meta["entry"] == weights_cache.entry_key(model_identity(tiny_gguf), torch.float32)
    assert meta["code"] == weights_cache.code_key() != meta_bf16["code"]
