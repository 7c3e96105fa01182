"""Compile backends: one per GPU vendor, behind the :class:`Backend` interface (``base``).

:func:`backend_for` picks the one for a :class:`fuser_core.targets.Target`:
:class:`CudaBackend` (cubin, ``cuda``) or :class:`HipBackend` (hsaco, ``hip``). Triton's
private launch-binding API is called in one place, :func:`bind_launch` (``binding``).

Example:
    >>> from fuser_core.targets import Target
    >>> backend_for(Target.parse("gfx942"))
    HipBackend(gfx942)
    >>> backend_for(Target.parse("sm_90")).assembly_kind
    'ptx'
"""

from __future__ import annotations

from fuser_core.codegen.backends.base import Backend, BoundLaunch, Resources
from fuser_core.codegen.backends.binding import bind_launch
from fuser_core.codegen.backends.cuda import CudaBackend
from fuser_core.codegen.backends.hip import HipBackend
from fuser_core.targets import CUDA, HIP, Target

_BACKENDS: dict[str, type[Backend]] = {CUDA: CudaBackend, HIP: HipBackend}


def backend_for(target: Target) -> Backend:
    """The compile backend of ``target`` (by its ``backend``: "cuda" or "hip")."""
    if not isinstance(target, Target):
        raise TypeError(f"backend_for takes a fuser_core.targets.Target, got {type(target).__name__} {target!r}")
    return _BACKENDS[target.backend](target)


__all__ = ["Backend", "BoundLaunch", "CudaBackend", "HipBackend", "Resources", "backend_for", "bind_launch"]
