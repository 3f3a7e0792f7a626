"""The tests' cubin reader (cubin_elf.py) on made-up ELF files: no DSL, GPU or cubin needed."""

from __future__ import annotations

import struct

import pytest

from cubin_elf import elf_arch


def test_the_elf_arch_parser_reads_the_header_and_the_note():
    """elf_arch on a made-up ELF: e_flags of ABI version 8 (sm_100 in bits 8..15), the ptxas
    command line in .note.nv.tkinfo; a header and a note that disagree fail; ABI version 7 (the SM
    in bits 0..7) without the note below sm_90, and not from sm_90 on (its "a" would be unknown)."""

    def elf(flags: int, note: bytes | None, version: int = 8) -> bytes:
        names = b"\0.shstrtab\0" + (b"" if note is None else b".note.nv.tkinfo\0")
        header = bytearray(64)
        header[:9] = b"\x7fELF\x02\x01\x01" + bytes([0x41 if version >= 8 else 0x33, version])
        body = names + (note or b"")
        shoff = 64 + len(body)
        struct.pack_into("<I", header, 0x30, flags)
        struct.pack_into("<Q", header, 0x28, shoff)
        struct.pack_into("<HHH", header, 0x3A, 64, 2 if note is None else 3, 1)  # e_shentsize, e_shnum, e_shstrndx
        sections = bytes(64)  # the null section
        sections += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0)
        if note is not None:
            sections += struct.pack("<IIQQQQIIQQ", 11, 7, 0, 0, 64 + len(names), len(note), 0, 0, 4, 0)
        return bytes(header) + body + sections

    assert elf_arch(elf(0x6006402, b"ptxas -O 3 -arch sm_100a ")) == "sm_100a"
    assert elf_arch(elf(0x6005A04, b"ptxas -O 3 -arch sm_90a ")) == "sm_90a"
    with pytest.raises(AssertionError):
        elf_arch(elf(0x6005A04, b"ptxas -O 3 -arch sm_100a "))
    assert elf_arch(elf(0x500550, None, version=7)) == "sm_80"
    assert elf_arch(elf(0x590559, None, version=7)) == "sm_89"
    with pytest.raises(AssertionError):
        elf_arch(elf(0x5A055A, None, version=7))
