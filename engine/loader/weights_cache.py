"""Converted-weights cache: a model's final tensors (dequantized, fused, in the engine dtype) as safetensors.

The first load of a GGUF file dequantizes every tensor and fuses q/k/v and gate/up; this cache keeps the
result so later loads map the file instead (``safe_open`` is mmap-backed: a page-in, no conversion, no copy).

* Key: the model's identity (``model_identity``: header + size + a sample of the data), the dtype, the
  torch version and a hash of the code that produces the tensors (engine/loader, engine/models, engine/quant): a new
  engine version never trusts an old layout.
* Integrity: a crc32 of every tensor's bytes, and a digest of the header's names, dtypes and shapes (``layout``),
  are stored in the file's metadata and checked on load (~4 GB/s a thread, two threads, and it pages the weights
  in, which the first step would do anyway). A truncated, corrupted or edited file is reported (naming the file
  and what does not match), deleted and rebuilt.
* Concurrency: writers write a private temporary file in the cache directory and ``os.replace`` it into
  place, so two processes loading at once both succeed and a reader never sees a half-written file.
* Size: at most ``MAX_ENTRIES`` files are kept (least recently used deleted first); each is the model's size
  in its dtype (gemma-3-270m: ~0.54 GB bf16, ~1.1 GB fp32; Llama-3.1-8B as int8: 9 GB). Each file also records
  what it caches (``entry_key``: identity, dtype, variant) and the code that made it (``code_key``): storing a model
  deletes that model's entries made by other code at once (after an upgrade they are never read again, and at 8B
  four stale ones would hold 36 GB until the count evicted them).

Location: ``$BATCHGEN_CACHE_DIR/weights`` (default ``~/.cache/batchgen/weights``); ``BATCHGEN_WEIGHTS_CACHE=0``
turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.cache_root import cache_root

log = logging.getLogger("batchgen.engine")

FORMAT = "2"       # 2: the header's layout digest (names, dtypes, shapes)
MAX_ENTRIES = 4
_CODE_DIRS = ("loader", "models", "quant")


def enabled() -> bool:
    return os.environ.get("BATCHGEN_WEIGHTS_CACHE", "1").lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return cache_root() / "weights"


def _code_hash() -> str:
    h = hashlib.sha256()
    engine_dir = Path(__file__).resolve().parent.parent
    for sub in _CODE_DIRS:
        for p in sorted((engine_dir / sub).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def entry_key(identity: str, dtype: torch.dtype, variant: str = "") -> str:
    """What an entry caches, whatever code made it: the model, the dtype, the variant."""
    return hashlib.sha256("|".join((identity, str(dtype), variant)).encode()).hexdigest()[:24]


def code_key() -> str:
    """The engine version an entry was made by: the file format, torch and the code that produces the tensors."""
    return hashlib.sha256("|".join((FORMAT, torch.__version__, _code_hash())).encode()).hexdigest()[:24]


def cache_path(identity: str, dtype: torch.dtype, variant: str = "") -> Path:
    """variant: "" for float weights, "int8" for the packed int8 model (engine.quant.int8)."""
    key = hashlib.sha256("|".join((FORMAT, identity, str(dtype), torch.__version__, _code_hash(), variant))
                         .encode())
    return cache_dir() / f"{key.hexdigest()[:24]}.safetensors"


_CHUNK = 64 << 20


def _crcs(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """crc32 of each tensor's bytes in 64 MiB chunks ("c1,c2,..."), over two threads (zlib releases the GIL)."""
    jobs = []
    for name, t in tensors.items():
        b = t.contiguous().view(-1).view(torch.uint8).numpy()
        jobs += [(name, i, b[i:i + _CHUNK]) for i in range(0, max(len(b), 1), _CHUNK)]
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda job: zlib.crc32(job[2]), jobs))
    out: dict[str, list[str]] = {}
    for (name, _, _), c in zip(jobs, sums):
        out.setdefault(name, []).append(str(c))
    return {name: ",".join(v) for name, v in out.items()}


