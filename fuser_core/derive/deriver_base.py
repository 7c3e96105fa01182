"""The derivation of one reduction, its base: which leaves of the integrand reach the axis, the
decision fused or not, and the separation of the integrand into terms.

The other parts (:mod:`.anchoring`, :mod:`.checks`, :mod:`.realise`) add to this class;
:class:`~fuser_core.derive.realise.Deriver` is all of them together.
"""

from __future__ import annotations

import sympy as sp

from fuser_core.derive.algebra import at_most, exp_logs_split, expanded_terms, masks_folded, symbol_names
from fuser_core.derive.forms import (
    GATHERED,
    MAX_EXPAND_POWER,
    MAX_SEPARATE_EXPONENT,
    MAX_TERMS,
    NotSeparable,
    ReductionForm,
    Term,
)
from fuser_core.derive.gathers import gather_form
from fuser_core.reduce_ops import is_selection
from fuser_core.spec import Step
from fuser_core.symbolic import SymbolicSpec, cast_decides, has_cast, strip_casts


class DeriverBase:
    def __init__(self, conv: SymbolicSpec, step: Step, forms: dict[str, ReductionForm]):
        self.conv = conv
        self.step = step
        self.forms = forms
        self.axis = step.over
        self.F = exp_logs_split(masks_folded(conv.integrand(step)))

    # -- classification of the integrand's leaves
    def reaches_axis(self, red: Step, seen: frozenset[str] = frozenset()) -> str | None:
        """The same-axis reduction a reduction over another axis depends on, if any."""
        for sym in self.conv.integrand(red).free_symbols:
            inner = self.conv.leaf_step.get(sym)
            if inner is None or inner.name in seen:
                continue
            if inner.over == self.axis:
                return inner.name
            found = self.reaches_axis(inner, seen | {red.name})
            if found:
                return found
        return None

    def nested_hint(self, red: Step, through: str) -> str:
        """Where the refusal comes from one reduction nested in another of the same kind over the
        dim the inner one leaves (a sum over g of a sum over c: GroupNorm written with one-dim
        steps), and every step over those two dims is such a pair, the list form of ``over`` that
        takes them in one loop; "" otherwise (a step over one of the dims alone, as a per-block
        amax, could not join a list)."""
        for outer, inner in ((self.step, red), (red, self.conv.spec.step(through))):
            if self.nests(outer, inner):
                dims = (outer.over, inner.over)
                over_them = {s.name for s in self.conv.spec.steps if s.is_reduction and s.over in dims}
                paired = {n for o in self.conv.spec.steps for i in self.conv.spec.steps if self.nests(o, i)
                          for n in (o.name, i.name)}
                if over_them <= paired:
                    listed = ", ".join(f'"{d}"' for d in dims)
                    return (f"; {outer.name} is a {outer.reduce} over {outer.over} of the {inner.reduce} "
                            f'{inner.name}: one step with "over": [{listed}] reduces both dims in one loop '
                            '(docs/SPEC.md, "Reducing over several dims")')
        return ""

    def nests(self, outer: Step, inner: Step) -> bool:
        """``outer`` reduces, by the same op, over a dim ``inner``'s result keeps, and reads it."""
        return (outer.is_reduction and inner.is_reduction and outer.reduce == inner.reduce
                and outer.reduce in ("sum", "max", "min") and isinstance(outer.over, str)
                and isinstance(inner.over, str) and outer.over in inner.dims
                and any(self.conv.leaf_step.get(sym) is inner for sym in self.conv.integrand(outer).free_symbols))

    def derive(self) -> ReductionForm:
        step, F = self.step, self.F
        deps: dict[str, sp.Symbol] = {}
        streamed: set[sp.Symbol] = set()
        for sym in sorted(F.free_symbols, key=str):
            red = self.conv.leaf_step.get(sym)
            if red is not None and red.over == self.axis:
                deps[red.name] = sym
                continue
            if red is not None:
                through = self.reaches_axis(red)
                if through:
                    return self.not_fused(
                        tuple(deps),
                        f"reads {red.name}, a reduction over {red.over} that itself needs the final {through}: "
                        "no single loop over the axis can provide it" + self.nested_hint(red, through),
                    )
            if self.axis in self.conv.leaf_dims.get(sym, ()):
                streamed.add(sym)
        order = [s.name for s in self.conv.spec.steps]
        dep_names = tuple(sorted(deps, key=order.index))
        contraction = self.is_contraction(streamed)
        if not deps:
            one = sp.Integer(1)
            return ReductionForm(
                step, F, (), "first", terms=(Term(F, one),), contributions=(F,), scales=(one,), deferred=(one,),
                corrections=(one,), effective_op=step.reduce or "", contraction=contraction,
            )
        gather = gather_form(self.conv, step, self.axis) if any(is_selection(self.forms[n].op) for n in dep_names) else None
        if gather is not None:  # X at the positions a selection over this axis chose: loaded there after its loop
            return ReductionForm(step, F, dep_names, GATHERED, gather=gather)
        for name in dep_names:
            dep_form = self.forms[name]
            if is_selection(dep_form.op):
                return self.not_fused(
                    dep_names, f"reads {name}, a {dep_form.op} result; only sum, max and min results have a running value"
                )
            if not dep_form.fused:
                return self.not_fused(dep_names, f"reads {name}, which is not fused")
        if cast_decides(F):
            return self.not_fused(
                dep_names, "a cast inside a comparison or round() decides a branch there; the fused forms work "
                "without casts, which could flip it"
            )
        self.deps = deps
        self.dep_syms = set(deps.values())
        self.streamed = streamed
        exact = not has_cast(F)
        try:
            terms = self.separate(strip_casts(F))
            if step.reduce == "sum":
                form = self.realise_sum(terms, dep_names)
            else:
                form = self.realise_order(terms, dep_names)
        except NotSeparable as err:
            return self.not_fused(dep_names, str(err))
        form.exact = exact
        form.contraction = contraction
        return form

    def not_fused(self, deps: tuple[str, ...], reason: str) -> ReductionForm:
        return ReductionForm(self.step, self.F, deps, "not_fused", reason=f"{self.step.reduce} over {self.axis}: {reason}")

    def is_contraction(self, streamed: set[sp.Symbol]) -> bool:
        """A sum over the axis of a product of tensors with other dims on both sides (a GEMM)."""
        if self.step.reduce != "sum":
            return False
        out = set(self.step.dims)
        carriers = [set(self.conv.leaf_dims[s]) - {self.axis} for s in streamed if s in self.conv.leaf_dims]
        carriers = [c for c in carriers if c]
        return len(carriers) >= 2 and not any(out <= c for c in carriers)

    def check(self, stage: str) -> None:
        self.conv.deadline.check(f"step {self.step.name!r}, {stage}")

    def along_axis(self, sym: sp.Symbol) -> bool:
        """Does ``sym`` vary along the axis or is it a same-axis result (not a constant of the loop)?
        Checked on every symbol, not only F's: a ratio of G to a dependency's integrand may bring in
        streamed values F itself does not read (``w / (logits * w)``)."""
        step = self.conv.leaf_step.get(sym)
        return self.axis in self.conv.leaf_dims.get(sym, ()) or (step is not None and step.over == self.axis)

    # -- separation
    def separate(self, F: sp.Expr) -> list[Term]:
        """F as sum_j G_j(x) H_j(D), grouped by G; raises NotSeparable naming the mixing factor."""
        xs, ds = self.streamed, self.dep_syms
        for p in F.atoms(sp.Pow):
            if p.exp.is_Integer and abs(int(p.exp)) > MAX_EXPAND_POWER and p.base.free_symbols & xs and p.base.free_symbols & ds:
                raise NotSeparable(f"{p} has a power above {MAX_EXPAND_POWER}: too many terms to separate")
            if p.exp.is_number and p.base.free_symbols & (xs | ds) and not at_most(p.exp, MAX_SEPARATE_EXPONENT):
                # sum(x**p) * D**p over- and underflows where the product x**p * D**p does not
                raise NotSeparable(
                    f"{sp.sstr(p.base)[:60]} is raised to an exponent beyond {MAX_SEPARATE_EXPONENT}: "
                    "its separated factors would over- or underflow"
                )
        estimate = expanded_terms(F, 4 * MAX_TERMS)
        if estimate > 4 * MAX_TERMS:
            raise NotSeparable(f"would expand to more than {4 * MAX_TERMS} terms: too many to separate")
        self.check("before expanding")
        E = sp.expand(F, deep=True, mul=True, multinomial=True, power_exp=True, power_base=False, log=True)
        parts = sp.Add.make_args(E)
        groups: dict[sp.Expr, sp.Expr] = {}
        for part in parts:
            self.check("separating terms")
            g, h = sp.Integer(1), sp.Integer(1)
            factors = sp.Mul.make_args(part)
            for i, factor in enumerate(factors):
                free = factor.free_symbols
                if free & xs and free & ds:
                    if self.is_mask(factor):
                        rest = sp.Mul(*factors[:i], *factors[i + 1 :])  # part / factor leaves Piecewise uncancelled
                        for t in self.separate_mask(factor, rest):
                            groups[t.g] = groups.get(t.g, sp.Integer(0)) + t.h
                        break
                    raise NotSeparable(
                        f"the term {factor} mixes the streamed values ({symbol_names(free & xs)}) with {symbol_names(free & ds)}, "
                        "so it cannot be split into G(x) * H(D)"
                    )
                if free & xs:
                    g *= factor
                else:
                    h *= factor
            else:
                groups[g] = groups.get(g, sp.Integer(0)) + h
        terms = [Term(g, sp.factor_terms(h)) for g, h in groups.items() if h != 0]
        if len(terms) > MAX_TERMS:
            raise NotSeparable(f"has {len(terms)} separable terms; the limit is {MAX_TERMS}")
        return terms

    def is_mask(self, factor: sp.Expr) -> bool:
        """A where() whose conditions read no dependency (``index(n) < len``): it selects per
        element, whatever the running values are, so it belongs to G whole."""
        return isinstance(factor, sp.Piecewise) and not any(
            cond.free_symbols & self.dep_syms for _, cond in factor.args
        )

    def live_branch(self, F: sp.Expr) -> sp.Expr | None:
        """For ``F = where(c, V, +-inf)`` (conditions free of D, every other branch infinite): V."""
        if not self.is_mask(F):
            return None
        live = [v for v, _ in F.args if v not in (sp.oo, -sp.oo)]
        return live[0] if len(live) == 1 else None

    def separate_mask(self, mask: sp.Piecewise, rest: sp.Expr) -> list[Term]:
        """``rest * where(c, v_1, ..., v_k)`` is ``sum_i where(c, 0, .., G, .., 0) * H`` over the terms
        G * H of each branch's ``rest * v_i``: masking G (not multiplying by a 0/1 indicator)
        keeps the user's guard, so a masked lane never evaluates 0 * inf."""
        out: list[Term] = []
        for i, (value, _) in enumerate(mask.args):
            for t in self.separate(rest * value):
                branches = [(t.g if j == i else sp.Integer(0), cond) for j, (_, cond) in enumerate(mask.args)]
                out.append(Term(sp.Piecewise(*branches), t.h))
        return out
