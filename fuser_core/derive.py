"""The derivation: does a cascade fuse into one incremental loop, and how (docs/THEORY.md 2-5).

For every reduction of a spec, :func:`derive_cascade` finds its cascade axis (``over``),
the earlier reductions over that axis it reads (its dependencies D, after inlining
elementwise steps), and decides with sympy whether its integrand F(x, D) separates:

- ``sum``: F = sum_j G_j(x) H_j(D) with finitely many terms (rank 1 is RedFuser's
  multiplicative case; rank > 1 is docs/THEORY.md section 5's multi-term case);
- ``max``/``min``/``topk``/``argmax``/``argmin``: F = a(D) G(x) + b(D) with a(D) provably
  positive (order kept) or negative (max and min swap), decided by sympy's assumptions.

The split is found by expanding F (exponentials of sums become products) and sorting each
factor of each term into streamed (x), dependent (D) or neutral; a factor that mixes x
and D -- ``sin(x*mx)``, ``Max(x, mean)`` -- makes the reduction non-fusible, and that factor
is the reason given.

Each fused reduction gets a realisation, the state a loop carries and how it is updated:

- ``first``: no dependency; the plain partial reduction.
- ``scaled``: one accumulator per term, each anchored at the running value of the max/min
  dependencies it has (``T_j = sum G_j(x) A_j(D~)``); when the anchor moves the
  accumulator is multiplied by the correction ``A_j(D_new) / A_j(D_old)`` (for softmax
  ``exp(mx_old - mx_new)``); the rest of ``H_j`` (for attention ``1 / den``) is applied
  once, at the end, with final values. Max/min/topk use the same with one term.
- ``shifted``: for multi-term sums whose changing terms can be re-expressed from running
  partial sums, where no Taylor form exists (a cast inside F), the accumulator holds
  ``sum F(x, D~)`` at an anchor that tracks the running estimate of each sum dependency (the
  running mean), and moving the anchor adds a sympy-factored correction
  (``count (mean_new - mean_old)^2 / N``): Welford/Chan's update, derived rather than written in.
  It takes ``sum (x - mean~)`` as 0, which the rounded running mean makes false, so the Taylor
  form below comes first (layernorm's variance is Taylor).
- ``taylor``: for sums ``F = A(D) B(D) P(x, D)`` with ``A`` a positive factor of the max/min
  dependencies (anchored, as in ``scaled``), ``B`` a factor applied at the end and ``P``
  polynomial in the anchorable dependencies (running max/min, running estimates of sums):
  the accumulators hold the Taylor coefficients ``sum A(D~) d^a P(x, D~) / a!`` at the
  anchors, and moving the anchors by ``delta`` is the exact binomial shift
  ``acc_a <- c * sum_{b >= a} binom(b, a) delta^(b - a) acc_b`` (Pebay's higher-moment
  updates). Every accumulator stays centred, so ``sum (x - mx)^2`` or a softmax-weighted
  variance never go through raw power sums. Factors that read dependencies with no running
  anchor (``log(den)``) are kept apart: F = sum_b k^b P_b, each ``P_b`` centred on its own
  accumulators and ``k^b`` applied at the end (softmax entropy: ``sum exp(x - mx) (x - mx)``).
  A weighted mean ``sum w g / W`` (``W = sum w`` at the same anchors) anchors at its running
  value, a convex combination of the ``g`` seen (:meth:`_Deriver.weighted_mean`). A top-order
  coefficient that reads neither the streamed values nor an anchor (layernorm's ``sum 1 / N``)
  is ``count * c`` and gets no state (:func:`_counted_out`).

Some realisations are refused (the step is then not fused, and the reason says why) because
they are exact in real arithmetic but not in floating point, found by fuzzing
(``benchmarks/fuzz_long.py``; docs/THEORY.md section 5):

- an anchored exponent the running max/min does not bound (``exp(x - mx)`` with
  ``mx = max(x**3)``): early running maxima sit far below the final one and the state
  overflows where the unfused value does not (:meth:`_Deriver.check_range`);
- a polynomial of degree 2 or more centred on the running estimate of a *raw* sum (one
  without ``1/size(axis)``): the estimate ``partial * N / count`` strays by about
  ``N / sqrt(count)`` values' worth early on, and the square cancels float32 accuracy away.
  Means (also ``s / size(n)`` of a raw ``s``), maxima and minima keep the Taylor form;
- a polynomial of degree 2 or more centred on a running max (min) that its values may exceed
  (:meth:`_Deriver.one_sided`): a move of the centre then adds terms of both signs;
- raw power sums: an end factor of degree 2 or more in a dependency with no running anchor
  (:meth:`_Deriver.check_raw_moments`).

Each fused form is then turned, once, into a :class:`~fuser_core.realisation.Realisation`
(``Derivation.realisations``): its accumulators as data, with the one tile-step and merge rule
for every kind (a merge re-anchors both parts to the merged dependencies and combines them with
the reduction's operator). The certificate, the kernel printer, the report and the tuner read
that object; :mod:`fuser_core.certificate` checks it numerically.

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "sm", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...               {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
    ...     "outputs": ["den"]})
    >>> d = derive_cascade(spec)
    >>> d.forms["den"].kind, d.forms["den"].corrections
    ('scaled', (exp(-mx[new] + mx[old]),))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy as sp

from fuser_core import expr as ex
from fuser_core.realisation import COUNT_OLD, Realisation, ShiftTerm, empty_adds_zero, new, old, realise
from fuser_core.spec import Spec, Step
from fuser_core.symbolic import Deadline, SymbolicSpec, axis_size, cast_decides, has_cast, strip_casts

MAX_TERMS = 32  # rank limit for multi-term separation
MAX_EXPAND_POWER = 12  # (x + D)**p with larger p is not expanded
MAX_SEPARATE_EXPONENT = 64  # x**p * D**p (sympy splits (x*D)**p) is not separated beyond this |p|
MAX_TAYLOR_DEGREE = 4  # polynomial degree in the dependencies for Taylor-shifted accumulators
SENTINEL_MAGNITUDE = 1e15  # a constant this large in a where() is a mask value, not data
# Wall-clock budget of one derivation: derive_cascade raises DerivationLimitError past it (the
# size limits of fuser_core.symbolic keep each sympy operation between two checks short).
DERIVE_TIME_LIMIT_S = 5.0

WEIGHTED_MEAN = "running weighted mean (the running value)"  # an anchor kind: see _Deriver.weighted_mean

SUM_OPS = ("sum",)
ORDER_OPS = ("max", "min", "topk", "argmax", "argmin")
SWAPPED = {"max": "min", "min": "max", "argmax": "argmin", "argmin": "argmax", "topk": "bottomk"}


@dataclass(frozen=True)
class Term:
    """One term G(x) * H(D) of a separated integrand."""

    g: sp.Expr
    h: sp.Expr


@dataclass
class ReductionForm:
    """How one reduction is computed inside its axis's loop (or why it is not)."""

    step: Step
    integrand: sp.Expr  # F(x, D), elementwise steps inlined, casts kept
    deps: tuple[str, ...]  # same-axis reductions F reads
    kind: str  # first | scaled | shifted | taylor | not_fused (read only by fuser_core.realisation)
    reason: str | None = None
    terms: tuple[Term, ...] = ()
    # scaled: per accumulator j
    contributions: tuple[sp.Expr, ...] = ()  # C_j(x, D~): what a tile adds, at the anchors
    scales: tuple[sp.Expr, ...] = ()  # A_j(D): the anchored factor
    deferred: tuple[sp.Expr, ...] = ()  # H_j / A_j: applied once at the end
    corrections: tuple[sp.Expr, ...] = ()  # A_j(D_new) / A_j(D_old)
    offset: sp.Expr = sp.Integer(0)  # b(D) for order reductions (value = deferred * T + offset)
    effective_op: str = ""  # the op actually run on T (max and min swap when a(D) < 0)
    # per accumulator: its deferred factor may be infinite where the reference has 0 -- it reads a
    # max/min (-inf while every element is masked out) or divides by a result that may be 0 (a
    # masked sum); an accumulator still 0 then adds 0, not 0 * inf (see final_value)
    empty_adds_zero: tuple[bool, ...] = ()
    # shifted
    delta: sp.Expr | None = None  # added to the accumulator when the anchors move
    # taylor: accumulator k after the anchors move, in terms of acc[j] (all j) and dep[old]/dep[new]
    reanchor: tuple[sp.Expr, ...] = ()
    anchors: dict[str, str] = field(default_factory=dict)  # dep -> "running" | "running estimate"
    guards: tuple[str, ...] = ()
    exact: bool = True  # False when a cast inside F makes the fused form differ from multi-pass
    contraction: bool = False  # a sum of a product that tl.dot should compute
    # what every consumer reads (fuser_core.realisation): built once by derive_cascade, None when not fused
    realisation: Realisation | None = None

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def op(self) -> str:
        assert self.step.reduce is not None
        return self.step.reduce

    @property
    def axis(self) -> str:
        assert self.step.over is not None
        return self.step.over

    @property
    def fused(self) -> bool:
        return self.reason is None

    def settles_at(self, syms: set[sp.Symbol]) -> bool:
        """Does the reference evaluate this reduction's integrand at the final value of ``syms`` (its
        running max/min anchors) on every element? Not where every branch of F reading them is under a
        where() condition (a mask): a fully masked row never evaluates exp(x - mx) at mx = -inf, and
        its sum is the fill's 0. Where it does, a fused kernel moves its accumulators from the safe
        anchor to the final value at the end (codegen.structure, certificate): exp(inf - inf) is NaN
        there, as in the reference."""
        F = self.integrand
        if not isinstance(F, sp.Piecewise):
            return True
        return any(cond == sp.true for value, cond in F.args if value.free_symbols & syms)

    @property
    def independent(self) -> bool:
        """Fused with no dependency: a plain partial reduction (its running value is exact)."""
        return self.fused and not self.deps

    def final_value(self, accs: list[sp.Expr]) -> sp.Expr:
        """The reduction's value from its accumulators ``accs`` (scaled and taylor forms):
        ``sum_j deferred_j * acc_j + offset``, where a guarded empty accumulator adds 0."""
        total = self.offset
        for j, (factor, acc) in enumerate(zip(self.deferred, accs)):
            term = factor * acc
            if j < len(self.empty_adds_zero) and self.empty_adds_zero[j]:
                term = empty_adds_zero(term, acc)
            total += term
        return total


