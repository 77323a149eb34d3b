"""Paths and URIs of job inputs and outputs: which paths are ``pyarrow.fs`` URIs, and where an output named by a
URI lives on this machine; where batchgen keeps its state (history, locks, cron logs, URI outputs)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def resolve_state_dir(state_dir: str | Path | None = None, home: str | Path | None = None) -> Path:
    """The state directory (not created). ``home`` replaces ``~`` (another user's home, for cron --user)."""
    if state_dir:
        return Path(state_dir).expanduser().absolute()
    if os.environ.get("BATCHGEN_STATE_DIR"):
        return Path(os.environ["BATCHGEN_STATE_DIR"]).expanduser().absolute()
    if home is None and os.environ.get("XDG_STATE_HOME"):
        return Path(os.environ["XDG_STATE_HOME"]).absolute() / "batchgen"
    return Path(home or Path.home()).absolute() / ".local" / "state" / "batchgen"


def is_uri(path: str) -> bool:
    """An input or output path that names a ``pyarrow.fs`` URI (``s3://...``, ``file://...``), not a local path."""
    return "://" in str(path)


def local_output_path(uri: str) -> Path:
    """Where an output named by a URI is assembled (and its run state kept) on this machine: the state dir
    (``resolve_state_dir``), ``outputs/<name>-<hash of the URI>/<name>``."""
    name = uri.rstrip("/").rpartition("/")[2] or "output"
    return resolve_state_dir() / "outputs" / f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}" / name


__all__ = ["resolve_state_dir", "is_uri", "local_output_path"]
