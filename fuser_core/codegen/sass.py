"""What a compiled kernel issues, read from its SASS (``cuobjdump -sass``, in the triton wheel).

The cost model needs more than registers and shared memory: how many instructions the hot
loop issues per element, how many of them go to the special-function unit (``MUFU.EX2`` for
every ``exp``), how wide the global loads and stores are (``LDG.E.128`` moves 16 bytes a
thread, ``LDG.E.U16`` two), and which tensor-core instruction the matrix products became
(``HGMMA`` bf16/fp16 or TF32 on sm_90, ``HMMA`` on sm_80, ``UTCHMMA``/``UTCQMMA`` on sm_100,
none). This module is the one parser of that text: :func:`parse` splits a listing into
functions and instructions, :func:`loops` finds the loops (a branch back to an earlier address),
and :func:`facts` counts per function and per innermost loop. Nothing else in the project reads SASS.

An instruction line of ``cuobjdump -sass`` reads::

    /*0d40*/               @P4 LDG.E.U16 R24, desc[UR16][R10.64] ;   /* 0x000000100a184981 */

(address, optional predicate, opcode with its dot-separated modifiers, operands).

Example:
    >>> text = open("tests/fuser_core/data/sass/softmax_streaming_sm90.sass").read()  # doctest: +SKIP
    >>> f = facts(text)["safe_softmax_streaming_fused_kernel"]  # doctest: +SKIP
    >>> f.loops[0].counts["mufu.ex2"], f.loops[0].load_bits  # doctest: +SKIP
    (4, {16: 4})
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
_GMMA_SHAPE = re.compile(r"^\d+x\d+x\d+$")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # the mnemonic with its modifiers: "LDG.E.128.CONSTANT"
    operands: str
    predicated: bool = False

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])


def parse(text: str) -> dict[str, list[Instruction]]:
    """Function name -> its instructions, in address order."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append(Instruction(int(m.group(1), 16), m.group(3), m.group(4).strip(), bool(m.group(2))))
    return out


# ---------------------------------------------------------------------------- classes


def access_bits(ins: Instruction) -> int:
    """Bits a global/shared load or store moves per thread: .U8/.S8 8, .U16/.S16 16, .64 64,
    .128 128, else 32."""
    mods = set(ins.modifiers)
    if mods & {"U8", "S8"}:
        return 8
    if mods & {"U16", "S16"}:
        return 16
    if "128" in mods:
        return 128
    if "64" in mods:
        return 64
    return 32


# Blackwell's tensor-core instructions (tcgen05.mma), issued by one thread for the whole CTA: their
# shape and operand types are in an instruction descriptor (a uniform register, ``idesc[UR..]``),
# not in the SASS text, so their multiply-adds come from the kernel's dots (warp_macs gives 0;
# tuner.static_bound.dot_macs counts them). The kind is PTX's tcgen05.mma kind, an operand family
# (kind::f16 is fp16 and bf16, one rate).
TCGEN05_MMA = {"UTCHMMA": "utchmma.kind_f16", "UTCQMMA": "utcqmma.kind_f8f6f4", "UTCOMMA": "utcomma.kind_mxf4"}


def tensor_kind(ins: Instruction) -> str | None:
    """``"hgmma.bf16"``, ``"hgmma.f16"``, ``"hgmma.tf32"``, ``"qgmma.e4m3"``, ``"hmma.bf16"``...
    for a tensor-core instruction, else None. After the shape come the accumulator's type and
    then the operands' (``HGMMA.64x64x16.F32.BF16``); fp16 operands are not spelled out
    (``HGMMA.64x64x16.F32``, ``HMMA.16816.F32``)."""
    if ins.base in TCGEN05_MMA:
        return TCGEN05_MMA[ins.base]
    if ins.base not in ("HGMMA", "QGMMA", "HMMA", "IMMA"):
        return None
    types = [m for m in ins.modifiers if not _GMMA_SHAPE.match(m) and not m.isdigit()
             and m not in ("SP", "GSB0", "GSB1")]
    operand = types[1].lower() if len(types) > 1 else "f16"
    return f"{ins.base.lower()}.{operand}"


_MMA_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "16832": (16, 8, 32), "884": (8, 8, 4)}


def tensor_shape(ins: Instruction) -> tuple[int, int, int] | None:
    """(M, N, K) of a tensor-core instruction: a warpgroup MMA's (``HGMMA.64x128x16``) or a warp
    MMA's (``HMMA.16816``: m16n8k16); its product is M*N*K multiply-adds."""
    for m in ins.modifiers:
        if _GMMA_SHAPE.match(m):
            a, b, c = (int(x) for x in m.split("x"))
            return a, b, c
        if m in _MMA_SHAPES:
            return _MMA_SHAPES[m]
    return None


def warp_macs(ins: Instruction) -> float:
    """Multiply-adds one warp's instruction stream accounts for: a warp MMA's M*N*K, a
    warpgroup MMA's shared by the 4 warps that each issue it."""
    shape = tensor_shape(ins)
    if shape is None:
        return 0.0
    macs = shape[0] * shape[1] * shape[2]
    return macs / 4 if ins.base in ("HGMMA", "QGMMA") else float(macs)


