"""Loop bounds derived from masks: the key blocks a program never needs (issue 22).

Causal attention masks its scores with ``where(index(n) <= index(m), s, -inf)``. A program
holding rows ``m`` in ``[m0, m0 + BLOCK_m)`` sees no unmasked key beyond ``m0 + BLOCK_m - 1``:
every tile past it adds the identity to every reduction (``-inf`` to the max, ``0`` to the
sums), so the loop can stop there, as FlashAttention's and Triton's tutorial 06's do. The same
holds for a KV-cache mask aligned bottom-right (``index(n) <= index(m) + size(n) - size(m)``)
and for the lower edge of a sliding window (``index(n) >= index(m) - W``).

:func:`axis_window` finds, for the folds of a streamed pass, the condition under which each
contribution is not its fold's identity; when every fold has the same condition and that
condition is a conjunction of linear inequalities in ``index(axis)``, it returns the range of
the axis a program can see, as expressions in the program's first and last lane indices
(``first(m)``, ``last(m)``) and the sizes. The printer clamps the loop to it (the lower end
rounded down to a block boundary). Elements inside the range still go through the mask.

Skipping is exact only when a skipped tile changes no state: so never for a kernel that counts
the values it has seen (a running mean), nor for selections (argmax/top-k keep indices even
of masked entries).

Example:
    >>> import sympy as sp
    >>> m, n = sp.Symbol("index(m)", integer=True), sp.Symbol("index(n)", integer=True)
    >>> w = window_of(n, [m >= n])
    >>> w.hi, w.lo
    (last(m) + 1, None)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sympy as sp

from fuser_core.codegen.ops.bounds import ZERO, Bound, group, maximum, minimum, name, num, plus, product
from fuser_core.dim_symbols import dim_symbol, is_dim_symbol, symbol_kind
from fuser_core.masks import masked_condition

_RELATIONS = (sp.LessThan, sp.StrictLessThan, sp.GreaterThan, sp.StrictGreaterThan)


@dataclass(frozen=True)
class Window:
    """The part ``[lo, hi)`` of the loop axis a program can see (None: that end is the axis's).
    Free symbols: ``first(d)`` / ``last(d)`` (the program's first and last index of lane d)
    and ``size(d)``."""

    lo: sp.Expr | None
    hi: sp.Expr | None


def first(dim: str) -> sp.Symbol:
    return dim_symbol("first", dim)


def last(dim: str) -> sp.Symbol:
    return dim_symbol("last", dim)


def window_of(index: sp.Symbol, conditions: Iterable[sp.Expr], every_lane: bool = False) -> Window | None:
    """The window of ``index`` (``index(axis)``) allowed by a conjunction of linear
    inequalities, each with ``index`` at coefficient +-1 and other indices ``index(d)`` at
    integer coefficients (replaced by the program's ``first(d)``/``last(d)``, whichever gives the
    widest bound: some lane may see it; ``every_lane``: the narrowest, where every lane of the
    program sees it, so a tile inside needs no mask). None when some condition is not of that form."""
    lo: list[sp.Expr] = []
    hi: list[sp.Expr] = []
    for cond in conditions:
        parts = cond.args if isinstance(cond, sp.And) else (cond,)
        for rel in parts:
            if not isinstance(rel, _RELATIONS):
                return None
            # normalise to  g <= 0  or  g < 0  with g = lhs - rhs
            g = sp.expand(rel.lhs - rel.rhs) if isinstance(rel, (sp.LessThan, sp.StrictLessThan)) \
                else sp.expand(rel.rhs - rel.lhs)
            strict = isinstance(rel, (sp.StrictLessThan, sp.StrictGreaterThan))
            a = g.coeff(index)
            rest = sp.expand(g - a * index)
            if a not in (1, -1) or index in rest.free_symbols:
                return None
            bound = -rest if a == 1 else rest  # a = 1: index <= -rest ; a = -1: index >= rest
            widened = _widest(bound, upper=(a == 1) != every_lane)
            if widened is None:
                return None
            if a == 1:
                hi.append(widened + (0 if strict else 1))  # exclusive end
            else:
                lo.append(widened + (1 if strict else 0))
    if not lo and not hi:
        return None
    # a conjunction: the latest lower end and the earliest upper end
    return Window(sp.Max(*lo) if len(lo) > 1 else (lo[0] if lo else None),
                  sp.Min(*hi) if len(hi) > 1 else (hi[0] if hi else None))


def _widest(bound: sp.Expr, upper: bool) -> sp.Expr | None:
    """``bound`` over the program's lanes at its widest: each ``index(d)`` replaced by the
    program's last (or first) index of d, whichever makes an upper bound largest (a lower bound
    smallest). Only linear, integer-coefficient bounds in indices and sizes qualify."""
    out = bound
    for s in bound.free_symbols:
        kind, dim = symbol_kind(s) or (None, "")
        if kind == "size":
            continue
        if kind != "index":
            return None
        c = sp.expand(bound).coeff(s)
        if not c.is_Integer or s in sp.expand(bound - c * s).free_symbols:
            return None
        grows = (c > 0) == upper
        out = out.subs(s, last(dim) if grows else first(dim))
    if not all(t.is_Integer or t.is_Symbol or (t.is_Mul and t.args[0].is_Integer) for t in sp.Add.make_args(sp.expand(out))):
        return None
    return sp.expand(out)


def axis_mask(folds: Sequence[tuple[str, sp.Expr]], *, counts: bool, selections: bool) -> sp.Expr | None:
    """The condition every fold of a pass (``folds``: (op, contribution) over the axis) shares,
    outside which each adds its identity; None when there is none, or when skipping tiles would
    change a state (a count, a selection)."""
    if counts or selections or not folds:
        return None
    conds = []
    for op, e in folds:
        c = masked_condition(e, op)
        if c is None:
            return None
        conds.append(c)
    if any(c != conds[0] for c in conds[1:]):
        return None
    return conds[0]


def axis_window(axis: str, folds: Sequence[tuple[str, sp.Expr]], *, counts: bool, selections: bool) -> Window | None:
    """The window of the loop axis for a pass folding ``folds`` ((op, contribution) over the
    axis), or None when the pass must visit the whole axis (module docstring)."""
    cond = axis_mask(folds, counts=counts, selections=selections)
    if cond is None:
        return None
    return window_of(dim_symbol("index", axis), [cond])


def window_bound(e: sp.Expr, tile_dims: Iterable[str], whole: Iterable[str] = ()) -> Bound:
    """A window end as a loop bound (:class:`fuser_core.codegen.ops.bounds.Bound`, printed by the
    printer): ``first(d)`` is ``pid_d * BLOCK_d``, ``last(d) + 1`` the end of the program's block of
    d (the smaller of ``pid_d * BLOCK_d + BLOCK_d`` and ``size_d``); a lane in no tile (block 1) is
    its scalar offset ``offs_d``; a dim each program holds ``whole`` (no program id: an inner axis)
    runs from 0 to ``size_d``; ``size(d)`` is ``size_d``."""
    tile, whole = set(tile_dims), set(whole)
    ends = {s: dim_symbol("end", symbol_kind(s)[1]) - 1 for s in e.free_symbols if is_dim_symbol(s, "last")}
    e = sp.expand(e.subs(ends)) if ends else e

    def node(e: sp.Expr) -> Bound:
        if e.is_Integer:
            return num(int(e))
        if e.is_Symbol:
            kind, dim = symbol_kind(e) or (None, "")
            if kind == "size":
                return name(f"size_{dim}")
            if dim in whole:
                return ZERO if kind == "first" else name(f"size_{dim}")  # end(d)
            if dim not in tile:  # a scalar lane: one index per program (its end: the next one)
                return group(plus(name(f"offs_{dim}"), num(1))) if kind == "end" else name(f"offs_{dim}")
            start = product(name(f"pid_{dim}"), name(f"BLOCK_{dim}"))
            if kind == "first":
                return start
            return minimum(plus(start, name(f"BLOCK_{dim}")), name(f"size_{dim}"))  # end(d)
        if isinstance(e, (sp.Min, sp.Max)):
            fold = minimum if isinstance(e, sp.Min) else maximum
            out = node(e.args[0])
            for arg in e.args[1:]:
                out = fold(out, node(arg))
            return out
        if e.is_Mul:
            return product(*(node(f) if not f.is_Add else group(node(f)) for f in e.args))
        if e.is_Add:
            terms = sorted(e.args, key=lambda t: (t.is_Integer, sp.default_sort_key(t)))  # the constant last
            signs, nodes = [1], [node(terms[0])]
            for t in terms[1:]:
                negative = (t.is_Integer and t < 0) or (t.is_Mul and t.args[0].is_Integer and t.args[0] < 0)
                signs.append(-1 if negative else 1)
                nodes.append(node(-t if negative else t))
            return group(plus(*nodes, signs=tuple(signs)))
        raise AssertionError(f"not a loop bound: {e}")

    return node(e)


__all__ = ["Window", "axis_mask", "axis_window", "first", "last", "masked_condition", "window_bound", "window_of"]
