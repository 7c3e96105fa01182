"""The Backend interface: what Foldwise needs of one vendor's toolchain to build a kernel.

After Triton's own ``BaseBackend`` (``triton.backends.compiler``), which a :class:`Backend`
wraps for one :class:`fuser_core.targets.Target`: Triton's backend lowers TTIR to the vendor's
binary; this one adds what Foldwise reads about the result. The compile side lives here and
needs no GPU:

- :meth:`Backend.bind` and :meth:`Backend.compile`: an intercepted launch
  (:mod:`fuser_core.codegen.launches`) through ``triton.compile`` for the target, bound as
  ``JITFunction.run`` binds it on a GPU (:func:`fuser_core.codegen.backends.binding.bind_launch`);
- ``binary_kind`` / ``assembly_kind``: what the compile gives (``cubin`` and ``ptx``, or ``hsaco``
  and ``amdgcn``: the keys of Triton's ``CompiledKernel.asm``);
- :meth:`Backend.resources`: registers, spilled bytes and shared memory (LDS) of a compiled
  kernel, read from its binary;
- :meth:`Backend.compiler_version`: the version of the vendor compiler that built a binary;
- :meth:`Backend.artifact` and :meth:`Backend.describe`: the stored form of a compiled kernel
  and of the build (:func:`fuser_core.codegen.gpu_compile.compile_artifacts`' answer).

Device-side duties (loading a stored binary, timing with an L2 flush, a device's arch) belong
to the code that runs kernels on a GPU, not to this compile-side interface.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fuser_core.targets import Target


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel holds on the GPU, by its backend's accounting.

    ``registers``: per thread (NVIDIA) or vector registers per lane (AMD, VGPRs with AGPRs);
    ``spill_bytes``: per thread, what spilled out of registers (NVIDIA stack + local; AMD scratch,
    the private segment); ``shared_bytes``: per program, the launch's dynamic shared memory (LDS)
    plus the binary's static allocation. NVIDIA only: ``stack_bytes``, ``local_bytes``; AMD only:
    ``sgprs``, the scalar registers per wavefront."""

    registers: int | None
    spill_bytes: int | None
    shared_bytes: int | None
    stack_bytes: int | None = None
    local_bytes: int | None = None
    sgprs: int | None = None


class BoundLaunch(NamedTuple):
    """A launch bound for a target: ``triton.compile``'s target (a ``GPUTarget``), options,
    signature, constexprs and attrs."""

    target: Any
    options: Any
    signature: Any
    constexprs: Any
    attrs: Any


class Backend(ABC):
    """One compile target's toolchain (see the module docstring for what it answers)."""

    def __init__(self, target: Target):
        self.target = target

    @property
    def binary_kind(self) -> str:
        """``cubin`` or ``hsaco``: the key of the binary in Triton's ``CompiledKernel.asm``."""
        return self.target.binary_kind

    @property
    def assembly_kind(self) -> str:
        """``ptx`` or ``amdgcn``: the key of the assembly in ``CompiledKernel.asm``."""
        return self.target.assembly_kind

    def bind(self, launch: Any) -> BoundLaunch:
        """Triton's own binding of an intercepted launch's arguments for this target."""
        from triton.compiler.compiler import make_backend

        from fuser_core.codegen.backends.binding import bind_launch
        from fuser_core.codegen.module import FP_FUSION

        target = self.target.triton()
        # The generated modules pass the FP-fusion knob; the unfused chain's launcher (codegen/chain.py)
        # does not yet: its launches get the same explicit value, Triton <= 3.9's default, so they are
        # compiled as they run on those versions, without Triton 3.9's warning about 3.10's default.
        kwargs = {"enable_fp_fusion": FP_FUSION, **launch.kwargs}
        return BoundLaunch(target, *bind_launch(launch.fn, launch.args, kwargs, make_backend(target)))

    def compile(self, launch: Any, bound: BoundLaunch) -> Any:
        """``triton.compile`` of a bound launch -> Triton's ``CompiledKernel`` (raises on failure)."""
        import triton
        from triton.compiler import ASTSource

        return triton.compile(ASTSource(launch.fn, bound.signature, bound.constexprs, bound.attrs),
                              target=bound.target, options=bound.options.__dict__)

    @abstractmethod
    def resources(self, compiled: Any) -> Resources:
        """What a ``CompiledKernel`` (from :meth:`compile`, or from a launched kernel's JIT cache)
        holds: read from its binary, plus the dynamic shared memory in Triton's metadata."""

    @abstractmethod
    def compiler_version(self, binaries: Sequence[bytes]) -> str:
        """The vendor compiler that built ``binaries`` (this target's), in one line of at most 120 characters."""

    def sass_facts(self, compiled: Any) -> dict[str, Any] | None:
        """What the binary issues (:class:`fuser_core.codegen.sass.KernelSass` as a dict); None where
        no disassembler is read (AMD)."""
        return None

    def artifact(self, compiled: Any) -> dict[str, Any]:
        """One compiled kernel as stored: ``{"name", <binary_kind>: bytes, <assembly_kind>: str,
        "metadata", "triton_hash", "registers", "spill_bytes", "shared_bytes"}``. The metadata is
        Triton's own JSON (name, shared, num_warps, global scratch, target...), read back from its
        cache group so it is exactly what ``CompiledKernel`` loads."""
        group = compiled.metadata_group
        meta_path = next(p for c, p in group.items() if c.endswith(".json") and not c.startswith("__grp__"))
        used = self.resources(compiled)
        return {"name": compiled.metadata.name, self.binary_kind: bytes(compiled.asm[self.binary_kind]),
                self.assembly_kind: str(compiled.asm[self.assembly_kind]),
                "metadata": json.loads(Path(meta_path).read_text()), "triton_hash": compiled.hash,
                "registers": used.registers, "spill_bytes": used.spill_bytes, "shared_bytes": used.shared_bytes}

    def describe(self, binaries: Sequence[bytes]) -> dict[str, Any]:
        """The build's facts around its kernels: the target, the binary's arch and kind, the
        capability (NVIDIA; None for AMD), Triton's and the vendor compiler's versions."""
        import triton

        t = self.target
        return {"target": {"backend": t.backend, "arch": t.arch, "warp_size": t.warp_size}, "arch": t.binary_arch,
                "binary_kind": t.binary_kind, "capability": t.capability, "triton_version": triton.__version__,
                "compiler_version": self.compiler_version(binaries)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target.arch_name})"
