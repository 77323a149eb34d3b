"""Attention backends over the paged KV cache, the metadata that describes a flat varlen batch, and the int8
cache's per-layer key shifts (key_shift.py, measured by running the model's attention once)."""
from engine.attention.backend import AttentionBackend
from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "write_kv"]
