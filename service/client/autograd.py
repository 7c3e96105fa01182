"""Gradients through Foldwise's torch operator (issue 39 item 6): ``loss.backward()`` runs the
derived backward's kernels.

``foldwise::run`` has one backward formula for every kernel (registered with the operator in
:mod:`service.client.torch_ops`, so it does not depend on what a process imported): it looks the
forward kernel's key up in a registry of the :class:`BackwardPlan`\\ s built here (a kernel with
none raises, naming it: gradients are never silently zero) and runs the plan's kernels through
the same operator, so ``torch.compile(fullgraph=True)`` traces forward and backward alike
(AOTAutograd calls this formula on fake tensors; each kernel's fake implementation gives shapes).

A plan is built from the spec's derived backward (:func:`fuser_core.derive_backward`) and
loaded kernels: the forward that saves its statistics (or the forward that writes the gradient,
:func:`fuser_core.gradient_in_forward`) and one kernel per backward spec. Each backward kernel's
inputs are read by name from the forward's inputs, its outputs (saved statistics) and the
upstream gradients (zeros for an output nobody used; in the forward output's dtype, which the
backward kernel was built for); its gradients are permuted from the backward spec's dim order to
the input's and cast to the input's dtype. Index inputs and runtime scalars get no gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from service.bundle import BundleError
from service.client.torch_ops import INPUT, OUTPUT, STAGED, UPSTREAM, FoldwiseOp, Kernel, register_backward, register_kernel



@dataclass(frozen=True)
class BackwardKernel:
    """One backward spec's kernel: what each of its inputs is (kind, forward name), the runtime
    scalars it takes, and which forward input each of its outputs is the gradient of (output
    part, input name, permutation from the part's dims to the input's)."""

    key: str
    reads: tuple[tuple[str, str], ...]
    scalars: tuple[str, ...]
    writes: tuple[tuple[int, str, tuple[int, ...]], ...]
    parts: tuple[str, ...]  # its output parts, by name (a stage's results are read by name)


@dataclass(frozen=True)
class InForward:
    """A gradient the forward wrote for a factor of 1 (:func:`fuser_core.gradient_factor`):
    ``input``'s gradient is the factor (``factor``, evaluated on ``reads``: each factor input's kind
    and forward name; permuted by ``order``, then viewed over the input's dims with size 1 where
    ``keep`` is False) times the forward's output part ``part``."""

    input: str
    part: str
    factor: Any  # fuser_core.GradientFactor
    reads: tuple[tuple[str, str, str], ...]  # (factor input, kind, forward name)
    order: tuple[int, ...]
    keep: tuple[bool, ...]


@dataclass(frozen=True)
class BackwardPlan:
    inputs: tuple[str, ...]  # the forward kernel's input order
    outputs: tuple[str, ...]  # its output parts
    kernels: tuple[BackwardKernel, ...] = ()
    in_forward: tuple[InForward, ...] = ()


def backward_plan(cascade: Any, forward: Kernel, backward: Mapping[str, Kernel]) -> BackwardPlan:
    """The plan of ``cascade`` (a :class:`fuser_core.BackwardCascade`) for the loaded ``forward``
    kernel (the saving forward, or the forward writing ``<input>_grad``) and ``backward``: backward
    spec name -> its loaded kernel, in the order the specs run."""
    reads_from: dict[str, tuple[str, str]] = {n: (INPUT, n) for n in forward.input_names}
    reads_from |= {n: (OUTPUT, n) for n in forward.output_parts}
    reads_from |= {up: (UPSTREAM, out) for out, up in cascade.upstream.items()}
    reads_from |= {n: (STAGED, n) for n in cascade.staged}
    kernels = []
    for name, kernel in backward.items():
        writes = []
        for g in (g for g in cascade.gradients if g.spec == name):
            part_dims, own = kernel.output_dims[g.output], forward.input_dims[g.input]
            writes.append((kernel.output_parts.index(g.output), g.input, tuple(part_dims.index(d) for d in own)))
        kernels.append(BackwardKernel(register_kernel(kernel), tuple(reads_from[n] for n in kernel.input_names),
                                      tuple(kernel.scalar_names), tuple(writes), tuple(kernel.output_parts)))
    from fuser_core import gradient_factor

    in_forward = []
    factor = gradient_factor(cascade)
    for g in cascade.gradients:
        part = g.input + "_grad"
        if factor is None or part not in forward.output_parts:
            continue
        own = forward.input_dims[g.input]
        along = [d for d in own if d in factor.dims]
        reads = tuple((i.name, *reads_from[i.name]) for i in factor.spec.inputs)
        in_forward.append(InForward(g.input, part, factor, reads, tuple(factor.dims.index(d) for d in along),
                                    tuple(d in factor.dims for d in own)))
    return BackwardPlan(tuple(forward.input_names), tuple(forward.output_parts), tuple(kernels), tuple(in_forward))


