"""Where batchgen keeps what it builds once per machine: ``$BATCHGEN_CACHE_DIR``, else
``$XDG_CACHE_HOME/batchgen``, else ``~/.cache/batchgen``. Subfolders: kernels/, weights/, tokenizers/, tuning/
(engine.tuning's decisions), and the calibrations (calibration-*.json) at the top."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("BATCHGEN_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen"


def tokenizers_dir() -> Path:
    """Per model identity: its converted tokenizer (engine.tokenizer) and llguidance's token bytes
    (engine.structured.llguidance_backend)."""
    return cache_root() / "tokenizers"
