"""The backward's certificate: the derived backward specs, evaluated by the float64 reference on
sampled inputs, give the gradients torch's float64 autograd gives for the forward's formula.

Each sample: random inputs (as the forward's certificate draws them) and a random upstream
gradient per output; the forward that saves its statistics runs in the reference, each backward
spec reads what it declares, and every gradient is compared with ``torch.autograd.grad`` of
``sum(output * upstream)`` through :class:`fuser_core.backward.torch_formula.TorchFormula`
(in the input's own dim order). The error is norm-wise: the largest difference over the largest
reference value; it holds within ``TOLERANCE`` (float64 evaluations of two different formulas
of one function differ by rounding: 1e-13 on the catalog), with NaN at the same places.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fuser_core.backward.derive import BackwardCascade, probe_shape
from fuser_core.backward.torch_formula import TorchFormula
from fuser_core.reference import Evaluator, random_inputs, random_scalars
from fuser_core.spec_model import Spec

TOLERANCE = 1e-9
SEEDS = (0, 1, 2)


def _shape_of(spec: Spec, shape: Mapping[str, int]) -> dict[str, int]:
    return {d: n for d, n in shape.items() if d in spec.sized_dims}


def backward_gradients(cascade: BackwardCascade, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                       upstream: Mapping[str, np.ndarray], scalars: Mapping[str, Any] | None = None
                       ) -> dict[str, np.ndarray]:
    """Each input's gradient (its own dim order) from the derived backward, in the float64 reference."""
    scalars = dict(scalars or {})
    saved = Evaluator(cascade.forward, shape).outputs({**inputs, **scalars})
    known = {**inputs, **{cascade.upstream[o]: g for o, g in upstream.items()}, **{s: saved[s] for s in cascade.saved}}
    out: dict[str, np.ndarray] = {}
    for spec in cascade.specs:
        reads = {i.name: known[i.name] for i in spec.inputs}
        own = {p.name: scalars[p.name] for p in spec.runtime_params if p.name in scalars}
        values = Evaluator(spec, _shape_of(spec, shape)).outputs({**reads, **own})
        known |= {name: values[name] for name in cascade.staged if name in values}
        for g in (g for g in cascade.gradients if g.spec == spec.name):
            own = cascade.forward.input(g.input).dims
            out[g.input] = np.transpose(values[g.output], [g.dims.index(d) for d in own])
    for name in cascade.zero:
        out[name] = np.zeros_like(inputs[name])
    return out


def autograd_gradients(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                       upstream: Mapping[str, np.ndarray], scalars: Mapping[str, Any] | None = None
                       ) -> dict[str, np.ndarray]:
    """Each float input's gradient by torch's float64 autograd of ``spec``'s formula."""
    import torch

    tensors = {}
    for inp in spec.inputs:
        value = torch.from_numpy(np.asarray(inputs[inp.name]))
        tensors[inp.name] = value.long() if inp.is_index else value.double().requires_grad_(True)
    outputs = TorchFormula(spec, shape).outputs(tensors, scalars)
    total = sum((outputs[o] * torch.from_numpy(np.asarray(upstream[o], np.float64))).sum() for o in spec.outputs)
    floats = [i.name for i in spec.inputs if not i.is_index]
    grads = torch.autograd.grad(total, [tensors[n] for n in floats], allow_unused=True)
    return {n: (np.zeros(tuple(tensors[n].shape)) if g is None else g.detach().numpy()) for n, g in zip(floats, grads)}


def gradient_error(value: np.ndarray, reference: np.ndarray) -> float:
    """Norm-wise relative error; inf when NaN or infinities differ in place."""
    if not np.array_equal(np.isnan(value), np.isnan(reference)) or \
            not np.array_equal(np.isinf(value), np.isinf(reference)):
        return float("inf")
    finite = np.isfinite(reference)
    if not finite.any():
        return 0.0
    scale = max(float(np.max(np.abs(reference[finite]))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(value[finite] - reference[finite]))) / scale


def certify_backward(spec: Spec, cascade: BackwardCascade, shape: Mapping[str, int] | None = None,
                     seeds: tuple[int, ...] = SEEDS) -> dict[str, Any]:
    """``{"holds", "tolerance", "worst": {input: error}, "samples"}`` (module doc)."""
    shape = probe_shape(spec, shape)
    worst: dict[str, float] = {}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        inputs = random_inputs(spec, shape, rng, "float32")
        scalars = {k: float(np.asarray(v)) for k, v in random_scalars(spec, rng).items()}
        ref = Evaluator(spec, shape)
        upstream = {o: rng.standard_normal(tuple(ref.shape[d] for d in spec.step(o).dims)) for o in spec.outputs}
        derived = backward_gradients(cascade, shape, inputs, upstream, scalars)
        torch_grads = autograd_gradients(spec, shape, inputs, upstream, scalars)
        for name, reference in torch_grads.items():
            worst[name] = max(worst.get(name, 0.0), gradient_error(derived[name], reference))
    return {"holds": all(e <= TOLERANCE for e in worst.values()), "tolerance": TOLERANCE, "worst": worst,
            "samples": len(seeds), "shape": shape}