@dataclass
class AxisGroup:
    """The reductions over one axis: one loop when all are fused."""

    axis: str
    members: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]  # (dependency, dependent)

    @property
    def horizontal(self) -> tuple[str, ...]:
        """Members with no dependency inside the group: they share the loop side by side."""
        dependents = {b for _, b in self.edges}
        return tuple(m for m in self.members if m not in dependents)


@dataclass(frozen=True)
class EpilogueStep:
    """An elementwise step computed from final values; ``second_pass`` when it still has a
    reduced axis (softmax's ``y``), so the kernel must read that axis again."""

    name: str
    reads: tuple[str, ...]
    second_pass: bool


@dataclass
class Derivation:
    spec: Spec
    forms: dict[str, ReductionForm]
    groups: tuple[AxisGroup, ...]
    epilogue: tuple[EpilogueStep, ...]
    symbols: SymbolicSpec

    @property
    def fusible(self) -> bool:
        """True when every dependent reduction fused (docs/THEORY.md: one loop per axis)."""
        return all(f.fused for f in self.forms.values())

    @property
    def exact(self) -> bool:
        return all(f.exact for f in self.forms.values())

    def realise(self, name: str) -> Realisation:
        """(Re)build the realisation of fused reduction ``name`` from its form: what derive_cascade
        does once; a test that edits a form calls it so that every consumer sees the edit."""
        form = self.forms[name]
        form.realisation = realise(form, tuple(self.symbols.symbols[d] for d in form.deps))
        return form.realisation

    @property
    def realisations(self) -> dict[str, Realisation]:
        """The realisation of every fused reduction, by name."""
        return {n: f.realisation for n, f in self.forms.items() if f.realisation is not None}


