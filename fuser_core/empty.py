"""Problems with a zero-size dim: their outputs, without a launch.

Serving code calls with an empty batch, and a grid of 0 programs is not a launch. Outputs over a
zero-size dim are empty tensors. A reduction over an empty axis still has a value: its identity
(0 for a sum, -inf for a max), then the spec's formula, as torch gives it (``torch.logsumexp``
of nothing is -inf, ``torch.sum`` 0); those outputs come from the float64 reference on the
caller's inputs, which are small there (every input over the empty dim is empty). An argmax over
an empty dim is refused by :func:`fuser_core.problem.bind_shape`, as torch refuses it.

Example:
    >>> import torch
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "s", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "t", "reduce": "sum", "over": "n", "expr": "x"}], "outputs": ["t"]})
    >>> empty_outputs(spec, {"m": 0, "n": 5}, {"x": torch.ones(0, 5)}, {"t": "float32"})["t"].shape
    torch.Size([0])
    >>> empty_outputs(spec, {"m": 2, "n": 0}, {"x": torch.ones(2, 0)}, {"t": "float32"})["t"].tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuser_core.spec import Spec


def has_empty_dim(shape: Mapping[str, int]) -> bool:
    return any(n == 0 for n in shape.values())


def empty_outputs(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, Any],
                  stores: Mapping[str, str]) -> dict[str, Any]:
    """Every output part of ``spec`` at ``shape`` (which has a 0), as a launch would return it: on
    the step's dims in ``step.dims`` order, in its storage dtype (``stores``), on the inputs' device."""
    import numpy as np  # here: the client imports this module, and an inference server's start-up no NumPy
    import torch

    from fuser_core.reference import Evaluator

    device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
    dims = {part: spec.step(part.split(".")[0]).dims for part in spec.output_parts}
    valued = [part for part in spec.output_parts if all(shape[d] for d in dims[part])]
    values: dict[str, Any] = {}
    if valued:
        arrays = {name: (t.double() if t.dtype.is_floating_point else t.long()).cpu().numpy() for name, t in inputs.items()}
        with np.errstate(all="ignore"):  # IEEE: log(0) is -inf, as the kernel's would be
            values = Evaluator(spec, shape).outputs(arrays)
    out = {}
    for part, part_dims in dims.items():
        dtype = getattr(torch, stores[part])
        if part in values:
            t = torch.from_numpy(values[part])
            t = t.to(torch.float32).to(dtype) if dtype.is_floating_point else t.to(dtype)
        else:
            t = torch.empty([shape[d] for d in part_dims], dtype=dtype)
        out[part] = t.to(device)
    return out
