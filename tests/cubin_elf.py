"""Reading CUDA cubins in tests: the ELF64 header, sections and symbols, parsed here (independent of
the builder and of any CUDA tool), and cuobjdump where one is installed."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path


def section_headers(data: bytes) -> list[tuple]:
    """ELF64 section headers (name, type, flags, addr, offset, size, link, info, align, entsize)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2  # 64-bit ELF
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def c_string(data: bytes, start: int) -> bytes:
    return data[start : data.index(b"\0", start)]


def elf_symbols(data: bytes) -> set[bytes]:
    """Names in the ELF64 .symtab of a cubin (parsed here, independent of the builder)."""
    sections = section_headers(data)
    names = set()
    for sh in sections:
        if sh[1] == 2:  # SHT_SYMTAB
            strtab = sections[sh[6]]
            for off in range(sh[4], sh[4] + sh[5], sh[9]):
                names.add(c_string(data, strtab[4] + struct.unpack_from("<I", data, off)[0]))
    return names


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents."""
    sections = section_headers(data)
    names = sections[struct.unpack_from("<H", data, 0x3E)[0]]  # e_shstrndx
    return {c_string(data, names[4] + sh[0]).decode(): data[sh[4] : sh[4] + sh[5]] for sh in sections}


CUDA_OSABI = (0x33, 0x41)  # e_ident[EI_OSABI] of CUDA cubins (ELF ABI versions 7 and 8)


def elf_arch(data: bytes) -> str:
    """The arch a cubin is built for, read from the ELF itself (parsed here, independent of the
    builder and of any CUDA tool): the SM number from the header's e_flags (CUDA ELF ABI version
    8 and later, e_ident[EI_ABIVERSION]: bits 8..15; before: bits 0..7), and the arch-specific
    suffix ("a") from the ptxas command line that the .note.nv.tkinfo note records ("-arch
    sm_90a"): e_flags is the same for sm_90 and sm_90a. A cubin without the note (ptxas of ELF ABI
    version 7 for an SM below 90, which has no arch-specific variant) is sm_<SM>."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[7] in CUDA_OSABI, data[:16].hex()
    (flags,) = struct.unpack_from("<I", data, 0x30)
    sm = (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF
    note = elf_sections(data).get(".note.nv.tkinfo")
    if note is None:
        assert data[8] < 8 and sm < 90, (data[8], hex(flags))  # a newer cubin records its ptxas command
        return f"sm_{sm}"
    (arch,) = re.findall(rb"-arch (sm_\d+[af]?)\b", note)
    arch = arch.decode()
    assert re.fullmatch(rf"sm_{sm}[af]?", arch), (arch, hex(flags))  # the header and the note agree
    return arch


def cuobjdump() -> str | None:
    """cuobjdump from a CUDA toolkit on PATH or the one triton ships, or None (CI has neither toolkit)."""
    import importlib.util

    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("triton")
    if found is None and spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(bundled) if bundled.is_file() else None
    return found


def cuobjdump_sm(path) -> str | None:
    """The SM cuobjdump reads from a cubin's header ("sm_100"; it prints no "a"), None without it."""
    tool = cuobjdump()
    if tool is None:
        return None
    done = subprocess.run([tool, "--dump-elf", str(path)], capture_output=True, text=True, check=True)
    (sm,) = re.findall(r"\bsm=(\d+)\b", done.stdout.split(".section")[0])
    return f"sm_{sm}"


def register_count(data: bytes) -> int:
    """EIATTR_REGCOUNT (0x2f) from the cubin's .nv.info: what ptxas allocated per thread."""
    info = elf_sections(data)[".nv.info"]
    i = 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != 4:  # the module-level .nv.info holds sized (EIFMT_SVAL) attributes only
            break
        (size,) = struct.unpack_from("<H", info, i + 2)
        if attr == 0x2F:
            return struct.unpack_from("<II", info, i + 4)[1]
        i += 4 + size
    raise AssertionError("no EIATTR_REGCOUNT in .nv.info")
