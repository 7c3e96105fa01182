"""The derivation: does a cascade fuse into one incremental loop, and how (docs/THEORY.md 2-5).

For every reduction of a spec, :func:`derive_cascade` finds its cascade axis (``over``),
the earlier reductions over that axis it reads (its dependencies D, after inlining
elementwise steps), and decides with sympy whether its integrand F(x, D) separates:

- ``sum``: F = sum_j G_j(x) H_j(D) with finitely many terms (rank 1 is RedFuser's
  multiplicative case; rank > 1 is docs/THEORY.md section 5's multi-term case);
- ``max``/``min``/``topk``/``argmax``/``argmin``: F = a(D) G(x) + b(D) with a(D) provably
  positive (order kept) or negative (max and min swap), decided by sympy's assumptions.

The split is found by expanding F (exponentials of sums become products) and sorting each
factor of each term into streamed (x), dependent (D) or neutral; a factor that mixes x
and D -- ``sin(x*mx)``, ``Max(x, mean)`` -- makes the reduction non-fusible, and that factor
is the reason given.

Each fused reduction gets a realisation, the state a loop carries and how it is updated:

- ``first``: no dependency; the plain partial reduction.
- ``scaled``: one accumulator per term, each anchored at the running value of the max/min
  dependencies it has (``T_j = sum G_j(x) A_j(D~)``); when the anchor moves the
  accumulator is multiplied by the correction ``A_j(D_new) / A_j(D_old)`` (for softmax
  ``exp(mx_old - mx_new)``); the rest of ``H_j`` (for attention ``1 / den``) is applied
  once, at the end, with final values. Max/min/topk use the same with one term.
- ``shifted``: for multi-term sums whose changing terms can be re-expressed from running
  partial sums, where no Taylor form exists (a cast inside F), the accumulator holds
  ``sum F(x, D~)`` at an anchor that tracks the running estimate of each sum dependency (the
  running mean), and moving the anchor adds a sympy-factored correction
  (``count (mean_new - mean_old)^2 / N``): Welford/Chan's update, derived rather than written in.
  It takes ``sum (x - mean~)`` as 0, which the rounded running mean makes false, so the Taylor
  form below comes first (layernorm's variance is Taylor).
- ``taylor``: for sums ``F = A(D) B(D) P(x, D)`` with ``A`` a positive factor of the max/min
  dependencies (anchored, as in ``scaled``), ``B`` a factor applied at the end and ``P``
  polynomial in the anchorable dependencies (running max/min, running estimates of sums):
  the accumulators hold the Taylor coefficients ``sum A(D~) d^a P(x, D~) / a!`` at the
  anchors, and moving the anchors by ``delta`` is the exact binomial shift
  ``acc_a <- c * sum_{b >= a} binom(b, a) delta^(b - a) acc_b`` (Pebay's higher-moment
  updates). Every accumulator stays centred, so ``sum (x - mx)^2`` or a softmax-weighted
  variance never go through raw power sums. Factors that read dependencies with no running
  anchor (``log(den)``) are kept apart: F = sum_b k^b P_b, each ``P_b`` centred on its own
  accumulators and ``k^b`` applied at the end (softmax entropy: ``sum exp(x - mx) (x - mx)``).
  A weighted mean ``sum w g / W`` (``W = sum w`` at the same anchors) anchors at its running
  value, a convex combination of the ``g`` seen (:meth:`Deriver.weighted_mean`). A top-order
  coefficient that reads neither the streamed values nor an anchor (layernorm's ``sum 1 / N``)
  is ``count * c`` and gets no state (:func:`~fuser_core.derive.algebra.counted_out`).

Some realisations are refused (the step is then not fused, and the reason says why) because
they are exact in real arithmetic but not in floating point, found by fuzzing
(``benchmarks/fuzz_long.py``; docs/THEORY.md section 5):

- an anchored exponent the running max/min does not bound (``exp(x - mx)`` with
  ``mx = max(x**3)``): early running maxima sit far below the final one and the state
  overflows where the unfused value does not (:meth:`Deriver.check_range`);
- a polynomial of degree 2 or more centred on the running estimate of a *raw* sum (one
  without ``1/size(axis)``): the estimate ``partial * N / count`` strays by about
  ``N / sqrt(count)`` values' worth early on, and the square cancels float32 accuracy away.
  Means (also ``s / size(n)`` of a raw ``s``), maxima and minima keep the Taylor form;
- a polynomial of degree 2 or more centred on a running max (min) that its values may exceed
  (:meth:`Deriver.one_sided`): a move of the centre then adds terms of both signs;
- raw power sums: an end factor of degree 2 or more in a dependency with no running anchor
  (:meth:`Deriver.check_raw_moments`).

Each fused form is then turned, once, into a :class:`~fuser_core.realisation.Realisation`
(``Derivation.realisations``): its accumulators as data, with the one tile-step and merge rule
for every kind (a merge re-anchors both parts to the merged dependencies and combines them with
the reduction's operator). The certificate, the kernel printer, the report and the tuner read
that object; :mod:`fuser_core.certificate` checks it numerically.

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "sm", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...               {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
    ...     "outputs": ["den"]})
    >>> d = derive_cascade(spec)
    >>> d.forms["den"].kind, d.forms["den"].corrections
    ('scaled', (exp(-mx[new] + mx[old]),))

The package, by job: :mod:`.forms` (the results, as data, and the limits), :mod:`.cascade`
(:func:`derive_cascade`), the derivation of one reduction in parts (:mod:`.deriver_base`:
classification and separation; :mod:`.anchoring`: anchors and the scaled form; :mod:`.checks`:
the floating-point refusals; :mod:`.realise`: the Taylor, order and shifted forms, and the whole
:class:`~fuser_core.derive.realise.Deriver`) and :mod:`.algebra` (the sympy helpers they share).
"""

from fuser_core.derive.cascade import derive_cascade
from fuser_core.derive.forms import (
    DERIVE_TIME_LIMIT_S,
    MAX_EXPAND_POWER,
    MAX_SEPARATE_EXPONENT,
    MAX_TAYLOR_DEGREE,
    MAX_TERMS,
    SENTINEL_MAGNITUDE,
    WEIGHTED_MEAN,
    AxisGroup,
    Derivation,
    EpilogueStep,
    NotSeparable,
    ReductionForm,
    Term,
)

__all__ = [
    "DERIVE_TIME_LIMIT_S", "MAX_EXPAND_POWER", "MAX_SEPARATE_EXPONENT", "MAX_TAYLOR_DEGREE", "MAX_TERMS",
    "SENTINEL_MAGNITUDE", "WEIGHTED_MEAN", "AxisGroup", "Derivation", "EpilogueStep", "NotSeparable",
    "ReductionForm", "Term", "derive_cascade",
]
