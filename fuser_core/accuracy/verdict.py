"""The accuracy bar's verdict: a strategy's error against BAR times the formula's and torch's,
with cancellation and overflow taken into account.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fuser_core.accuracy.formula import ulp_floor
from fuser_core.reference import Evaluator, cast_to
from fuser_core.spec import Spec

BAR = 2.0  # a strategy may err at most this many times the formula's (and torch's) error


# ---------------------------------------------------------------- the verdict


def _float64(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return (t.double() if t.dtype.is_floating_point else t).cpu().numpy().astype(np.float64)  # float64 outputs exactly


class TermScales:
    """A mixin for an :class:`~fuser_core.reference.Evaluator`: each sum step's terms' magnitudes,
    ``sum |t|`` (in ``scales``, aligned), recorded as the steps run: the scale a sum's rounding errors
    live on whatever the order of its additions."""

    def reduce(self, step: Any, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if step.reduce == "sum":
            edims = self.spec.expr_dims(step.expr)
            with np.errstate(all="ignore"):
                value = np.broadcast_to(self.eval_expr(step.expr, env), self.aligned_shape(edims))
                self.scales = {**getattr(self, "scales", {}),
                               step.name: np.sum(np.abs(value), axis=self.axis[step.over], keepdims=True)}
        return super().reduce(step, env)


class _TermScaled(TermScales, Evaluator):
    pass


def cancellation(spec: Spec, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                 reference: Mapping[str, np.ndarray], evaluator: Any = None) -> dict[str, np.ndarray]:
    """For each output that is a sum step: ``sum |t| / |sum t|`` per element (at least 1), how far its
    terms cancel. No order of additions holds such a sum to better than a few ulps of ``sum |t|``: a
    13-term sum that cancels 22-fold errs 11 units of its result's roundoff in a kernel's tile order and
    2 in the formula's pairwise order, both within 1 unit of its largest partial sum (fuzz seed 61). The
    bar divides both errors by this factor, so the floor is a few ulps of the terms, not of the result.
    Sums whose terms share a sign (every centred square) have factor 1: nothing changes for them."""
    ev = evaluator or _TermScaled(spec, shape)  # ``evaluator``: another TermScales (the GPU measurer's sampled rows)
    with np.errstate(all="ignore"):
        ev.run(inputs)
        out = {}
        for part, ref in reference.items():
            if part in getattr(ev, "scales", {}):
                m = np.ascontiguousarray(ev.unaligned(ev.scales[part], spec.step(part).dims))
                k = m / np.abs(np.asarray(ref, np.float64))
                out[part] = np.where(np.isfinite(k) & (k > 1.0), k, 1.0)
    return out


def _errors_beside_overflow(got: np.ndarray, ref: np.ndarray, formulas: Sequence[np.ndarray], floor: float,
                            ulps: float, cancel: np.ndarray | None = None) -> tuple[float, float]:
    """The kernel's and the formula's errors (:func:`fuser_core.runner.elementwise_err`, the largest
    element), on the elements where the formula in the dtype is not itself infinitely wrong.

    Where the formula's evaluation in the dtype overflows (or gives NaN, or an infinity of the wrong
    sign) against a finite float64 reference, its error there is inf, and a ratio inf/inf (NaN)
    would refuse every kernel, even one that computes exactly what the formula computes: the
    dtype cannot hold the value, and that is the spec's, not the strategy's. So such an element
    is judged apart: the kernel passes there when it gives the value one of the formula's
    evaluations gives (the same infinity, NaN where it is NaN) or is within the bar of the
    reference: ``BAR`` x the worst of the formula's evaluations that stay finite there (the plain
    rounding's ``0 log 0`` is NaN where a nudged rounding's is not: a softmax entropy at scale 30,
    whose centred kernel gives the finite value), else ``BAR`` x ``ulps``; an element it fails
    counts as an infinite error. Every other element is judged as always, its ratio against the
    formula's error on those elements."""
    from fuser_core.runner import elementwise_err

    e_got = elementwise_err(got, ref, floor)
    e_forms = np.stack(np.broadcast_arrays(*[elementwise_err(f, ref, floor) for f in formulas]))
    if cancel is not None:  # a cancelling sum: errors in units of its terms' magnitude (:func:`cancellation`)
        e_got, e_forms = e_got / cancel, e_forms / cancel
    e_form = np.max(e_forms, axis=0)
    over = ~np.isfinite(e_form)
    if over.any():
        g = np.broadcast_to(np.asarray(got, np.float64), e_form.shape)
        same = np.zeros(e_form.shape, bool)
        for f in formulas:
            f = np.broadcast_to(f, e_form.shape)
            same |= (g == f) | (np.isnan(g) & np.isnan(f))
        finite_form = np.max(np.where(np.isfinite(e_forms), e_forms, 0.0), axis=0)
        held = same | (e_got <= BAR * np.maximum(ulps, finite_form))
        e_got = np.where(over, np.where(held, 0.0, np.inf), e_got)
        e_form = np.where(over, 0.0, e_form)
    return float(np.max(e_got, initial=0.0)), float(np.max(e_form, initial=0.0))


