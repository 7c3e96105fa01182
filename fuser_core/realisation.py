"""Realisations as data: the one description of how a fused reduction is computed incrementally.

:func:`fuser_core.derive.derive_cascade` decides *whether* a reduction fuses and finds its
pieces (contributions, corrections, the shift, the Taylor re-anchoring); this module turns
them, once, into a :class:`Realisation` that everything downstream reads: the float64
certificate evaluates it, the Triton printer prints it, ``present``/the dashboard render it,
the tuner counts from it. It is the only module that branches on the realisation's kind
(``first`` | ``scaled`` | ``shifted`` | ``taylor``).

A realisation is a tuple of :class:`Accumulator` s. Each holds, as sympy expressions:

- its fold operator ``op`` (``sum``, ``max``, ``min``, or a selection ``topk``/``bottomk``/
  ``argmax``/``argmin`` whose state is (values, indices)) and so its initial state, the
  operator's identity (:func:`identity`);
- ``contribution``: what one element adds, with the dependencies at their (new) anchors;
- ``moved``: the accumulator after the anchors move, in terms of ``acc[j]`` (every
  accumulator of the realisation), ``dep[old]``, ``dep[new]`` and ``count[old]``.

Every kind then updates and merges by the same two rules (THEORY.md section 6):

- one tile: ``acc_k <- op(moved_k(prev), fold_op(contribution_k over the tile))``
  (:meth:`Realisation.step`);
- two partial states a and b: ``acc_k = op(moved_k(a), moved_k(b))`` with ``[old]`` = each
  part's anchors and count, ``[new]`` = the merged anchors (:meth:`Realisation.merge`).

The final value is ``value`` (:attr:`Realisation.value`), an expression in the accumulators
and the dependencies' final values (for a selection, of the values; its indices are the
state's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from fuser_core.reduce_ops import has_slots, is_selection, reduce_op

if TYPE_CHECKING:
    from fuser_core.derive import ReductionForm


# acc * c for a correction c, taking a c that is not a positive finite number (0 where it
# underflowed; inf or NaN where it only multiplies an empty accumulator) as RESCALE_FLOOR, so that
# an infinite accumulator is never made NaN by a zero correction: the rescale guard of the
# kernels' `rescale` helper and of the certificate, one definition for both. The guard reads the
# correction alone: one test per row where the correction is per row (attention's), not per element.
Rescale = sp.Function("rescale")
RESCALE_FLOOR = 2.0 ** -126  # float32's least normal number (the kernels' nonzero_correction)
# ``shift_term(acc, c)``: one term ``acc * c`` of a Taylor shift, 0 when the shift ``c`` is 0 (a part
# already at the merged anchor: the term is 0 whatever acc is) or NaN (an anchor that stayed at one
# infinity: inf - inf, no move), when acc is 0 (nothing seen yet), or when c is finite and acc infinite
# (an infinite element's moments are infinite at every finite centre, and the order-0 accumulator
# already holds the answer: (x - b)^2 = inf for x = -inf, where inf * c would cancel it to NaN)
class ShiftTerm(sp.Function):
    nargs = 2

    @classmethod
    def eval(cls, acc, c):  # noqa: ANN001, ANN206 (sympy's protocol)
        if c.is_zero or acc.is_zero:
            return sp.Integer(0)
        return None


ShiftTerm.__name__ = "shift_term"  # its name in printers and lambdify's namespace
# ``nan_to_zero(d)``: a shifted (Welford) accumulator's move ``d``, 0 where it is NaN: an anchor that stayed
# at one infinity (a running sum's estimate at -inf before and after a tile: inf - inf) does not move.
# A NaN the data brought has already made the accumulator NaN (its contributions read the running anchor).
class NanToZero(sp.Function):
    nargs = 1

    @classmethod
    def eval(cls, d):  # noqa: ANN001, ANN206 (sympy's protocol)
        if d.is_number and d is not sp.nan:  # a number moves by itself (0: no move)
            return d
        return None


NanToZero.__name__ = "nan_to_zero"  # its name in printers and lambdify's namespace

COUNT_OLD = sp.Symbol("count[old]", integer=True, nonnegative=True)

DOCS = {
    "first": "plain partial reduction (no dependency)",
    "scaled": "one accumulator per term, anchored at running max/min values and rescaled by the correction",
    "shifted": "shifted accumulator (Welford/Chan style): anchored at running estimates, corrected additively",
    "taylor": "Taylor-shifted accumulators: centred at the anchors, moved by an exact binomial shift (Pebay style)",
    "gathered": "one load after the loop: the value at the positions a selection over the axis chose",
    "not_fused": "not fused: computed by a separate pass after its dependencies are final",
}


def old(sym: sp.Symbol) -> sp.Symbol:
    """A dependency's anchor before the move."""
    return sp.Symbol(f"{sym.name}[old]", **sym.assumptions0)


