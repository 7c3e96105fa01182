"""Reductions that are one term: ``sum over axis of where(index(axis) == at, X, 0)``.

Such a sum is X at index ``at`` (0 where ``at`` lies outside the axis), so a kernel loads X there
instead of folding the axis (Liger-Kernel's cross-entropy loads the target's logit). ``at`` is
either known before the loop (index inputs and other dims' indices: the target of a
cross-entropy) or a selection's final position along the same axis (a top-k's ``.indices``, an
argmax): the value at the selected positions of another expression, gathered after the
selection's loop. DeepSeek-V3's router selects its experts by biased scores and weights them by
the unbiased ones, ``where(index(x) == sel.indices, sigmoid(logits), 0)`` summed over ``x``: the
selection carries those values with it at the cost of k loads a row, where a second pass over the
axis would read it again and compare every element with all k indices.
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from fuser_core.dim_symbols import is_dim_symbol, symbol_kind
from fuser_core.reduce_ops import has_slots, returns_indices
from fuser_core.spec import Input, Step
from fuser_core.symbolic import SymbolicSpec


def gather_form(conv: SymbolicSpec, step: Step, axis: str) -> tuple[Any, Any] | None:
    """(X, at) when ``step`` is ``sum over axis of where(index(axis) == at, X, 0)`` with ``at`` an
    integer expression of indices and index inputs that does not vary along the axis, or the final
    position a selection over the same axis chose (:func:`selection_at`); X made of inputs, params
    and sizes only (no other step: it is evaluated at one index, alone); and no other reduction over
    the axis reads the step (it is not in the loop's states). Else None."""
    spec = conv.spec
    if step.reduce != "sum" or step.over != axis:
        return None
    e = conv.integrand(step)
    if not (isinstance(e, sp.Piecewise) and len(e.args) == 2 and e.args[1] == (0, True)):
        return None
    x, cond = e.args[0]
    if not isinstance(cond, sp.Eq):
        return None
    index = next((s for s in cond.free_symbols if symbol_kind(s) == ("index", axis)), None)
    if index is None:
        return None
    solved = sp.solve(cond, index)
    if len(solved) != 1:
        return None
    at = solved[0]
    selected = selection_at(conv, at, axis)
    if selected is None:
        for sym in at.free_symbols:  # an index input or an index of another dim: integers all
            inp = spec.lookup(sym.name)
            if is_dim_symbol(sym, "index"):
                if symbol_kind(sym) == ("index", axis):
                    return None
                continue
            if not (inp is not None and getattr(inp, "is_index", False) and axis not in inp.dims):
                return None
        if not all(c.is_Integer for c in sp.Add.make_args(at) for c in ([c] if c.is_number else [])):
            return None
    for sym in x.free_symbols:
        if is_dim_symbol(sym, "size", "index"):
            continue
        if not isinstance(spec.lookup(sym.name), Input):
            return None  # a step's value (or a param folded later): not a plain load at one index
    readers = [s for s in spec.steps if s.is_reduction and s.over == axis and s.name != step.name
               and any(sym.name == step.name for sym in conv.integrand(s).free_symbols)]
    return None if readers else (x, at)


def selection_at(conv: SymbolicSpec, at: sp.Expr, axis: str) -> Step | None:
    """The selection over ``axis`` whose final positions ``at`` is, exactly (a top-k's
    ``.indices``, an argmax or argmin), else None."""
    if not isinstance(at, sp.Symbol):
        return None
    step = conv.leaf_step.get(at)
    if step is None or step.over != axis:
        return None
    if returns_indices(step.reduce) or (has_slots(step.reduce) and at.name.endswith(".indices")):
        return step
    return None
