"""Small shapes for catalog specs, and the targets each (spec, strategy) compiles for in turn:
shared by the compile tests (tests/fuser_core/test_gpu_compile.py) and benchmarks/compile_catalog.py (CI's
Triton 3.6 job)."""

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


def distinct_targets(names) -> list[tuple[str, object]]:
    """(name, Target) of each distinct compile target of these GPU profiles (h100) or arch names
    (sm_90, gfx942), in order, the first name kept (h200 compiles as h100: the same sm_90a cubins)."""
    from fuser_core.targets import Target
    from tuner.profiles import PROFILES

    out: dict[object, str] = {}
    for name in names:
        key = name.strip().lower()
        out.setdefault(PROFILES[key].target if key in PROFILES else Target.parse(key), key)
    return [(name, target) for target, name in out.items()]


def targets_in_turn(targets: list[tuple[str, object]], turn: int) -> list[tuple[str, object]]:
    """The targets the ``turn``-th (spec, strategy) of a compile matrix compiles for: the first
    always, and one of each vendor's others taking turns. So every strategy compiles for both
    vendors, each target sees every strategy over the catalog, and the matrix grows by one target
    per vendor instead of by the fleet's size (CI's time)."""
    first, *others = targets
    by_backend: dict[str, list] = {}
    for name, target in others:
        by_backend.setdefault(target.backend, []).append((name, target))
    return [first] + [group[turn % len(group)] for group in by_backend.values()]
