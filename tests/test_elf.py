"""The grader's reader of built objects: the names they leave undefined, and nothing it is told to
believe without checking."""

import shutil
import struct
import subprocess

import pytest

from autograder.engine import elf

SOURCE = """
extern int puts(const char*);
extern int PyRun_SimpleString(const char*);
__attribute__((weak)) extern int maybe_there(void);
static int hidden(void) { return 1; }
int exported(void) { return puts("x") + PyRun_SimpleString("y") + hidden() + (maybe_there ? maybe_there() : 0); }
"""

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("elf")
    (folder / "unit.c").write_text(SOURCE)
    subprocess.run(["cc", "-c", "-fPIC", "unit.c", "-o", "unit.o"], cwd=folder, check=True)
    subprocess.run(["cc", "-shared", "unit.o", "-o", "lib.so"], cwd=folder, check=True)
    return (folder / "unit.o").read_bytes(), (folder / "lib.so").read_bytes()


def test_an_object_file_names_what_it_leaves_to_the_linker(built):
    unit, _ = built
    assert {"puts", "PyRun_SimpleString", "maybe_there"} <= set(elf.undefined_symbols(unit))
    assert not {"exported", "hidden"} & set(elf.undefined_symbols(unit))


def test_a_shared_object_names_what_it_leaves_to_the_loader_and_the_libraries_it_needs(built):
    _, library = built
    undefined = set(elf.undefined_symbols(library))
    assert {"puts", "PyRun_SimpleString", "maybe_there"} <= undefined
    assert "exported" not in undefined
    assert "libc.so.6" in elf.needed_libraries(library)


def _dynamic_entry(data: bytes, tag: int) -> int:
    """The file offset of the dynamic segment's entry ``tag``."""
    fields = struct.unpack_from("<16sHHIQQQIHHHHHH", data)
    phoff, phnum = fields[5], fields[10]
    for i in range(phnum):
        kind, _, offset, _, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + 56 * i)
        if kind == elf.PT_DYNAMIC:
            for j in range(filesz // 16):
                if struct.unpack_from("<q", data, offset + 16 * j)[0] == tag:
                    return offset + 16 * j
    raise AssertionError(f"no dynamic entry {tag}")


def test_a_file_whose_two_views_of_its_symbols_differ_is_refused(built):
    # The loader reads the dynamic segment; a reader of section headers alone would see another table.
    _, library = built
    forged = bytearray(library)
    where = _dynamic_entry(library, elf.DT_SYMTAB)
    struct.pack_into("<Q", forged, where + 8, struct.unpack_from("<Q", library, where + 8)[0] + 24)
    with pytest.raises(elf.ElfError, match="disagree"):
        elf.undefined_symbols(bytes(forged))


def test_tables_that_lie_about_their_size_or_place_are_refused(built):
    unit, library = built
    with pytest.raises(elf.ElfError, match="not an ELF"):
        elf.undefined_symbols(b"#!/bin/sh\n" + unit)
    with pytest.raises(elf.ElfError):
        elf.undefined_symbols(unit[: len(unit) // 2])  # the section headers lie at the end
    shoff = struct.unpack_from("<Q", unit, 0x28)[0]
    for field, value in ((0x28, len(unit) + 4096), (0x3C, 0xFFFF)):  # e_shoff past the end; 65535 sections
        forged = bytearray(unit)
        struct.pack_into("<Q" if field == 0x28 else "<H", forged, field, value)
        with pytest.raises(elf.ElfError, match="outside the file|section header"):
            elf.undefined_symbols(bytes(forged))
    # A symbol table whose size says a million entries more than the file holds.
    shnum = struct.unpack_from("<H", unit, 0x3C)[0]
    forged = bytearray(unit)
    for i in range(shnum):
        if struct.unpack_from("<I", unit, shoff + 64 * i + 4)[0] == elf.SHT_SYMTAB:
            struct.pack_into("<Q", forged, shoff + 64 * i + 32, 24 * 10**6)
    with pytest.raises(elf.ElfError):
        elf.undefined_symbols(bytes(forged))
    with pytest.raises(elf.ElfError, match="not a shared object"):
        elf.needed_libraries(unit)
    with pytest.raises(elf.ElfError, match="MiB"):
        elf.undefined_symbols(library + bytes(elf.MAX_BYTES))
