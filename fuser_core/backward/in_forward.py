"""The gradient written by the forward kernel: a loss's backward in the same loop (Liger's
cross-entropy, issue 39 item 3).

When a spec's backward needs no reduction of its own (cross-entropy's ``d_logits = d_loss *
(exp(logits - mx) / den - onehot)``: every statistic it reads is one the forward computes), the
gradient is a *factor* ``R`` times a per-row Jacobian ``G`` that the forward can write while it
still holds the row: one kernel writes the loss and ``G``, and the backward is ``R * G``, an
elementwise scale. ``R`` is the one name through which the gradient reads the upstream gradients
(:func:`gradient_factor`): the upstream gradient itself for a one-output loss, or a backward step
over the outputs' dims that combines them with forward values, as cross-entropy with an ignore
index has: ``d_loss + d_mean / maximum(counted, 1)`` (its per-token losses and their mean are both
outputs; ``counted`` is then written by the forward too). ``R`` is a small elementwise spec of its
own (:class:`GradientFactor`), evaluated in torch after the forward. Without this, such a backward
would be a kernel with no reduction, which no strategy runs, reading the logits a second time.

The linearity that makes this valid (the gradient is ``R`` times something free of the upstream
gradients) is checked numerically on random inputs, as every rewrite here is: when it does not
hold, :func:`gradient_in_forward` returns None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuser_core import expr as ex
from fuser_core.backward.certify import backward_gradients
from fuser_core.backward.differentiate import folded
from fuser_core.backward.derive import BackwardCascade, probe_shape, statistics_json
from fuser_core.backward.packing import refs, step_json
from fuser_core.reference import Evaluator, random_inputs, random_scalars
from fuser_core.spec import load_spec
from fuser_core.spec_model import Spec, raw_param

TOLERANCE = 1e-12
GRAD_SUFFIX = "_grad"
FACTOR = "factor"  # the factor spec's one output


@dataclass(frozen=True)
class GradientFactor:
    """``R`` of a gradient the forward writes (module doc): ``name`` in the backward spec, and
    ``spec``, an elementwise spec whose output ``factor`` is ``R``, over ``dims``. Its inputs are
    upstream gradients, forward values (``saved``: outputs the forward writes for it) and index
    inputs."""

    name: str
    spec: Spec
    dims: tuple[str, ...]
    saved: tuple[str, ...]


def gradient_factor(cascade: BackwardCascade) -> GradientFactor | None:
    """The factor ``R`` of the cascade's one elementwise backward spec, or None: several backward
    specs, a reduction, a gradient that reads the upstream gradients through more than one name,
    or an ``R`` that reads a float input of the forward (then it is no per-row factor)."""
    if len(cascade.specs) != 1 or any(s.is_reduction for s in cascade.specs[0].steps):
        return None
    (b,) = cascade.specs
    upstream = set(cascade.upstream.values())
    reads_upstream = set(upstream)  # names whose value depends on an upstream gradient
    for step in b.steps:
        if set(refs(step.expr)) & reads_upstream:
            reads_upstream.add(step.name)
    outputs = [g.output for g in cascade.gradients]
    through = [[n for n in refs(b.step(g).expr) if n in reads_upstream] for g in outputs]
    if all(len(names) == 1 for names in through) and len({names[0] for names in through}) == 1:
        name = through[0][0]  # every gradient reads the upstream gradients through this one name
        closure = _closure(b, name)
        if reads_upstream - set(outputs) - closure:  # another path from the upstream gradients to a gradient
            return None
    elif len(upstream) == 1:  # one output: its upstream gradient itself (the linearity check decides)
        (name,), closure = upstream, set(upstream)
    else:
        return None
    forward = cascade.forward
    floats = {i.name for i in forward.inputs if i.is_float}
    inputs = [i.name for i in b.inputs if i.name in closure]  # in the spec's order: the same JSON every run
    if set(inputs) & floats:
        return None
    params = {n for n in closure if n in {p.name for p in b.params}}
    raw = {"foldwise": 1, "name": f"{b.name}_factor",
           "doc": f"The factor of {', '.join(sorted(outputs))} read from the upstream gradients (the forward "
                  "writes the rest): the gradient is this times the forward's <input>_grad.",
           "inputs": {n: {"dims": list(b.input(n).dims), **({"kind": "index"} if b.input(n).is_index else {})}
                      for n in inputs},
           "params": {p.name: raw_param(p) for p in b.params if p.name in params},
           "steps": [step_json(s.name, s.expr, None, None) for s in b.steps if s.name in closure]
           + [{"name": FACTOR, "expr": name}],
           "outputs": [FACTOR]}
    saved = tuple(n for n in inputs if n not in upstream and n in {s.name for s in forward.steps})
    factor_spec = load_spec(raw, printed=True)
    return GradientFactor(name, factor_spec, factor_spec.step(FACTOR).dims, saved)


def factor_value(factor: GradientFactor, tensors: Mapping[str, Any]) -> Any:
    """``R`` from torch tensors (each of the factor spec's inputs, in its own dims), in float64,
    over ``factor.dims``: a few operations on a tensor the size of the outputs, after the forward."""
    from fuser_core.backward.torch_formula import TorchFormula

    shape: dict[str, int] = {}
    for i in factor.spec.inputs:
        shape |= dict(zip(i.dims, tensors[i.name].shape))
    values = {i.name: tensors[i.name].long() if i.is_index else tensors[i.name].double() for i in factor.spec.inputs}
    return TorchFormula(factor.spec, shape).outputs(values)[FACTOR]


def _closure(spec: Spec, name: str) -> set[str]:
    """``name`` and every name its value reads, through ``spec``'s steps."""
    steps = {s.name: s for s in spec.steps}
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in steps:
            todo.extend(refs(steps[n].expr))
        else:
            p = next((p for p in spec.params if p.name == n and not p.runtime), None)
            if p is not None:
                todo.extend(refs(p.expr))
    return seen


def gradient_in_forward(spec: Spec, cascade: BackwardCascade, shape: Mapping[str, int] | None = None) -> Spec | None:
    """``spec`` also writing ``<input>_grad`` = the gradient for a factor ``R`` of 1, for every
    input with a gradient, and the forward values ``R`` reads (module doc); None where that does
    not apply."""
    factor = gradient_factor(cascade)
    if factor is None:
        return None
    (b,) = cascade.specs
    unit = {ex.Ref(factor.name): ex.Num(1.0)}
    raw = statistics_json(spec, [n for n in factor.saved if n not in spec.outputs])
    forward_names = {s.name for s in spec.steps}
    skipped = _closure(b, factor.name)
    steps, outputs = list(raw["steps"]), list(raw["outputs"])
    for step in b.steps:
        if step.name in forward_names or step.name in skipped:  # the forward has it, or R does
            continue
        steps.append({"name": step.name, "expr": ex.to_text(folded(ex.map_expr(step.expr, lambda n: unit.get(n))))})
    renames = {}
    for g in cascade.gradients:
        name = g.input + GRAD_SUFFIX
        steps.append({"name": name, "expr": g.output})
        renames[g.input] = name
        outputs.append(name)
    raw |= {"name": f"{spec.name}_with_grad", "steps": steps, "outputs": outputs,
            "doc": f"{spec.doc} Also writes the gradient for a factor {factor.name} of 1 "
                   f"({', '.join(renames.values())}): the backward is {factor.name} times it."}
    combined = load_spec(raw, printed=True)
    return combined if _linear(spec, cascade, factor, combined, renames, probe_shape(spec, shape)) else None


def _linear(spec: Spec, cascade: BackwardCascade, factor: GradientFactor, combined: Spec, renames: Mapping[str, str],
            shape: dict[str, int]) -> bool:
    """True when the backward's gradients are the factor (broadcast) times ``combined``'s."""
    upstream_of = {up: out for out, up in cascade.upstream.items()}
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        inputs = random_inputs(spec, shape, rng, "float32")
        scalars = {k: float(np.asarray(v)) for k, v in random_scalars(spec, rng).items()}
        ev = Evaluator(combined, shape)
        upstream = {o: rng.standard_normal(tuple(ev.shape[d] for d in spec.step(o).dims)) for o in spec.outputs}
        grads = backward_gradients(cascade, shape, inputs, upstream, scalars)
        unit = ev.outputs({**inputs, **scalars})
        known = {**inputs, **unit, **{up: upstream[out] for up, out in upstream_of.items()}}
        f_shape = {d: ev.shape[d] for d in factor.spec.sized_dims}
        r = Evaluator(factor.spec, f_shape).outputs({i.name: known[i.name] for i in factor.spec.inputs})[FACTOR]
        for name, grad_name in renames.items():
            dims = spec.input(name).dims
            grad_dims = combined.step(grad_name).dims
            if not set(factor.dims) <= set(dims) or set(grad_dims) != set(dims):
                return False
            along = [d for d in dims if d in factor.dims]
            scale = np.transpose(r, [factor.dims.index(d) for d in along])
            scale = scale.reshape([ev.shape[d] if d in factor.dims else 1 for d in dims])
            expected = scale * np.transpose(unit[grad_name], [grad_dims.index(d) for d in dims])
            if not np.allclose(grads[name], expected, rtol=TOLERANCE, atol=TOLERANCE * np.max(np.abs(expected))):
                return False
    return True
