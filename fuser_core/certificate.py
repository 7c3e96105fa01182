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
import scipy.special
import sympy as sp

from fuser_core import expr as ex
from fuser_core.derive import WEIGHTED_MEAN, Derivation, ReductionForm
from fuser_core.realisation import (
    COUNT_OLD, Combine, Realisation, new, old, part_acc, part_anchor, part_count, settled,
    state_symbols,
)
from fuser_core.errors import DerivationLimitError
from fuser_core.masks import may_exclude_every
from fuser_core.reference import Evaluator, cast_to, random_inputs, random_scalars
from fuser_core.spec import Spec, load_spec, raw_param
from fuser_core.symbolic import CAST_FUNCTIONS, COMPARE_OPS

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
    return shape


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


class _Broadcasting:
    """``logical_or``/``logical_and`` for lambdify, which prints ``Or(a, b)`` as
    ``logical_or.reduce((a, b))``: NumPy cannot stack arrays of different (broadcastable)
    shapes, so reduce pairwise instead."""

    def __init__(self, ufunc: np.ufunc):
        self.ufunc = ufunc

    def __call__(self, *args: Any) -> Any:
        return self.ufunc(*args)

    def reduce(self, arrays: Any) -> Any:
        out = arrays[0]
        for a in arrays[1:]:
            out = self.ufunc(out, a)
        return out


