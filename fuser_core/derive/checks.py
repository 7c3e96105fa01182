"""The floating-point checks that refuse realisations exact only in real arithmetic: anchors,
means and centring, one-sided polynomials, unbounded exponents, sentinel anchors
(docs/THEORY.md section 5).
"""

from __future__ import annotations

import sympy as sp

from fuser_core.derive.algebra import given, is_bounded, masked_exps_combined, powers_under_conditions, symbol_names
from fuser_core.derive.anchoring import AnchoringDeriver
from fuser_core.derive.forms import SENTINEL_MAGNITUDE, WEIGHTED_MEAN, NotSeparable
from fuser_core.symbolic import axis_size, has_cast, strip_casts


class CheckingDeriver(AnchoringDeriver):
    """Anchorable dependencies and the refusal checks (a part of :class:`~fuser_core.derive.realise.Deriver`)."""

    def anchorable(self) -> dict[sp.Symbol, str]:
        """Dependencies with a running anchor: max/min (running value), first-level sums (estimate)."""
        out = {s: "running" for s in self.max_type()}
        for name, sym in self.deps.items():
            f = self.forms[name]
            if f.independent and f.op == "sum":
                out[sym] = "running estimate (partial * size / count)"
            elif self.weighted_mean(name):
                out[sym] = WEIGHTED_MEAN
        return out

    def weighted_mean(self, name: str) -> bool:
        """Is dependency ``name`` a weighted mean ``sum w g / W`` with ``W = sum w`` another fused
        dependency and ``w >= 0`` (softmax-weighted mean: ``sum exp(x - mx) v / den``)? Its running
        value, both sums over the values seen at the same anchors, is then a convex combination of
        the g seen (West's weighted mean): within their range, a centre as good as the final one."""
        f = self.forms[name]
        if f.kind != "scaled" or f.op != "sum" or has_cast(f.integrand):
            return False
        for w_name in f.deps:
            w = self.forms[w_name]
            w_sym = self.conv.symbols[w_name]
            if (w.kind != "scaled" or w.op != "sum" or any(d != 1 for d in w.deferred)
                    or any(sp.simplify(d * w_sym) != 1 for d in f.deferred)
                    or len(set(w.scales) | set(f.scales)) != 1 or not sp.Add(*w.contributions).is_nonnegative):
                continue
            # every accumulator of f deferred by 1/W: its running value is sum(f's contributions) / W
            g = sp.cancel(sp.Add(*f.contributions) / sp.Add(*w.contributions))
            if not any(self.conv.leaf_step.get(s) is not None for s in g.free_symbols):
                return True
        return False

    def mean_like(self, sym: sp.Symbol) -> bool:
        """Is ``sym`` a sum over the axis of an integrand carrying 1/size(axis)? Its running estimate
        (partial * size / count) is then a running average, within the range of the values averaged."""
        form = self.forms[self.conv.leaf_step[sym].name]
        n = axis_size(self.conv.spec, self.axis)
        scaled_up = masked_exps_combined(strip_casts(form.integrand) * n)
        branches = [v for v, _ in scaled_up.args] if isinstance(scaled_up, sp.Piecewise) else [scaled_up]
        return form.op == "sum" and not any(n in sp.cancel(b).free_symbols for b in branches)

    def centred_as_mean(self, branches: list[sp.Expr], sym: sp.Symbol) -> bool:
        """Does every branch read the raw sum ``sym`` only as ``sym / size(axis)`` (``(x - s / size(n))^2``
        with ``s = sum(x)``)? Its centre is then the running mean, as for a mean itself."""
        n = axis_size(self.conv.spec, self.axis)
        for br in branches:
            for (k,), c in sp.Poly(br, sym).terms():
                if k and (sp.cancel(c * n**k).free_symbols & n.free_symbols):
                    return False
        return True

    def one_sided(self, branches: list[sp.Expr], kappas: list[sp.Symbol], sym: sp.Symbol) -> bool:
        """Can a Taylor form centred on the running max (min) ``sym`` move its centre without cancellation?

        Moving the centre by delta adds ``sum_j P^(j) delta^j / j!`` to each element's value. With
        ``sym = I + t`` (a min: ``I - t``), ``I`` the max's own integrand and ``t >= 0`` how far the running
        value is past the element's own (every element seen is at most the running max), the terms share
        one sign when every derivative of P in ``t`` is provably of one sign: ``(x - mx)^2`` is ``t^2``, its
        derivatives ``2t`` and ``2``. ``(maximum(w, x) - mx)^2`` is not: w may lie above the running max."""
        form = self.forms[self.conv.leaf_step[sym].name]
        integrand = strip_casts(form.integrand)
        values = ([v for v, _ in integrand.args if v.is_finite is not False and v not in (sp.oo, -sp.oo)]
                  if isinstance(integrand, sp.Piecewise) else [integrand])
        t = sp.Dummy("t", nonnegative=True)
        direction = 1 if form.op == "max" else -1  # the step's own op: max(-x) realised as a min is still >= -x
        for br in branches:
            parts = [c for _, c in sp.Poly(br, *kappas).terms()] if kappas else [br]
            for part in parts:
                degree = sp.Poly(part, sym).degree()
                if degree <= 1:  # linear: one move is one product delta * acc1, as the formula's own product
                    continue
                for value in values:
                    q = sp.expand(part.xreplace({sym: value + direction * t}))
                    signs = set()
                    for j in range(degree + 1):
                        d = sp.expand(sp.diff(q, t, j))
                        if d == 0:
                            continue
                        if d.is_nonnegative:
                            signs.add(1)
                        elif d.is_nonpositive:
                            signs.add(-1)
                        else:
                            return False
                    if len(signs) > 1:
                        return False
        return True

    def check_range(self, contribution: sp.Expr) -> None:
        """Refuse an anchored contribution whose running state can overflow where the final value cannot.

        The state holds ``G(x) * A(D~)`` at the running max/min ``D~``. An exponent ``E(x) + s * m``
        with the running ``m`` moving away from the final value in the direction that grows it
        (``s < 0`` for a running max, which only rises to its final value) is largest right after
        the element that set ``m``, where ``m`` equals that element's own integrand ``I_m(x)``.
        So the state is bounded when ``E(x) + s * I_m(x)`` is bounded above (:func:`is_bounded`): for
        softmax, ``x - mx`` becomes ``x - x = 0`` and every term is at most 1. ``exp(x - mx)`` with
        ``mx = max(x**3)`` is refused: early running maxima can be far below the final one.

        The argument needs only that the exponent is monotone in ``m`` (:meth:`monotone_direction`),
        not that it is linear: an attention sink's ``exp(s - maximum(mx, sink))`` is non-increasing
        in the running ``mx``. Every element i already seen has ``mx~ >= I_m(x_i)`` (the running max
        includes it), so its term is at most ``exp(E(x_i) - maximum(I_m(x_i), sink))``, and the bound
        ``s - maximum(s, sink) = minimum(0, s - sink) <= 0`` keeps every term at most 1, as for
        softmax. A direction that grows the term towards the final value (a running max in
        ``exp(maximum(mx, c) - x)``) is bounded by the final value, a constant of the loop, as before.
        """
        anchors = {sym: self.forms[name] for name, sym in self.deps.items() if sym in self.max_type()}
        if not anchors:
            return
        for power, known in powers_under_conditions(sp.powsimp(contribution, combine="exp")):
            self.check("range of the anchored state")
            if isinstance(power, sp.exp):
                exponent = power.args[0]
            elif power.base.is_number and power.base.is_positive:
                exponent = power.exp * sp.log(power.base)
            else:
                continue
            exponent = sp.expand(exponent)
            if not exponent.free_symbols & set(anchors):
                continue
            bound, below_final = exponent, set()
            for sym, form in anchors.items():
                direction = self.monotone_direction(exponent, sym)
                if direction == 0:
                    continue
                rising = form.op == "max"  # a running max only rises, a running min only falls
                if (direction < 0) == rising:
                    # under the where() branch that evaluates this power, the dependency's own mask
                    # (the same condition on the same element) has taken its branch too
                    bound = bound.xreplace({sym: given(strip_casts(form.integrand), known)})
                else:
                    below_final.add(sym)  # the running value keeps the term below its final size
            if not is_bounded(sp.expand(bound), upper=True, varies=lambda v: self.along_axis(v) and v not in below_final):
                raise NotSeparable(
                    f"exp({exponent}) is not bounded by the running value of "
                    f"{symbol_names(exponent.free_symbols & set(anchors))}: the fused state could overflow before "
                    "the anchor reaches its final value"
                )

    def check_deferred_anchor(self, contribution: sp.Expr, rest: sp.Expr) -> None:
        """Refuse a term whose anchoring exponential is deferred to the end while the state holds an
        unanchored exponential of the streamed values: ``exp(x - maximum(mx, t))`` with ``t`` a sum over
        the same axis cannot be anchored at the running ``mx`` (``t`` has no running value there), so
        the loop would sum ``exp(x)``, which overflows (x > 88 in float32) where the formula does not."""
        anchors = self.max_type()
        held = sorted((p for p in rest.atoms(sp.exp) if p.free_symbols & anchors), key=str)
        if not held:
            return
        for power, _ in powers_under_conditions(sp.powsimp(contribution, combine="exp")):
            free = power.free_symbols
            if free & anchors or not any(self.along_axis(v) and v not in self.dep_syms for v in free):
                continue
            raise NotSeparable(
                f"{held[0]} reads the running {symbol_names(held[0].free_symbols & anchors)} but is applied only at the "
                f"end (it also reads {symbol_names((held[0].free_symbols & self.dep_syms) - anchors) or 'no anchor alone'}), "
                f"so the loop would sum the unanchored {power}, which can overflow where the formula does not"
            )

    def loop_constant(self, e: sp.Expr) -> bool:
        """Is ``e`` the same at every element of the axis and through the whole loop: no streamed value,
        no same-axis result (a per-head sink, a param, a size, a result over another axis)?"""
        return not any(self.along_axis(v) for v in e.free_symbols)

    def monotone_direction(self, exponent: sp.Expr, sym: sp.Symbol) -> int:
        """+1 when ``exponent`` is provably non-decreasing in the anchor ``sym``, -1 when non-increasing,
        0 when it does not read it; raises NotSeparable when neither is proved.

        Each term of the (expanded) exponent reading ``sym`` must be ``c * sym`` or
        ``c * maximum(g, k_1, ..)`` / ``c * minimum(g, k_1, ..)`` with ``c`` a loop constant of known
        sign, every ``k_i`` a loop constant (:meth:`loop_constant`) and ``g`` itself such a term of
        ``sym`` alone, with loop constants (recursively). ``maximum`` and ``minimum`` are
        non-decreasing in each argument, so such a term has the direction of ``c`` times that of
        ``g``; every term must agree. Refused: a constant that varies along the axis or is another
        same-axis result (``maximum(mx, den)``: den's running value moves too, and the two anchors'
        moves need not keep one direction), an argument reading ``sym`` twice (``maximum(mx, -mx)``
        is ``|mx|``), any other function of ``sym`` (``mx**2``, ``sin(mx)``), terms that disagree
        (``mx - 2 maximum(mx, c)``), and a factor ``c`` of unknown sign."""
        direction = 0
        for term in sp.Add.make_args(sp.expand(exponent)):
            if sym not in term.free_symbols:
                continue
            d = self.term_direction(term, sym, exponent)
            if direction and d != direction:
                raise NotSeparable(f"the exponent {exponent} is not monotone in {sym}: its terms move in opposite directions")
            direction = d
        return direction

    def term_direction(self, term: sp.Expr, sym: sp.Symbol, exponent: sp.Expr) -> int:
        """The direction (+1/-1) of one term ``c * core`` of an exponent in ``sym`` (monotone_direction)."""
        unknown = NotSeparable(f"the exponent {exponent} is not linear in {sym} with a known sign, nor monotone in it "
                               "through maximum/minimum with constants of the loop")
        c, core = term.as_independent(sym, as_Add=False)
        if not self.loop_constant(c) or (c.is_positive is None and c.is_negative is None):
            raise unknown
        sign = 1 if c.is_positive else -1
        if core == sym:
            return sign
        if isinstance(core, (sp.Max, sp.Min)):
            reading = [a for a in core.args if sym in a.free_symbols]
            others = [a for a in core.args if sym not in a.free_symbols]
            if len(reading) != 1 or not all(self.loop_constant(a) for a in others):
                raise unknown
            (g,) = reading
            if not self.loop_constant(g.xreplace({sym: sp.Integer(0)})):
                raise unknown
            inner = 0
            for part in sp.Add.make_args(sp.expand(g)):
                if sym in part.free_symbols:
                    d = self.term_direction(part, sym, exponent)
                    if inner and d != inner:
                        raise unknown
                    inner = d
            return sign * inner
        raise unknown

    def masked_alike(self, sym: sp.Symbol, dep: sp.Expr) -> bool:
        """Every branch of F that reads ``sym`` is taken only under a condition of ``dep``'s own
        finite branches (masked attention's ``where(c, exp(s - mx) (s - mx), 0.5)`` with
        ``mx = max where(c, s, -inf)``): where the dependency is infinite, no element reaches it."""
        if not isinstance(dep, sp.Piecewise) or not isinstance(self.F, sp.Piecewise):
            return False
        live = {c for v, c in dep.args if v.is_finite is not False and c is not sp.true}
        for value, cond in self.F.args:
            if sym in value.free_symbols:
                parts = set(cond.args) if isinstance(cond, sp.And) else {cond}
                if not (parts & live):
                    return False
        return bool(live)

    def check_sentinel_anchors(self, syms) -> None:
        """A polynomial centred on a dependency that can be infinite or a huge sentinel at the end
        (a max/min whose every element a where() masks to +-inf or +-1e30: a fully masked row) is
        not exact: the shift cancels inf against inf (NaN where the unfused value is inf), or 1e30
        against 1e30 (fuzz seeds 43 and 44). Scaled forms keep their guards; these are refused."""
        names = {sym: name for name, sym in self.deps.items()}
        for sym in sorted(set(syms) & set(names), key=str):
            dep = self.forms[names[sym]].integrand
            atoms = dep.atoms(sp.Number)
            if not any(not a.is_finite or abs(float(a)) >= SENTINEL_MAGNITUDE for a in atoms if a.is_extended_real):
                continue
            if self.masked_alike(sym, dep):
                continue
            raise NotSeparable(
                    f"{sym} can be infinite or a sentinel (|value| >= {SENTINEL_MAGNITUDE:g}) where every element "
                    "is masked, and a polynomial centred on it would cancel inf against inf"
                )