def classify(ins: Instruction) -> str:
    """The counting class of an instruction: ``mufu.ex2``, ``ldg``, ``stg``, ``lds``, ``sts``,
    ``ldgsts`` (cp.async), ``tma`` (bulk tensor copy), ``tensor``, ``shfl``, ``bar``, ``other``."""
    base = ins.base
    if base == "MUFU":
        return "mufu." + (ins.modifiers[0].lower() if ins.modifiers else "?")
    if base in ("LDG", "STG", "LDS", "STS", "LDGSTS", "SHFL", "BAR"):
        return base.lower()
    if base.startswith("UTMA") or base.startswith("UBLKCP"):
        return "tma"
    if tensor_kind(ins) is not None:
        return "tensor"
    return "other"


@dataclass(frozen=True)
class Counts:
    """Counts over a stretch of instructions (one issue each, per warp)."""

    instructions: int
    classes: dict[str, int]  # classify() -> count
    load_bits: dict[int, int]  # global load width -> count (LDG and LDGSTS)
    store_bits: dict[int, int]  # global store width -> count
    tensor: dict[str, int]  # tensor_kind() -> count
    tensor_macs: float  # multiply-adds this warp's instructions account for (warp_macs)

    def __getitem__(self, key: str) -> int:
        return self.classes.get(key, 0)

    def to_dict(self) -> dict:
        return {"instructions": self.instructions, "classes": dict(self.classes),
                "load_bits": {str(k): v for k, v in self.load_bits.items()},
                "store_bits": {str(k): v for k, v in self.store_bits.items()},
                "tensor": dict(self.tensor), "tensor_macs": self.tensor_macs}


def count(instructions: list[Instruction]) -> Counts:
    classes: Counter = Counter()
    loads: Counter = Counter()
    stores: Counter = Counter()
    tensor: Counter = Counter()
    macs = 0.0
    for ins in instructions:
        if ins.base in ("NOP",):
            continue
        kind = classify(ins)
        classes[kind] += 1
        if kind in ("ldg", "ldgsts"):
            loads[access_bits(ins)] += 1
        elif kind == "stg":
            stores[access_bits(ins)] += 1
        elif kind == "tensor":
            tensor[tensor_kind(ins)] += 1
            macs += warp_macs(ins)
    total = sum(classes.values())
    return Counts(total, dict(classes), dict(loads), dict(stores), dict(tensor), macs)


# ---------------------------------------------------------------------------- loops


@dataclass(frozen=True)
class SassLoop:
    """Instructions from a backward branch's target to the branch: one iteration's issue."""

    start: int
    end: int
    counts: Counts

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, **self.counts.to_dict()}


def loops(instructions: list[Instruction]) -> list[SassLoop]:
    """The innermost loops (containing no other loop), in address order. A loop is a branch
    (``BRA``, not the ``EXIT``-guarding jumps forward) to an address at or before itself."""
    spans = []
    for ins in instructions:
        if ins.base != "BRA":
            continue
        m = _BRANCH_TARGET.search(ins.operands)
        if m and int(m.group(1), 16) <= ins.address:
            spans.append((int(m.group(1), 16), ins.address))
    spans = sorted(set(spans))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    inner = [s for s in inner if s[1] > s[0]]  # a branch to itself is a trap (the end of a kernel), not work
    out = []
    for lo, hi in inner:
        body = [i for i in instructions if lo <= i.address <= hi]
        if all(i.base in ("SYNCS", "BRA") for i in body):
            continue  # an mbarrier's try-wait retried (TMA, async copies), out of line: a wait, not a loop of work
        out.append(SassLoop(lo, hi, count(body)))
    return out


@dataclass(frozen=True)
class KernelSass:
    """One function's facts: the whole body and each innermost loop."""

    name: str
    total: Counts
    loops: tuple[SassLoop, ...] = field(default_factory=tuple)

    @property
    def hot_loop(self) -> SassLoop | None:
        """The innermost loop that issues the most instructions per iteration."""
        return max(self.loops, key=lambda lp: lp.counts.instructions, default=None)

    def to_dict(self) -> dict:
        return {"name": self.name, "total": self.total.to_dict(), "loops": [lp.to_dict() for lp in self.loops]}


def facts(text: str) -> dict[str, KernelSass]:
    """Function name -> its :class:`KernelSass`, from ``cuobjdump -sass`` text."""
    return {name: KernelSass(name, count(ins), tuple(loops(ins))) for name, ins in parse(text).items()}


def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin (the tool in the triton wheel)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True,
                             timeout=60, check=True)
    finally:
        os.unlink(path)
    return out.stdout


def cubin_facts(cubin: bytes) -> dict[str, KernelSass]:
    return facts(disassemble(cubin))


__all__ = ["Counts", "Instruction", "KernelSass", "SassLoop", "access_bits", "classify", "count", "cubin_facts",
           "disassemble", "facts", "loops", "parse", "TCGEN05_MMA", "tensor_kind", "tensor_shape", "warp_macs"]