def _rescale(acc: Any, c: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.Rescale` in float64: acc * c with a non-finite correction taken
    as 0, and an accumulator kept where that product is NaN (an infinite one times 0), as the
    kernels' ``rescale``."""
    acc, c = np.asarray(acc, dtype=np.float64), np.asarray(c, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        t = acc * np.where(np.isfinite(c), c, 0.0)
    return np.where(np.isnan(t), acc, t)


def _shift_term(acc: Any, c: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.ShiftTerm` in float64: acc * c, 0 where c is 0 or NaN (an anchor
    that stayed at one infinity), where acc is 0 (nothing seen), or where c is finite and acc infinite,
    as the kernels' ``shift_term``."""
    acc, c = np.asarray(acc, dtype=np.float64), np.asarray(c, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where((c == 0.0) | np.isnan(c) | (acc == 0.0) | (np.isfinite(c) & np.isinf(acc)), 0.0, acc * c)


_NUMPY_COMPARE = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                  "!=": np.not_equal}


def _nan_to_zero(d: Any) -> np.ndarray:
    """:data:`fuser_core.realisation.NanToZero` in float64, as the kernels' ``nan_to_zero``."""
    d = np.asarray(d, dtype=np.float64)
    return np.where(np.isnan(d), 0.0, d)


def _inf_compare(k: Any, lhs: Any, rhs: Any) -> np.ndarray:
    """:class:`fuser_core.symbolic.InfCompare` in float64 (IEEE: NaN compares unequal)."""
    return _NUMPY_COMPARE[COMPARE_OPS[int(k)]](lhs, rhs)


def _nan_of(v: Any) -> np.ndarray:
    """0 for a finite v, NaN for an infinite or NaN v, as the kernels' ``nan_of`` (v - v)."""
    v = np.asarray(v, np.float64)
    with np.errstate(invalid="ignore"):
        return v - v


def _unordered(a: Any, b: Any) -> np.ndarray:
    """:class:`fuser_core.symbolic.Unordered` in float64: a or b is NaN."""
    return np.isnan(np.asarray(a, dtype=np.float64)) | np.isnan(np.asarray(b, dtype=np.float64))


_NUMPY_FUNCS = {"InfCompare": _inf_compare, "Unordered": _unordered, "nan_of": _nan_of, "round": np.rint, "rescale": _rescale, "shift_term": _shift_term,
                "nan_to_zero": _nan_to_zero,
                "erf": scipy.special.erf,
                "logical_or": _Broadcasting(np.logical_or), "logical_and": _Broadcasting(np.logical_and)}


class _Compiled:
    """sympy expressions turned into NumPy functions, once per derivation and mode."""

    def __init__(self, keep_casts: bool):
        self.cache: dict[sp.Expr, tuple[Any, list[sp.Symbol]]] = {}
        funcs: dict[str, Any] = dict(_NUMPY_FUNCS)
        for dtype, fn in CAST_FUNCTIONS.items():
            funcs[str(fn)] = (lambda x, dt=dtype: cast_to(np.asarray(x, dtype=np.float64), dt)) if keep_casts else (lambda x: x)
        self.modules = [funcs, "numpy"]

    def __call__(self, e: sp.Expr, values: dict[sp.Symbol, Any]) -> np.ndarray:
        try:
            hit = self.cache.get(e)
            if hit is None:
                syms = sorted(e.free_symbols, key=str)
                literal, big = _float_literals(e)
                hit = (sp.lambdify(syms + list(big), literal, modules=self.modules), syms, list(big.values()))
                self.cache[e] = hit
            fn, syms, big_values = hit
            return np.asarray(fn(*[values[s] for s in syms], *big_values), dtype=np.float64)
        except RecursionError:  # lambdify rebuilds a where() whose Piecewise.eval recurses without end
            raise DerivationLimitError(
                "the certificate cannot evaluate this derivation: sympy recursed without end rebuilding a where()"
            ) from None
        except (TypeError, ValueError) as err:  # sympy rebuilding max(zoo, ..), numpy.select of a scalar condition
            raise DerivationLimitError(
                f"the certificate cannot evaluate {sp.sstr(e)[:80]}: {type(err).__name__}: {str(err)[:120]}"
            ) from None


EXACT_INTEGER_LIMIT = 2**53  # float64 holds every integer up to here; beyond, an integer literal is a float


def _float_literals(e: sp.Expr) -> tuple[sp.Expr, dict[sp.Dummy, np.float64]]:
    """``e`` with integers beyond float64's exact range as arguments holding their float64 value:
    a spec's ``-1e30`` is an exact sympy Integer, which lambdify prints as a Python int that
    NumPy stores as an object array (where() then cannot select it into float64). They become
    symbols, not sympy Floats, which sympy would fold (``exp(-1e30)`` to a 434-million-digit
    exponent). The reference computes with the float."""
    big = {i: sp.Dummy(f"big{k}") for k, i in enumerate(e.atoms(sp.Integer)) if abs(int(i)) > EXACT_INTEGER_LIMIT}
    if not big:
        return e, {}
    return e.xreplace(big), {d: np.float64(float(i)) for i, d in big.items()}


_COMPILED: dict[tuple[int, bool], _Compiled] = {}


def _compiled(derivation: Derivation, keep_casts: bool) -> _Compiled:
    key = (id(derivation), keep_casts)
    if key not in _COMPILED:
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        _COMPILED[key] = _Compiled(keep_casts)
    return _COMPILED[key]


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
    compiled = _compiled(derivation, keep_casts)
    errors: dict[str, float] = {}
    movement: dict[str, np.ndarray] | None = None
    for group in derivation.groups:
        forms = [derivation.forms[m] for m in group.members if derivation.forms[m].fused]
        if not forms:
            continue
        loop = _AxisLoop(derivation, evaluator, env, group.axis, forms, compiled, _input_scale(inputs))
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


def _state(form: ReductionForm) -> tuple[str, str]:
    """A form's key in a loop state: a tuple, so that no step name ("count", "run") meets the state's own keys."""
    return ("form", form.name)


def _real(form: ReductionForm) -> Realisation:
    assert form.realisation is not None, f"{form.name} is fused but has no realisation"
    return form.realisation


def _safe(v: np.ndarray) -> np.ndarray:
    """A running max/min that is still infinite (nothing finite seen) anchors at 0."""
    return np.where(np.isfinite(v), v, 0.0)


class _AxisLoop:
    """Runs the derived realisation of one axis's fused reductions over tiles and splits."""

    def __init__(self, derivation, evaluator: Evaluator, env, axis: str, forms: list[ReductionForm], compiled,
                 input_scale: float = 0.0):
        self.d = derivation
        self.input_scale = input_scale
        self.ev = evaluator
        self.env = env
        self.axis = axis
        self.pos = evaluator.spec.dims.index(axis)
        self.n = evaluator.shape[axis]
        self.forms = forms
        self.compiled = compiled
        self.sym = derivation.symbols

    # -- values of leaves
    def tile(self, arr: np.ndarray, lo: int, hi: int) -> np.ndarray:
        if arr.ndim <= self.pos or arr.shape[self.pos] == 1:
            return arr
        idx = [slice(None)] * arr.ndim
        idx[self.pos] = slice(lo, hi)
        return arr[tuple(idx)]

    def leaf(self, s: sp.Symbol, lo: int, hi: int) -> np.ndarray | float:
        name = s.name
        if name.startswith("size("):  # a NumPy float: overflow gives inf, as in the reference, not OverflowError
            return np.float64(self.ev.shape[name[5:-1]])
        if name.startswith("index("):
            dim = name[6:-1]
            arr = self.ev.aligned(np.arange(self.ev.shape[dim], dtype=np.float64), (dim,))
            return self.tile(arr, lo, hi)
        return self.tile(np.asarray(self.env[name], dtype=np.float64), lo, hi)

    def evaluate(self, e: sp.Expr, known: dict[sp.Symbol, Any], lo: int = 0, hi: int = 0) -> np.ndarray:
        values = dict(known)
        for s in e.free_symbols:
            if s not in values:
                values[s] = self.leaf(s, lo, hi)
        return self.compiled(e, values)

    def full_shape(self, form: ReductionForm, length: int) -> tuple[int, ...]:
        dims = set(self.ev.spec.expr_dims(form.step.expr))
        return tuple(
            (length if d == self.axis else self.ev.shape[d]) if d in dims else 1 for d in self.ev.spec.dims
        )

    # -- reductions on one tile
    def reduce(self, form: ReductionForm, op: str, values: np.ndarray, lo: int, hi: int):
        """One tile of ``values`` folded with ``op`` (a selection: its candidates, (values, indices))."""
        values = np.broadcast_to(values, self.full_shape(form, hi - lo))
        if op == "sum":
            return values.sum(axis=self.pos, keepdims=True)
        if op == "max":
            return values.max(axis=self.pos, keepdims=True)
        if op == "min":
            return values.min(axis=self.pos, keepdims=True)
        positions = [1] * values.ndim
        positions[self.pos] = hi - lo
        idx = np.broadcast_to(np.arange(lo, hi, dtype=np.int64).reshape(positions), values.shape)
        return self.select(op, values, idx, form.step.k or 1)

    def select(self, op: str, values: np.ndarray, idx: np.ndarray, k: int):
        """Top (or bottom) k candidates along the axis, ties to the lower index. NaN follows the
        reference (NumPy): argmax/argmin take the first NaN as the extreme, topk sorts NaN last."""
        descending = op in ("topk", "argmax")
        keys: tuple[np.ndarray, ...] = (idx, -values if descending else values)
        if op in ("argmax", "argmin"):
            keys += (~np.isnan(values),)  # the last key sorts first: False (NaN) before any number
        order = np.lexsort(keys, axis=self.pos)[(slice(None),) * self.pos + (slice(0, k),)]
        return (np.take_along_axis(values, order, self.pos), np.take_along_axis(idx, order, self.pos))

    def combine(self, form: ReductionForm, op: str, a, b):
        """``op`` of two states of one accumulator (a selection's are (values, indices))."""
        if op == "sum":
            return a + b
        if op == "max":
            return np.maximum(a, b)
        if op == "min":
            return np.minimum(a, b)
        va, ia = a
        vb, ib = b
        shape = np.broadcast_shapes(va.shape[: self.pos] + va.shape[self.pos + 1 :], vb.shape[: self.pos] + vb.shape[self.pos + 1 :])

        def widen(v: np.ndarray) -> np.ndarray:
            target = shape[: self.pos] + (v.shape[self.pos],) + shape[self.pos :]
            return np.broadcast_to(v, target)

        values = np.concatenate([widen(va), widen(vb)], axis=self.pos)
        idx = np.concatenate([widen(ia), widen(ib)], axis=self.pos)
        return self.select(op, values, idx, form.step.k or 1)

    # -- states: {"accs": [state per accumulator], "anchor": {dep: value}}, a selection's state (values, indices)
    def value(self, form: ReductionForm, st: dict[str, Any]) -> Any:
        """The running (or, at the end, final) value of a reduction in a state: the realisation's value."""
        real = _real(form)
        accs = st[_state(form)]["accs"]
        known = self.dep_values(form, st)
        if real.selection:
            vals, idx = accs[0]
            return (self.evaluate(real.value, known | {real.symbols[0]: vals}), idx)
        return self.evaluate(real.value, known | dict(zip(real.symbols, accs)))

    def dep_values(self, form: ReductionForm, st: dict[str, Any]) -> dict[sp.Symbol, Any]:
        return {self.sym.symbols[n]: st["run"][n] for n in form.deps}

    def anchors(self, form: ReductionForm, st: dict[str, Any], count: int) -> dict[str, np.ndarray]:
        out = {}
        for name in form.deps:
            if name not in form.anchors:
                continue
            run = st["run"][name]
            if form.anchors[name] in ("running", WEIGHTED_MEAN):
                out[name] = _safe(run)
            else:  # running estimate of a sum: partial * size / count
                out[name] = run * self.n / max(count, 1)
        return out

    def side_values(self, form: ReductionForm, state: dict[str, Any], count: int, side: str | None) -> dict[sp.Symbol, Any]:
        """Values of one state's accumulators, anchors and count under the symbols of the realisation's
        moved expressions (``side`` None: acc[j], dep[old], count[old]; "a"/"b": a part of a merge)."""
        real = _real(form)
        values: dict[sp.Symbol, Any] = {}
        for j, acc in enumerate(state["accs"]):
            sym = real.symbols[j] if side is None else part_acc(j, side)
            values[sym] = acc[0] if real.selection else acc
        for name, anchor in state["anchor"].items():
            s = self.sym.symbols[name]
            values[old(s) if side is None else part_anchor(s, side)] = anchor
        values[COUNT_OLD if side is None else part_count(side)] = np.float64(count)
        return values

    def moved_state(self, real: Realisation, e: sp.Expr, values: dict[sp.Symbol, Any], acc: Any) -> Any:
        """A moved accumulator (``e``) evaluated; a selection keeps its indices."""
        moved = self.evaluate(e, values)
        return (moved, acc[1]) if real.selection else moved

    def apply(self, form: ReductionForm, rules: tuple[Combine, ...], left: list, right: list) -> list:
        return [self.combine(form, rule.op, a, b) for rule, a, b in zip(rules, left, right)]

    def step_tile(self, st: dict[str, Any] | None, lo: int, hi: int) -> dict[str, Any]:
        """Fold tile [lo, hi) into state ``st`` (None: the part's first tile, which starts from each
        accumulator's identity, op(identity, x) = x) with the realisation's step rule."""
        count_old = 0 if st is None else st["count"]
        out: dict[str, Any] = {"count": count_old + hi - lo, "run": {}}
        for form in self.forms:
            real = _real(form)
            known = dict(self.dep_values(form, out))
            a_new = self.anchors(form, out, out["count"])
            at_new = known | {self.sym.symbols[n]: v for n, v in a_new.items()}
            rules = real.step()
            tiles = [self.reduce(form, rule.op, self.evaluate(rule.right, at_new, lo, hi), lo, hi) for rule in rules]
            if st is None:
                accs = tiles
            else:
                prev = st[_state(form)]
                values = self.side_values(form, prev, count_old, None) | {new(self.sym.symbols[n]): v for n, v in a_new.items()}
                moved = [self.moved_state(real, rule.left, values, acc) for rule, acc in zip(rules, prev["accs"])]
                accs = self.apply(form, rules, moved, tiles)
            out[_state(form)] = {"accs": accs, "anchor": a_new}
            out["run"][form.name] = self.value(form, out)
        return out

    def merge(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """Two partial states merged with the realisation's merge rule."""
        out: dict[str, Any] = {"count": a["count"] + b["count"], "run": {}}
        for form in self.forms:
            real = _real(form)
            a_new = self.anchors(form, out, out["count"])
            values = {new(self.sym.symbols[n]): v for n, v in a_new.items()}
            for side, state in (("a", a), ("b", b)):
                values |= self.side_values(form, state[_state(form)], state["count"], side)
            rules = real.merge()
            left = [self.moved_state(real, r.left, values, acc) for r, acc in zip(rules, a[_state(form)]["accs"])]
            right = [self.moved_state(real, r.right, values, acc) for r, acc in zip(rules, b[_state(form)]["accs"])]
            out[_state(form)] = {"accs": self.apply(form, rules, left, right), "anchor": a_new}
            out["run"][form.name] = self.value(form, out)
        return out

    def run_split(self, rng: np.random.Generator) -> dict[str, Any]:
        n_parts = int(rng.integers(1, min(4, self.n) + 1))
        cuts = sorted(rng.choice(np.arange(1, self.n), size=n_parts - 1, replace=False).tolist()) if n_parts > 1 else []
        bounds = [0, *cuts, self.n]
        states = []
        for lo, hi in zip(bounds, bounds[1:]):
            st = None
            start = lo
            while start < hi:
                stop = int(rng.integers(start + 1, hi + 1))
                st = self.step_tile(st, start, stop)
                start = stop
            states.append(st)
        while len(states) > 1:  # merge random pairs: the merge must not care about order
            i, j = sorted(rng.choice(len(states), size=2, replace=False).tolist())
            b = states.pop(j)
            a = states.pop(i)
            states.append(self.merge(a, b) if rng.random() < 0.5 else self.merge(b, a))
        return self.settle(states[0])

    def settle(self, st: dict[str, Any]) -> dict[str, Any]:
        """The kernels' last move (fuser_core.codegen.structure, ``_Walk.settle``): a scaled reduction's
        accumulators, held at a max/min's safe anchor (0 while it is infinite), moved to the final
        max with a plain product. 1 where the max is finite; where it is not, the value the spec's
        own formula gives (exp(inf - inf): NaN), as the multi-pass reference has it."""
        for form in self.forms:
            real = _real(form)
            running = [n for n, how in form.anchors.items() if how == "running"]
            if not running or real.selection or not form.settles_at({self.sym.symbols[n] for n in running}):
                continue
            state = st[_state(form)]
            if real.moves_jointly:  # a Taylor form: its shift from every anchor to the final values
                values = self.side_values(form, state, st["count"], None)
                values |= {new(self.sym.symbols[n]): st["run"][n] for n in form.anchors}
                state["accs"] = [self.evaluate(a.moved, values) for a in real.accumulators]
                st["run"][form.name] = self.value(form, st)
                continue
            values = {old(self.sym.symbols[n]): state["anchor"][n] for n in running}
            values |= {new(self.sym.symbols[n]): st["run"][n] for n in running}
            state["accs"] = [
                acc if a.correction is None or a.correction == 1
                or not a.correction.free_symbols & state_symbols(real.dep_symbols) <= set(values)
                else self.evaluate(settled(a, real.dep_symbols), values | {a.symbol: acc})
                for acc, a in zip(state["accs"], real.accumulators)
            ]
            st["run"][form.name] = self.value(form, st)
        return st

    # -- comparison with the reference
    def given_deps(self, form: ReductionForm, final: dict[str, Any]) -> dict[str, np.ndarray]:
        """The multi-pass truth for ``form`` given its dependencies' fused final values.

        Each dependency is compared with its own reference; a dependent reduction is compared
        with the multi-pass evaluation at the dependencies the loop really ended with, so that
        float64 rounding of a dependency that cancels (a mean of exactly balanced values) is
        not mistaken for an error of the dependent's algebra.
        """
        if not form.deps:
            return self.env
        env = dict(self.env)
        overridden = False
        with np.errstate(all="ignore"):
            for step in self.ev.spec.steps:
                if step.name == form.name:
                    env.update(self.ev.reduce(step, env))
                    break
                if step.name in form.deps:
                    env[step.name] = np.asarray(final["run"][step.name], dtype=np.float64)
                    overridden = True
                elif overridden and step.is_reduction:
                    env.update(self.ev.reduce(step, env))
                elif overridden:
                    value = self.ev.eval_expr(step.expr, env)
                    env[step.name] = np.broadcast_to(value, self.ev.aligned_shape(step.dims)).astype(np.float64)
        return env

    def compare(self, form: ReductionForm, final: dict[str, Any], allowance: np.ndarray | None = None) -> float:
        """The relative error of ``form``'s fused final value; ``allowance``: an absolute error
        forgiven elementwise (the reference's conditioning, see CONDITIONING_K)."""
        got = final["run"][form.name]
        step = form.step
        env = self.given_deps(form, final)
        if isinstance(got, tuple):
            vals, idx = got
            if step.reduce == "topk":  # the k slots lie on the axis here, on `as` in the reference
                as_pos = self.ev.spec.dims.index(step.as_dim)
                ref_v, ref_i = env[f"{step.name}.values"], env[f"{step.name}.indices"]
                return max(_rel_err(np.swapaxes(vals, self.pos, as_pos), ref_v, input_scale=self.input_scale),
                           self.index_err(form, idx, np.swapaxes(ref_i, self.pos, as_pos), env))
            return self.index_err(form, idx, env[form.name], env)
        got = self.where_fallback(form, got, env)
        magnitude = None
        if step.reduce == "sum":  # sum |F|: the scale of float64's own rounding in a sum that cancels
            with np.errstate(all="ignore"):
                terms = np.abs(np.broadcast_to(self.ev.eval_expr(step.expr, env), self.full_shape(form, self.n)))
                magnitude = terms.sum(axis=self.pos, keepdims=True)
        return _rel_err(got, env[step.name], magnitude, allowance, self.input_scale)

    def where_fallback(self, form: ReductionForm, got: np.ndarray, env: dict[str, np.ndarray]) -> np.ndarray:
        """``got`` with the reference's value on the rows the kernels compute with a fallback pass, not with the
        fused form: where a where() on indices may drop every element (fuser_core.masks) and a dependency ended
        +-inf or NaN there (an empty row's max is -inf; its sum 0, where the settle gives 0 * inf)."""
        real = form.realisation
        if real is None or not form.deps or not any(
                may_exclude_every(a.contribution, a.op, form.step.over) for a in real.accumulators):
            return got
        ref = np.asarray(env[form.step.name], np.float64)
        redone = np.zeros(ref.shape, bool)
        with np.errstate(all="ignore"):
            for dep in form.deps:
                redone |= np.broadcast_to(~np.isfinite(np.asarray(env[dep], np.float64)), ref.shape)
        return np.where(redone, ref, np.broadcast_to(np.asarray(got, np.float64), ref.shape))

    def index_err(self, form: ReductionForm, idx: np.ndarray, ref_idx: np.ndarray, env: dict[str, np.ndarray]) -> float:
        """1.0 when an argmax/argmin/topk index (along the axis) differs from the reference's and
        the reduced values at the two positions differ. Tied values (:func:`_tied`) may come out of
        the rescaled running values in either order, at the k-th place of a topk too."""
        idx, ref_idx = np.broadcast_arrays(idx, ref_idx)
        wrong = idx != ref_idx
        if wrong.any():
            values = np.broadcast_to(self.ev.eval_expr(form.step.expr, env), self.full_shape(form, self.n))
            lanes = list(np.broadcast_shapes(idx.shape, values.shape[: self.pos] + (1,) + values.shape[self.pos + 1 :]))
            idx, ref_idx, wrong = (np.broadcast_to(a, tuple(lanes)) for a in (idx, ref_idx, wrong))
            lanes[self.pos] = self.n
            values = np.broadcast_to(values, tuple(lanes))
            at_got = np.take_along_axis(values, idx, self.pos)
            at_ref = np.take_along_axis(values, ref_idx, self.pos)
            wrong = wrong & ~(_tied(at_got, at_ref) | (np.isnan(at_got) & np.isnan(at_ref)))
        return 1.0 if wrong.any() else 0.0


CANCELLATION_FLOOR = 1e-4  # times sum |F|: below it a sum has cancelled, and is judged absolutely
# times the largest input: a result this much smaller than the values it was computed from is judged
# absolutely, at TOLERANCE * INPUT_FLOOR = 1e-14 of them (about 45 float64 ulps). An entropy of one
# value is 0 in real arithmetic and x/t - mx - log(den) ~ 1e-16 in float64, reference and fused
# form alike; judged relative to itself that rounding read as a failed certificate (1.0, or 2e284
# against an exact 0). A wrong form errs at the size of the values themselves: ~1e5 here.
INPUT_FLOOR = 1e-5
TIE_RTOL = 1e-12  # values equal in real arithmetic differ by a few float64 ulps once rescaled by corrections


def _tied(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Equal up to float64 rounding: exactly tied values (``round(a * 4)``, a constant branch)
    rescaled by running corrections, ``exp(v - m_old) * exp(m_old - m_new)`` against ``exp(v - m_new)``,
    may come out of a tile a few ulps apart, in either order."""
    with np.errstate(all="ignore"):
        return (a == b) | (np.abs(a - b) <= TIE_RTOL * np.maximum(np.abs(a), np.abs(b)))


def _rel_err(got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray | None = None,
             allowance: np.ndarray | None = None, input_scale: float = 0.0) -> float:
    """Elementwise relative error, floored at 1e-12 of the largest reference value, at
    INPUT_FLOOR * ``input_scale`` (the largest input) and, for a sum (``magnitude`` = sum of
    |terms|), at CANCELLATION_FLOOR * magnitude: a sum that cancels to almost nothing (sum of
    x - mean) carries float64 rounding of its terms, not of itself. The check stays strict
    there: an error must be below 1e-13 of the terms' magnitude."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    try:
        if np.broadcast_shapes(got.shape, ref.shape) != ref.shape:
            return math.inf  # e.g. empty: a derived rule read streamed values outside any tile
    except ValueError:
        return math.inf
    got, ref = np.broadcast_arrays(got, ref)
    # nan against nan or inf: both sides overflowed float64 (inf - inf, 0 * inf), in another order
    same = (got == ref) | (np.isnan(got) & ~np.isfinite(ref)) | (~np.isfinite(got) & np.isnan(ref))
    finite = np.isfinite(ref)
    scale = float(np.max(np.abs(ref[finite]), initial=0.0))
    floor = max(1e-12 * scale, INPUT_FLOOR * input_scale, 1e-300)
    if magnitude is not None:
        magnitude = np.asarray(magnitude, dtype=np.float64)
        floor = np.maximum(floor, CANCELLATION_FLOOR * np.where(np.isfinite(magnitude), magnitude, 0.0))
    with np.errstate(all="ignore"):
        diff = np.abs(got - ref)
        if allowance is not None:
            diff = np.maximum(diff - np.broadcast_to(allowance, diff.shape), 0.0)
        err = diff / np.maximum(np.abs(ref), floor)
    err = np.where(same, 0.0, err)
    err = np.where(np.isnan(err), math.inf, err)
    return float(np.max(err, initial=0.0))
