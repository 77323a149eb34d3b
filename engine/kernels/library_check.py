"""The kernel library checked before use, and built again once when a check fails.

A damaged file in the build cache must end neither in a traceback, nor in a signal (dlopen maps a truncated file:
SIGBUS at its first touch past the end), nor in a wrong row, nor on the slow torch path for good. Before dlopen
the file is read in Python (``elf``): a whole 64-bit ELF shared library for this machine, defining every function
``kernels.h`` declares, whose size and sha256 equal the build's record beside it (``build.write_record``). After
dlopen the library must report the build id in its file name (``batchgen_build_id``). When any check fails: one
warning naming the file and what failed, the file deleted, built again once and checked again; only when that
fails too does the caller fall back to torch.
"""
from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

import engine.kernels.build as build
from engine.kernels.binding import KernelLibrary, header_signatures, open_library
from engine.kernels.elf import MACHINES, ElfError, read_shared_library

log = logging.getLogger("batchgen.engine")

MAX_BYTES = 256 << 20          # a build is well under 1 MB; a file past this is not one (and is not read whole)


def problem(data: bytes, record: dict | None, declared) -> str | None:
    """What keeps the library bytes ``data`` from being loaded, or None: ``record`` is its build record
    (``build.read_record``), ``declared`` the function names kernels.h declares. Never raises."""
    try:
        lib = read_shared_library(data)
    except ElfError as e:
        return str(e)
    host = MACHINES.get(platform.machine().lower())
    if host is not None and lib.machine != host:
        return f"it is built for another machine (ELF machine {lib.machine}; this {platform.machine()} is {host})"
    missing = [name for name in declared if name not in lib.functions]      # in kernels.h's order
    if missing:
        more = f" and {len(missing) - 3} more kernels.h declares" if len(missing) > 3 else ""
        return f"it lacks {', '.join(missing[:3])}{more}"
    if record is None:
        return "its build record (.json beside it) is missing or damaged"
    if record["size"] != len(data):
        return f"it is {len(data)} bytes, the build recorded {record['size']}"
    if record["sha256"] != hashlib.sha256(data).hexdigest():
        return "its bytes differ from the build's (sha256)"
    return None


def check_file(path: Path, declared=None) -> str | None:
    """What keeps the library file at ``path`` from being loaded, or None (``problem`` on its bytes)."""
    declared = header_signatures() if declared is None else declared
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            return f"it is {size} bytes, far larger than any build"
        data = path.read_bytes()
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    return problem(data, build.read_record(path), declared)


def _open(path: Path) -> tuple[KernelLibrary | None, str | None]:
    """The checked library at ``path``, or why not: the file checks, dlopen, then the build id it reports."""
    signatures = header_signatures()
    why = check_file(path, signatures)
    if why is not None:
        return None, why
    try:
        loaded = open_library(path, signatures)
    except (OSError, AttributeError) as e:          # dlopen refused it, or a symbol it lacks after all
        return None, f"it does not load ({e})"
    reported = loaded.batchgen_build_id().decode(errors="replace")
    if reported != build.build_id_of(path):
        loaded.close()                                 # unmapped, so the rebuilt file at this path is loaded afresh
        return None, f"it reports build {reported!r}, its name says {build.build_id_of(path)!r}"
    return loaded, None


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def load_checked(cc: str) -> KernelLibrary:
    """The kernel library built by ``cc`` (or taken from the cache), checked; a library that fails a check is
    deleted and built again once. OSError saying what failed when no checked library can be had (the compiler
    commands that failed, or the rebuilt file's own problem)."""
    path = build.build(cc)
    seen = _identity(path)
    lib, why = _open(path)
    if lib is not None:
        return lib
    log.warning("CPU kernels: %s failed its check (%s); deleting it and building it again", path, why)
    if _identity(path) == seen:     # NOTE: else another process rebuilt it meanwhile: keep theirs, check it below
        build.discard(path)
    path = build.build(cc)
    lib, why = _open(path)
    if lib is None:
        raise OSError(f"the rebuilt {path} failed its check too ({why})")
    return lib
