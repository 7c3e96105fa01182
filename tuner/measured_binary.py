"""The binary a GPU measurement ran, for the kernel store (issue 15): a cubin, or an hsaco
from a ROCm measurement (not run on AMD).

With ``--measurer cuda`` the stored binary is the one that was timed, not a recompile: the
measurer's child process keeps each generated module loaded (fuser_core.codegen.module caches
modules by key), and Triton's JIT keeps every kernel it compiled for a launch in
``JITFunction.device_caches[device][0]`` (Triton 3.6 and 3.9: ``(kernel_cache, kernel_key_cache,
target, backend, binder)``), a map of specialization key -> ``CompiledKernel``. A
``CompiledKernel`` holds ``asm["cubin"]`` (bytes), ``asm["ptx"]``, ``metadata`` (a namedtuple:
name, shared, num_warps, target ...), ``metadata_group`` (its files in Triton's cache, the
metadata JSON among them) and ``hash`` (its cache key); an AMD kernel ``asm["hsaco"]`` and ``asm["amdgcn"]``.
:func:`measured_artifacts` turns those into the same answer as
:func:`fuser_core.codegen.gpu_compile.compile_artifacts`, by the backend of their target.

Not measured on a GPU: the machines this was written on have none. The extraction is tested with
real ``CompiledKernel`` objects from ``triton.compile`` placed in a stand-in JIT cache
(tests/service/test_binaries.py); the launch that fills the cache in the child is Triton's own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def compiled_kernels(module: ModuleType) -> list[Any]:
    """The ``CompiledKernel`` of every launched ``@triton.jit`` kernel of a loaded generated
    module, in definition order. A kernel compiled for more than one specialization is ambiguous
    (which one ran?) and raises; one never launched is left out (under TRITON_INTERPRET=1 there
    is no JIT cache: nothing is returned)."""
    out = []
    for name, value in vars(module).items():
        caches = getattr(value, "device_caches", None)
        if not isinstance(caches, dict):
            continue
        found = [compiled for cache in caches.values() for compiled in cache[0].values()]
        if len(found) > 1:
            raise ValueError(f"{name}: {len(found)} compiled specializations in Triton's JIT cache; "
                             "expected the one the measurement launched")
        out.extend(found)
    return out


def measured_artifacts(compiled: list[Any]) -> dict[str, Any]:
    """``compile_artifacts``' answer (target, arch, binary kind, capability, versions, kernels)
    for kernels Triton compiled at a launch, by the backend of the target they were compiled for
    (their metadata's): the variant's arch is the measuring GPU's, a cubin's or an hsaco's."""
    from fuser_core.codegen.gpu_compile import compiled_artifacts

    if not compiled:
        raise ValueError("no compiled kernel in the module's JIT cache: was it launched on a GPU?")
    return compiled_artifacts(compiled)
