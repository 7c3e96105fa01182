"""The derivation of a whole cascade: every reduction derived in step order, the axis groups and
the epilogue.
"""

from __future__ import annotations

from fuser_core import expr as ex
from fuser_core.derive.forms import DERIVE_TIME_LIMIT_S, AxisGroup, Derivation, EpilogueStep, ReductionForm
from fuser_core.derive.realise import Deriver
from fuser_core.spec import Spec, Step
from fuser_core.symbolic import Deadline, SymbolicSpec


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
            forms[step.name] = Deriver(conv, step, forms).derive()
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
        if form.fused and not form.gathered:
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
