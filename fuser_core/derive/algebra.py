"""Sympy helpers of the derivation: bounds, masked ratios, powers under conditions, branches,
merging and counting out contributions, terms kept apart, multi-indices.
"""

from __future__ import annotations

import math

import sympy as sp

from fuser_core.realisation import COUNT_OLD


def at_most(value: sp.Expr, bound: float) -> bool:
    """|value| <= bound for a sympy number (False for nan, oo or a complex number)."""
    try:
        return abs(float(value)) <= bound
    except (TypeError, ValueError, OverflowError):
        return False


def is_bounded(e: sp.Expr, *, upper: bool, varies) -> bool:
    """Is ``e`` provably bounded above (``upper``) or below, whatever the values of the symbols
    ``varies`` accepts? Interval reasoning over sums, constant multiples, min/max, where and a
    few bounded functions; ``False`` when unsure (the caller then refuses to fuse)."""
    if not any(varies(v) for v in e.free_symbols):
        return True
    if isinstance(e, sp.Piecewise):
        return all(is_bounded(branch, upper=upper, varies=varies) for branch, _ in e.args)
    if e.is_Add:
        for arg in e.args:  # push the rest of the sum into a min, max or where, where it may cancel
            k, core = arg.as_coeff_Mul()
            if isinstance(core, (sp.Min, sp.Max)) and k.is_number and k.is_extended_real and k != 0:
                # k * max(a, b) is max(k a, k b) for k > 0 and min(k a, k b) for k < 0: an attention
                # sink's s - max(s, sink) is min(0, s - sink), bounded above by its 0
                func = core.func if k > 0 else (sp.Max if core.func is sp.Min else sp.Min)
                rest = e - arg
                return is_bounded(func(*(k * a + rest for a in core.args), evaluate=False), upper=upper, varies=varies)
            if isinstance(arg, sp.Piecewise):
                return is_bounded(sp.piecewise_fold(e), upper=upper, varies=varies)
        return all(is_bounded(arg, upper=upper, varies=varies) for arg in e.args)
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff.is_number and coeff != 1:
            return is_bounded(sp.expand(rest), upper=upper if coeff > 0 else not upper, varies=varies)
        return False
    if isinstance(e, (sp.Min, sp.Max)):
        one_suffices = isinstance(e, sp.Min) == upper  # min(a, b) <= a; max(a, b) >= a
        test = any if one_suffices else all
        return test(is_bounded(sp.expand(a), upper=upper, varies=varies) for a in e.args)
    if isinstance(e, (sp.sin, sp.cos, sp.tanh)):
        return True
    if isinstance(e, sp.exp):
        return not upper or is_bounded(e.args[0], upper=True, varies=varies)
    return False


def masks_folded(e: sp.Expr) -> sp.Expr:
    """``e`` with every product by a mask (a ``where(cond, a, 0)``) written as the mask of the
    product: ``w * (x - mean)**2`` with ``w = where(index(t) < length, 1, 0)`` becomes
    ``where(index(t) < length, (x - mean)**2, 0)``. The same value; but only the second shows the
    derivation a branch that is a polynomial in the running mean, which it centres (a shifted or
    Taylor form), where the product was expanded into raw power sums that cancel (issue 37, 13:
    a masked variance of data near 1000 with spread 0.01 came out 1.7e3 off)."""
    def is_masked_product(node: sp.Basic) -> bool:
        return isinstance(node, sp.Mul) and any(_zero_else(a) for a in node.args)

    def fold(node: sp.Mul) -> sp.Expr:
        mask = next(a for a in node.args if _zero_else(a))
        rest = sp.Mul(*[a for a in node.args if a is not mask])
        (value, cond), _ = mask.args
        return sp.Piecewise((value * rest, cond), (0, True))

    return e.replace(is_masked_product, fold)


def exp_logs_split(e: sp.Expr) -> sp.Expr:
    """``e`` with the exponential factors taken out of every log: ``log(exp(u) * r)`` becomes
    ``u + log(r)``. Exact wherever either side is defined, and the same special values (exp(u) > 0:
    r < 0 gives NaN on both sides, r = 0 gives -inf; u = inf with r = 0 gives NaN on both). An
    entropy written ``-p * log(p)`` with ``p = exp((x - mx) / temp) / den`` then shows the
    derivation ``(x - mx) / temp - log(den)``, a polynomial in mx it centres, where ``log(exp(..) /
    den)`` as a whole hid it and the raw ``sum exp(..) x`` cancelled at the end (issue 37, 13: 158x
    the formula's error at x + 1000)."""
    def splittable(node: sp.Basic) -> bool:
        return (isinstance(node, sp.log) and isinstance(node.args[0], sp.Mul)
                and any(isinstance(f, sp.exp) for f in node.args[0].args))

    def split(node: sp.log) -> sp.Expr:
        factors = node.args[0].args
        exps = [f for f in factors if isinstance(f, sp.exp)]
        rest = sp.Mul(*[f for f in factors if not isinstance(f, sp.exp)])
        return sp.Add(*(f.args[0] for f in exps)) + sp.log(rest)

    return e.replace(splittable, split)


