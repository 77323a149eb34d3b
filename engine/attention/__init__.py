"""Attention backends over the paged KV cache, and the metadata that describes a flat varlen batch."""
from engine.attention.backend import AttentionBackend
from engine.attention.cache import write_kv
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "write_kv"]