def new(sym: sp.Symbol) -> sp.Symbol:
    """A dependency's anchor after the move (in a merge: the merged anchor)."""
    return sp.Symbol(f"{sym.name}[new]", **sym.assumptions0)


def state_symbols(dep_symbols) -> set[sp.Symbol]:
    """The loop-state symbols a correction may read: each dependency's ``[old]`` and ``[new]`` anchor and
    ``count[old]``. Anything else it reads is a constant of the loop (an attention sink's per-head
    ``sink`` in ``exp(maximum(mx[old], sink) - maximum(mx[new], sink))``, a param, a size)."""
    return {f(s) for s in dep_symbols for f in (old, new)} | {COUNT_OLD}


def settled(acc: "Accumulator", dep_symbols) -> sp.Expr:
    """The accumulator moved from its running (safe) anchors ``dep[old]`` to the final values ``dep[new]`` at
    the end of the loop, with a plain product ``acc * correction`` (no rescale guard: where the final max is
    +-inf the formula's exp(inf - inf) is NaN, and so is the result).

    Where the correction reads a constant of the loop as well (an attention sink:
    ``exp(max(mx[old], sink) - max(mx[new], sink))``), the product is taken only where the anchored
    exponent differs at the two anchors: with sink = +inf both are -inf, the correction is
    exp(-inf + inf) = NaN, but the anchor does not matter there (every term is exp(s - inf) = 0 at either),
    so the accumulator stays as it is. Without a constant, the exponents differ exactly where the
    anchors do, and the plain product is kept."""
    product = acc.symbol * acc.correction
    a = acc.anchored_factor
    if a is None or not (acc.correction.free_symbols - state_symbols(dep_symbols)) or not isinstance(a, sp.exp):
        return product
    at_old = a.args[0].xreplace({s: old(s) for s in dep_symbols})
    at_new = a.args[0].xreplace({s: new(s) for s in dep_symbols})
    return sp.Piecewise((acc.symbol, sp.Eq(at_old, at_new)), (product, True))


def acc_symbol(j: int) -> sp.Symbol:
    """Accumulator j of a realisation (in ``moved`` and ``value``)."""
    return sp.Symbol(f"acc[{j}]")


def part_acc(j: int, side: str) -> sp.Symbol:
    """Accumulator j of partial state ``side`` ("a" or "b") in :meth:`Realisation.merge`."""
    return sp.Symbol(f"acc_{side}[{j}]")


def part_anchor(sym: sp.Symbol, side: str) -> sp.Symbol:
    """A dependency's anchor in partial state ``side`` in :meth:`Realisation.merge`."""
    return sp.Symbol(f"{sym.name}[{side}]", **sym.assumptions0)


def part_count(side: str) -> sp.Symbol:
    """The count of values partial state ``side`` has seen, in :meth:`Realisation.merge`."""
    return sp.Symbol(f"count[{side}]", integer=True, nonnegative=True)


def empty_adds_zero(term: sp.Expr, acc: sp.Expr) -> sp.Expr:
    """``term`` (a final factor times ``acc``), but 0 while ``acc`` is still empty (0): the factor may be
    infinite where the reference has 0 (it reads a -inf max of an all-masked row), and 0 * inf is nan."""
    return sp.Piecewise((sp.Integer(0), sp.Eq(acc, 0)), (term, True))


def unguarded(e: sp.Expr) -> sp.Expr:
    """``e`` with every :func:`empty_adds_zero` guard removed: the formula as people read it."""
    def plain(node: sp.Basic) -> bool:
        return (isinstance(node, sp.Piecewise) and len(node.args) == 2 and node.args[0][0] == 0
                and isinstance(node.args[0][1], sp.Eq) and node.args[0][1].rhs == 0 and node.args[1][1] is sp.true)
    return e.replace(plain, lambda node: node.args[1][0])


def identity(op: str) -> sp.Expr:
    """The initial (empty) state of a fold with ``op``: its identity. A selection's values
    start at -inf (selections run on values negated for bottomk/argmin), its indices at 0."""
    value = reduce_op(op).identity
    return sp.Integer(0) if value == 0 else sp.oo if value > 0 else -sp.oo


@dataclass(frozen=True)
class Combine:
    """``op(left, right)``: how two states of one accumulator meet (``right`` is folded over the
    tile with ``op`` first when it is a tile's contribution, see :meth:`Realisation.step`)."""

    op: str
    left: sp.Expr
    right: sp.Expr


