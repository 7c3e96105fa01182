"""NVIDIA: cubins from Triton's ptxas, their resources from ``cuobjdump -res-usage``.

Both tools ship in the triton wheel, so nothing else is installed and no GPU is needed. A cubin
is built for the target's arch as Triton's ptxas targets it (``sm_90a`` for capability 90:
:attr:`fuser_core.targets.Target.binary_arch`). ``cuobjdump -res-usage`` gives a function's
registers, stack, local and static shared bytes; Triton's metadata the dynamic shared memory a
launch asks for. The SASS facts (what the cubin issues) are :mod:`fuser_core.codegen.sass`'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fuser_core.codegen.backends.base import Backend, Resources

_RESOURCE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of a cubin (the tool ships in the triton wheel): REG, STACK,
    SHARED, LOCAL of its (single) function."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    return {key: int(value) for key, value in _RESOURCE.findall(out)}


def ptxas_version(capability: int) -> str:
    """The version line of the ptxas Triton uses for ``sm_<capability>`` (it ships in the wheel)."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    text = get_ptxas_version(capability)
    found = re.findall(r"release [^\n]*", text)
    return (found[-1] if found else text.strip().splitlines()[-1])[:120]


class CudaBackend(Backend):
    """NVIDIA targets (``Target("cuda", 90, 32)``): cubin and PTX."""

    def resources(self, compiled: Any) -> Resources:
        used = cubin_resources(compiled.asm["cubin"])
        return Resources(
            registers=used.get("REG"),
            # Triton inlines every call and keeps no local arrays: the stack frame holds spills
            spill_bytes=used.get("STACK", 0) + used.get("LOCAL", 0),
            # the launch's dynamic shared memory plus the cubin's static allocation
            shared_bytes=int(compiled.metadata.shared) + used.get("SHARED", 0),
            stack_bytes=used.get("STACK"), local_bytes=used.get("LOCAL"))

    def compiler_version(self, binaries: Sequence[bytes] = ()) -> str:
        """The ptxas that Triton runs for this capability (the same for every cubin it builds)."""
        return ptxas_version(self.target.capability)

    def sass_facts(self, compiled: Any) -> dict[str, Any] | None:
        """The SASS facts of the compiled kernel (None if cuobjdump names no such function)."""
        from fuser_core.codegen.sass import cubin_facts

        found = cubin_facts(bytes(compiled.asm["cubin"]))
        name = compiled.metadata.name
        kernel = found.get(name) or (next(iter(found.values())) if len(found) == 1 else None)
        return kernel.to_dict() if kernel is not None else None

    def describe(self, binaries: Sequence[bytes]) -> dict[str, Any]:
        """:meth:`Backend.describe` plus ``ptxas_version`` (the compiler version under the name
        stored bundles and the kernel store have always used)."""
        facts = super().describe(binaries)
        return {**facts, "ptxas_version": facts["compiler_version"]}
