"""The backward kernels' accuracy against torch's own backward, per input family (issue 39 item 5).

For each catalog spec torch has an op for, each family (applied to the spec's first float input;
the others and the upstream gradient standard normal) and each strategy: the saving forward and
the backward kernels in float32 (Triton's interpreter without a GPU;
:func:`fuser_core.backward.kernels.kernel_gradients`; cross-entropy through its forward that writes
the gradient), the norm-wise error of each gradient against torch's backward in float64, the
backward formula's own float32 error (round to nearest and random roundings, as the accuracy bar
evaluates it) and torch's float32 backward's, and the kernel's ratio to each (errors below 4
float32 ulps count as 4 ulps). Prints a Markdown table.

    TRITON_INTERPRET=1 python benchmarks/backward_accuracy.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from fuser_core import catalog_entries, derive_backward, gradient_in_forward, load_spec, run
from fuser_core.accuracy.families import apply_family
from fuser_core.accuracy.formula import formula_outputs
from fuser_core.accuracy.torch_ops import _torch_ops
from fuser_core.backward.certify import gradient_error
from fuser_core.backward.kernels import kernel_gradients
from fuser_core.reference import Evaluator

SPECS = {"safe_softmax": {"m": 4, "n": 300}, "logsumexp": {"m": 4, "n": 300}, "rmsnorm": {"t": 4, "c": 300},
         "layernorm": {"t": 4, "c": 300}, "cross_entropy": {"t": 4, "v": 300}}
PARAMS = {"eps": 1e-6}
FAMILIES = ("normal", "offset100", "offset1000", "scale30", "peaked", "near_ties")
STRATEGIES = ("row_resident", "streaming_fused", "split_fused")


FLOOR = 4 * 2.0**-24  # 4 float32 ulps at 1, relative: errors below it count as equal (the accuracy bar's floor)


def ratio(error: float, reference: float) -> float:
    return max(error, FLOOR) / max(reference, FLOOR)


def torch_gradients(name, spec, shape, inputs, upstream, dtype):
    op = _torch_ops()[name]
    tensors = {i.name: (torch.tensor(inputs[i.name]) if i.is_index else
                        torch.tensor(inputs[i.name], dtype=dtype, requires_grad=True)) for i in spec.inputs}
    outputs = op(shape, PARAMS, tensors)
    total = sum((outputs[o] * torch.tensor(upstream[o], dtype=dtype)).sum() for o in spec.outputs)
    floats = [i.name for i in spec.inputs if not i.is_index]
    grads = torch.autograd.grad(total, [tensors[n] for n in floats])
    return {n: g.double().numpy() for n, g in zip(floats, grads)}


def fused_gradients(spec, fused, cascade, shape, inputs, upstream, strategy):
    """Through the forward that writes the gradient: upstream times it."""
    (out,) = spec.outputs
    result = run(fused, shape, "float32", inputs, strategy=strategy).outputs
    dims = spec.step(out).dims
    grads = {}
    for g in cascade.gradients:
        own = spec.input(g.input).dims
        scale = upstream[out].reshape([shape[d] if d in dims else 1 for d in own])
        grads[g.input] = scale * result[g.input + "_grad"].double().numpy()
    return grads


def formula_errors(spec, cascade, fused, shape, inputs, upstream, ref):
    """The backward's own formula evaluated in float32 (``formula_outputs``: round to nearest and
    random roundings; the saved statistics from the forward's float32 formula): its largest error."""
    worst: dict[str, float] = {}
    if fused is not None:
        (out,) = spec.outputs
        for sample in formula_outputs(fused, shape, inputs, "float32"):
            for g in cascade.gradients:
                own = spec.input(g.input).dims
                scale = upstream[out].reshape([shape[d] if d in spec.step(out).dims else 1 for d in own])
                e = gradient_error(scale * sample[g.input + "_grad"], ref[g.input])
                worst[g.input] = max(worst.get(g.input, 0.0), e)
        return worst
    saved = formula_outputs(cascade.forward, shape, inputs, "float32")[0]
    known = {**inputs, **{cascade.upstream[o]: u for o, u in upstream.items()}, **{s: saved[s] for s in cascade.saved}}
    for b in cascade.specs:
        sub = {d: n for d, n in shape.items() if d in b.sized_dims}
        reads = {i.name: known[i.name] for i in b.inputs} | {p.name: inputs[p.name] for p in b.runtime_params}
        for sample in formula_outputs(b, sub, reads, "float32"):
            for g in (g for g in cascade.gradients if g.spec == b.name):
                own = spec.input(g.input).dims
                value = sample[g.output].transpose([g.dims.index(d) for d in own])
                worst[g.input] = max(worst.get(g.input, 0.0), gradient_error(value, ref[g.input]))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    lines = ["| spec | family | strategy | input | kernel error | formula float32 | torch float32 | vs formula | vs torch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for entry in (e for e in catalog_entries() if e.name in SPECS):
        spec, shape = load_spec(entry.path.read_text()), SPECS[entry.name]
        cascade = derive_backward(spec)
        runnable = all(any(s.is_reduction for s in b.steps) for b in cascade.specs)
        fused = None if runnable else gradient_in_forward(spec, cascade)
        ev = Evaluator(spec, shape)
        for family in FAMILIES:
            rng = np.random.default_rng(11)
            inputs = {}
            for i, inp in enumerate(spec.inputs):
                dims = tuple(ev.shape[d] for d in inp.dims)
                if inp.is_index:
                    inputs[inp.name] = rng.integers(0, ev.shape["v"], dims)  # cross-entropy's target
                    continue
                x = rng.standard_normal(dims)
                x = apply_family(family, x, rng) if i == 0 else x
                inputs[inp.name] = x.astype(np.float32).astype(np.float64)
            upstream = {o: rng.standard_normal(tuple(ev.shape[d] for d in spec.step(o).dims)).astype(np.float32)
                        .astype(np.float64) for o in spec.outputs}
            ref = torch_gradients(entry.name, spec, shape, inputs, upstream, torch.float64)
            t32 = torch_gradients(entry.name, spec, shape, inputs, upstream, torch.float32)
            scalars = {p.name: PARAMS[p.name] for p in spec.runtime_params}
            formula = formula_errors(spec, cascade, fused, shape, {**inputs, **scalars}, upstream, ref)
            for strategy in STRATEGIES:
                if fused is not None:
                    got = fused_gradients(spec, fused, cascade, shape, {**inputs, **scalars}, upstream, strategy)
                else:
                    got = kernel_gradients(spec, cascade, shape, "float32", {**inputs, **scalars}, upstream, strategy)
                for name in ref:
                    e, t, f = gradient_error(got[name], ref[name]), gradient_error(t32[name], ref[name]), formula[name]
                    lines.append(f"| {entry.name} | {family} | {strategy} | {name} | {e:.2e} | {f:.2e} | {t:.2e} "
                                 f"| {ratio(e, f):.2f} | {ratio(e, t):.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Backward kernels vs torch's backward (float32; CPU, Triton's interpreter)\n\n"
                    "Generated by `TRITON_INTERPRET=1 python benchmarks/backward_accuracy.py`. Errors are norm-wise "
                    "(largest difference over the largest float64 reference value). Not measured on GPU.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
