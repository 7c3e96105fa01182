"""Targets: which GPU a kernel is compiled for, after Triton's own ``GPUTarget``.

A :class:`Target` is Triton's triple (backend, arch, warp size) with the names Foldwise needs
around it: the arch a binary is built for (``sm_90a``, ``gfx942``), the kind of binary the
backend's compiler gives (``cubin`` or ``hsaco``), and the text a user or a stored bundle
writes for it. It replaces arch strings and bare compute capabilities: code that needs to know
the vendor asks ``target.backend``; nothing parses ``sm_`` text but :meth:`Target.parse`.

NVIDIA targets are named by compute capability, as Triton names them (``GPUTarget("cuda", 90,
32)``); their binary arch is the one Triton's ptxas really targets (``sm_90a`` for 90, the
arch-specific variant with wgmma and TMA; ``sm_100a`` for 100; ``sm_80`` and ``sm_89`` plain).
AMD targets are named by their gfx arch with 64-wide wavefronts (``GPUTarget("hip", "gfx942",
64)``, CDNA3).

Example:
    >>> Target.parse("sm_90").binary_arch, Target.parse("gfx942").binary_kind
    ('sm_90a', 'hsaco')
    >>> Target.parse("sm_80") == Target("cuda", 80, 32)
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CUDA = "cuda"
HIP = "hip"
BINARY_KINDS = {CUDA: "cubin", HIP: "hsaco"}
ASSEMBLY_KINDS = {CUDA: "ptx", HIP: "amdgcn"}  # the text Triton keeps beside the binary
WARP_SIZES = {CUDA: 32, HIP: 64}

_SM = re.compile(r"sm_(\d{2,3})a?")
_GFX = re.compile(r"gfx[0-9a-f]{3,4}")
# capabilities whose wgmma/TMA (or tcgen05) instructions exist only in the arch-specific "a"
# variant, which Triton's ptxas targets for them (triton.backends.nvidia.compiler.sm_arch_from_capability)
_ARCH_SPECIFIC = {90, 100, 101, 103, 120, 121}


@dataclass(frozen=True)
class Target:
    """One compile target: ``backend`` ("cuda" or "hip"), ``arch`` (the compute capability as an
    int for cuda, the gfx name for hip) and ``warp_size`` (32, or 64 for AMD's wavefronts)."""

    backend: str
    arch: int | str
    warp_size: int

    def __post_init__(self) -> None:
        if self.backend == CUDA:
            ok = isinstance(self.arch, int) and not isinstance(self.arch, bool) and 50 <= self.arch <= 199
        elif self.backend == HIP:
            ok = isinstance(self.arch, str) and _GFX.fullmatch(self.arch) is not None
        else:
            raise ValueError(f"unknown backend {self.backend!r}; one of {', '.join(BINARY_KINDS)}")
        if not ok:
            raise ValueError(f"not a {self.backend} arch: {self.arch!r}")
        if self.warp_size != WARP_SIZES[self.backend]:
            raise ValueError(f"{self.backend} targets have warp size {WARP_SIZES[self.backend]}, got {self.warp_size}")

    @staticmethod
    def parse(text: str) -> Target:
        """``"sm_90"``, ``"sm_90a"`` -> cuda 90; ``"gfx942"`` -> hip gfx942 (ValueError otherwise)."""
        name = str(text).strip().lower()
        if m := _SM.fullmatch(name):
            return Target(CUDA, int(m.group(1)), WARP_SIZES[CUDA])
        if _GFX.fullmatch(name):
            return Target(HIP, name, WARP_SIZES[HIP])
        raise ValueError(f"not a GPU arch: {str(text)[:40]!r} (expected sm_NN for NVIDIA or gfxNNN for AMD)")

    @property
    def binary_kind(self) -> str:
        """What the backend's compiler gives: ``cubin`` (NVIDIA) or ``hsaco`` (an AMDGPU ELF)."""
        return BINARY_KINDS[self.backend]

    @property
    def assembly_kind(self) -> str:
        """The assembly Triton keeps beside the binary: ``ptx`` (NVIDIA) or ``amdgcn`` (AMD)."""
        return ASSEMBLY_KINDS[self.backend]

    @property
    def capability(self) -> int | None:
        """The NVIDIA compute capability (90), None for AMD."""
        return self.arch if self.backend == CUDA else None  # type: ignore[return-value]

    @property
    def fp8_native(self) -> bool:
        """Does it convert e4m3 and multiply it on the tensor cores in hardware (NVIDIA sm_89 and
        newer)? The generated launchers ask the device the same question (codegen.helpers.fp8_native,
        copied into self-contained modules; a test keeps the two equal); AMD's fp8 is the fnuz
        variant, so AMD kernels convert in software."""
        return self.backend == CUDA and int(self.arch) >= 89

    @property
    def arch_name(self) -> str:
        """The arch as users and profiles write it: ``sm_90``, ``gfx942``."""
        return f"sm_{self.arch}" if self.backend == CUDA else str(self.arch)

    @property
    def binary_arch(self) -> str:
        """The arch a binary for this target runs on, as bundles store it: ``sm_90a``, ``sm_80``, ``gfx942``."""
        if self.backend == CUDA:
            return f"sm_{self.arch}a" if self.arch in _ARCH_SPECIFIC else f"sm_{self.arch}"
        return str(self.arch)

    def triton(self) -> Any:
        """Triton's ``GPUTarget`` for this target (imports triton)."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)

    def __str__(self) -> str:
        return self.arch_name
