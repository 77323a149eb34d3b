"""A damaged kernel library in the build cache is caught before dlopen, deleted and built again once (issue 40).

Each damage case runs the load in a subprocess (a SIGBUS there fails the test instead of killing pytest) over a
throwaway cache holding one build made here with ``FLAGS`` (the quickest build: each case rebuilds once), damaged:
another ELF library, the file cut to 4 KB, random bytes, a declared symbol missing, a wrong build id. Each ends
with one warning naming the file and what failed, and a rebuilt library that reports its build id; with no working
compiler, with the torch fallback and a warning that says how to fix it. The fuzz tests only read bytes (no dlopen).
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.kernels.build as kbuild
import engine.kernels.library_check as check
from engine.kernels.binding import header_signatures
from engine.kernels.elf import ElfError, read_shared_library

CC = kbuild.compiler()
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["-O0"]
DECLARED = header_signatures()
LOAD = ("import logging, sys; logging.basicConfig(stream=sys.stderr, format='%(levelname)s %(message)s'); "
        "import engine.kernels.build as b, engine.kernels.library_check as c; lib = c.load_checked(b.compiler()); "
        "print(lib.batchgen_build_id().decode(), lib.batchgen_kernel_isa().decode())")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, bytes]:
    """One library built with FLAGS in a throwaway cache: its path (the name the cases' caches use) and bytes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        path = kbuild.build(CC, flag_sets=(FLAGS,))
    return path, path.read_bytes()


def _cache_holding(tmp_path: Path, name: str, data: bytes, recorded: bytes | None) -> Path:
    """A cache dir whose library ``name`` is ``data``, with a build record of ``recorded`` (None: no record)."""
    target = tmp_path / "cache" / "kernels" / name
    target.parent.mkdir(parents=True)
    target.write_bytes(data)
    if recorded is not None:
        kbuild.write_record(target, recorded)
    return target


def _run(target: Path, code: str = LOAD, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(target.parent.parent), "BATCHGEN_KERNEL_FLAGS": " ".join(FLAGS),
           **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _assert_rebuilt(r: subprocess.CompletedProcess, target: Path, why: str) -> None:
    """The load survived (no signal, no traceback), warned once naming the file and ``why``, and the library it
    loaded is the rebuilt one: it reports this build's id, and the file now passes every check."""
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, r.stderr
    assert str(target) in warnings[0] and why in warnings[0] and "building it again" in warnings[0], warnings[0]
    assert r.stdout.split()[0] == kbuild.build_id_of(target), r.stdout
    assert check.check_file(target) is None


def test_another_elf_library_in_its_place_is_rebuilt(built, tmp_path):
    path, good = built
    (tmp_path / "other.c").write_text("int other(void) { return 1; }\n")
    subprocess.run([CC, "-shared", "-fPIC", str(tmp_path / "other.c"), "-o", str(tmp_path / "other.so")], check=True)
    target = _cache_holding(tmp_path, path.name, (tmp_path / "other.so").read_bytes(), good)
    _assert_rebuilt(_run(target), target, "it lacks batchgen_build_id, batchgen_kernel_isa")


def test_a_truncated_library_is_rebuilt_not_a_sigbus(built, tmp_path):
    path, good = built
    target = _cache_holding(tmp_path, path.name, good[:4096], good)
    _assert_rebuilt(_run(target), target, "it is cut short")


def test_random_bytes_are_rebuilt_not_the_torch_path_for_good(built, tmp_path):
    path, good = built
    target = _cache_holding(tmp_path, path.name, random.Random(0).randbytes(len(good)), good)
    _assert_rebuilt(_run(target), target, "it is not an ELF file")


def test_a_library_missing_a_declared_symbol_is_rebuilt(built, tmp_path):
    """Renamed in its dynamic string table, with a record of those bytes: only the symbol check can catch it."""
    path, good = built
    assert b"batchgen_q8_isa\0" in good
    damaged = good.replace(b"batchgen_q8_isa\0", b"batchgen_q8_isb\0")
    target = _cache_holding(tmp_path, path.name, damaged, damaged)
    _assert_rebuilt(_run(target), target, "it lacks batchgen_q8_isa")


def test_a_library_reporting_another_build_id_is_rebuilt(built, tmp_path):
    """Another build's library with its own record under this build's name: it loads, reports the other id, is
    unloaded and rebuilt, and the rebuilt one at the same path reports the right id."""
    path, good = built
    build_id = kbuild.build_id_of(path).encode()
    assert good.count(build_id) == 1
    damaged = good.replace(build_id, b"0" * len(build_id))
    target = _cache_holding(tmp_path, path.name, damaged, damaged)
    _assert_rebuilt(_run(target), target, "it reports build '0000000000000000'")


def test_without_a_working_compiler_a_damaged_library_falls_back_to_torch_with_a_fix(built, tmp_path):
    _, good = built
    false = shutil.which("false")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
        name = kbuild.output_path(false, FLAGS).name
    target = _cache_holding(tmp_path, name, good[:4096], good)
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, format='%(levelname)s %(message)s'); "
            "import engine.kernels.library as l; print(l.load() is None); print(l.describe())")
    r = _run(target, code, CC=false)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == "True" and "torch path" in r.stdout, r.stdout
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert str(target) in warnings[0] and "it is cut short" in warnings[0], warnings
    assert f"`{false} -O0 ...` exited 1" in warnings[-1] and "slower torch path" in warnings[-1], warnings
    assert "To fix: make" in warnings[-1] and "set CC" in warnings[-1] and str(target.parent) in warnings[-1]
    assert not target.exists()                          # deleted, never loaded