def _special_reference(got: np.ndarray, ref: np.ndarray, store: str, formulas: Sequence[Mapping[str, np.ndarray]],
                       part: str) -> np.ndarray:
    """The special values an output is held to: the float64 reference as the output's dtype holds it (1.3e59 is
    +inf in float32; fuzz seed 73), and where the formula in the dtype gives the kernel's own NaN or infinity (an
    intermediate that overflows there), that: as :func:`_errors_beside_overflow` judges the errors."""
    want = cast_to(np.asarray(ref, np.float64), store)
    g = np.broadcast_to(np.asarray(got, np.float64), want.shape)
    for f in formulas:
        fp = np.broadcast_to(np.asarray(f[part], np.float64), want.shape)
        same = (np.isnan(g) & np.isnan(fp)) | (np.isinf(g) & (g == fp))
        want = np.where(same, g, want)
    return want


def bar_verdict(spec: Spec, outputs: Mapping[str, Any], reference: Mapping[str, np.ndarray],
                formula: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]], stores: Mapping[str, str],
                torch_ref: Mapping[str, np.ndarray] | None = None, *, special: bool = False,
                cancel: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """One family's verdict on ``outputs`` (a strategy's, torch tensors or arrays): per float part,
    ``error`` = :func:`fuser_core.runner.rel_err` against the float64 ``reference``, ``formula_error``
    the same of ``formula`` (:func:`formula_outputs`), ``torch_error`` of ``torch_ref`` (None
    without one); ``ratio`` = error / max(formula error (the largest of ``formula``'s evaluations), floor), ``torch_ratio`` likewise; passed
    when both ratios are at most ``BAR`` and, with ``special``, the special values are the
    reference's. The worst part's numbers are reported at the top level."""
    from fuser_core.edge_rows import special_mismatches
    from fuser_core.runner import FLOOR, rel_err

    formulas = [formula] if isinstance(formula, Mapping) else list(formula)
    parts: dict[str, dict[str, Any]] = {}
    for part, ref in reference.items():
        if part.endswith(".indices") or stores.get(part) == "int32":
            continue
        got = _float64(outputs[part])
        if got.size == np.size(ref):  # a scalar output may come back as () or (1,)
            got = got.reshape(np.shape(ref))
        else:
            parts[part] = {"error": float("inf"), "formula_error": 0.0, "ratio": float("inf"), "torch_error": None,
                           "torch_ratio": None, "spec_torch_ratio": None, "passed": False,
                           "specials": [f"shape {list(got.shape)}, expected {list(np.shape(ref))}"]}
            continue
        floor = FLOOR[stores[part]]
        ulps = ulp_floor(stores[part])
        # the formula's result as the output holds it: where even the float64 value does not fit the
        # output's dtype (a float16 GEMM output past 65504), no kernel can store better than its
        # infinity, which _errors_beside_overflow then judges as the formula's own overflow
        with np.errstate(over="ignore"):
            stored = [cast_to(np.asarray(f[part], np.float64), stores[part]) for f in formulas]
        err, ferr = _errors_beside_overflow(got, ref, stored, floor, ulps, (cancel or {}).get(part))
        ratio = err / max(ferr, ulps)
        terr = rel_err(torch_ref[part], ref, floor) if torch_ref is not None and part in torch_ref else None
        tratio = err / max(terr, ulps) if terr is not None else None
        # the formula as written against torch: past the bar, no strategy of this spec is held to torch's error
        spec_ratio = ferr / max(terr, ulps) if terr is not None else None
        specials = special_mismatches(got, _special_reference(got, ref, stores[part], formulas, part)) if special else []
        torch_holds = tratio is None or tratio <= BAR or spec_ratio > BAR
        ok = ratio <= BAR and torch_holds and not specials
        parts[part] = {"error": err, "formula_error": ferr, "ratio": ratio, "torch_error": terr,
                       "torch_ratio": tratio, "spec_torch_ratio": spec_ratio, "passed": ok, "specials": specials}
    worst = max(parts.values(), key=lambda p: (not p["passed"], max(p["ratio"], p["torch_ratio"] or 0.0)),
                default=None)
    out: dict[str, Any] = {"passed": all(p["passed"] for p in parts.values())}
    for key in ("error", "formula_error", "ratio", "torch_error", "torch_ratio", "spec_torch_ratio", "specials"):
        out[key] = worst[key] if worst else (0.0 if key in ("error", "formula_error", "ratio") else None)
    if out["specials"] is None:
        out["specials"] = []
    worst_spec = max((p["spec_torch_ratio"] for p in parts.values() if p["spec_torch_ratio"] is not None), default=None)
    # the spec's own verdict: its formula as written loses digits that torch's op keeps (every strategy inherits it)
    out["spec_warning"] = (f"the spec's formula as written errs {worst_spec:.3g}x torch's op on these inputs: "
                           f"a rearrangement (torch's) keeps those digits" if worst_spec is not None and worst_spec > BAR
                           else None)
    out["parts"] = parts
    return out
