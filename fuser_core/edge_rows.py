"""The rows real models produce at their edges, and how special values are compared.

Every strategy must give the float64 reference's special values (docs/SPEC.md, "Special values"):
:func:`edge_inputs` puts a row of -inf, one +inf, one NaN, a row of +inf and one -inf into the
first float input along the loop axis; :func:`special_mismatches` names where an output's NaN,
+inf or -inf differ from the reference's. Used by tests/fuser_core/test_special_values.py (the interpreter)
and the GPU check's ``specials`` stage (benchmarks/gpu/check.py), so both judge the same rows.

Example:
    >>> import numpy as np
    >>> special_mismatches(np.array([1.0, np.nan]), np.array([1.0, np.inf]))
    ['NaN at [[1]]', '+inf at [[1]]']
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fuser_core.spec import Spec


def edge_inputs(spec: Spec, shape: Mapping[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 inputs with edge rows along the loop axis in the first float input over it:
    row 0 all -inf, row 1 one +inf, row 2 one NaN, row 3 all +inf, row 4 one -inf (rows past the
    input's other dims are left out); the rest standard normal."""
    from fuser_core.codegen.plan import loop_axis
    from fuser_core.reference import random_inputs

    axis, _ = loop_axis(spec)
    inputs = random_inputs(spec, shape, np.random.default_rng(seed), "float32")
    target = next((i for i in spec.inputs if i.kind != "index" and axis in i.dims), None)
    if target is None:
        return inputs
    pos = target.dims.index(axis)
    x = np.moveaxis(inputs[target.name].copy(), pos, -1)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[1]
    edits = [(0, slice(None), -np.inf), (1, 3 % n, np.inf), (2, 5 % n, np.nan), (3, slice(None), np.inf),
             (4, 7 % n, -np.inf)]
    for row, col, value in edits:
        if row < rows.shape[0]:
            rows[row, col] = value
    inputs[target.name] = np.ascontiguousarray(np.moveaxis(rows.reshape(x.shape), -1, pos))
    return inputs


def special_mismatches(got: np.ndarray, want: np.ndarray) -> list[str]:
    """Where ``got``'s NaN, +inf and -inf differ from ``want``'s (the first few positions each)."""
    got, want = np.broadcast_arrays(np.asarray(got, np.float64), np.asarray(want, np.float64))
    out = []
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = test(got) != test(want)
        if differ.any():
            out.append(f"{name} at {np.argwhere(differ)[:4].tolist()}")
    return out