class NotSeparable(Exception):
    """F does not separate; the message names the offending term."""


def derive_cascade(spec: Spec, *, time_limit_s: float | None = DERIVE_TIME_LIMIT_S) -> Derivation:
    """Derive every reduction of ``spec``; see the module docstring for what comes out.

    Raises :class:`~fuser_core.errors.DerivationLimitError` (naming the step) when the work
    would exceed ``time_limit_s`` seconds (None: no limit) or a size limit of
    :mod:`fuser_core.symbolic`; it never hangs on a crafted spec and is safe in any thread.
    """
    conv = SymbolicSpec(spec, deadline=Deadline(time_limit_s))
    for step in spec.steps:  # every step within the limits and defined, not only those reductions read
        if not step.is_reduction:
            conv.value(step.name)
    forms: dict[str, ReductionForm] = {}
    for step in spec.steps:
        if step.is_reduction:
            conv.deadline.check(f"step {step.name!r}")
            forms[step.name] = _Deriver(conv, step, forms).derive()
    groups: dict[str, list[str]] = {}
    for form in forms.values():
        groups.setdefault(form.axis, []).append(form.name)
    axis_groups = tuple(
        AxisGroup(axis, tuple(members), tuple((d, m) for m in members for d in forms[m].deps))
        for axis, members in groups.items()
    )
    conv.deadline = Deadline(None)  # the budget was this derivation's; later users (codegen) convert freely
    derivation = Derivation(spec, forms, axis_groups, _epilogue(spec), conv)
    for name, form in forms.items():
        if form.fused:
            derivation.realise(name)  # once: every consumer reads this object
    return derivation


