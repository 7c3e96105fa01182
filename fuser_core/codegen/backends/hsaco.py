"""What an hsaco (an AMDGPU code object: an ELF) says about its kernels, read from its bytes.

The code object's ``.note`` section holds one ``NT_AMDGPU_METADATA`` note (owner ``AMDGPU``):
a MessagePack map whose ``amdhsa.kernels`` list gives, per kernel, what the LLVM backend
allocated: ``.vgpr_count`` (vector registers per lane, AGPRs included on CDNA3), ``.sgpr_count``,
``.group_segment_fixed_size`` (static LDS bytes per workgroup), ``.private_segment_fixed_size``
(scratch bytes per lane: spills), ``.vgpr_spill_count`` / ``.sgpr_spill_count``. The same map is
printed as YAML at the end of Triton's ``amdgcn`` text; the binary is read instead because it is
what a bundle stores and a GPU loads, and the note's layout is fixed by the HSA code object
format (v4 and v5: Triton 3.6 to 3.9), where the assembly text's comments are not. The
``.comment`` section names the linker that built it (``Linker: LLD 24.0.0 (...)``).

No ROCm or msgpack package is needed: the ELF64 section table, the note records and the few
MessagePack types the metadata uses are read here, in a few lines each.

Example:
    >>> kernels = hsaco_kernels(hsaco)  # doctest: +SKIP
    >>> kernels["safe_softmax_streaming_fused_kernel"][".vgpr_count"]  # doctest: +SKIP
    58
"""

from __future__ import annotations

import struct
from typing import Any

ELF_MAGIC = b"\x7fELF"
EM_AMDGPU = 224  # e_machine of an AMDGPU code object (elf.h)
NT_AMDGPU_METADATA = 32  # the note type of the MessagePack metadata (code object v3 and later)


class HsacoError(ValueError):
    """Not an AMDGPU code object, or one whose metadata cannot be read."""


def elf_machine(binary: bytes) -> int | None:
    """The ELF ``e_machine`` of ``binary`` (224: AMDGPU; 190: CUDA), None if it is not an ELF."""
    if len(binary) < 20 or binary[:4] != ELF_MAGIC:
        return None
    return struct.unpack_from("<H", binary, 18)[0]


def _sections(binary: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 (an hsaco)."""
    if elf_machine(binary) != EM_AMDGPU:
        raise HsacoError("not an AMDGPU ELF (hsaco)")
    if binary[4] != 2 or binary[5] != 1:
        raise HsacoError("not a little-endian ELF64")
    shoff, = struct.unpack_from("<Q", binary, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", binary, 0x3A)
    headers = []
    for k in range(shnum):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", binary, shoff + k * shentsize)
        headers.append((name, binary[offset:offset + size] if _type != 8 else b""))  # 8: SHT_NOBITS
    names = headers[shstrndx][1]
    return {names[n:names.index(b"\0", n)].decode(): data for n, data in headers}


def _notes(data: bytes):
    """(owner, type, description) of each record of an ELF note section (4-byte aligned)."""
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, kind = struct.unpack_from("<III", data, pos)
        pos += 12
        owner = data[pos:pos + namesz].rstrip(b"\0").decode("ascii", "replace")
        pos += (namesz + 3) & ~3
        yield owner, kind, data[pos:pos + descsz]
        pos += (descsz + 3) & ~3


_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
          0xCA: ">f", 0xCB: ">d"}
_SIZED = {0xC4: (">B", bytes), 0xC5: (">H", bytes), 0xC6: (">I", bytes), 0xD9: (">B", str), 0xDA: (">H", str),
          0xDB: (">I", str), 0xDC: (">H", list), 0xDD: (">I", list), 0xDE: (">H", dict), 0xDF: (">I", dict)}


def unpack_msgpack(data: bytes, pos: int = 0) -> tuple[Any, int]:
    """One MessagePack value at ``pos`` -> (value, the position after it). Maps, arrays, strings,
    binaries, ints, floats, booleans and nil: every type the AMDGPU metadata uses (no extensions)."""
    head = data[pos]
    pos += 1
    if head <= 0x7F or head >= 0xE0:  # positive / negative fixint
        return (head if head <= 0x7F else head - 0x100), pos
    if head in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[head], pos
    if head in _FIXED:
        fmt = _FIXED[head]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    if 0x80 <= head <= 0x9F:
        kind, count = (dict, head & 0x0F) if head <= 0x8F else (list, head & 0x0F)
    elif 0xA0 <= head <= 0xBF:
        kind, count = str, head & 0x1F
    elif head in _SIZED:
        fmt, kind = _SIZED[head]
        count = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
    else:
        raise HsacoError(f"MessagePack type 0x{head:02x} is not one the AMDGPU metadata uses")
    if kind in (str, bytes):
        raw = data[pos:pos + count]
        return (raw.decode("utf-8") if kind is str else bytes(raw)), pos + count
    items = []
    for _ in range(count * (2 if kind is dict else 1)):
        item, pos = unpack_msgpack(data, pos)
        items.append(item)
    return (dict(zip(items[::2], items[1::2])) if kind is dict else items), pos


def hsaco_metadata(binary: bytes) -> dict[str, Any]:
    """The code object's whole ``NT_AMDGPU_METADATA`` map (``amdhsa.kernels``, ``amdhsa.target``...)."""
    for owner, kind, desc in _notes(_sections(binary).get(".note", b"")):
        if owner == "AMDGPU" and kind == NT_AMDGPU_METADATA:
            value, _ = unpack_msgpack(desc)
            if isinstance(value, dict):
                return value
    raise HsacoError("the hsaco has no AMDGPU metadata note")


def hsaco_kernels(binary: bytes) -> dict[str, dict[str, Any]]:
    """Kernel name -> its metadata (``.vgpr_count``, ``.sgpr_count``, ``.group_segment_fixed_size``...)."""
    return {k[".name"]: k for k in hsaco_metadata(binary).get("amdhsa.kernels", [])}


def linker_version(binary: bytes) -> str | None:
    """What the hsaco's ``.comment`` says built it, e.g. ``LLD 24.0.0 (https://github.com/llvm/llvm-project
    b010a18...)``: the LLVM that Triton's AMD backend links with; None when it names none."""
    text = _sections(binary).get(".comment", b"").split(b"\0")[0].decode("utf-8", "replace").strip()
    return text.removeprefix("Linker:").strip() or None
