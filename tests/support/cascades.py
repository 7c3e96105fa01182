"""Small specs written in code, for tests of one behaviour each: ``spec_of`` loads steps and
outputs as a spec, ``red`` writes a reduction step, ``every_strategy_passes`` runs the
self-check in every valid strategy at a small tile."""

from __future__ import annotations

from fuser_core.codegen.plan import KernelConfig, loop_axis, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.runner import self_check
from fuser_core.spec import load_spec


def spec_of(steps, outputs, inputs=None, params=None, name="reg"):
    raw = {"foldwise": 1, "name": name, "inputs": inputs or {"x": {"dims": ["m", "n"]}}, "steps": steps,
           "outputs": outputs}
    if params:
        raw["params"] = params
    return load_spec(raw)


def red(name, op, expr, over="n", **extra):
    return {"name": name, "reduce": op, "over": over, "expr": expr, **extra}


def every_strategy_passes(spec, shape, block=4):
    """self_check with the default choice and every valid strategy (tiles of `block` on the axis)."""
    d = derive_cascade(spec)
    valid = [s for s, why in valid_strategies(spec, d, shape).items() if why is None]
    assert valid, valid_strategies(spec, d, shape)
    reports = [self_check(spec, shape, derivation=d)]
    axis, _ = loop_axis(spec)  # the dim the kernels loop over (an inner dim's block is its whole size)
    for strategy in valid:
        config = None if strategy == "row_resident" else KernelConfig({axis: block}, split=2 if strategy == "split_fused" else 1)
        reports.append(self_check(spec, shape, strategy=strategy, config=config, derivation=d))
    for r in reports:
        assert r["passed"], r
    return reports