def _epilogue(spec: Spec) -> tuple[EpilogueStep, ...]:
    """Elementwise steps after the loops: they read final reduction values and feed no reduction."""
    read_by_reduction: set[str] = set()
    reads: dict[str, set[str]] = {}  # elementwise step -> reductions it reads, through other elementwise steps
    for step in spec.steps:
        direct = {n.name for n in ex.walk(step.expr) if isinstance(n, ex.Ref)}
        if step.is_reduction:
            read_by_reduction |= direct
            continue
        found: set[str] = set()
        for name in direct:
            obj = spec.lookup(name)
            if isinstance(obj, Step):
                found |= {name} if obj.is_reduction else reads.get(name, set())
        reads[step.name] = found
    out = []
    for step in spec.steps:
        if step.is_reduction or step.name in read_by_reduction or not reads.get(step.name):
            continue
        # a top-k's slots (its `as` dim) are held whole after the loop: keeping them is no second pass
        selected = {s.as_dim for s in spec.steps if s.as_dim}
        axes = {spec.step(r).over for r in reads[step.name]} - selected
        out.append(EpilogueStep(step.name, tuple(sorted(reads[step.name])), any(a in step.dims for a in axes)))
    return tuple(out)


class _Deriver:
    def __init__(self, conv: SymbolicSpec, step: Step, forms: dict[str, ReductionForm]):
        self.conv = conv
        self.step = step
        self.forms = forms
        self.axis = step.over
        self.F = conv.integrand(step)

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
                        "no single loop over the axis can provide it",
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
        for name in dep_names:
            dep_form = self.forms[name]
            if dep_form.op not in ("sum", "max", "min"):
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
            if step.reduce in SUM_OPS:
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
            if p.exp.is_number and p.base.free_symbols & (xs | ds) and not _at_most(p.exp, MAX_SEPARATE_EXPONENT):
                # sum(x**p) * D**p over- and underflows where the product x**p * D**p does not
                raise NotSeparable(
                    f"{sp.sstr(p.base)[:60]} is raised to an exponent beyond {MAX_SEPARATE_EXPONENT}: "
                    "its separated factors would over- or underflow"
                )
        estimate = _expanded_terms(F, 4 * MAX_TERMS)
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
                        f"the term {factor} mixes the streamed values ({_names(free & xs)}) with {_names(free & ds)}, "
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

    # -- realisations
    def max_type(self) -> set[sp.Symbol]:
        """Dependencies whose running value is a max or min: the natural anchors."""
        out = set()
        for name, sym in self.deps.items():
            f = self.forms[name]
            if (f.effective_op or f.op) in ("max", "min"):
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
                candidate = _combined((self.F - offset) / rest)
                if not (candidate.free_symbols & (self.dep_syms - anchors)):
                    contribution = candidate
                elif has_cast(self.F):
                    raise NotSeparable(
                        f"a cast inside F reads {_names(candidate.free_symbols & (self.dep_syms - anchors))}, "
                        "a sum result with no running anchor"
                    )
            if contribution is None:
                contribution = _combined(t.g * a)
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
                    f"{_names(syms)}, which has no running anchor to centre on; the end would cancel float32 accuracy away"
                )

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
        scaled_up = _combined(strip_casts(form.integrand) * n)
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
        So the state is bounded when ``E(x) + s * I_m(x)`` is bounded above (:func:`_bounded`): for
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
        for power, known in _powers_under_conditions(sp.powsimp(contribution, combine="exp")):
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
                    bound = bound.xreplace({sym: _given(strip_casts(form.integrand), known)})
                else:
                    below_final.add(sym)  # the running value keeps the term below its final size
            if not _bounded(sp.expand(bound), upper=True, varies=lambda v: self.along_axis(v) and v not in below_final):
                raise NotSeparable(
                    f"exp({exponent}) is not bounded by the running value of "
                    f"{_names(exponent.free_symbols & set(anchors))}: the fused state could overflow before "
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
        for power, _ in _powers_under_conditions(sp.powsimp(contribution, combine="exp")):
            free = power.free_symbols
            if free & anchors or not any(self.along_axis(v) and v not in self.dep_syms for v in free):
                continue
            raise NotSeparable(
                f"{held[0]} reads the running {_names(held[0].free_symbols & anchors)} but is applied only at the "
                f"end (it also reads {_names((held[0].free_symbols & self.dep_syms) - anchors) or 'no anchor alone'}), "
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
        centred, kept = _kept_apart(_combined(strip_casts(self.F) / (a * b)), self.dep_syms - set(anchorable),
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
                f"a polynomial of degree >= 2 in {_names(set(raw))} would be centred on the running estimate "
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
            part_polys = [sp.Poly(br, *syms) for br in _branches(sp.expand(part, power_exp=True))]
            degrees = [max(p.degree(s) for p in part_polys) for s in syms]
            total_degree = max(p.total_degree() for p in part_polys)
            orders = [o for o in _multi_indices(degrees) if sum(o) <= total_degree]
            if len(contributions) + len(orders) > MAX_TERMS:
                return None
            acc = [sp.Symbol(f"acc[{len(contributions) + k}]") for k in range(len(orders))]
            for order in orders:
                self.check("Taylor coefficients")
                d = part
                for s, k in zip(syms, order):
                    d = sp.diff(d, s, k) / math.factorial(k)
                contributions.append(_combined(a * d))
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
        contributions, deferred, reanchor = _merge_alike(contributions, deferred, reanchor, correction)
        contributions, deferred, reanchor = _counted_out(contributions, deferred, reanchor,
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
            eff = SWAPPED[op]
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
                    ratio = _masked_ratio(t.g, strip_casts(self.forms[name].integrand))
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


def _at_most(value: sp.Expr, bound: float) -> bool:
    """|value| <= bound for a sympy number (False for nan, oo or a complex number)."""
    try:
        return abs(float(value)) <= bound
    except (TypeError, ValueError, OverflowError):
        return False


def _bounded(e: sp.Expr, *, upper: bool, varies) -> bool:
    """Is ``e`` provably bounded above (``upper``) or below, whatever the values of the symbols
    ``varies`` accepts? Interval reasoning over sums, constant multiples, min/max, where and a
    few bounded functions; ``False`` when unsure (the caller then refuses to fuse)."""
    if not any(varies(v) for v in e.free_symbols):
        return True
    if isinstance(e, sp.Piecewise):
        return all(_bounded(branch, upper=upper, varies=varies) for branch, _ in e.args)
    if e.is_Add:
        for arg in e.args:  # push the rest of the sum into a min, max or where, where it may cancel
            k, core = arg.as_coeff_Mul()
            if isinstance(core, (sp.Min, sp.Max)) and k.is_number and k.is_extended_real and k != 0:
                # k * max(a, b) is max(k a, k b) for k > 0 and min(k a, k b) for k < 0: an attention
                # sink's s - max(s, sink) is min(0, s - sink), bounded above by its 0
                func = core.func if k > 0 else (sp.Max if core.func is sp.Min else sp.Min)
                rest = e - arg
                return _bounded(func(*(k * a + rest for a in core.args), evaluate=False), upper=upper, varies=varies)
            if isinstance(arg, sp.Piecewise):
                return _bounded(sp.piecewise_fold(e), upper=upper, varies=varies)
        return all(_bounded(arg, upper=upper, varies=varies) for arg in e.args)
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff.is_number and coeff != 1:
            return _bounded(sp.expand(rest), upper=upper if coeff > 0 else not upper, varies=varies)
        return False
    if isinstance(e, (sp.Min, sp.Max)):
        one_suffices = isinstance(e, sp.Min) == upper  # min(a, b) <= a; max(a, b) >= a
        test = any if one_suffices else all
        return test(_bounded(sp.expand(a), upper=upper, varies=varies) for a in e.args)
    if isinstance(e, (sp.sin, sp.cos, sp.tanh)):
        return True
    if isinstance(e, sp.exp):
        return not upper or _bounded(e.args[0], upper=True, varies=varies)
    return False


def _combined(e: sp.Expr) -> sp.Expr:
    """``e`` with factors moved into a where() (a mask) and exponentials combined in each branch:
    ``exp(-mx) * where(c, exp(x), 0)`` is ``where(c, exp(x - mx), 0)``, so that the anchor stays
    inside the exponent the range check and the kernel see."""
    e = sp.piecewise_fold(e)
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*((sp.powsimp(v, combine="exp"), c) for v, c in e.args))
    return sp.powsimp(e, combine="exp")


def _masked_ratio(g: sp.Expr, integrand: sp.Expr) -> sp.Expr | None:
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


def _powers_under_conditions(e: sp.Expr, known: tuple[tuple[sp.Basic, bool], ...] = ()):
    """Every exp/power in ``e`` with the where() conditions known to hold (True) or fail (False)
    where it is evaluated: branch i of a Piecewise runs when its condition holds and every
    earlier one failed."""
    if isinstance(e, sp.Piecewise):
        before: tuple[tuple[sp.Basic, bool], ...] = ()
        for value, cond in e.args:
            yield from _powers_under_conditions(value, known + before + ((cond, True),))
            before += ((cond, False),)
        return
    if isinstance(e, (sp.exp, sp.Pow)):
        yield e, known
    for arg in e.args:
        yield from _powers_under_conditions(arg, known)


def _given(e: sp.Expr, known: tuple[tuple[sp.Basic, bool], ...]) -> sp.Expr:
    """``e`` with a top-level where() resolved by the ``known`` conditions, where they decide it."""
    if not isinstance(e, sp.Piecewise):
        return e
    decided = dict(known)
    for value, cond in e.args:
        if cond is sp.true or decided.get(cond) is True:
            return _given(value, known)
        if decided.get(cond) is not False:
            return e  # undecided here: the whole where()
    return e


def _merge_alike(contributions: list[sp.Expr], deferred: list[sp.Expr], reanchor: list[sp.Expr],
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


def _counted_out(contributions: list[sp.Expr], deferred: list[sp.Expr], reanchor: list[sp.Expr],
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


def _branches(e: sp.Expr) -> list[sp.Expr]:
    """The values of a where() (a mask), or ``[e]``."""
    return [v for v, _ in e.args] if isinstance(e, sp.Piecewise) else [e]


def _kept_apart(e: sp.Expr, apart: set[sp.Symbol], inside: set[sp.Symbol]) -> tuple[sp.Expr, dict[sp.Symbol, sp.Expr]]:
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


def _names(syms: set[sp.Symbol]) -> str:
    return ", ".join(sorted(str(s) for s in syms))


def _expanded_terms(e: sp.Expr, cap: int) -> int:
    """An upper bound on the number of terms ``expand`` makes of ``e``, saturating above ``cap``.

    Checked before expanding, so that a spec cannot make sympy multiply out a huge product.
    """
    if e.is_Add:
        return min(cap + 1, sum(_expanded_terms(a, cap) for a in e.args))
    if e.is_Mul:
        out = 1
        for a in e.args:
            out = min(cap + 1, out * _expanded_terms(a, cap))
        return out
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        base = _expanded_terms(e.base, cap)
        return min(cap + 1, math.comb(base + int(e.exp) - 1, int(e.exp)))
    inner = max((_expanded_terms(a, cap) for a in e.args), default=1)  # expand(deep=True) reaches into functions
    return min(cap + 1, inner)


def _multi_indices(degrees: list[int]) -> list[tuple[int, ...]]:
    """All (a_1..a_k) with 0 <= a_i <= degrees[i], lowest total order first."""
    out: list[tuple[int, ...]] = [()]
    for d in degrees:
        out = [o + (k,) for o in out for k in range(d + 1)]
    return sorted(out, key=lambda o: (sum(o), o))
