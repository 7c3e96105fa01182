"""The gradient written by the forward kernel: a loss's backward in the same loop (Liger's
cross-entropy, issue 39 item 3).

When a spec has one output and its backward needs no reduction of its own (cross-entropy's
``d_logits = d_loss * (exp(logits - mx) / den - onehot)``: every statistic it reads is one the
forward computes), the backward is the upstream gradient times a per-row Jacobian ``G`` that the
forward can write while it still holds the row: one kernel writes the loss and ``G``, and the
backward is ``d_loss * G``, an elementwise scale (none at all when the upstream gradient is a
known constant, as for a mean or a sum of the losses). Without it, such a backward would be a
kernel with no reduction, which no strategy runs, reading the logits a second time.

The linearity that makes this valid (the gradient is the upstream gradient times something free
of it) is checked numerically on random inputs, as every rewrite here is: when it does not hold,
:func:`gradient_in_forward` returns None.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fuser_core import expr as ex
from fuser_core.backward.certify import backward_gradients
from fuser_core.backward.differentiate import folded
from fuser_core.backward.derive import BackwardCascade, probe_shape, spec_json
from fuser_core.reference import Evaluator, random_inputs, random_scalars
from fuser_core.spec import load_spec
from fuser_core.spec_model import Spec

TOLERANCE = 1e-12
GRAD_SUFFIX = "_grad"


def gradient_in_forward(spec: Spec, cascade: BackwardCascade, shape: Mapping[str, int] | None = None) -> Spec | None:
    """``spec`` also writing ``<input>_grad`` = the gradient of its one output for an upstream
    gradient of 1, for every input with a gradient (module doc); None where that does not apply."""
    if len(spec.outputs) != 1 or any(s.is_reduction for b in cascade.specs for s in b.steps):
        return None
    (out,) = spec.outputs
    one = {ex.Ref(cascade.upstream[out]): ex.Num(1.0)}
    raw = spec_json(spec)
    forward_names = {s.name for s in spec.steps}
    steps, outputs = list(raw["steps"]), list(spec.outputs)
    for b in cascade.specs:
        for step in b.steps:
            if step.name in forward_names:  # a forward step the backward recomputes: the forward has it
                continue
            expr = folded(ex.map_expr(step.expr, lambda n: one.get(n)))
            steps.append({"name": step.name, "expr": ex.to_text(expr)})
    renames = {}
    for g in cascade.gradients:
        name = g.input + GRAD_SUFFIX
        steps.append({"name": name, "expr": g.output})
        renames[g.input] = name
        outputs.append(name)
    raw |= {"name": f"{spec.name}_with_grad", "steps": steps, "outputs": outputs,
            "doc": f"{spec.doc} Also writes the gradient of {out} for an upstream gradient of 1 "
                   f"({', '.join(renames.values())}): the backward is the upstream gradient times it."}
    combined = load_spec(raw, printed=True)
    return combined if _linear(spec, cascade, combined, renames, probe_shape(spec, shape)) else None


def _linear(spec: Spec, cascade: BackwardCascade, combined: Spec, renames: Mapping[str, str],
            shape: dict[str, int]) -> bool:
    """True when the backward's gradients are the upstream gradient (broadcast) times ``combined``'s."""
    (out,) = spec.outputs
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        inputs = random_inputs(spec, shape, rng, "float32")
        scalars = {k: float(np.asarray(v)) for k, v in random_scalars(spec, rng).items()}
        ev = Evaluator(combined, shape)
        upstream = rng.standard_normal(tuple(ev.shape[d] for d in spec.step(out).dims))
        grads = backward_gradients(cascade, shape, inputs, {out: upstream}, scalars)
        unit = ev.outputs({**inputs, **scalars})
        out_dims = spec.step(out).dims
        for name, grad_name in renames.items():
            dims = spec.input(name).dims
            grad_dims = combined.step(grad_name).dims
            if not set(out_dims) <= set(dims) or set(grad_dims) != set(dims):
                return False
            along = [d for d in dims if d in out_dims]
            scale = np.transpose(upstream, [out_dims.index(d) for d in along])
            scale = scale.reshape([ev.shape[d] if d in out_dims else 1 for d in dims])
            expected = scale * np.transpose(unit[grad_name], [grad_dims.index(d) for d in dims])
            if not np.allclose(grads[name], expected, rtol=TOLERANCE, atol=TOLERANCE * np.max(np.abs(expected))):
                return False
    return True
