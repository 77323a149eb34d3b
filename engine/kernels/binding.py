"""The ctypes binding, read from ``csrc/kernels.h``: every declared function with its argtypes and restype.

The header is the single source of the signatures: the C files include it (the compiler checks every definition
against it) and this module parses it (Python calls exactly what was declared). The parser reads only the
restricted declaration syntax the header documents: ``RET NAME(TYPE ARG, ...);`` with scalar C types, ``const``
and ``*``. ``open_library`` returns a ``KernelLibrary`` whose attributes are the declared functions only, so a
call to an undeclared symbol fails with AttributeError rather than running with ctypes' default int signature.
"""
from __future__ import annotations

import _ctypes
import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from engine.kernels.build import HEADER

# scalar C types -> ctypes; every pointer is a c_void_p (the callers pass data_ptr() integers), except a returned
# ``const char *`` (a NUL-terminated string: c_char_p)
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "uint8_t": ctypes.c_uint8, "int8_t": ctypes.c_int8, "uint16_t": ctypes.c_uint16,
            "uint32_t": ctypes.c_uint32, "char": ctypes.c_char}
_DECL = re.compile(r"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>\w+)\s*\((?P<args>[^()]*)\)$", re.S)
_TYPE = re.compile(r"^(?:const\s+)?(?P<base>\w+)\s*(?P<stars>(?:\*\s*(?:const\s*)?)*)$")


@dataclass(frozen=True)
class Signature:
    name: str
    restype: type | None
    argtypes: tuple[type, ...]


def _ctype(text: str, is_return: bool) -> type | None:
    m = _TYPE.match(" ".join(text.split()))
    if m is None:
        raise ValueError(f"kernels.h: cannot read the type {text!r}")
    base, stars = m["base"], m["stars"].count("*")
    if stars:
        return ctypes.c_char_p if (is_return and base == "char" and stars == 1) else ctypes.c_void_p
    if base == "void":
        return None
    if base not in _SCALARS:
        raise ValueError(f"kernels.h: unknown scalar type {base!r}")
    return _SCALARS[base]


def _param_type(param: str) -> str:
    """``const float *x`` -> ``const float *``: drop the trailing parameter name."""
    m = re.match(r"^(.*?[\s\*])(\w+)$", param.strip())
    if m is None or m[1].strip() in ("", "const"):
        raise ValueError(f"kernels.h: a parameter needs a type and a name: {param!r}")
    return m[1]


def parse_header(text: str) -> dict[str, Signature]:
    """name -> Signature for every function declared in ``text`` (a kernels.h)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    sigs: dict[str, Signature] = {}
    for stmt in text.split(";"):
        stmt = " ".join(stmt.split())
        if not stmt:
            continue
        m = _DECL.match(stmt)
        if m is None:
            raise ValueError(f"kernels.h: not a declaration this parser reads: {stmt[:120]!r}")
        args = m["args"].strip()
        argtypes = () if args == "void" else tuple(_ctype(_param_type(a), False) for a in args.split(","))
        if m["name"] in sigs:
            raise ValueError(f"kernels.h: {m['name']} declared twice")
        sigs[m["name"]] = Signature(m["name"], _ctype(m["ret"], True), argtypes)
    return sigs


def header_signatures(path: Path = HEADER) -> dict[str, Signature]:
    return parse_header(path.read_text())


class KernelLibrary:
    """The declared functions of one built library, as attributes (``lib.bf16_gemm(...)``)."""

    def __init__(self, cdll: ctypes.CDLL, signatures: dict[str, Signature]):
        self.path = cdll._name
        self.signatures = signatures
        self._cdll = cdll
        for sig in signatures.values():
            fn = getattr(cdll, sig.name)          # AttributeError: declared but not in the library
            fn.restype, fn.argtypes = sig.restype, list(sig.argtypes)
            setattr(self, sig.name, fn)

    def __repr__(self) -> str:
        return f"KernelLibrary({self.path!r})"

    def close(self) -> None:
        """Unload the library (dlclose), so the same path can be opened again after a rebuild; call nothing of it
        afterwards."""
        _ctypes.dlclose(self._cdll._handle)


def open_library(path: Path, signatures: dict[str, Signature] | None = None) -> KernelLibrary:
    return KernelLibrary(ctypes.CDLL(str(path)), header_signatures() if signatures is None else signatures)
