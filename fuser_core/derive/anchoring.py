"""Anchored realisations: the factors anchored at running maxima/minima, their corrections and
guards, the ``scaled`` form and the realisation of sums.
"""

from __future__ import annotations

import sympy as sp

from fuser_core.derive.algebra import masked_exps_combined, symbol_names
from fuser_core.derive.deriver_base import DeriverBase
from fuser_core.derive.forms import NotSeparable, ReductionForm, Term
from fuser_core.realisation import new, old
from fuser_core.reduce_ops import is_extremum
from fuser_core.symbolic import has_cast, strip_casts


class AnchoringDeriver(DeriverBase):
    """Anchors, corrections and the scaled realisation (a part of :class:`~fuser_core.derive.realise.Deriver`)."""

    def max_type(self) -> set[sp.Symbol]:
        """Dependencies whose running value is a max or min: the natural anchors."""
        out = set()
        for name, sym in self.deps.items():
            f = self.forms[name]
            if is_extremum(f.effective_op or f.op):
                out.add(sym)
        return out

    def anchored_factor(self, h: sp.Expr) -> sp.Expr:
        """The provably positive part of H that reads only max/min dependencies (and constants).

        Positive, so that rescaling never flips an order; everything else of H is deferred.
        """
        anchors = self.max_type()
        a = sp.Integer(1)
        for factor in sp.Mul.make_args(sp.factor_terms(h)):
            if factor.free_symbols & self.dep_syms <= anchors and factor.is_positive:
                a *= factor
        return a

    def anchor_split(self, h: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
        """``(A, H / A)``: the anchored factor of H (:meth:`anchored_factor`) and the factor deferred to the end.

        Expanding F moves an anchored exponential into a denominator it shares with other terms: an
        attention sink's ``exp(s - maximum(mx, sink)) * v / (den + exp(sink - maximum(mx, sink)))``
        separates as ``G = v exp(s)``, ``H = 1 / (den exp(maximum(mx, sink)) + exp(sink))``, with no
        anchored factor left, so the state would hold the unanchored ``exp(s)`` (inf past s = 88 in
        float32). Where H has none, the anchored exponential of its denominator (when there is
        exactly one) is pulled out: ``A = exp(-maximum(mx, sink))`` and the deferred
        ``1 / (den + exp(sink - maximum(mx, sink)))``, each exponent combined so that no exp(sink)
        alone overflows."""
        a = self.anchored_factor(h)
        if a == 1:
            pulled = self.pulled_anchor(h)
            if pulled is not None:
                return pulled
        return a, sp.powsimp(sp.cancel(h / a), combine="exp")

    def pulled_anchor(self, h: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
        """``(exp(-E), H exp(E))`` for the one anchored exponential ``exp(E)`` of H's denominator
        (:meth:`anchor_split`), or None."""
        anchors = self.max_type()
        num, den = sp.fraction(h)
        if not anchors or not den.is_Add or num.free_symbols & anchors:
            return None
        exponents = {
            p.args[0] for term in den.args for p in sp.Mul.make_args(term)
            if isinstance(p, sp.exp) and p.free_symbols & self.dep_syms and p.free_symbols & self.dep_syms <= anchors
            and self.loop_constant(p.args[0].xreplace({s: sp.Integer(0) for s in anchors}))
        }
        if len(exponents) != 1:
            return None
        (e,) = exponents
        a = sp.exp(-e)
        if not a.is_positive:
            return None
        rest = num / sp.powsimp(sp.expand(den * sp.exp(-e), power_exp=True), combine="exp")
        return a, rest

    def correction(self, a: sp.Expr) -> sp.Expr:
        """``A(D_new) / A(D_old)``: the factor that moves an accumulator held at the old anchors to the new.

        Exact for any anchors (it is the ratio itself); its size is what keeps the state bounded. For
        ``A = exp(-mx)`` it is ``exp(mx_old - mx_new) <= 1``. For an anchor that enters through a
        maximum/minimum with loop constants, ``A = exp(-maximum(mx, sink))``, it is
        ``exp(maximum(mx_old, sink) - maximum(mx_new, sink))``, still ``<= 1``: maximum(., sink) is
        non-decreasing and the running max only rises (check_range proves the direction of every
        anchored exponent, :meth:`monotone_direction`). The kernels print maximum/minimum as the
        NaN-propagating ``max_nan``/``min_nan``; the certificate evaluates it with NumPy's
        NaN-propagating ``maximum``."""
        to_new = {s: new(s) for s in self.dep_syms}
        to_old = {s: old(s) for s in self.dep_syms}
        return sp.powsimp(a.xreplace(to_new) / a.xreplace(to_old), combine="exp")

    def may_be_infinite(self, factor: sp.Expr) -> bool:
        """Can a deferred factor be infinite: does it read a running max/min, or divide by a
        dependency not provably nonzero?"""
        if factor.free_symbols & self.max_type():
            return True
        _, den = sp.fraction(sp.together(factor))
        return any(f.free_symbols & self.dep_syms and f.is_zero is not False for f in sp.Mul.make_args(den))

    def empty_may_be_zero(self) -> bool:
        """Can the reference give 0 where an accumulator stays empty and its final factor is not finite?
        Only through a where() around F (a masked row: its fill, 0). Without one the reference evaluates
        F = G * H on every element, and a non-finite H makes each term, and so its sum, NaN or infinite:
        an attention sink of +inf gives den = 0 and o = 0 / (0 + exp(inf - inf)) = NaN, which a guard
        returning 0 would hide."""
        return isinstance(strip_casts(self.F), sp.Piecewise)

    def guards_for(self, corrections: list[sp.Expr]) -> tuple[str, ...]:
        out = []
        anchors = self.max_type()
        for sym in sorted(anchors, key=str):
            out.append(
                f"{sym} is -inf/+inf until a finite value is seen (all masked): its running value anchors at 0 instead"
            )
        for c in corrections:
            _, den = sp.fraction(sp.together(c))
            for factor in sp.Mul.make_args(den):
                if factor.is_number or factor.is_zero is False:
                    continue
                out.append(f"{factor} can be 0: then nothing was accumulated and the correction is taken as 0")
        return tuple(dict.fromkeys(out))

    def scaled(self, terms: list[Term], dep_names: tuple[str, ...], *, offset: sp.Expr, op: str) -> ReductionForm:
        contributions, scales, deferred, corrections = [], [], [], []
        anchors = self.max_type()
        for t in terms:
            self.check("realising terms")
            a, rest = self.anchor_split(t.h)
            contribution = None
            if len(terms) == 1:
                # Keep the user's own form (casts included) when it divides out cleanly.
                candidate = masked_exps_combined((self.F - offset) / rest)
                if not (candidate.free_symbols & (self.dep_syms - anchors)):
                    contribution = candidate
                elif has_cast(self.F):
                    raise NotSeparable(
                        f"a cast inside F reads {symbol_names(candidate.free_symbols & (self.dep_syms - anchors))}, "
                        "a sum result with no running anchor"
                    )
            if contribution is None:
                contribution = masked_exps_combined(t.g * a)
            self.check_range(contribution)
            self.check_deferred_anchor(contribution, rest)
            contributions.append(contribution)
            scales.append(a)
            deferred.append(rest)
            corrections.append(self.correction(a))
        return ReductionForm(
            self.step, self.F, dep_names, "scaled", terms=tuple(terms), contributions=tuple(contributions),
            scales=tuple(scales), deferred=tuple(deferred), corrections=tuple(corrections), offset=offset,
            effective_op=op, anchors={n: "running" for n, s in self.deps.items() if s in anchors},
            guards=self.guards_for(corrections), empty_adds_zero=tuple(self.empty_may_be_zero() and self.may_be_infinite(d)
                                                                    for d in deferred),
        )

    def realise_sum(self, terms: list[Term], dep_names: tuple[str, ...]) -> ReductionForm:
        if len(terms) > 1:
            # Taylor first: its centred accumulators carry the first-order sum a shifted (Welford) move
            # assumes is 0, so a variance stays as accurate as the two-pass formula at any mean / std
            # (the shifted form: 351x the formula's error at mean 1000, fuzz seed 70). A form Taylor
            # refuses for accuracy (a square centred on a raw sum's estimate) is refused, not shifted:
            # the shifted move cancels the same way (2.1x the formula's error, fuzz seed 70).
            stable = self.taylor(terms, dep_names) or self.shifted(terms, dep_names)
            if stable is not None:
                return stable
            self.check_raw_moments(terms)
        return self.scaled(terms, dep_names, offset=sp.Integer(0), op="sum")

    def check_raw_moments(self, terms: list[Term]) -> None:
        """Refuse raw power sums: terms whose end factors are a polynomial of degree >= 2 in a dependency
        with no running anchor (``sum((q - acc)^2)`` kept as ``sum(q^2) - 2 acc sum(q) + n acc^2``, acc a
        dependent sum). Where q lies near acc the end cancels float32 accuracy away (17.6x and 25x the
        formula's error, fuzz seeds 60 and 61); no centred form exists without a running anchor."""
        free = self.dep_syms - self.max_type()
        for t in terms:
            syms = t.h.free_symbols & free
            if not syms:
                continue
            try:
                degree = sp.Poly(t.h, *sorted(syms, key=str)).total_degree()
            except sp.PolynomialError:
                continue
            if degree >= 2:
                raise NotSeparable(
                    f"raw power sums: {t.h} multiplies sum({t.g}), a polynomial of degree {degree} in "
                    f"{symbol_names(syms)}, which has no running anchor to centre on; the end would cancel float32 accuracy away"
                )
