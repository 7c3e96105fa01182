"""A certificate's axis loop: the derived realisation of one axis's fused reductions run over tiles
and split chunks in float64, and judged against the step-by-step reference (relative errors with
cancellation and input-size floors, ties of selections).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import sympy as sp

from fuser_core.derive import WEIGHTED_MEAN, ReductionForm
from fuser_core.dim_symbols import symbol_kind
from fuser_core.masks import may_exclude_every
from fuser_core.realisation import (
    COUNT_OLD,
    Combine,
    Realisation,
    new,
    old,
    part_acc,
    part_anchor,
    part_count,
    settled,
    state_symbols,
)
from fuser_core.reduce_ops import is_negated, returns_indices
from fuser_core.reference import Evaluator


def _state(form: ReductionForm) -> tuple[str, str]:
    """A form's key in a loop state: a tuple, so that no step name ("count", "run") meets the state's own keys."""
    return ("form", form.name)


def _real(form: ReductionForm) -> Realisation:
    assert form.realisation is not None, f"{form.name} is fused but has no realisation"
    return form.realisation


def _safe(v: np.ndarray) -> np.ndarray:
    """A running max/min that is still infinite (nothing finite seen) anchors at 0."""
    return np.where(np.isfinite(v), v, 0.0)


class AxisLoop:
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
        kind, dim = symbol_kind(s) or (None, "")
        if kind == "size":  # a NumPy float: overflow gives inf, as in the reference, not OverflowError
            return np.float64(self.ev.shape[dim])
        if kind == "index":
            arr = self.ev.aligned(np.arange(self.ev.shape[dim], dtype=np.float64), (dim,))
            return self.tile(arr, lo, hi)
        return self.tile(np.asarray(self.env[s.name], dtype=np.float64), lo, hi)

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
        descending = not is_negated(op)
        keys: tuple[np.ndarray, ...] = (idx, -values if descending else values)
        if returns_indices(op):
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
        """The kernels' last move (fuser_core.codegen.structure, ``Walk.settle``): a scaled reduction's
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
                return max(rel_err(np.swapaxes(vals, self.pos, as_pos), ref_v, input_scale=self.input_scale),
                           self.index_err(form, idx, np.swapaxes(ref_i, self.pos, as_pos), env))
            return self.index_err(form, idx, env[form.name], env)
        got = self.where_fallback(form, got, env)
        magnitude = None
        if step.reduce == "sum":  # sum |F|: the scale of float64's own rounding in a sum that cancels
            with np.errstate(all="ignore"):
                terms = np.abs(np.broadcast_to(self.ev.eval_expr(step.expr, env), self.full_shape(form, self.n)))
                magnitude = terms.sum(axis=self.pos, keepdims=True)
        return rel_err(got, env[step.name], magnitude, allowance, self.input_scale)

    def gathered_error(self, form: ReductionForm) -> float:
        """A gathered form's error (:mod:`fuser_core.derive.gathers`): X evaluated along the axis and
        taken at the positions the selection chose (the reference's), against the reference's sum
        of ``where(index(axis) == at, X, 0)``."""
        assert form.gather is not None, f"{form.name} is gathered but has no gather form"
        x, at = form.gather
        with np.errstate(all="ignore"):
            values = np.broadcast_to(self.evaluate(x, {}, 0, self.n), self.full_shape(form, self.n))
            at_values = np.asarray(self.evaluate(at, {}), dtype=np.float64)
            inside = (at_values >= 0) & (at_values < self.n)
            positions = np.where(inside, at_values, 0).astype(np.int64)
            shape = list(np.broadcast_shapes(values.shape[:self.pos] + (1,) + values.shape[self.pos + 1:], positions.shape))
            picked = np.take_along_axis(np.broadcast_to(values, shape[:self.pos] + [self.n] + shape[self.pos + 1:]),
                                        np.broadcast_to(positions, shape), axis=self.pos)
            got = np.where(inside, picked, 0.0)
        return rel_err(got, self.env[form.name], input_scale=self.input_scale)

    def where_fallback(self, form: ReductionForm, got: np.ndarray, env: dict[str, np.ndarray]) -> np.ndarray:
        """``got`` with the reference's value on the rows the kernels compute with a fallback pass, not with the
        fused form: where a where() on indices may drop every element (fuser_core.masks) and a dependency ended
        +-inf or NaN there (an empty row's max is -inf; its sum 0, where the settle gives 0 * inf)."""
        real = form.realisation
        if real is None or not form.deps or not any(
                may_exclude_every(a.contribution, a.op, form.step.over, self.ev.spec.constraints)
                for a in real.accumulators):
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


def rel_err(got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray | None = None,
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
