"""Paths and URIs of job inputs and outputs: which paths are ``pyarrow.fs`` URIs, and where an output named by a
URI lives on this machine. Both ``pipeline.job`` and ``pipeline.io`` import it (it imports neither)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.history import resolve_state_dir


def is_uri(path: str) -> bool:
    """An input or output path that names a ``pyarrow.fs`` URI (``s3://...``, ``file://...``), not a local path."""
    return "://" in str(path)


def local_output_path(uri: str) -> Path:
    """Where an output named by a URI is assembled (and its run state kept) on this machine: the state dir
    (``pipeline.history.resolve_state_dir``), ``outputs/<name>-<hash of the URI>/<name>``."""
    name = uri.rstrip("/").rpartition("/")[2] or "output"
    return resolve_state_dir() / "outputs" / f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}" / name


__all__ = ["is_uri", "local_output_path"]
