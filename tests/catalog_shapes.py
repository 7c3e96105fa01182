"""Small shapes for catalog specs, shared by the compile tests and benchmarks/compile_catalog.py."""

from __future__ import annotations

from fuser_core.codegen.plan import loop_axis
from fuser_core.reference import bind_shape


def small_shape(spec) -> dict[str, int]:
    """Ragged against every block: loop axis 37 (19 with an inner axis), inner axes 5, lanes 3,
    a topk's ``as`` dim its k."""
    axis, inner = loop_axis(spec)
    as_dims = {s.as_dim: s.k for s in spec.steps if s.as_dim}
    shape = {}
    for d in spec.dims:
        if d in as_dims:
            shape[d] = as_dims[d]
        elif d == axis:
            shape[d] = 19 if inner else 37
        else:
            shape[d] = 5 if d in inner else 3
    return bind_shape(spec, shape)
