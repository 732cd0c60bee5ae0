"""Read the symbols of a built object (an ELF file the grader did not write) without trusting it.

A C++ item's extension is compiled in a sandbox and comes back to the grader as bytes: a shared
object and the object file of the student's unit. The grader judges what they call, not what the
source says: the names of the symbols each leaves undefined (resolved by the dynamic loader at
load, or by the linker), and the libraries a shared object asks the loader for.

This reader takes bytes only (never a path), and checks every count, offset and size it reads
against the bytes it holds and against caps of its own before using them: a file that lies about
its tables is refused (``ElfError``), never followed. It reads little-endian 64-bit ELF, what g++
produces on x86-64 and aarch64 hosts.

- ``undefined_symbols(data)``: the names an object or shared object leaves undefined, from its
  symbol table (``.symtab`` for an object file; ``.dynsym`` for a shared object, the table the
  dynamic loader resolves);
- ``needed_libraries(data)``: the ``DT_NEEDED`` entries of a shared object's dynamic section.

For a shared object the section headers (which name ``.dynsym``) must agree with the dynamic
segment (which the loader reads): a file whose two views differ is refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_BYTES = 256 << 20
MAX_SECTIONS = 1 << 16
MAX_SYMBOLS = 1 << 20
MAX_NAME = 4096
MAX_DYNAMIC = 1 << 14

ELF_MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB = 2, 1
ET_REL, ET_DYN = 1, 3
SHT_SYMTAB, SHT_STRTAB, SHT_DYNAMIC, SHT_NOBITS, SHT_DYNSYM = 2, 3, 6, 8, 11
SHN_UNDEF = 0
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_SYMENT = 0, 1, 5, 6, 10, 11
STB_LOCAL = 0

_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SEGMENT = struct.Struct("<IIQQQQQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_DYNAMIC = struct.Struct("<qQ")


class ElfError(ValueError):
    """The bytes are not an ELF file this reader accepts, or their tables do not add up."""


@dataclass(frozen=True)
class _Section:
    type: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


def _span(data: bytes, offset: int, size: int, what: str) -> memoryview:
    if offset < 0 or size < 0 or offset + size > len(data):
        raise ElfError(f"{what} lies outside the file ({offset}+{size} of {len(data)} bytes)")
    return memoryview(data)[offset:offset + size]


def _header(data: bytes) -> tuple:
    if len(data) > MAX_BYTES:
        raise ElfError(f"{len(data)} bytes: more than the {MAX_BYTES >> 20} MiB a built extension may have")
    if len(data) < _HEADER.size or data[:4] != ELF_MAGIC:
        raise ElfError("not an ELF file")
    fields = _HEADER.unpack_from(data, 0)
    ident = fields[0]
    if ident[4] != ELFCLASS64 or ident[5] != ELFDATA2LSB:
        raise ElfError("not a little-endian 64-bit ELF file")
    return fields


def _sections(data: bytes) -> list[_Section]:
    _, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _ = _header(data)
    if shnum == 0 or shnum > MAX_SECTIONS or shentsize != _SECTION.size:
        raise ElfError(f"{shnum} section headers of {shentsize} bytes")
    table = _span(data, shoff, shnum * shentsize, "the section header table")
    sections = []
    for i in range(shnum):
        _, kind, _, addr, offset, size, link, _, _, entsize = _SECTION.unpack_from(table, i * shentsize)
        if kind != SHT_NOBITS:
            _span(data, offset, size, f"section {i}")
        sections.append(_Section(kind, addr, offset, size, link, entsize))
    return sections


def _string(data: bytes, table: _Section, offset: int) -> str:
    if offset >= table.size:
        raise ElfError(f"a name at {offset}, past its string table of {table.size} bytes")
    start = table.offset + offset
    end = data.find(b"\0", start, min(table.offset + table.size, start + MAX_NAME + 1))
    if end < 0:
        raise ElfError("a name without its end within its string table (or longer than a name may be)")
    return data[start:end].decode("utf-8", "replace")


def _symbol_table(data: bytes, sections: list[_Section], kind: int) -> tuple[_Section, _Section]:
    found = [s for s in sections if s.type == kind]
    if len(found) != 1:
        raise ElfError(f"{len(found)} symbol tables of the kind wanted, not one")
    table = found[0]
    if table.entsize != _SYMBOL.size or table.size % _SYMBOL.size or table.size // _SYMBOL.size > MAX_SYMBOLS:
        raise ElfError(f"a symbol table of {table.size} bytes in entries of {table.entsize}")
    if not 0 < table.link < len(sections) or sections[table.link].type != SHT_STRTAB:
        raise ElfError("a symbol table whose names are not in a string table")
    return table, sections[table.link]


def _undefined(data: bytes, table: _Section, names: _Section) -> list[str]:
    found = []
    for i in range(1, table.size // _SYMBOL.size):  # entry 0 is the null symbol
        name, info, _, shndx, _, _ = _SYMBOL.unpack_from(data, table.offset + i * _SYMBOL.size)
        if shndx == SHN_UNDEF and info >> 4 != STB_LOCAL and name:
            found.append(_string(data, names, name))
    return found


def _dynamic_entries(data: bytes) -> list[tuple[int, int]]:
    """The (tag, value) pairs of the dynamic segment, which is what the loader reads."""
    fields = _header(data)
    etype, phoff, phentsize, phnum = fields[1], fields[5], fields[9], fields[10]
    if etype != ET_DYN:
        raise ElfError("not a shared object")
    if phnum == 0 or phnum > MAX_SECTIONS or phentsize != _SEGMENT.size:
        raise ElfError(f"{phnum} program headers of {phentsize} bytes")
    table = _span(data, phoff, phnum * phentsize, "the program header table")
    dynamic = [_SEGMENT.unpack_from(table, i * phentsize) for i in range(phnum)]
    dynamic = [seg for seg in dynamic if seg[0] == PT_DYNAMIC]
    if len(dynamic) != 1:
        raise ElfError(f"{len(dynamic)} dynamic segments, not one")
    _, _, offset, _, _, filesz, _, _ = dynamic[0]
    if filesz % _DYNAMIC.size or filesz // _DYNAMIC.size > MAX_DYNAMIC:
        raise ElfError(f"a dynamic segment of {filesz} bytes")
    view = _span(data, offset, filesz, "the dynamic segment")
    entries = []
    for i in range(filesz // _DYNAMIC.size):
        tag, value = _DYNAMIC.unpack_from(view, i * _DYNAMIC.size)
        if tag == DT_NULL:
            break
        entries.append((tag, value))
    return entries


def _dynamic_tables(data: bytes) -> tuple[list[_Section], _Section, _Section, list[tuple[int, int]]]:
    """``.dynsym`` and ``.dynstr`` as the section headers name them, checked against the dynamic
    segment's own addresses of the two tables."""
    if _header(data)[1] != ET_DYN:
        raise ElfError("not a shared object")
    sections = _sections(data)
    symbols, names = _symbol_table(data, sections, SHT_DYNSYM)
    entries = _dynamic_entries(data)
    tags = {}
    for tag, value in entries:
        if tag in (DT_SYMTAB, DT_STRTAB, DT_STRSZ, DT_SYMENT):
            if tags.setdefault(tag, value) != value:
                raise ElfError("the dynamic segment names two different symbol tables")
    if (tags.get(DT_SYMTAB) != symbols.addr or tags.get(DT_STRTAB) != names.addr
            or tags.get(DT_STRSZ) != names.size or tags.get(DT_SYMENT, _SYMBOL.size) != _SYMBOL.size):
        raise ElfError("the dynamic segment and the section headers disagree about the symbol tables")
    return sections, symbols, names, entries


def undefined_symbols(data: bytes) -> list[str]:
    """The names ``data`` leaves for the linker (an object file: its ``.symtab``) or the dynamic
    loader (a shared object: its ``.dynsym``) to find elsewhere; local and nameless entries aside."""
    kind = _header(data)[1]
    if kind == ET_REL:
        sections = _sections(data)
        symbols, names = _symbol_table(data, sections, SHT_SYMTAB)
    elif kind == ET_DYN:
        _, symbols, names, _ = _dynamic_tables(data)
    else:
        raise ElfError(f"an ELF file of type {kind}, neither an object file nor a shared object")
    return _undefined(data, symbols, names)


def needed_libraries(data: bytes) -> list[str]:
    """The libraries a shared object asks the dynamic loader to load with it (``DT_NEEDED``)."""
    _, _, names, entries = _dynamic_tables(data)
    return [_string(data, names, value) for tag, value in entries if tag == DT_NEEDED]