def _zero_else(node: sp.Basic) -> bool:
    """A two-branch Piecewise whose other branch is 0: ``where(cond, a, 0)``."""
    return (isinstance(node, sp.Piecewise) and len(node.args) == 2 and node.args[1].cond == sp.true
            and node.args[1].expr == 0)


def masked_exps_combined(e: sp.Expr) -> sp.Expr:
    """``e`` with factors moved into a where() (a mask) and exponentials combined in each branch:
    ``exp(-mx) * where(c, exp(x), 0)`` is ``where(c, exp(x - mx), 0)``, so that the anchor stays
    inside the exponent the range check and the kernel see."""
    e = sp.piecewise_fold(e)
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*((sp.powsimp(v, combine="exp"), c) for v, c in e.args))
    return sp.powsimp(e, combine="exp")


def masked_ratio(g: sp.Expr, integrand: sp.Expr) -> sp.Expr | None:
    """``g / integrand`` when it is one value wherever either is nonzero: the plain ratio, or
    for two where()s with the same conditions, zero in the same branches, the ratio of their
    other branches when it is the same in all of them. None otherwise."""
    if not isinstance(g, sp.Piecewise) and not isinstance(integrand, sp.Piecewise):
        return sp.cancel(g / integrand)
    if not (isinstance(g, sp.Piecewise) and isinstance(integrand, sp.Piecewise)) or len(g.args) != len(integrand.args):
        return None
    ratios = set()
    for (v, c), (w, d) in zip(g.args, integrand.args):
        if c != d or (v == 0) != (w == 0):
            return None
        if v != 0:
            ratios.add(sp.cancel(v / w))
    return ratios.pop() if len(ratios) == 1 else None


def powers_under_conditions(e: sp.Expr, known: tuple[tuple[sp.Basic, bool], ...] = ()):
    """Every exp/power in ``e`` with the where() conditions known to hold (True) or fail (False)
    where it is evaluated: branch i of a Piecewise runs when its condition holds and every
    earlier one failed."""
    if isinstance(e, sp.Piecewise):
        before: tuple[tuple[sp.Basic, bool], ...] = ()
        for value, cond in e.args:
            yield from powers_under_conditions(value, known + before + ((cond, True),))
            before += ((cond, False),)
        return
    if isinstance(e, (sp.exp, sp.Pow)):
        yield e, known
    for arg in e.args:
        yield from powers_under_conditions(arg, known)


def given(e: sp.Expr, known: tuple[tuple[sp.Basic, bool], ...]) -> sp.Expr:
    """``e`` with a top-level where() resolved by the ``known`` conditions, where they decide it."""
    if not isinstance(e, sp.Piecewise):
        return e
    decided = dict(known)
    for value, cond in e.args:
        if cond is sp.true or decided.get(cond) is True:
            return given(value, known)
        if decided.get(cond) is not False:
            return e  # undecided here: the whole where()
    return e


def merge_alike(contributions: list[sp.Expr], deferred: list[sp.Expr], reanchor: list[sp.Expr],
                 correction: sp.Expr) -> tuple[list[sp.Expr], list[sp.Expr], list[sp.Expr]]:
    """Taylor accumulators with one state where two hold the same sum up to a number: KL's
    ``sum exp(a - ma)`` is a first-order coefficient in ``ma`` and in ``mb`` and the sum each of
    ``log(da)`` and ``log(db)`` multiplies (five accumulators, two of them distinct). Accumulator
    j joins i when ``C_j = c C_i`` and both only rescale when the anchors move (no other
    accumulator flows into them): every read of ``acc[j]`` becomes ``c acc[i]``."""
    acc = [sp.Symbol(f"acc[{k}]") for k in range(len(contributions))]
    keep: list[int] = []
    into: dict[int, tuple[int, sp.Expr]] = {}
    for j, c in enumerate(contributions):
        for i in keep:
            ratio = sp.cancel(c / contributions[i]) if contributions[i] != 0 else None
            if (ratio is not None and ratio.is_Number and ratio != 0 and reanchor[i] == correction * acc[i]
                    and reanchor[j] == correction * acc[j]):
                into[j] = (i, ratio)
                break
        else:
            keep.append(j)
    if not into:
        return contributions, deferred, reanchor
    deferred = list(deferred)
    for j, (i, ratio) in into.items():
        deferred[i] = deferred[i] + ratio * deferred[j]
    renamed = {acc[j]: ratio * acc[i] for j, (i, ratio) in into.items()}
    renamed = {k: v.xreplace({acc[i]: acc[keep.index(i)] for i in keep}) for k, v in renamed.items()}
    renamed.update({acc[i]: acc[n] for n, i in enumerate(keep) if acc[i] not in renamed})
    return ([contributions[i] for i in keep], [deferred[i] for i in keep],
            [reanchor[i].xreplace(renamed) for i in keep])


