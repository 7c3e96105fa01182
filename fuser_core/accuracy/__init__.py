"""The accuracy bar: every strategy on the inputs real models produce, against what the dtype can do.

The float64 check (:func:`fuser_core.runner.judge`) draws standard-normal inputs and holds every
output to a fixed tolerance. Issue 23 adds a second bar, relative to the dtype: on each input
*family* below, a strategy's error (:func:`fuser_core.runner.rel_err` against the float64
reference, the kernel check's measure) may be at most ``BAR`` (2) times

- the error of the **spec's formula evaluated step by step in the run's dtype**
  (:class:`FormulaEvaluator`: the float64 reference's evaluator with every rounding operation's
  result rounded to that dtype; a sum as additions in that dtype, pairwise or in a loop's order), the
  largest over round-to-nearest and ``FORMULA_SAMPLES`` evaluations with random roundings (|d| <= u): one input set's
  error is one draw of the formula's rounding errors, and a strategy whose arithmetic is the
  formula's lands up to 3x either side of a single draw (:func:`formula_outputs`), and
- where torch has the op (``TORCH_OPS``: the catalog's safe_softmax, logsumexp, layernorm,
  rmsnorm and cross_entropy, matched by spec hash), the error of **torch's own op** on the same
  inputs in the same dtype,

each floored at ``FLOOR_ULPS`` units in the last place of the output's dtype (below that both are
exact, and a ratio of two roundings means nothing). The float64 check stays as it was; this is an
additional verdict, reported per family (``foldwise run``'s ``accuracy`` section, the tuner's
correctness gate, the fuzzers).

**Families** (``FAMILIES``; each has one job, named in ``Family.job``). Value families transform
every float input (along the loop axis where the input has it, else its last axis):
``normal`` (as drawn), ``offset100`` and ``offset1000`` (x + 100, x + 1000: cancellation in
``x - max`` and ``x - mean``), ``scale30`` (x * 30: a wide dynamic range in ``exp``), ``peaked``
(one value per row 20 above the rest: softmax ~ one-hot) and ``near_ties`` (a few levels, 1e-6
apart within each: max/argmax ties, variances of near-equal values). Special families check the
special-value pattern (:func:`fuser_core.edge_rows.special_mismatches`: NaN, +inf and -inf where
the reference has them) as well as the bar: ``masked`` (row 0 of the first float input over the
loop axis fully -inf, row 1 half -inf: attention masks), ``nan`` (one NaN in row 0, row 1 all NaN:
NaN propagates as torch propagates it), ``axis1`` (the loop axis of length 1) and ``empty`` (a
zero-size dim: first a lane dim, then the loop axis; the outputs must be the reference's (an empty
tensor, or a reduction's identity through the formula), or the run refuses with the same
``ShapeError`` the reference raises (an argmax over nothing), never another exception).

Index outputs (argmax/argmin/topk indices) are left to the float64 check, which judges a selection
by what it selects; the bar covers float outputs. A fused strategy of a cascade whose derivation is
inexact (a cast inside a fused reduction: fp8_quant_gemm) rounds its casts with running values, so
it does not compute the formula as written: the bar does not apply (each family says so), and the
float64 check judges it normwise.

Example:
    >>> import numpy as np
    >>> apply_family("offset100", np.zeros((2, 3)), np.random.default_rng(0)).tolist()
    [[100.0, 100.0, 100.0], [100.0, 100.0, 100.0]]
    >>> formula_dtype({"x": "bfloat16", "w": "bfloat16"}), formula_dtype({"x": "float16", "w": "float32"})
    ('bfloat16', 'float32')

The package, by job: :mod:`.families` (the input families and the shapes they run on),
:mod:`.formula` (the formula in the run's dtype), :mod:`.torch_ops` (torch's own op),
:mod:`.verdict` (the bar's verdict) and :mod:`.check` (the whole check and its table).
"""

from fuser_core.accuracy.check import (
    accuracy_check,
    check_family,
    describe,
    refusal,
    table,
)
from fuser_core.accuracy.families import (
    AXIS_LIMIT,
    FAMILIES,
    FREE_LIMIT,
    GATE_FAMILIES,
    INNER_LIMIT,
    LANE_LIMIT,
    RUN_FAMILIES,
    SPECIAL_FAMILIES,
    VALUE_FAMILIES,
    Family,
    accuracy_shape,
    apply_family,
    family_inputs,
    family_shape,
    parse_families,
)
from fuser_core.accuracy.formula import (
    FLOOR_ULPS,
    FORMULA_SAMPLES,
    SEQUENTIAL_STEPS,
    UNIT_ROUNDOFF,
    FormulaEvaluator,
    formula_dtype,
    formula_outputs,
    ulp_floor,
)
from fuser_core.accuracy.torch_ops import (
    TORCH_OPS,
    torch_op_name,
    torch_outputs,
)
from fuser_core.accuracy.verdict import (
    BAR,
    TermScales,
    bar_verdict,
    cancellation,
)

__all__ = [
    "AXIS_LIMIT",
    "BAR",
    "FAMILIES",
    "FLOOR_ULPS",
    "FORMULA_SAMPLES",
    "FREE_LIMIT",
    "Family",
    "FormulaEvaluator",
    "GATE_FAMILIES",
    "INNER_LIMIT",
    "LANE_LIMIT",
    "RUN_FAMILIES",
    "SEQUENTIAL_STEPS",
    "SPECIAL_FAMILIES",
    "TORCH_OPS",
    "TermScales",
    "UNIT_ROUNDOFF",
    "VALUE_FAMILIES",
    "accuracy_check",
    "accuracy_shape",
    "apply_family",
    "bar_verdict",
    "cancellation",
    "check_family",
    "describe",
    "family_inputs",
    "family_shape",
    "formula_dtype",
    "formula_outputs",
    "parse_families",
    "refusal",
    "table",
    "torch_op_name",
    "torch_outputs",
    "ulp_floor",
]
