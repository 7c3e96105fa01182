"""The Taylor, order and shifted realisations, and :class:`Deriver`: every part of the derivation of one reduction.
"""

from __future__ import annotations

import math

import sympy as sp

from fuser_core.derive.algebra import (
    counted_out,
    kept_apart,
    masked_exps_combined,
    masked_ratio,
    merge_alike,
    multi_indices,
    symbol_names,
    where_branches,
)
from fuser_core.derive.checks import CheckingDeriver
from fuser_core.derive.forms import (
    MAX_TAYLOR_DEGREE,
    MAX_TERMS,
    WEIGHTED_MEAN,
    NotSeparable,
    ReductionForm,
    Term,
)
from fuser_core.realisation import COUNT_OLD, ShiftTerm, new, old
from fuser_core.reduce_ops import reduce_op
from fuser_core.symbolic import axis_size, has_cast, strip_casts


class Deriver(CheckingDeriver):
    """The derivation of one reduction (every part: separation, anchoring, checks, realisations)."""

    def taylor(self, terms: list[Term], dep_names: tuple[str, ...]) -> ReductionForm | None:
        """Taylor-shifted accumulators (module docstring), or None when F is not of that shape.

        Factors of F that read dependencies with no running anchor (a dependent sum: softmax
        entropy's ``log(den)``, KL's ``log(da)``) stay out of the accumulators: each such factor
        ``k`` is a symbol while F is taken apart, F = sum_b k^b P_b(x, D~), and each P_b gets its own
        centred accumulators, ``k^b`` applied once at the end. So entropy accumulates
        ``sum exp(x - mx) (x - mx)``, centred, not the raw ``sum exp(x - mx) x`` that
        ``- mx sum exp(x - mx)`` must cancel at the end (issue 23: 22x to 123x the formula's error)."""
        if has_cast(self.F):
            return None
        anchorable = self.anchorable()
        factor_sets = [set(sp.Mul.make_args(t.h)) for t in terms]
        common = set.intersection(*factor_sets) if factor_sets else set()
        a = b = sp.Integer(1)
        for factor in common:
            free = factor.free_symbols & self.dep_syms
            if free and free <= self.max_type() and factor.is_positive:
                a *= factor
            elif free and not free <= set(anchorable):
                b *= factor
        # differentiate the unexpanded form, so that coefficients stay centred: -2 (x - mx), not 2 mx - 2 x
        centred, kept = kept_apart(masked_exps_combined(strip_casts(self.F) / (a * b)), self.dep_syms - set(anchorable),
                                    self.streamed | set(anchorable))
        poly = sp.expand(centred, power_exp=True)
        if isinstance(poly, sp.Piecewise):  # a mask: each branch a polynomial, the conditions free of D
            if any(c.free_symbols & (self.dep_syms | set(kept)) for _, c in poly.args):
                return None
            branches = [v for v, _ in poly.args]
        else:
            branches = [poly]
        syms = sorted((poly.free_symbols & self.dep_syms), key=str)
        if not syms or not set(syms) <= set(anchorable):
            return None
        kappas = sorted(kept, key=str)
        try:
            polys = [sp.Poly(br, *syms, *kappas) for br in branches]
        except sp.PolynomialError:
            return None
        self.check_sentinel_anchors(syms)
        n = len(syms)
        if max(sum(m[:n]) for p in polys for m in p.monoms()) > MAX_TAYLOR_DEGREE:
            return None
        raw = [s for s in syms if s not in self.max_type() and anchorable[s] != WEIGHTED_MEAN
               and not self.mean_like(s) and not self.centred_as_mean(branches, s)]
        if raw and max(sp.Poly(br, *raw).total_degree() for br in branches) >= 2:
            # The estimate partial * N / count of a raw sum strays from its final value by about
            # N / sqrt(count) rows' worth early on, and a polynomial around it cancels that away in float32:
            # errors of 1e-4 to 5e-3 for cubics (fuzz_long.py --wild), 17x to 25x the formula's for squares
            # (fuzz seeds 60, 61: sum((q - acc)^2) with acc a raw sum); a mean's estimate stays within the
            # values averaged.
            raise NotSeparable(
                f"a polynomial of degree >= 2 in {symbol_names(set(raw))} would be centred on the running estimate "
                "of a raw sum, which loses float32 accuracy; written as a mean (sum(x / size(axis))) it fuses"
            )
        for sym in syms:
            if sym in self.max_type() and not self.one_sided(branches, kappas, sym):
                # (maximum(w, x) - mx)^2 with w above the early running max of x: each move of mx cancels
                # the squares of values near the final mx away (392x the formula's error, fuzz seed 61)
                raise NotSeparable(
                    f"the polynomial in {sym} would be centred on its running value while the values it is "
                    f"centred against may lie on both sides of it: moving the centre would cancel float32 accuracy away"
                )
        kappa_powers = sorted({m[n:] for p in polys for m in p.monoms()})
        if len(kappa_powers) > MAX_TERMS:
            return None
        correction = self.correction(a)
        delta = {s: new(s) - old(s) for s in syms}
        zero = sp.Integer(0)
        contributions: list[sp.Expr] = []
        deferred: list[sp.Expr] = []
        reanchor: list[sp.Expr] = []
        for powers in kappa_powers:
            part = centred  # the coefficient of prod kappa^powers, unexpanded
            for k, p in zip(kappas, powers):
                part = sp.diff(part, k, p) / math.factorial(p)
            part = part.xreplace({k: zero for k in kappas})
            part_polys = [sp.Poly(br, *syms) for br in where_branches(sp.expand(part, power_exp=True))]
            degrees = [max(p.degree(s) for p in part_polys) for s in syms]
            total_degree = max(p.total_degree() for p in part_polys)
            orders = [o for o in multi_indices(degrees) if sum(o) <= total_degree]
            if len(contributions) + len(orders) > MAX_TERMS:
                return None
            acc = [sp.Symbol(f"acc[{len(contributions) + k}]") for k in range(len(orders))]
            for order in orders:
                self.check("Taylor coefficients")
                d = part
                for s, k in zip(syms, order):
                    d = sp.diff(d, s, k) / math.factorial(k)
                contributions.append(masked_exps_combined(a * d))
                self.check_range(contributions[-1])
            factor = b * sp.Mul(*(kept[k] ** p for k, p in zip(kappas, powers)))
            deferred += [factor] + [zero] * (len(orders) - 1)
            for order in orders:
                total = zero
                for k, other in enumerate(orders):
                    if all(o >= q for o, q in zip(other, order)):
                        coeff = sp.Integer(1)
                        for s, o, q in zip(syms, other, order):
                            coeff *= sp.binomial(o, q) * delta[s] ** (o - q)
                        total += acc[k] if other == order else ShiftTerm(acc[k], coeff)
                reanchor.append(correction * total)
        contributions, deferred, reanchor = merge_alike(contributions, deferred, reanchor, correction)
        contributions, deferred, reanchor = counted_out(contributions, deferred, reanchor,
                                                         self.streamed | self.dep_syms)
        count = len(contributions)
        return ReductionForm(
            self.step, self.F, dep_names, "taylor", terms=tuple(terms), contributions=tuple(contributions),
            scales=(a,) * count, deferred=tuple(deferred), corrections=(correction,) * count,
            reanchor=tuple(reanchor), effective_op="sum",
            anchors={n: anchorable[s] for n, s in self.deps.items() if s in set(syms) | (a.free_symbols & self.dep_syms)},
            guards=self.guards_for([correction]),
        )

    def realise_order(self, terms: list[Term], dep_names: tuple[str, ...]) -> ReductionForm:
        op = self.step.reduce
        assert op is not None
        live = self.live_branch(strip_casts(self.F))
        if live is not None:
            # where(c, a(D) G(x) + b(D), -inf): a masked-out element stays -inf (or +inf) under any
            # a(D) > 0 and finite b(D), so the order form is that of the live branch; the
            # contribution keeps the user's where()
            terms = self.separate(live)
        offset = sum((t.h for t in terms if t.g == 1), sp.Integer(0))
        varying = [t for t in terms if t.g != 1]
        if len(varying) != 1:
            raise NotSeparable(
                f"{op} needs F = a(D)*G(x) + b(D), but F = {self.F} has {len(varying)} independent "
                "terms in the streamed values"
            )
        (t,) = varying
        rest = t.h / self.anchored_factor(t.h)  # the realisation runs the op on G * A with A > 0
        if rest.is_positive:
            eff = op
        elif rest.is_negative:
            eff = reduce_op(op).swapped
        else:
            raise NotSeparable(
                f"cannot decide the sign of the factor {t.h} (it must be provably > 0 or < 0 to keep the order)"
            )
        return self.scaled([t], dep_names, offset=offset, op=eff)

    def shifted(self, terms: list[Term], dep_names: tuple[str, ...]) -> ReductionForm | None:
        """Welford/Chan-style realisation when every changing term's sum is known from partials."""
        n = axis_size(self.conv.spec, self.axis)
        sum_deps = {
            name: sym for name, sym in self.deps.items() if self.forms[name].independent and self.forms[name].op == "sum"
        }
        anchors = self.max_type()
        if set(self.deps.values()) - anchors - set(sum_deps.values()):
            return None
        self.check_sentinel_anchors(self.deps.values())
        delta = sp.Integer(0)
        for t in terms:
            self.check("shifted terms")
            if not (t.h.free_symbols & self.dep_syms):
                continue  # this term never changes with the anchors
            if t.g == 1:
                seen_sum = COUNT_OLD
            else:
                seen_sum = None
                for name, sym in sum_deps.items():
                    if has_cast(self.forms[name].integrand):
                        continue  # its partial sums the cast values, not G: sum(cast(a)) is not sum(a)
                    ratio = masked_ratio(t.g, strip_casts(self.forms[name].integrand))
                    if ratio is None:
                        continue
                    if not any(self.along_axis(s) for s in ratio.free_symbols):
                        # sum of G over what was seen = ratio * partial(dep); partial = anchor * count / N
                        seen_sum = ratio * old(sym) * COUNT_OLD / n
                        break
                if seen_sum is None:
                    return None
            delta += seen_sum * (t.h.xreplace({s: new(s) for s in self.dep_syms}) - t.h.xreplace({s: old(s) for s in self.dep_syms}))
        delta = sp.factor(delta)
        anchor_kind = {name: "running estimate (partial * size / count)" for name in sum_deps}
        anchor_kind.update({n_: "running" for n_, s in self.deps.items() if s in anchors})
        return ReductionForm(
            self.step, self.F, dep_names, "shifted", terms=tuple(terms), delta=delta, anchors=anchor_kind,
            guards=self.guards_for([]) + ("count[old] = 0: the anchor is 0 and the correction vanishes",),
            effective_op="sum",
        )
