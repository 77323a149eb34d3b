"""Building the kernel library: the compiler, the flag sets, and the build cache.

The build takes a second or two, has no torch headers, and is cached per source + flags + CPU under
``$BATCHGEN_CACHE_DIR`` (default ``~/.cache/batchgen/kernels``). ``BATCHGEN_KERNEL_FLAGS`` replaces
``-march=native`` (e.g. ``"-O3 -mavx2 -mfma -fopenmp"``: the AVX2 build on an AVX-512 machine, to measure it, or
one build for a mixed fleet).

Each build is compiled into a temp file and renamed into place, with a record beside it (``<name>.json``: its
size and sha256) that ``library_check`` compares before the library is loaded; the build id (the key in the file
name) is compiled in, and the loaded library must report it.

The library links OpenMP (``-fopenmp``). torch's CPU wheels ship ``libgomp.so.1``; loading ours after torch
reuses that runtime (same soname), so both share one thread pool.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.cache_root import cache_root
from engine.kernels.cpu_features import cpu_signature

log = logging.getLogger("batchgen.engine")

CSRC = Path(__file__).parent / "csrc"
HEADER = CSRC / "kernels.h"
PREFIX = "batchgen_kernels-"                  # the cache file name: PREFIX + build id + ".so"
# every .c under csrc/: the families' own files and, per family with instruction-set-specific code, one file per
# instruction set in csrc/<family>/ (csrc/dispatch.h: each compiles to code only where the build chose it)
SOURCES = sorted(CSRC.rglob("*.c"))
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],                                   # no OpenMP: single-threaded, still gather-free
)
# Every build: -fno-trapping-math lets GCC if-convert the float selects in exp's clamp and the softmax masks,
# without which it vectorizes none of the elementwise loops for AVX2 (AVX-512 masks hide the problem): GeGLU ran
# far slower in an AVX2 build. Values do not change (no rounding or NaN semantics are relaxed).
COMMON_FLAGS = ("-fno-trapping-math", "-shared", "-fPIC", "-std=c11")


def cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def default_flag_sets() -> tuple[list[str], ...]:
    """The compile flag sets tried in order. ``BATCHGEN_KERNEL_FLAGS`` (e.g. ``"-O3 -mavx2 -mfma -fopenmp"``)
    replaces ``-march=native``: a build for an older CPU kind than this one (one build for a mixed fleet, or
    measuring the AVX2 path on an AVX-512 machine); the portable fallbacks stay."""
    forced = os.environ.get("BATCHGEN_KERNEL_FLAGS", "").split()
    return (forced, *FLAG_SETS[1:]) if forced else FLAG_SETS


def source_key() -> bytes:
    """Every source and header under csrc/, each with its path: what a build is compiled from."""
    files = sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h"))
    return b"".join(str(p.relative_to(CSRC)).encode() + b"\0" + p.read_bytes() for p in files)


def output_path(cc: str, flags: list[str]) -> Path:
    """Where the build with ``flags`` lives in the cache; its name carries the build id (sources + flags + compiler
    + CPU), which the library also reports (``batchgen_build_id``, compiled in)."""
    key = hashlib.sha256(source_key() + repr((cc, flags, COMMON_FLAGS, cpu_signature())).encode()).hexdigest()[:16]
    return cache_dir() / f"{PREFIX}{key}.so"


def build_id_of(path: Path) -> str:
    """The build id a library file at ``path`` must report: the key in its cache file name."""
    return path.stem.removeprefix(PREFIX)


def record_path(path: Path) -> Path:
    """The build record beside a library: ``{"size": bytes, "sha256": hex}`` of the file the compiler wrote."""
    return path.with_suffix(".json")


def write_record(path: Path, data: bytes) -> None:
    """Record ``data`` (the library's bytes) as the build of ``path``, atomically (a temp file renamed)."""
    text = json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)        # readable like the library (mkstemp's 0600 would fail other users of a cache)
        os.replace(tmp, record_path(path))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_record(path: Path) -> dict | None:
    """The build record of ``path``, or None when it is missing or not one (unreadable, damaged, wrong fields)."""
    try:
        record = json.loads(record_path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("size"), int) and isinstance(record.get("sha256"), str)
    return record if ok else None


def discard(path: Path) -> None:
    """Delete a library and its record (a damaged build: the next ``build`` compiles it again)."""
    for p in (path, record_path(path)):
        try:
            p.unlink()
        except OSError:       # already gone, or not ours to delete: the rebuild replaces it or says why not
            pass


def build(cc: str, flag_sets=None) -> Path:
    """Compile the kernels with the first flag set that works (or reuse the cached build); the .so path.

    A build is compiled into a temp file, recorded (``write_record``), then renamed into place: a crash mid-build
    never leaves a partial library under the cache name. OSError, naming each failed compiler command, when no
    flag set builds."""
    flag_sets = flag_sets or default_flag_sets()
    errors = []
    for flags in flag_sets:
        out = output_path(cc, flags)
        if errors:   # the previous flags failed (e.g. BATCHGEN_KERNEL_FLAGS the compiler rejects): say so
            log.warning("CPU kernels: the build with %s; trying %s", errors[-1], " ".join(flags))
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        build_id = f'-DBATCHGEN_BUILD_ID="{build_id_of(out)}"'
        cmd = [cc, *flags, *COMMON_FLAGS, build_id, *map(str, SOURCES), "-o", tmp, "-lm"]
        shown = f"`{cc} {' '.join(flags)} ...`"
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                write_record(out, Path(tmp).read_bytes())
                os.replace(tmp, out)           # atomic: concurrent builders never see a partial file
                return out
            errors.append(f"{shown} exited {r.returncode}: {r.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{shown}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("; ".join(errors))
