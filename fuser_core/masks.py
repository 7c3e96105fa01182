"""Masked elements: what a reduction never sees, in the reference and in every kernel alike.

A reduction over ``where(index(n) <= index(m), s, -inf)`` (a causal mask), or over a product with
such a where() folded into it (``exp(where(C, s, -inf) - mx) * v``: 0 outside C), adds its
operator's identity at every masked element. The streamed kernels do not read the masked tiles at
all (:mod:`fuser_core.codegen.bounds`, as FlashAttention does not read masked keys), so a NaN or an
infinity there never reaches the result; the formula read literally would give ``0 * NaN = NaN``.
One meaning for every strategy: **an element whose contribution a where() on indices and sizes
masks to the identity is not part of the reduction.** The reference (:mod:`fuser_core.reference`)
drops it, and every kernel's fold takes the identity there (:func:`excluded`), whether or not its
loop skips the tile.

Only conditions on indices, sizes and index inputs count (what a loop can skip: a padding mask
``index(n) >= kv_start`` is one; it drops a KV cache's pad slots, NaN garbage included); a where() on values
(``where(x > 0, x, 0)``) keeps its IEEE meaning. A tensor-core fold (``tl.dot(p, v)``) cannot drop a
product inside a tile: there a NaN of ``v`` at a key masked for one query and not for another in
the same tile still reaches the masked query (FlashAttention's behaviour too; docs/SPEC.md).

Example:
    >>> import sympy as sp
    >>> m, n = sp.Symbol("index(m)", integer=True), sp.Symbol("index(n)", integer=True)
    >>> s, v = sp.Symbol("s", real=True), sp.Symbol("v", real=True)
    >>> masked_condition(sp.exp(sp.Piecewise((s, n <= m), (-sp.oo, True))) * v, "sum")
    index(m) >= index(n)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import sympy as sp

from fuser_core.realisation import identity
from fuser_core.reduce_ops import excludes_masked
from fuser_core.dim_symbols import dim_symbol, is_dim_symbol, symbol_kind



def masked_condition(e: sp.Expr, op: str) -> sp.Expr | None:
    """C when ``e`` is ``where(C, X, identity of op)``, after folding the where outwards
    (``exp(where(C, s, -inf) - mx)`` is ``where(C, exp(s - mx), 0)``): outside C the fold adds nothing."""
    if not isinstance(e, sp.Piecewise) and e.has(sp.Piecewise):
        e = sp.piecewise_fold(e)
    if isinstance(e, sp.Piecewise) and len(e.args) == 2 and e.args[1][1] == sp.true:
        fill = e.args[1][0]
        if fill == identity(op) or (fill.is_number and _value(fill) == _value(identity(op))):
            return e.args[0][1]
    return None


def _value(e: sp.Expr) -> float | None:
    """A constant's float value (sp.Float cannot take sigmoid(-1) = 1/(1 + E): fuzz seed 50)."""
    try:
        return float(e)
    except (TypeError, ValueError):  # complex, or not a number after all
        return None


def on_indices(cond: sp.Basic) -> bool:
    """Does ``cond`` read only indices, sizes and index inputs (no value)?"""
    from fuser_core.symbolic import IndexData

    return bool(cond.free_symbols) and all(isinstance(s, IndexData) or is_dim_symbol(s, "index", "size")
                                           for s in cond.free_symbols)


def exclusion(e: sp.Expr, op: str) -> sp.Expr | None:
    """The condition on indices and sizes outside which a fold of ``e`` with ``op`` drops the element
    (module docstring), or None."""
    if not excludes_masked(op):  # selections keep masked entries' indices (a top-k of a short row)
        return None
    cond = masked_condition(e, op)
    return cond if cond is not None and on_indices(cond) else None


def excluded(e: sp.Expr, op: str) -> sp.Expr:
    """``e`` as a kernel folds it: ``where(C, e, identity)`` where :func:`exclusion` finds C."""
    cond = exclusion(e, op)
    if cond is None:
        return e
    return sp.Piecewise((e, cond), (identity(op), True))


