"""What a derivation decides, as data: a separated term, a reduction's form, an axis group, an
epilogue step, the whole :class:`Derivation`; and the limits the derivation works within.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from fuser_core.realisation import Realisation, empty_adds_zero, realise
from fuser_core.spec import Spec, Step
from fuser_core.symbolic import SymbolicSpec

MAX_TERMS = 32  # rank limit for multi-term separation
MAX_EXPAND_POWER = 12  # (x + D)**p with larger p is not expanded
MAX_SEPARATE_EXPONENT = 64  # x**p * D**p (sympy splits (x*D)**p) is not separated beyond this |p|
MAX_TAYLOR_DEGREE = 4  # polynomial degree in the dependencies for Taylor-shifted accumulators
SENTINEL_MAGNITUDE = 1e15  # a constant this large in a where() is a mask value, not data
# Wall-clock budget of one derivation: derive_cascade raises DerivationLimitError past it (the
# size limits of fuser_core.symbolic keep each sympy operation between two checks short).
DERIVE_TIME_LIMIT_S = 5.0

GATHERED = "gathered"  # a form kind: see ReductionForm.gathered
WEIGHTED_MEAN = "running weighted mean (the running value)"  # an anchor kind: see Deriver.weighted_mean



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
    kind: str  # first | scaled | shifted | taylor | gathered | not_fused (read only by fuser_core.realisation)
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
    gather: tuple[sp.Expr, sp.Expr] | None = None  # gathered: (X, at), fuser_core.derive.gathers.gather_form
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
    def gathered(self) -> bool:
        """Fused as one load after the loop (:mod:`fuser_core.derive.gathers`): X at the positions a
        selection over the axis chose. No state of the loop, no realisation: the kernel's value is
        X's at that position, the reference's one term."""
        return self.kind == GATHERED

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