def test_a_library_another_process_rebuilt_meanwhile_is_kept(built, tmp_path, monkeypatch):
    """Two processes find the same damaged file; the other one rebuilds it while this one checks: this one must not
    delete the fresh library (nor compile again), only check and load it."""
    path, good = built
    target = _cache_holding(tmp_path, path.name, good[:4096], good)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(target.parent.parent))
    monkeypatch.setenv("BATCHGEN_KERNEL_FLAGS", " ".join(FLAGS))
    real_check, calls = check.check_file, []

    def check_while_another_rebuilds(p, declared=None):
        calls.append(p)
        why = real_check(p, declared)
        if len(calls) == 1:            # the other process renames its fresh build into place just after our read
            fresh = target.with_suffix(".fresh")
            fresh.write_bytes(good)
            os.replace(fresh, target)
        return why

    monkeypatch.setattr(check, "check_file", check_while_another_rebuilds)
    monkeypatch.setattr(kbuild.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    lib = check.load_checked(CC)
    assert lib.batchgen_build_id().decode() == kbuild.build_id_of(target) and len(calls) == 2
    assert target.read_bytes() == good


def test_a_compiler_dying_mid_build_leaves_no_file(tmp_path, monkeypatch):
    """The compiler writes half a library and is killed: no file under the cache name, no temp file left."""
    cc = tmp_path / "dying-cc"
    cc.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nprintf "\\177ELF half" > "$2"\nkill -9 $$\n')
    cc.chmod(0o755)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(OSError, match="exited -9"):
        kbuild.build(str(cc), flag_sets=(FLAGS,))
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def test_each_check_names_what_failed(built):
    path, good = built
    record = {"size": len(good), "sha256": kbuild.read_record(path)["sha256"]}
    assert check.problem(good, record, DECLARED) is None
    assert kbuild.record_path(path).stat().st_mode & 0o444 == 0o444     # every user of a shared cache reads it
    assert "build record" in check.problem(good, None, DECLARED)
    assert "differ from the build's" in check.problem(good[:-1] + bytes([good[-1] ^ 1]), record, DECLARED)
    assert "the build recorded" in check.problem(good + b"\0", record, DECLARED)
    other = 183 if read_shared_library(good).machine == 62 else 62
    moved = good[:18] + other.to_bytes(2, sys.byteorder) + good[20:]
    assert "another machine" in check.problem(moved, record, DECLARED)
    assert "64-bit" in check.problem(good[:4] + b"\1" + good[5:], record, DECLARED)
    assert "shorter than an ELF header" in check.problem(good[:10], record, DECLARED)


@settings(max_examples=150, deadline=None)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_fuzz_any_truncation_is_refused(built, fraction):
    path, good = built
    cut = good[:int(len(good) * fraction)]
    assert check.problem(cut, kbuild.read_record(path), DECLARED) is not None
    with pytest.raises(ElfError):            # the section header table sits at the end: no cut leaves it whole
        read_shared_library(cut)


@settings(max_examples=150, deadline=None)
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4))
def test_fuzz_byte_flips_are_refused_and_never_crash_the_reader(built, flips):
    """Any changed byte fails the record's sha256; the ELF reader alone, on the same bytes, answers or raises
    ElfError (never another exception), whatever it is given."""
    path, good = built
    data = bytearray(good)
    for at, mask in flips:
        data[int(len(data) * at)] ^= mask
    data = bytes(data)
    if data == good:                         # two flips undid each other
        return
    assert check.problem(data, kbuild.read_record(path), DECLARED) is not None
    try:
        read_shared_library(data)
    except ElfError:
        pass
