"""Backward sums that are zero for every input: a statistic's stationarity.

LayerNorm's variance is ``Σ (x - mean)² / C`` with ``mean`` its own minimiser, so the chain rule's
``∂var/∂mean = -2 Σ (x - mean) / C`` is zero exactly, for every input; computed, it is one more
reduction per row whose rounding noise (``C · u · |x|``, large at ``x + 1000``) multiplies into the
gradient. torch's and Liger's LayerNorm backwards never compute it. The derivation cannot see the
identity (it would need the mean's definition inside the sum), so it is found numerically, as the
shifts are (:mod:`fuser_core.backward.shift`): a backward sum whose value is below ``TOLERANCE``
times the sum of its terms' magnitudes at every element, on random inputs and upstream gradients,
is dropped (replaced by 0), provided the terms are not all zero there (a ``where`` branch the
samples never take proves nothing: attention with a sink, whose maximum the random scores always
beat, once lost the sink's gradient that way). The certificate against torch's autograd checks
the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fuser_core import expr as ex
from fuser_core.backward.packing import BackStep, refs, step_json
from fuser_core.reference import Evaluator, random_inputs, random_scalars
from fuser_core.spec import load_spec
from fuser_core.errors import SpecError
from fuser_core.spec_model import Spec, Step, raw_param

TOLERANCE = 1e-12  # relative to the sum of the terms' magnitudes: rounding gives ~1e-16 times the count
SEEDS = (0, 1)


def vanishing_sums(spec: Spec, steps: list[BackStep], dims: Mapping[str, tuple[str, ...]],
                   upstream: Mapping[str, str], shape: Mapping[str, int]) -> set[str]:
    """The backward sum steps (of ``steps``) that are zero for every input (module doc). A sum
    whose probe exceeds a spec's limits is kept."""
    zero = set()
    for s in (s for s in steps if s.reduce == "sum"):
        try:
            probe = load_spec(_probe_json(spec, steps, dims, upstream, s), printed=True)
        except SpecError:
            continue
        if all(_vanishes(probe, s.name, shape, seed) for seed in SEEDS):
            zero.add(s.name)
    return zero


def _vanishes(probe: Spec, name: str, shape: Mapping[str, int], seed: int) -> bool:
    rng = np.random.default_rng(seed)
    shape = {d: n for d, n in shape.items() if d in probe.sized_dims}
    inputs = random_inputs(probe, shape, rng, "float32")
    scalars = {k: float(np.asarray(v)) for k, v in random_scalars(probe, rng).items()}
    with np.errstate(all="ignore"):
        values = Evaluator(probe, shape).outputs({**inputs, **scalars})
    value, scale = values[name], values[f"{name}__abs"]
    # terms that are all zero (a where() branch these inputs never take) prove nothing
    return bool(np.all(np.isfinite(value)) and np.all(scale > 0) and np.all(np.abs(value) <= TOLERANCE * scale))


def _probe_json(spec: Spec, steps: list[BackStep], dims: Mapping[str, tuple[str, ...]],
                upstream: Mapping[str, str], target: BackStep) -> dict[str, Any]:
    """One spec writing ``target`` (a backward sum) and its magnitude from the forward's inputs and
    the upstream gradients, through the forward and backward steps it needs."""
    back = {s.name: s for s in steps}
    needed: set[str] = set()
    todo = refs(target.expr)
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        obj = back.get(name) or spec.lookup(name)
        if isinstance(obj, BackStep | Step):
            needed.add(name)
            todo.extend(refs(obj.expr))
    raw_steps = [step_json(s.name, s.expr, s.reduce, s.over) for s in spec.steps if s.name in needed]
    raw_steps += [step_json(s.name, s.expr, s.reduce, s.over) for s in steps if s.name in needed]
    raw_steps += [step_json(target.name, target.expr, "sum", target.over),
                  step_json(f"{target.name}__abs", ex.Call("abs", (target.expr,)), "sum", target.over)]
    read = {r for e in [target.expr, *(obj.expr for n in needed for obj in [back.get(n) or spec.lookup(n)])]
            for r in refs(e)}
    inputs = {i.name: {"dims": list(i.dims), **({"kind": i.kind} if i.is_index else {})}
              for i in spec.inputs if i.name in read}
    inputs |= {up: {"dims": list(dims[up])} for up in upstream.values() if up in read}
    return {"foldwise": 1, "name": f"{spec.name}_probe", "inputs": inputs,
            "params": {p.name: raw_param(p) for p in spec.params if p.name in read}, "steps": raw_steps,
            "outputs": [target.name, f"{target.name}__abs"]}