def may_exclude_every(e: sp.Expr, op: str, axis: str, constraints: tuple[tuple[str, str, str], ...] = ()) -> bool:
    """Can a fold of ``e`` over ``axis`` drop every element of a row (:func:`exclusion`'s condition false for
    every index of the axis)? False when the condition provably holds at index 0, at the last index or
    at the index of another dim it compares with (causal attention's ``index(n) <= index(m)`` keeps key 0
    and key m); True when unsure (``index(d) > index(t)`` drops every d once t >= size(d) - 1).
    ``constraints``: the spec's (``m <= n``: a bottom-right causal mask ``index(n) <= index(m) + size(n) -
    size(m)`` keeps key 0 then)."""
    cond = exclusion(e, op)
    if cond is None:
        return False
    cond = cond.xreplace(sizes_under(constraints))
    here = next((s for s in cond.free_symbols if symbol_kind(s) == ("index", axis)), None)
    if here is None:
        return True  # a condition on other dims only: it may drop the whole row
    size = dim_symbol("size", axis)
    others = [s for s in cond.free_symbols if is_dim_symbol(s, "index") and s is not here]
    for at in [sp.Integer(0), size - 1, *others]:
        if cond.xreplace({here: at}) is sp.true:  # not bool(): an undecided And is a truthy Python object
            return False
    return True


def sizes_under(constraints: tuple[tuple[str, str, str], ...]) -> dict[sp.Symbol, sp.Expr]:
    """The larger size of each constraint written as the smaller plus a nonnegative gap (``m <= n``:
    size(n) = size(m) + gap), so that sympy decides what the constraint implies."""
    out: dict[sp.Symbol, sp.Expr] = {}
    for a, rel, b in constraints:
        small, large = (dim_symbol("size", d) for d in (a, b))
        gap = sp.Symbol(f"gap({a},{b})", integer=True, nonnegative=True)
        out[large] = small + {"<=": gap, "<": gap + 1, "==": sp.Integer(0)}[rel]
    return out


def truth(cond: sp.Basic, values: dict) -> np.ndarray:
    """``cond`` (a condition on indices and sizes) evaluated with numpy arrays for its symbols (``values``), the
    arrays broadcasting together (sympy's own printer folds ``and`` with ``logical_and.reduce`` over a tuple,
    which refuses arrays of different shapes)."""
    if cond is sp.true or cond is sp.false:
        return np.asarray(cond is sp.true)
    if isinstance(cond, (sp.And, sp.Or)):
        parts = [truth(c, values) for c in cond.args]
        out = parts[0]
        for p in parts[1:]:
            out = (out & p) if isinstance(cond, sp.And) else (out | p)
        return out
    if isinstance(cond, sp.Not):
        return ~truth(cond.args[0], values)
    if isinstance(cond, sp.Rel):
        lhs, rhs = (_number(side, values) for side in (cond.lhs, cond.rhs))
        return np.asarray(_RELATIONS[cond.rel_op](lhs, rhs))
    from fuser_core.symbolic import InfCompare, Unordered

    if isinstance(cond, Unordered):  # `not a <= b` is `a > b or unordered(a, b)`: never, for indices and sizes
        a, b = (_number(side, values) for side in cond.args)
        return np.isnan(a) | np.isnan(b)
    if isinstance(cond, InfCompare):
        lhs, rhs = (_number(side, values) for side in cond.args[1:])
        return np.asarray(_RELATIONS[cond.op](lhs, rhs))
    raise ValueError(f"not a condition on indices and sizes: {cond}")


def _number(e: sp.Expr, values: dict) -> np.ndarray:
    syms = sorted(e.free_symbols, key=str)
    return np.asarray(sp.lambdify(syms, e, "numpy")(*(values[s] for s in syms)), np.float64)


_RELATIONS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
              "!=": np.not_equal}


@lru_cache(maxsize=512)
def step_exclusions(spec) -> dict[str, sp.Expr]:  # noqa: ANN001 (a Spec; hashable, frozen)
    """Each reduction step's :func:`exclusion` condition, for the reference (by step name)."""
    from fuser_core.symbolic import SymbolicSpec

    conv = SymbolicSpec(spec)
    out = {}
    for step in spec.steps:
        if step.is_reduction and excludes_masked(step.reduce):
            cond = exclusion(conv.integrand(step), step.reduce)
            if cond is not None:
                out[step.name] = cond
    return out


__all__ = ["excluded", "exclusion", "masked_condition", "may_exclude_every", "on_indices",
           "step_exclusions", "truth"]
