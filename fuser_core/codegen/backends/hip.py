"""AMD: hsaco code objects from Triton's AMD backend, their resources from the code object itself.

``triton.compile`` for ``GPUTarget("hip", "gfx942", 64)`` runs on a machine with no ROCm: Triton
links its own LLVM (AMDGPU target and LLD), so it gives the ``amdgcn`` assembly and the
``hsaco`` (an AMDGPU ELF) as it does on an MI300X. What the kernel holds is read from the
hsaco's metadata note (:mod:`fuser_core.codegen.backends.hsaco`): VGPRs per lane (Foldwise's
``registers``), SGPRs per wavefront, static LDS bytes (added to the dynamic LDS a launch asks
for, Triton's ``shared``) and scratch bytes per lane (what spilled). The compiler's version is the
LLD that linked it, as its ``.comment`` names it.

Compiled here only: no AMD GPU has run these binaries (loading and timing on ROCm are device-side
work, not this module's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuser_core.codegen.backends.base import Backend, Resources
from fuser_core.codegen.backends.hsaco import HsacoError, hsaco_kernels, linker_version


class HipBackend(Backend):
    """AMD targets (``Target("hip", "gfx942", 64)``): hsaco and AMDGCN assembly."""

    def resources(self, compiled: Any) -> Resources:
        name = compiled.metadata.name
        kernels = hsaco_kernels(bytes(compiled.asm["hsaco"]))
        facts = kernels.get(name) or (next(iter(kernels.values())) if len(kernels) == 1 else None)
        if facts is None:
            raise HsacoError(f"the hsaco has no metadata for kernel {name!r} (it names {sorted(kernels)})")
        return Resources(registers=int(facts[".vgpr_count"]), spill_bytes=int(facts[".private_segment_fixed_size"]),
                         shared_bytes=int(compiled.metadata.shared) + int(facts[".group_segment_fixed_size"]),
                         sgprs=int(facts[".sgpr_count"]))

    def compiler_version(self, binaries: Sequence[bytes]) -> str:
        """The LLD (Triton's bundled LLVM) that linked the first hsaco, e.g. ``LLD 24.0.0
        (https://github.com/llvm/llvm-project b010a18...)``; Triton's version where none is named."""
        import triton

        found = next((v for v in map(linker_version, binaries) if v), None)
        return (found or f"Triton {triton.__version__} AMD backend (no linker named)")[:120]
