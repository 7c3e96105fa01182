"""The derivation certificate: the derived incremental forms, run in float64, against the
multi-pass reference (docs/THEORY.md section 7).

Each trial draws a random shape and random inputs, evaluates the spec step by step with
:mod:`fuser_core.reference` (the multi-pass truth), and then, for every axis, runs the
*derived* realisation of each fused reduction: the axis is cut into random parts (the split
of a split-fused kernel), each part into random tiles; a part's state is built tile by tile
with the derived corrections, the parts' states are merged in a random order with the
derived merge rule, and the final values are compared with the reference.

Casts (fp8 quantisation with a running amax) are outside the algebra: the fused form is
exact in real arithmetic only. Such specs are checked twice: once with casts as written
(``max_rel_err``: what a fused kernel really gets) and once with every cast removed
(``algebra_max_rel_err``: the proof of the algebra), and ``exact`` is false.

Example:
    >>> from fuser_core.spec import load_spec
    >>> from fuser_core.derive import derive_cascade
    >>> spec = load_spec({"foldwise": 1, "name": "lse", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...               {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
    ...     "outputs": ["den"]})
    >>> cert = certify(derive_cascade(spec), trials=4)
    >>> cert.holds, cert.max_rel_err < 1e-12
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fuser_core import expr as ex
from fuser_core.certificate_loop import AxisLoop
from fuser_core.certificate_numpy import compile_forms
from fuser_core.derive import Derivation
from fuser_core.problem import meeting_constraints
from fuser_core.reference import Evaluator, random_inputs, random_scalars
from fuser_core.spec import Spec, load_spec, raw_param

TOLERANCE = 1e-9  # float64 re-association error is ~1e-15; anything near 1e-9 is a wrong form
# An ill-conditioned reference (sin of an argument near 1e15) moves by O(1) when its inputs move by
# a few float64 ulps, so algebraically equal forms differ by as much: a failing reduction is
# allowed CONDITIONING_K times the reference's own movement at inputs moved by CONDITIONING_ULPS,
# or at cast operands moved by as many (a cast's operand exactly on a rounding midpoint).
CONDITIONING_ULPS = 4
CONDITIONING_K = 8
MAX_AXIS = 48
MAX_OTHER = 3


@dataclass
class Certificate:
    max_rel_err: float  # fused (casts as written) vs multi-pass, max over trials and reductions
    algebra_max_rel_err: float  # the same with every cast removed: real arithmetic
    trials: int
    exact: bool  # False when casts make the fused form differ from multi-pass
    holds: bool  # algebra error within TOLERANCE
    per_reduction: dict[str, float] = field(default_factory=dict)
    tolerance: float = TOLERANCE
    note: str = ""

    def to_dict(self, names: dict[str, str] | None = None) -> dict[str, Any]:
        rename = names or {}
        return {
            "max_rel_err": self.max_rel_err,
            "algebra_max_rel_err": self.algebra_max_rel_err,
            "trials": self.trials,
            "exact": self.exact,
            "holds": self.holds,
            "tolerance": self.tolerance,
            "per_reduction": {rename.get(k, k): v for k, v in self.per_reduction.items()},
            "failed": [rename.get(k, k) for k in self.failed],
            "verdict": self.verdict(rename),
            "note": self.note,
        }

    @property
    def failed(self) -> list[str]:
        """The fused reductions whose derived form missed the multi-pass reference."""
        return [] if self.holds else [k for k, v in self.per_reduction.items() if not v <= self.tolerance] or list(
            self.per_reduction)

    def verdict(self, names: dict[str, str] | None = None) -> str:
        """What the certificate means for the kernels, in one sentence (docs/THEORY.md section 7)."""
        if self.holds:
            return ("holds: every fused reduction equals its step-by-step form in float64 on random inputs; "
                    "the fused kernels compute the spec")
        failed = ", ".join(f"{(names or {}).get(k, k)} (relative error {self.per_reduction.get(k, math.inf):.2e})"
                           for k in self.failed)
        return (f"fails for {failed}, over the tolerance {self.tolerance:.0e}: the derived fused form disagrees "
                "with the step-by-step float64 reference, so the fused strategies may compute wrong values; "
                "tuning jobs for this spec are refused unless the request sets allow_uncertified")


def certify(derivation: Derivation, *, trials: int = 12, seed: int = 0) -> Certificate:
    """Check every fused reduction of ``derivation`` numerically (see the module docstring)."""
    fused = [f for f in derivation.forms.values() if f.fused]
    exact = all(f.exact for f in fused)
    rng = np.random.default_rng(seed)
    spec = derivation.spec
    per: dict[str, float] = {f.name: 0.0 for f in fused}
    algebra_err = 0.0
    plain_spec = spec if exact else _without_casts(spec)
    for _ in range(trials):
        shape = _random_shape(spec, rng)
        # runtime scalars take random values too: the fused form must hold for every value, not its default
        inputs = {**random_inputs(spec, shape, rng, "float32"), **random_scalars(spec, rng)}
        for name, err in _trial(derivation, spec, shape, inputs, rng, keep_casts=True).items():
            per[name] = max(per[name], err)
        if exact:
            continue
        for err in _trial(derivation, plain_spec, shape, inputs, rng, keep_casts=False).values():
            algebra_err = max(algebra_err, err)
    max_err = max(per.values(), default=0.0)
    if exact:
        algebra_err = max_err
    note = "the fused form equals the multi-pass form in real arithmetic; the error is float64 rounding"
    if not exact:
        casts = ", ".join(f.name for f in fused if not f.exact)
        note = (
            f"casts inside {casts} round with running values, so the fused result is exact in real arithmetic "
            "(algebra_max_rel_err) but not bit-identical to multi-pass (max_rel_err)"
        )
    if not fused:
        note = "no reduction is fused; nothing to check"
    elif algebra_err > TOLERANCE:  # the notes above describe a passing certificate's error
        note = "the fused form disagrees with the multi-pass form beyond float64 rounding (see verdict)"
    return Certificate(
        max_rel_err=max_err, algebra_max_rel_err=algebra_err, trials=trials, exact=exact,
        holds=algebra_err <= TOLERANCE, per_reduction=per, note=note,
    )


# ---------------------------------------------------------------- set-up


def _random_shape(spec: Spec, rng: np.random.Generator) -> dict[str, int]:
    axes = {s.over for s in spec.steps if s.is_reduction}
    need: dict[str, int] = {}  # the largest k of any topk over each axis
    for s in spec.steps:
        if s.reduce == "topk":
            need[s.over] = max(need.get(s.over, 1), s.k)
    shape: dict[str, int] = {}
    for d in spec.dims:
        if any(s.as_dim == d for s in spec.steps):
            continue
        if d in axes:
            lo = max(1, need.get(d) or 1)
            shape[d] = int(rng.integers(lo, max(lo + 1, MAX_AXIS)))
        else:
            shape[d] = int(rng.integers(1, MAX_OTHER + 1))
    return meeting_constraints(spec, shape)


def _without_casts(spec: Spec) -> Spec:
    """The same spec with every cast(x, ...) replaced by x: real arithmetic."""

    def strip(node: ex.Expr) -> ex.Expr | None:
        return node.operand if isinstance(node, ex.Cast) else None

    raw: dict[str, Any] = {
        "foldwise": 1,
        "name": spec.name,
        "inputs": {i.name: {"dims": list(i.dims), "kind": i.kind} for i in spec.inputs},
        "params": {p.name: raw_param(p) for p in spec.params},
        "steps": [],
        "outputs": list(spec.outputs),
    }
    for s in spec.steps:
        entry: dict[str, Any] = {"name": s.name, "expr": ex.to_text(ex.map_expr(s.expr, strip))}
        if s.reduce:
            entry.update(reduce=s.reduce, over=s.over)
        if s.reduce == "topk":
            entry.update(k=s.k, **{"as": s.as_dim})
        raw["steps"].append(entry)
    return load_spec(raw, printed=True)


# ---------------------------------------------------------------- one trial


def _trial(
    derivation: Derivation, spec: Spec, shape: dict[str, int], inputs: dict[str, np.ndarray],
    rng: np.random.Generator, *, keep_casts: bool,
) -> dict[str, float]:
    with np.errstate(all="ignore"):  # IEEE semantics, as in the reference: inf/nan are compared, not raised
        return _run_trial(derivation, spec, shape, inputs, rng, keep_casts)


def _run_trial(derivation, spec, shape, inputs, rng, keep_casts) -> dict[str, float]:
    evaluator = Evaluator(spec, shape)
    env = evaluator.run(inputs)
    compiled = compile_forms(derivation, keep_casts)
    errors: dict[str, float] = {}
    movement: dict[str, np.ndarray] | None = None
    for group in derivation.groups:
        forms = [derivation.forms[m] for m in group.members if derivation.forms[m].fused]
        gathered = [f for f in forms if f.gathered]  # one load after the loop, no state of it
        forms = [f for f in forms if not f.gathered]
        if not forms:
            continue
        loop = AxisLoop(derivation, evaluator, env, group.axis, forms, compiled, _input_scale(inputs))
        errors.update({f.name: loop.gathered_error(f) for f in gathered})
        final = loop.run_split(rng)
        for form in forms:
            errors[form.name] = loop.compare(form, final)
            if errors[form.name] > TOLERANCE and not isinstance(final["run"][form.name], tuple):
                if movement is None:  # only where a reduction fails: a passing spec costs nothing extra
                    movement = _reference_movement(evaluator, inputs, env, rng)
                if form.name in movement:
                    errors[form.name] = loop.compare(form, final, CONDITIONING_K * movement[form.name])
    return errors


def _input_scale(inputs: dict[str, np.ndarray]) -> float:
    """The largest finite float input value: the size of what float64 rounds while a cascade runs."""
    values = [np.abs(a[np.isfinite(a)]) for a in inputs.values() if np.issubdtype(a.dtype, np.floating)]
    return float(max((v.max(initial=0.0) for v in values), default=0.0))


def _reference_movement(evaluator: Evaluator, inputs: dict[str, np.ndarray], env: dict[str, np.ndarray],
                        rng: np.random.Generator) -> dict[str, np.ndarray]:
    """|reference(inputs moved by up to CONDITIONING_ULPS float64 ulps) - reference(inputs)| per float
    step, the largest of two draws; a non-finite movement counts as 0 (it widens nothing).

    A spec with casts is also run twice with every cast's operand moved up, then down, by
    CONDITIONING_ULPS float64 ulps (``Evaluator(cast_nudge=...)``): a cast is discontinuous at its rounding
    midpoints, and float32 inputs put a float64 operand exactly on one often (about 1 in 600 for
    ``(x - r) / 3``). There the fused form's algebraically equal operand (``x/3 - r/3``, one float64
    ulp away) rounds to the other neighbour, one cast ulp off. Random input moves find that edge
    only by chance (both draws may land on the same side, or round back onto the midpoint); the
    pair of opposite nudges finds it always, and moves nothing where no operand is that close."""
    out: dict[str, np.ndarray] = {}
    runs = [{
        name: arr.astype(np.float64) * (1.0 + rng.uniform(-CONDITIONING_ULPS, CONDITIONING_ULPS, arr.shape) * 2.0 ** -52)
        if np.issubdtype(arr.dtype, np.floating) else arr
        for name, arr in inputs.items()
    } for _ in range(2)]
    evaluators = [evaluator, evaluator]
    if _has_cast(evaluator.spec):
        for sign in (1.0, -1.0):
            runs.append(inputs)
            evaluators.append(Evaluator(evaluator.spec, evaluator.shape, cast_nudge=1.0 + sign * CONDITIONING_ULPS * 2.0 ** -52))
    for ev, moved_inputs in zip(evaluators, runs):
        moved = ev.run(moved_inputs)
        for name, ref in env.items():
            if name in moved and np.issubdtype(np.asarray(ref).dtype, np.floating):
                diff = np.abs(np.asarray(moved[name], np.float64) - np.asarray(ref, np.float64))
                diff = np.where(np.isfinite(diff), diff, 0.0)
                out[name] = np.maximum(out[name], diff) if name in out else diff
    return out


def _has_cast(spec: Spec) -> bool:
    exprs = [p.expr for p in spec.params if p.expr is not None] + [s.expr for s in spec.steps]
    return any(isinstance(node, ex.Cast) for e in exprs for node in ex.walk(e))