class TrainableOp:
    """A Foldwise operator with a backward: ``op(x=..., w=...)`` -> the spec's outputs (the
    saved statistics the forward also writes are kept for the backward, not returned), and
    ``loss.backward()`` runs the backward's kernels."""

    def __init__(self, forward: Kernel, plan: BackwardPlan, outputs: tuple[str, ...]):
        self.op = FoldwiseOp(forward)
        self.plan = plan
        self.outputs = outputs
        register_backward(self.op.key, plan)

    def __repr__(self) -> str:
        return f"TrainableOp({self.op.key!r})"

    def __call__(self, inputs: Mapping[str, torch.Tensor] | None = None, /, **tensors: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
        result = self.op(inputs, **tensors)
        return {name: result[name] for name in self.outputs}


def trainable_op(cascade: Any, forward: Kernel, backward: Mapping[str, Kernel], outputs: tuple[str, ...]) -> TrainableOp:
    """``forward`` with the backward of ``cascade`` (module doc); ``outputs``: the spec's own."""
    return TrainableOp(forward, backward_plan(cascade, forward, backward), outputs)


def fetch_trainable(fetch_all: Any, user: Any, shape: Mapping[str, Any], dtype: str | Mapping[str, str]) -> TrainableOp:
    """The trainable op of ``user`` (a loaded spec) at ``shape``: derives its backward, then fetches
    the forward (saving, or writing the gradient) and every backward kernel in one call of
    ``fetch_all([(spec JSON, shape, dtype), ...]) -> kernels`` (:meth:`service.client.KernelCache.
    prefetch`: in parallel, so with ``tune_if_missing`` their jobs tune side by side; each is a spec
    of its own). A backward kernel's input dtypes: a forward input's own, a saved statistic's or an
    upstream gradient's that of the forward output it is (:func:`fuser_core.output_dtypes`)."""
    from fuser_core import bind_dtypes, derive_backward, gradient_in_forward, output_dtypes, spec_json

    if any(isinstance(v, Mapping) for v in shape.values()):
        raise BundleError("shape: a trainable op is for one shape; give sizes, not ranges")
    cascade = derive_backward(user, sizes=shape)  # packed for these sizes (a dim too long to hold: staged)
    fused = gradient_in_forward(user, cascade)
    elementwise = [b.name for b in cascade.specs if not any(s.is_reduction for s in b.steps)]
    if fused is None and elementwise:
        raise BundleError(f"spec: the backward of {user.name} has no kernel yet: {', '.join(elementwise)} is elementwise "
                          "(no reduction: no strategy runs it), and its forward cannot write the gradient (it has "
                          f"{len(user.outputs)} outputs)")
    forward_spec = fused or cascade.forward
    forward_dtypes = bind_dtypes(forward_spec, dtype)
    written = output_dtypes(forward_spec, forward_dtypes)
    requests = [(spec_json(forward_spec), dict(shape), dtype)]
    for b in () if fused else cascade.specs:
        dtypes = {}
        for inp in b.inputs:
            if inp.is_float:  # an upstream gradient: its output's dtype; a saved or staged result: as written
                source = next((o for o, up in cascade.upstream.items() if up == inp.name), inp.name)
                dtypes[inp.name] = written.get(source) or forward_dtypes[source]
        requests.append((spec_json(b), {d: n for d, n in shape.items() if d in b.sized_dims}, dtypes))
        # what a stage writes (a statistic in float32, rule 8's d_logits as the data), the next specs read
        written |= {o: t for o, t in output_dtypes(b, dtypes).items() if o in cascade.staged}
    forward, *kernels = fetch_all(requests)
    backward = {raw["name"]: k for (raw, _, _), k in zip(requests[1:], kernels)}
    return trainable_op(cascade, forward, backward, tuple(user.outputs))
