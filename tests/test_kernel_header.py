"""csrc/kernels.h is the one list of the C functions Python calls: the compiler checks every definition against it,
and the ctypes binding takes its argtypes/restype from it. A wrong signature on either side fails here."""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import engine.kernels.binding as binding
import engine.kernels.build as kbuild
import engine.kernels.library as library

CC = kbuild.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
ENGINE = Path(kbuild.__file__).parents[1]
# the flag sets of the builds the tests force (test_cpu_kernels.BUILDS) plus native: every #if branch compiles
FLAG_SETS = [["-march=native"], ["-mavx2", "-mfma"], []]
CHECK = ["-fsyntax-only", "-std=c11", "-fopenmp", "-Werror=missing-prototypes",
         "-Werror=implicit-function-declaration"]


def _syntax(csrc: Path, source: str, flags: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([CC, *CHECK, *flags, "-I", str(csrc), str(csrc / source)], capture_output=True, text=True)


def test_parser_reads_the_restricted_syntax():
    sigs = binding.parse_header("""
        /* a comment; with a semicolon */
        #include <stdint.h>
        const char *isa(void);
        int f(const float *x, int64_t n,
              float eps, uint16_t *out, int32_t nt);
        void g(void *p);
    """)
    assert sigs["isa"] == binding.Signature("isa", ctypes.c_char_p, ())
    assert sigs["f"].restype is ctypes.c_int
    assert sigs["f"].argtypes == (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int32)
    assert sigs["g"] == binding.Signature("g", None, (ctypes.c_void_p,))
    for bad in ("int f(double x);", "int f(int);", "int f(int x) { return x; }", "int f(int x); int f(int y);"):
        with pytest.raises(ValueError):
            binding.parse_header(bad)


@needs_cc
def test_the_library_is_bound_with_the_headers_signatures():
    lib = library.load()
    assert lib is not None, library.unavailable_reason()
    sigs = binding.header_signatures()
    assert set(lib.signatures) == set(sigs) and len(sigs) > 40
    for name, sig in sigs.items():
        fn = getattr(lib, name)
        assert fn.restype is sig.restype and fn.argtypes == list(sig.argtypes), name
    with pytest.raises(AttributeError):                   # exported by the .so but not declared: not callable
        lib.ngram_propose


def test_python_calls_only_declared_functions():
    """Every kernel name the Python side spells (``lib.name(`` or ``f"name_{...}"``) is declared in the header."""
    declared = set(binding.header_signatures())
    spelled = set()
    for path in ENGINE.rglob("*.py"):
        text = path.read_text()
        spelled |= {(m, False) for m in re.findall(r"\blib\.(\w+)\(", text)}
        spelled |= {(m, True) for m in re.findall(r'getattr\([^,]+, f"(\w+?)_\{', text)}
        spelled |= {(m, False) for m in re.findall(r'"((?:paged_decode|kv_write)_\w+)"', text)}
    assert spelled
    for name, prefix in spelled:
        assert (any(d.startswith(name + "_") for d in declared) if prefix else name in declared), name


@needs_cc
@pytest.mark.parametrize("flags", FLAG_SETS, ids=["native", "avx2", "portable"])
def test_every_definition_matches_its_declaration(flags):
    """Each source includes kernels.h and compiles against it: a definition whose types differ from its
    declaration is a compile error, and a non-static function without a declaration is one too."""
    for src in kbuild.SOURCES:
        name = str(src.relative_to(kbuild.CSRC))
        assert re.search(r'#include "(\.\./)?kernels\.h"', src.read_text()), name
        r = _syntax(kbuild.CSRC, name, flags)
        assert r.returncode == 0, (name, r.stderr[-2000:])


# Compile flags of the CPU kinds dispatch.h tells apart (an AVX-512 CPU has FMA too), and the file each family with
# instruction-set-specific code compiles for it: every implementation file is compiled by one of them, on any
# machine whose compiler accepts the flags (nothing is run).
TARGETS = {
    "portable": [],
    "avx2": ["-mavx2", "-mfma"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
    "avx512-bf16-vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx512vnni", "-mavx512bf16"],
    # AMX-BF16: the avx512_bf16 bf16_gemm file with its tile path (bf16_gemm/amx_tiles.h) compiled in
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx512vnni", "-mavx512bf16", "-mamx-tile",
            "-mamx-bf16"],
}
CHOSEN = {   # target -> family -> implementation file (csrc/<family>/<name>.c)
    "portable": {"bf16_gemm": "portable", "paged_decode": "portable", "prefill": "portable", "qlinear": "portable",
                 "small_m": "portable", "panel": "portable"},
    "avx2": {"bf16_gemm": "portable", "paged_decode": "avx2", "prefill": "avx2", "qlinear": "avx2", "small_m": "avx2",
             "panel": "avx2"},
    "avx512": {"bf16_gemm": "portable", "paged_decode": "avx512", "prefill": "avx512", "qlinear": "avx2",
               "small_m": "avx512", "panel": "avx2"},
    "avx512-bf16-vnni": {"bf16_gemm": "avx512_bf16", "paged_decode": "avx512_bf16", "prefill": "avx512",
                         "qlinear": "avx512_vnni", "small_m": "avx512_bf16", "panel": "avx2"},
}
CHOSEN["amx"] = CHOSEN["avx512-bf16-vnni"]


