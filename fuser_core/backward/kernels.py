"""The backward run as kernels (Triton; the interpreter without a GPU): the forward that saves its
statistics, then each backward spec, as a training step runs them. For checks and benchmarks;
served kernels run through bundles (service.client)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fuser_core.backward.derive import BackwardCascade
from fuser_core.runner import run
from fuser_core.spec_model import Spec


def kernel_gradients(spec: Spec, cascade: BackwardCascade, shape: Mapping[str, int], dtype: str,
                     inputs: Mapping[str, Any], upstream: Mapping[str, np.ndarray], strategy: str | None = None
                     ) -> dict[str, np.ndarray]:
    """Each input's gradient (float64 arrays, the input's own dim order) from the kernels of
    ``strategy`` (None: each spec's best valid one). ``inputs`` holds runtime scalars too."""
    saved = run(cascade.forward, shape, dtype, inputs, strategy=strategy).outputs
    known = {**inputs, **{cascade.upstream[o]: g for o, g in upstream.items()},
             **{s: saved[s].double().cpu().numpy() for s in cascade.saved}}
    out: dict[str, np.ndarray] = {}
    for s in cascade.specs:
        sub = {d: n for d, n in shape.items() if d in s.sized_dims}
        reads = {i.name: known[i.name] for i in s.inputs} | {p.name: inputs[p.name] for p in s.runtime_params
                                                             if p.name in inputs}
        result = run(s, sub, dtype, reads, strategy=strategy).outputs
        known |= {name: result[name].double().cpu().numpy() for name in cascade.staged if name in result}
        for g in (g for g in cascade.gradients if g.spec == s.name):
            own = spec.input(g.input).dims
            out[g.input] = result[g.output].double().cpu().numpy().transpose([g.dims.index(d) for d in own])
    for name in cascade.zero:
        out[name] = np.zeros(np.shape(inputs[name]))
    return out