def _layout(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor's name, dtype and shape, as written: a header edited since (a tensor's dtype or shape
    changed, its bytes and checksum intact) no longer matches, so it is never read as other values."""
    spec = ";".join(f"{name}:{t.dtype}:{tuple(t.shape)}" for name, t in sorted(tensors.items()))
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def load(path: Path) -> dict[str, torch.Tensor] | None:
    """The cached tensors (memory-mapped), or None when absent; a damaged file is deleted and None returned."""
    if not path.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import safe_open
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(_PAD)}
        if meta.get("batchgen_format") != FORMAT:
            raise ValueError(f"batchgen_format is {meta.get('batchgen_format')!r:.40}, not {FORMAT!r}")
        if meta.get("layout") != _layout(tensors):
            raise ValueError("its header's tensor names, dtypes or shapes are not those written (layout)")
        for name, crc in _crcs(tensors).items():
            if crc != meta.get(f"crc32:{name}"):
                raise ValueError(f"checksum mismatch in tensor {name!r}")
        if any(t.data_ptr() % _ALIGN for t in tensors.values()):
            raise ValueError("tensors are not 64-byte aligned")
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError, OverflowError) as e:
        log.warning("weights cache %s is damaged (%s); rebuilding it", path, e)
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)                      # recency for pruning
    except OSError:
        pass
    return tensors


_ALIGN = 64
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_PAD = "__pad"


def _write_aligned(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file whose tensors all start 64-byte aligned (padding entries in between, header padded
    with spaces as the format allows). Mapped tensors then have the alignment torch's allocator gives, so
    matmuls take the same kernels and the logits are bit-identical to the converted model's (unaligned ones
    took another summation order: 7e-8 apart)."""
    import json
    entries, chunks, offset = {}, [], 0
    for i, (name, t) in enumerate(tensors.items()):
        if offset % _ALIGN:
            pad = _ALIGN - offset % _ALIGN
            entries[f"{_PAD}{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            chunks.append(bytes(pad))
            offset += pad
        data = t.view(-1).view(torch.uint8).numpy()
        entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + data.nbytes]}
        chunks.append(data)
        offset += data.nbytes
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for c in chunks:
            f.write(c)


def store(path: Path, tensors: dict[str, torch.Tensor], entry: str = "") -> bool:
    """Write ``tensors`` atomically; False (logged) when the cache directory cannot be written. ``entry``:
    ``entry_key`` of what they are (then this model's entries made by other code are deleted)."""
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    meta = {"batchgen_format": FORMAT, "layout": _layout(tensors), "entry": entry, "code": code_key(),
            **{f"crc32:{k}": v for k, v in _crcs(tensors).items()}}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        os.close(fd)
        _write_aligned(tmp, tensors, meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("could not write the weights cache %s (%s); later loads convert again", path, e)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    _prune(path.parent, keep=path, entry=entry, code=meta["code"])
    return True


def _prune(root: Path, keep: Path, entry: str = "", code: str = "") -> None:
    try:
        files = sorted(root.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    others = [f for f in files if f != keep]
    if entry:
        stale = [p for p in others if _superseded(_metadata(p), entry, code)]
        for p in stale:
            log.info("weights cache: %s holds this model as an earlier engine version made it; deleted", p)
            p.unlink(missing_ok=True)
        others = [p for p in others if p not in stale]
    for p in others[MAX_ENTRIES - 1:]:
        p.unlink(missing_ok=True)
    for p in root.glob("*.tmp"):            # left by a writer that died mid-write (an hour is ample)
        try:
            if time.time() - p.stat().st_mtime > 3600:
                p.unlink(missing_ok=True)
        except OSError:
            pass


def _superseded(meta: dict, entry: str, code: str) -> bool:
    """An entry's metadata says it caches ``entry`` as other code than ``code`` made it."""
    return meta.get("entry") == entry and meta.get("code") != code


def _metadata(path: Path) -> dict:
    """``path``'s safetensors metadata (the header only is read); {} where unreadable or absent."""
    import json
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 << 20:
                return {}
            meta = json.loads(f.read(n)).get("__metadata__")
    except (OSError, ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


__all__ = ["cache_path", "entry_key", "code_key", "load", "store", "enabled", "cache_dir", "MAX_ENTRIES"]
