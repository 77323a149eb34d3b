"""The scope of batch invariance, as one fingerprint: what a row's tokens are a function of besides the row, its
settings and its seed (docs/guide/determinism.md).

Within one fingerprint a row's tokens do not depend on the other rows of its steps, the token budget, the prefix
cache, speculation, preemption or the process (a Ray replica, a resumed run). Across fingerprints they may
differ in rare rows: another weights format or KV cache dtype rounds otherwise, another kernel build (sources,
flags, compiler, CPU) or thread count sums otherwise, and another CPU kind or CUDA picks other kernels.
"""
from __future__ import annotations

import hashlib
import json

import torch

import engine.kernels.cpu_features as cpu_features
import engine.kernels.library as library


def invariance(identity: str, quantization: str, dtype: str, kv_cache_dtype: str, device: str,
               deterministic: bool) -> dict:
    """The parts and their ``fingerprint`` (16 hex digits) for an engine with these resolved settings here."""
    cpu = device.startswith("cpu")
    parts = {
        "model": identity, "weights": quantization, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
        "deterministic": deterministic, "device": device,
        "cpu": cpu_features.cpu_model_name() if cpu else "",
        "kernel_build": library.build_id() if cpu else "",
        "threads": torch.get_num_threads() if cpu else 0,
        "torch": torch.__version__,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return {**parts, "fingerprint": digest}


__all__ = ["invariance"]
