"""A small reader of ELF shared libraries, from their bytes: what the kernel library's check needs before dlopen.

dlopen trusts the file: a truncated library is mapped anyway and the first touch past its end is a SIGBUS, and a
library without a symbol fails only when Python asks for it. This reader looks first, in Python, and never
raises anything but ``ElfError`` (whatever the bytes): a 64-bit ELF shared library in this host's byte order,
every segment and section inside the file, and the functions its dynamic symbol table defines (``.dynsym`` with
its ``.dynstr``: the names dlsym finds).
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

# e_machine of the hosts the kernels build for (platform.machine() -> ELF machine number)
MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
ET_DYN = 3
SHT_NOBITS, SHT_DYNSYM = 8, 11
STT_FUNC = 2
_EHDR, _PHDR, _SHDR, _SYM = 64, 56, 64, 24        # Elf64 header, program header, section header, symbol sizes


class ElfError(ValueError):
    """The bytes are not a whole ELF shared library this reader (and this host) can use; the message says what."""


@dataclass(frozen=True)
class SharedLibrary:
    machine: int                      # e_machine: 62 x86-64, 183 AArch64
    functions: frozenset[str]         # the functions its dynamic symbol table defines (what dlsym finds)


def read_shared_library(data: bytes) -> SharedLibrary:
    """The machine and exported functions of the ELF shared library ``data``; ElfError when it is not one, or is
    cut short (a segment, a section or a header table past the end of the file)."""
    order = "<" if sys.byteorder == "little" else ">"
    _header_checks(data, order)
    (phoff, shoff, phentsize, phnum, shentsize, shnum) = struct.unpack_from(order + "QQ6xHHHH", data, 32)
    machine = struct.unpack_from(order + "H", data, 18)[0]
    if phentsize != _PHDR or shentsize != _SHDR:
        raise ElfError(f"its header tables have entries of {phentsize} and {shentsize} bytes (ELF64: 56 and 64)")
    _inside(data, phoff, phnum * _PHDR, "its program header table")
    for i in range(phnum):
        offset, filesz = struct.unpack_from(order + "Q16xQ", data, phoff + i * _PHDR + 8)
        _inside(data, offset, filesz, f"segment {i}")
    _inside(data, shoff, shnum * _SHDR, "its section header table")
    sections = [struct.unpack_from(order + "4xI16xQQI", data, shoff + i * _SHDR) for i in range(shnum)]
    for i, (kind, offset, size, _link) in enumerate(sections):
        if kind != SHT_NOBITS:
            _inside(data, offset, size, f"section {i}")
    return SharedLibrary(machine, _dynamic_functions(data, order, sections))


def _header_checks(data: bytes, order: str) -> None:
    if len(data) < _EHDR:
        raise ElfError(f"it is {len(data)} bytes, shorter than an ELF header")
    if data[:4] != b"\x7fELF":
        raise ElfError(f"it is not an ELF file (it starts with {data[:4]!r})")
    if data[4] != 2:
        raise ElfError(f"it is not a 64-bit ELF file (class {data[4]})")
    if data[5] != (1 if order == "<" else 2):
        raise ElfError(f"its byte order (ELF data {data[5]}) is not this host's")
    kind = struct.unpack_from(order + "H", data, 16)[0]
    if kind != ET_DYN:
        raise ElfError(f"it is not a shared library (ELF type {kind})")


def _inside(data: bytes, offset: int, size: int, what: str) -> None:
    if offset + size > len(data):
        raise ElfError(f"it is cut short: {what} ends at byte {offset + size}, the file has {len(data)}")


def _dynamic_functions(data: bytes, order: str, sections: list[tuple[int, int, int, int]]) -> frozenset[str]:
    """The defined function symbols of the (first) .dynsym section, named from the string table it links."""
    dynsym = next((s for s in sections if s[0] == SHT_DYNSYM), None)
    if dynsym is None:
        raise ElfError("it has no dynamic symbol table")
    _, offset, size, link = dynsym
    if link >= len(sections):
        raise ElfError(f"its dynamic symbol table links section {link}, of {len(sections)}")
    _, str_offset, str_size, _ = sections[link]
    names = set()
    for at in range(offset, offset + size - _SYM + 1, _SYM):
        name, info, shndx = struct.unpack_from(order + "IBxH", data, at)
        if info & 0xF != STT_FUNC or shndx == 0 or name >= str_size:     # not a function, or undefined here
            continue
        start = str_offset + name
        end = data.find(b"\0", start, str_offset + str_size)
        if end < 0:
            raise ElfError("its dynamic string table has a name without an end")
        names.add(data[start:end].decode("ascii", "replace"))
    return frozenset(names)