def counted_out(contributions: list[sp.Expr], deferred: list[sp.Expr], reanchor: list[sp.Expr],
                 loop_symbols: set[sp.Symbol]) -> tuple[list[sp.Expr], list[sp.Expr], list[sp.Expr]]:
    """Taylor accumulators that need no state: a top-order coefficient whose contribution ``c`` reads no
    streamed value and no dependency (layernorm's ``sum 1 / N``, the second derivative of
    ``(x - mean)^2 / N``), never rescaled (its move is itself) and read only by the other accumulators'
    moves, is ``c count[old]``: every read of it becomes that. So a centred variance carries the
    first-order ``sum (x - mean)`` that a shifted (Welford) move assumes is 0 -- it is not, once the
    running mean is rounded, and the move then loses |mean| / std units in the last place -- at the
    cost of one more sum per tile, not two."""
    acc = [sp.Symbol(f"acc[{k}]") for k in range(len(contributions))]
    counted = {k for k, c in enumerate(contributions)
               if not (c.free_symbols & loop_symbols) and not c.has(sp.Piecewise) and c != 0
               and deferred[k] == 0 and reanchor[k] == acc[k]}
    if not counted:
        return contributions, deferred, reanchor
    keep = [k for k in range(len(contributions)) if k not in counted]
    renamed = {acc[k]: contributions[k] * COUNT_OLD for k in counted}
    renamed.update({acc[i]: acc[n] for n, i in enumerate(keep)})
    return ([contributions[i] for i in keep], [deferred[i] for i in keep],
            [reanchor[i].xreplace(renamed) for i in keep])


def where_branches(e: sp.Expr) -> list[sp.Expr]:
    """The values of a where() (a mask), or ``[e]``."""
    return [v for v, _ in e.args] if isinstance(e, sp.Piecewise) else [e]


def kept_apart(e: sp.Expr, apart: set[sp.Symbol], inside: set[sp.Symbol]) -> tuple[sp.Expr, dict[sp.Symbol, sp.Expr]]:
    """``e`` with each largest subexpression that reads symbols of ``apart`` and none of ``inside``
    replaced by a fresh symbol (``log(den)`` in softmax entropy): returns the new expression and
    what each symbol stands for. Those factors are constants of the loop, applied at the end."""
    kept: dict[sp.Expr, sp.Symbol] = {}

    def walk(node: sp.Basic) -> sp.Basic:
        free = node.free_symbols
        if isinstance(node, sp.Expr) and free & apart and not free & inside and not node.is_Symbol | node.is_Add:
            if node not in kept:
                kept[node] = sp.Symbol(f"kept[{len(kept)}]", real=True)
            return kept[node]
        if node.is_Symbol and node in apart:
            kept.setdefault(node, sp.Symbol(f"kept[{len(kept)}]", real=True))
            return kept[node]
        if not node.args or not free & apart:
            return node
        return node.func(*(walk(a) for a in node.args))

    out = walk(e)
    return out, {sym: node for node, sym in kept.items()}


def symbol_names(syms: set[sp.Symbol]) -> str:
    return ", ".join(sorted(str(s) for s in syms))


def expanded_terms(e: sp.Expr, cap: int) -> int:
    """An upper bound on the number of terms ``expand`` makes of ``e``, saturating above ``cap``.

    Checked before expanding, so that a spec cannot make sympy multiply out a huge product.
    """
    if e.is_Add:
        return min(cap + 1, sum(expanded_terms(a, cap) for a in e.args))
    if e.is_Mul:
        out = 1
        for a in e.args:
            out = min(cap + 1, out * expanded_terms(a, cap))
        return out
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        base = expanded_terms(e.base, cap)
        return min(cap + 1, math.comb(base + int(e.exp) - 1, int(e.exp)))
    inner = max((expanded_terms(a, cap) for a in e.args), default=1)  # expand(deep=True) reaches into functions
    return min(cap + 1, inner)


def multi_indices(degrees: list[int]) -> list[tuple[int, ...]]:
    """All (a_1..a_k) with 0 <= a_i <= degrees[i], lowest total order first."""
    out: list[tuple[int, ...]] = [()]
    for d in degrees:
        out = [o + (k,) for o in out for k in range(d + 1)]
    return sorted(out, key=lambda o: (sum(o), o))
