"""The float64 reference on a sample of independent rows: the correctness check of device-sized problems.

The reference (:mod:`fuser_core.reference`) runs in NumPy float64 on the host, step by step,
materialising every broadcast expression (attention's ``q * k`` over [b, h, m, n, d]), which at
full size would need terabytes. A kernel that runs at the full shape is therefore checked on a
*sample of independent rows*: for every dim that no step reduces over and that is not a topk
``as`` dim (:func:`sliceable_dims`), a few indices (the first, the last -- tails are where
masking goes wrong -- and random ones), chosen by :func:`sample_rows` so that the largest
expression the evaluator materialises (:func:`reference_cost`) has at most ``budget`` elements
(default :data:`REFERENCE_BUDGET`, 2**24, about 128 MiB of float64).

Contract: rows are independent along such dims, so the sampled reference
(:class:`SampledEvaluator`) is exact for the sampled rows; ``index(dim)`` and ``size(dim)``
keep their full-shape values. :class:`SampledTermScales` and :class:`SampledFormula` are the
accuracy bar's evaluators (:mod:`fuser_core.accuracy`) on the same rows. An empty sample
(``{}``) means every row: at the small shapes of tests the sample is the whole problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fuser_core.accuracy import FormulaEvaluator, TermScales
from fuser_core.reference import Evaluator
from fuser_core.spec import Spec

REFERENCE_BUDGET = 1 << 24  # elements of the largest array the sampled float64 reference materialises
ROWS_PER_DIM = 16  # at most this many sampled indices per sliceable dim


def sliceable_dims(spec: Spec) -> tuple[str, ...]:
    """Dims along which rows are independent: no step reduces over them, and no topk lays
    its result on them."""
    fixed = {s.over for s in spec.steps if s.is_reduction} | {s.as_dim for s in spec.steps if s.as_dim}
    return tuple(d for d in spec.dims if d not in fixed)


def reference_cost(spec: Spec, sizes: Mapping[str, int]) -> int:
    """Elements of the largest array the reference evaluator materialises at ``sizes``."""
    worst = max((math.prod(sizes[d] for d in i.dims) for i in spec.inputs), default=1)
    for s in spec.steps:
        dims = set(spec.expr_dims(s.expr)) | set(s.dims)
        worst = max(worst, math.prod(sizes[d] for d in dims))
    return worst


def sample_rows(spec: Spec, shape: Mapping[str, int], budget: int = REFERENCE_BUDGET,
                rng: np.random.Generator | None = None, per_dim: int = ROWS_PER_DIM) -> dict[str, np.ndarray]:
    """Sorted indices to check per sliceable dim (a dim absent from the result is whole).

    Each dim starts at ``min(size, per_dim)`` indices, or all of them when the whole problem
    fits the budget; the largest count is halved until the reference fits ``budget``. Raises
    ValueError when even one row is too large."""
    rng = rng or np.random.default_rng(0)
    dims = sliceable_dims(spec)
    if reference_cost(spec, shape) <= budget:
        return {}
    counts = {d: min(shape[d], per_dim) for d in dims}
    while reference_cost(spec, {**shape, **counts}) > budget:
        big = max((d for d in dims if counts[d] > 1), key=lambda d: counts[d], default=None)
        if big is None:
            raise ValueError(f"the float64 reference needs {reference_cost(spec, {**shape, **counts})} elements for a "
                             f"single row of {spec.name} (budget {budget}): the correctness check cannot run at "
                             "this shape")
        counts[big] = (counts[big] + 1) // 2
    out = {}
    for d in dims:
        n, c = shape[d], counts[d]
        if c >= n:
            continue
        if c == 1:
            chosen = [n - 1]
        else:
            middle = rng.choice(np.arange(1, n - 1), size=c - 2, replace=False) if c > 2 else []
            chosen = [0, n - 1, *middle]
        out[d] = np.array(sorted(int(i) for i in chosen), dtype=np.int64)
    return out


class SampledEvaluator(Evaluator):
    """The reference on sampled rows: shapes are the sample's, but ``size(dim)`` and
    ``index(dim)`` keep their full-shape values (the original indices of the sampled rows)."""

    def __init__(self, spec: Spec, full_shape: Mapping[str, int], rows: Mapping[str, np.ndarray]):
        sampled = {d: (len(rows[d]) if d in rows else n) for d, n in full_shape.items()}
        super().__init__(spec, sampled)
        self.full_shape = dict(full_shape)
        self.rows = {d: np.asarray(v, np.int64) for d, v in rows.items()}

    def size_value(self, dim: str) -> np.float64:
        return np.float64(self.full_shape[dim])

    def index_array(self, dim: str) -> np.ndarray:
        if dim in self.rows:
            return self.rows[dim].astype(np.float64).reshape(self.aligned_shape((dim,)))
        return super().index_array(dim)


class SampledTermScales(TermScales, SampledEvaluator):
    """The terms' magnitudes of each sum (:func:`fuser_core.accuracy.cancellation`) on sampled rows."""


class SampledFormula(SampledEvaluator, FormulaEvaluator):
    """The spec's formula in a dtype (:class:`fuser_core.accuracy.FormulaEvaluator`) on sampled rows
    (:class:`SampledEvaluator`): the accuracy bar's yardstick for a device-sized problem."""

    def __init__(self, spec: Spec, full_shape: Mapping[str, int], rows: Mapping[str, np.ndarray], dtype: str,
                 rng: np.random.Generator | None):
        SampledEvaluator.__init__(self, spec, full_shape, rows)
        self.dtype, self.rng = dtype, rng

