"""What this CPU can do: the one place that reads ``/proc/cpuinfo`` and asks torch's ISA probes.

Used by the dtype policy (``engine.dtype_policy``), the kernel build cache key (``engine.kernels.build``) and the
attention backend's AMX check.
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path


def _flags_line() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return None


def cpuinfo_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (x86 ``flags``, arm ``Features``); empty where unreadable."""
    line = _flags_line()
    return frozenset(line.split(":", 1)[1].split()) if line else frozenset()


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo ``model name``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """What a measurement names as its CPU: model name, family/model (what tells AMD Zen generations apart) and the
    vector units, e.g. ``AMD EPYC (family 25 model 1; avx2 fma)``."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    units = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2", "fma")
                     if f in cpuinfo_flags())
    where = f"family {fields['cpu family']} model {fields['model']}; " if "cpu family" in fields else ""
    return f"{cpu_model_name()} ({where}{units or 'no x86 vector units listed'})"


def cpu_signature() -> str:
    """Part of the kernel cache key: -march=native output must not move to another CPU (shared home directories)."""
    return _flags_line() or platform.processor() or platform.machine()


def cpu_features() -> frozenset[str]:
    """The CPU features that decide the dtype: a subset of {amx_bf16, avx512_bf16, avx512f, avx2, fma}, from
    /proc/cpuinfo and torch's own probes (``torch.cpu._is_amx_tile_supported`` and friends, the ones its kernels
    dispatch on)."""
    # NOTE: imported here, not at the top: the kernel build and its checks run without torch
    import torch

    flags = cpuinfo_flags()
    found = {f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma") if f in flags}
    probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported",
              "avx512f": "_is_avx512_supported", "avx2": "_is_avx2_supported"}
    for feature, probe in probes.items():
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                found.add(feature)
        except Exception:          # noqa: BLE001 - a probe that fails only means "unknown"
            pass
    return frozenset(found)


@functools.cache
def has_amx() -> bool:
    """AMX-BF16 on this CPU (read once: every attention layer asks, every step). torch's bf16 matmul runs on AMX
    tiles there (oneDNN), several times faster than float32 and than our bf16 kernel."""
    return "amx_bf16" in cpuinfo_flags()