# global functions one family calls in another, declared in that family's header instead of kernels.h
# bf16_gemm/bf16_gemm.h: for prefill/ (the two-product tiles, the AMX online-softmax item) and paged_decode/ (tiles on?)
INTERNAL = {"bf16_gemm_serial", "bf16_attention_amx", "bf16_gemm_tiles_on"}


def _families() -> dict[str, list[Path]]:
    """family -> its implementation files: the folders of csrc/ with .c files."""
    return {d.name: sorted(d.glob("*.c")) for d in sorted(kbuild.CSRC.iterdir()) if d.is_dir() and any(d.glob("*.c"))}


def _exported(src: Path, flags: list[str]) -> set[str] | None:
    """The global functions src defines when compiled with flags (-O0, to assembly); None if the compiler rejects
    the flags themselves."""
    r = subprocess.run([CC, "-O0", "-std=c11", "-fopenmp", *flags, "-S", "-o", "-", str(src)], capture_output=True,
                       text=True)
    if r.returncode != 0 and "unrecognized" in r.stderr:
        return None
    assert r.returncode == 0, (str(src.relative_to(kbuild.CSRC)), flags, r.stderr[-2000:])
    return set(re.findall(r"^\s*\.globl\s+(\w+)", r.stdout, flags=re.M))


@needs_cc
def test_dispatch_compiles_one_implementation_per_family():
    """csrc/dispatch.h picks one file per family for each CPU kind; that file compiles (AVX-512 ones included, on
    any machine) and defines the family's exported functions, the same set in every implementation, and the other
    files compile to nothing. Every implementation file is picked for some kind."""
    families = _families()
    assert set(families) == set(CHOSEN["portable"])
    declared = set(binding.header_signatures())
    exports: dict[str, set[str]] = {}
    compiled = set()
    for target, flags in TARGETS.items():
        for family, files in families.items():
            defined = {}
            for src in files:
                names = _exported(src, flags)
                if names is None:
                    pytest.skip(f"{CC} does not accept {' '.join(flags)}")
                if names:
                    defined[src.stem] = names
            assert list(defined) == [CHOSEN[target][family]], (target, family, list(defined))
            names = defined[CHOSEN[target][family]]
            assert names - INTERNAL <= declared, (target, family, names - declared)
            assert exports.setdefault(family, names) == names, (target, family, names)
            compiled.add(f"{family}/{CHOSEN[target][family]}.c")
    assert compiled == {f"{family}/{src.name}" for family, files in families.items() for src in files}


@needs_cc
def test_a_wrong_signature_is_caught(tmp_path):
    """The inverse check: a header that says table_stride is int32_t (the C says int64_t) fails to compile, and a
    header that drops a declaration fails too; the binding would otherwise call with the wrong types."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kbuild.CSRC, csrc)
    header = (csrc / "kernels.h").read_text()
    wrong = header.replace("int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, "
                           "const int32_t *block_tables,\n                     int64_t table_stride",
                           "int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, "
                           "const int32_t *block_tables,\n                     int32_t table_stride")
    assert wrong != header
    assert binding.parse_header(wrong)["paged_decode_f32"].argtypes[4] is ctypes.c_int32   # what Python would pass
    (csrc / "kernels.h").write_text(wrong)
    r = _syntax(csrc, "paged_decode/portable.c", [])
    assert r.returncode != 0 and "conflicting types" in r.stderr
    dropped = re.sub(r"void bf16_gemm\(.*?\);", "", header, flags=re.S)
    assert dropped != header
    (csrc / "kernels.h").write_text(dropped)
    r = _syntax(csrc, "bf16_gemm/portable.c", [])
    assert r.returncode != 0 and "bf16_gemm" in r.stderr


@needs_cc
def test_a_declaration_the_library_lacks_fails_to_bind():
    lib = library.load()
    assert lib is not None
    sigs = {**binding.header_signatures(), "no_such_kernel": binding.Signature("no_such_kernel", None, ())}
    with pytest.raises(AttributeError):
        binding.open_library(Path(lib.path), sigs)