@dataclass(frozen=True)
class Accumulator:
    """One piece of a fused reduction's loop state."""

    symbol: sp.Symbol  # acc[j]
    op: str  # the fold operator (a reduce kind, fuser_core.reduce_ops)
    contribution: sp.Expr  # what one element adds, dependencies at their (new) anchors
    moved: sp.Expr  # the accumulator after the anchors move: acc[*], dep[old], dep[new], count[old]
    # scaled/first only (the JSON report and the dashboard show them): the anchored factor A_j,
    # the multiplicative correction A_j(new)/A_j(old) and the factor applied at the end
    anchored_factor: sp.Expr | None = None
    correction: sp.Expr | None = None
    final_factor: sp.Expr | None = None

    @property
    def initial(self) -> sp.Expr:
        return identity(self.op)

    @property
    def selection(self) -> bool:
        """Is the state (values, indices)? ``moved`` and ``contribution`` are of the values."""
        return is_selection(self.op)

    @property
    def move(self) -> str:
        """How ``moved`` changes the accumulator: ``none``, ``rescale`` (times a correction),
        ``shift`` (plus a term free of accumulators) or ``joint`` (mixes accumulators: Taylor)."""
        m = self.moved
        if m == self.symbol:
            return "none"
        if m.func == Rescale and m.args[0] == self.symbol:
            return "rescale"
        if not any(s.name.startswith("acc[") for s in (m - self.symbol).free_symbols):
            return "shift"
        return "joint"

    @property
    def move_terms(self) -> tuple[sp.Expr, ...]:
        """What a move evaluates besides the accumulators: a rescale's correction, a shift's term
        (none for a joint move, an expression of the accumulators themselves)."""
        move = self.move
        if move == "rescale":
            return (self.moved.args[1],)
        if move == "shift":
            return (self.moved - self.symbol,)
        return ()


@dataclass(frozen=True)
class Realisation:
    """How one fused reduction is computed in its axis's loop (module docstring)."""

    name: str
    kind: str  # first | scaled | shifted | taylor: a label; consumers read the fields, not this
    op: str  # the fold operator all accumulators share
    axis: str
    deps: tuple[str, ...]
    dep_symbols: tuple[sp.Symbol, ...]
    anchors: dict[str, str]  # dep -> "running" | "running estimate ..."
    accumulators: tuple[Accumulator, ...]
    value: sp.Expr  # the reduction's value from acc[*] and the dependencies' (current) values
    per_lane: bool  # may lanes keep separate states, merged once at the end with merge()?
    per_lane_reason: str
    k: int | None = None  # topk's k

    @property
    def doc(self) -> str:
        return DOCS[self.kind]

    @property
    def selection(self) -> bool:
        return is_selection(self.op)

    @property
    def symbols(self) -> tuple[sp.Symbol, ...]:
        return tuple(a.symbol for a in self.accumulators)

    @property
    def rescales(self) -> bool:
        """Do its moves multiply the accumulators by a correction (``exp(mx[old] - mx[new])``)? A kernel
        moves such a state back to the final anchor at the end (``settle``), the formula's value at +-inf."""
        return self.kind == "scaled"

    @property
    def shifts(self) -> bool:
        """Do its moves add terms to the accumulators (shifted, Taylor)? Those terms skip an infinite
        accumulator, so a non-finite result is computed again (the kernels' fallback passes)."""
        return self.kind in ("shifted", "taylor")

    @property
    def moves(self) -> bool:
        """Does any accumulator change when the anchors move?"""
        return any(a.moved != a.symbol for a in self.accumulators)

    @property
    def moves_jointly(self) -> bool:
        """Does a moved accumulator read another one (a Taylor shift)? Printers then need temporaries."""
        return any(a.moved.free_symbols & (set(self.symbols) - {a.symbol}) for a in self.accumulators)

    def step(self) -> tuple[Combine, ...]:
        """One tile: ``acc_k <- op(moved_k, fold(contribution_k over the tile))``, anchors [old] = before the
        tile, [new] = after it, ``count[old]`` = the values seen before it."""
        return tuple(Combine(a.op, a.moved, a.contribution) for a in self.accumulators)

    def merge(self) -> tuple[Combine, ...]:
        """THE merge rule, the same for every kind: ``acc_k = op(moved_k(a), moved_k(b))``, each part moved from
        its own anchors and count (:func:`part_anchor`, :func:`part_count`, accumulators :func:`part_acc`) to
        the merged anchors ``dep[new]``."""
        return tuple(
            Combine(a.op, self.at_part(a.moved, "a"), self.at_part(a.moved, "b")) for a in self.accumulators
        )

    def at_part(self, e: sp.Expr, side: str) -> sp.Expr:
        """``e`` (in acc[j], dep[old], count[old]) for partial state ``side``."""
        repl: dict[sp.Basic, sp.Basic] = {acc_symbol(j): part_acc(j, side) for j in range(len(self.accumulators))}
        repl.update({old(s): part_anchor(s, side) for s in self.dep_symbols})
        repl[COUNT_OLD] = part_count(side)
        return e.xreplace(repl)

    # -- words, for the JSON report and the dashboard
    def correction_text(self, text) -> str | None:
        """The re-anchoring correction in words (``text`` prints an expression)."""
        if self.kind == "first":
            return None
        if self.kind == "shifted":  # the move, without its NaN guard
            return f"add {text((self.accumulators[0].moved - self.accumulators[0].symbol).args[0])}"
        if self.kind == "taylor":
            return "move accumulator k to: " + "; ".join(
                f"acc[{k}] <- {text(a.moved)}" for k, a in enumerate(self.accumulators)
            )
        factors = list(dict.fromkeys(text(a.correction) for a in self.accumulators if a.correction != 1))
        if not factors:
            return "none: the dependence enters only through a factor or offset applied at the end"
        return "multiply by " + "; ".join(factors) if len(factors) == 1 else "multiply term j by: " + "; ".join(factors)

    def merge_text(self) -> str:
        """The merge rule in words (the expressions are :meth:`merge`)."""
        if self.kind == "first":
            return _FIRST_MERGE[self.op]
        if self.kind == "shifted":
            return (
                "acc = acc_a + acc_b + the correction from each part's anchors to the merged ones "
                "(count[old] = that part's count)"
            )
        if self.kind == "taylor":
            return "move both parts' accumulators to the merged anchors (the shift above), then add them"
        return (
            f"re-anchor both parts to the merged dependencies (multiply each T by its correction "
            f"with [old] = the part's anchor, [new] = the merged one), then combine with {_COMBINE[self.op]}"
        )


_FIRST_MERGE = {
    "sum": "a + b",
    "max": "max(a, b)",
    "min": "min(a, b)",
    "topk": "the k largest of both candidate lists (lower index first on ties)",
    "bottomk": "the k smallest of both candidate lists (lower index first on ties)",
    "argmax": "the larger (value, index) pair, lower index on ties",
    "argmin": "the smaller (value, index) pair, lower index on ties",
}
_COMBINE = {
    "sum": "+", "max": "max", "min": "min", "topk": "top-k", "bottomk": "bottom-k",
    "argmax": "argmax", "argmin": "argmin",
}


def realise(form: ReductionForm, dep_symbols: tuple[sp.Symbol, ...]) -> Realisation:
    """The realisation of a fused ``form`` (its kind decides the accumulators, once, here)."""
    op = form.effective_op or form.op
    accs: list[Accumulator] = []
    if form.kind == "shifted":
        assert form.delta is not None
        acc = acc_symbol(0)
        accs.append(Accumulator(acc, "sum", form.integrand, acc + NanToZero(form.delta)))
        value: sp.Expr = acc
    elif form.kind == "taylor":
        accs = [Accumulator(acc_symbol(j), "sum", c, m) for j, (c, m) in enumerate(zip(form.contributions, form.reanchor))]
        value = form.final_value([acc_symbol(j) for j in range(len(accs))])
    elif form.kind in ("first", "scaled"):
        for j, (c, a, k, d) in enumerate(zip(form.contributions, form.scales, form.corrections, form.deferred)):
            acc = acc_symbol(j)
            accs.append(Accumulator(acc, op, c, acc if k == 1 else Rescale(acc, k), a, k, d))
        if is_selection(op):  # values: scale * selected + offset, no empty guard (a selection is never empty)
            value = form.deferred[0] * acc_symbol(0) + form.offset
        else:
            value = form.final_value([acc_symbol(j) for j in range(len(accs))])
    else:
        raise ValueError(f"{form.name}: no realisation for {form.kind!r}")
    if has_slots(op):
        per_lane, why = False, (
            "a per-lane top-k would keep a k-slot list in every lane (k x BLOCK state); the merge is exact, "
            "the state is not elementwise"
        )
    elif form.kind == "shifted":
        per_lane, why = True, "the merge is exact for any partition, given each lane's own count"
    else:
        per_lane, why = True, "the merge is exact for any partition"
    return Realisation(
        name=form.name, kind=form.kind, op=op, axis=form.axis, deps=form.deps, dep_symbols=dep_symbols,
        anchors=dict(form.anchors), accumulators=tuple(accs), value=value, per_lane=per_lane,
        per_lane_reason=why, k=form.step.k if has_slots(op) else None,
    )
