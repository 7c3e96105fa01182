"""The backward of a cascade, derived as cascades of the same grammar.

Given a forward spec, :func:`derive_backward` writes the vector-Jacobian product of its outputs
for every float input as one or more specs: each reads the forward's inputs it needs, the
*saved statistics* (forward reductions the forward writes as extra outputs: a row's max and
denominator, a mean square), and an upstream gradient ``d_<output>`` per output; each writes
``d_<input>``. Those specs derive, fuse, certify, generate and tune like any other.

How (reverse accumulation over the steps, last to first):

1. Every output's adjoint starts as its upstream gradient. A step's adjoint is the sum of what its
   readers sent it; it is named as a step of its own when it is more than one name.
2. A step sends each name it reads ``adjoint * partial(expr, name)``
   (:func:`fuser_core.backward.differentiate.partial`), summed over the dims the name lacks: a
   reduction of the backward, over the step's own ``over`` for a sum, over the broadcast dims for
   an input with fewer dims (a norm's weight: over the tokens, another axis than the forward's).
3. Such a sum that is a factor free of the summed dim times a forward sum's own summand is that
   forward sum (``sum_n exp(s - mx) v / den`` is the forward's ``o``): read, not recomputed.
4. A max or min the outputs do not depend on (a softmax's shift, :mod:`fuser_core.backward.shift`)
   sends nothing. Any other sends its adjoint to the elements equal to it, split evenly among
   ties, as torch's ``amax`` does.
5.-8. What the backward reads saved and how its steps are packed into specs (per-row statistics
   saved, attention's scores recomputed; one spec per set of outer reduction axes; a stage before
   where a gradient's outer reductions span two axes, or where a value they read sums over a dim
   too long to hold whole at the sizes given): :mod:`fuser_core.backward.packing`.

Not differentiated, and said so: index inputs (labels, positions), runtime scalars (eps, a
scale: constants to the backward), argmax/argmin results (their uses are conditions). Refused,
naming the field: topk steps, merged dims, paged inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fuser_core import expr as ex
from fuser_core.backward.packing import BackStep, Packer, load_backward, refs, step_json
from fuser_core.backward.shift import is_shift
from fuser_core.backward.vanishing import vanishing_sums
from fuser_core.backward.differentiate import (
    NotDifferentiable, ONE, ZERO, add, div, folded, is_zero, mul, neg, partial, where,
)
from fuser_core.errors import SpecError
from fuser_core.spec import load_spec
from fuser_core.spec_model import Input, Param, Spec, Step, raw_param

GRAD_PREFIX = "d_"
EXAMPLE_SIZE = 7  # each dim's size for the numeric checks when the spec has no example


def probe_shape(spec: Spec, shape: Mapping[str, int] | None = None) -> dict[str, int]:
    """The sizes the backward's numeric checks run at: ``shape``, else the spec's example, else
    ``EXAMPLE_SIZE`` for every dim."""
    return dict(shape or spec.example or {d: EXAMPLE_SIZE for d in spec.sized_dims})


@dataclass(frozen=True)
class Gradient:
    """Where one input's gradient is written: ``output`` of backward spec ``spec``, over ``dims``
    (the backward spec's dim order; transpose to the input's own order when they differ)."""

    input: str
    output: str
    spec: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class BackwardCascade:
    forward: Spec  # the forward spec writing the saved statistics too
    saved: tuple[str, ...]  # the forward's reductions the backward reads (outputs of ``forward``)
    specs: tuple[Spec, ...]  # the backward specs, in the order they run
    gradients: tuple[Gradient, ...]  # one per differentiated input with a gradient
    upstream: dict[str, str]  # forward output -> the backward's input holding its gradient
    zero: tuple[str, ...] = ()  # float inputs whose gradient is zero (read only in conditions)
    not_differentiated: dict[str, str] = field(default_factory=dict)  # name -> why
    shifts: tuple[str, ...] = ()  # max/min steps found to be shifts (no gradient)
    staged: tuple[str, ...] = ()  # results of a backward spec that a later one reads (specs run in order)
    vanished: dict[str, str] = field(default_factory=dict)  # backward sums zero for every input, dropped

    def spec(self, name: str) -> Spec:
        return next(s for s in self.specs if s.name == name)


def derive_backward(spec: Spec, shape: Mapping[str, int] | None = None,
                    sizes: Mapping[str, int] | None = None) -> BackwardCascade:
    """The backward cascade(s) of ``spec`` (module doc). ``shape``: the sizes the shift test runs
    at (default: the spec's example). ``sizes``: the sizes the kernels will run at, where the packing
    depends on them (rule 8: a dim too long to hold whole); none: packed as for short dims.
    Raises :class:`SpecError` naming what it cannot differentiate."""
    _refuse(spec)
    return _Reverse(spec, shape, sizes).build()


def _refuse(spec: Spec) -> None:
    if spec.merges:
        raise SpecError("a reduction over several dims has no backward yet", loc=("steps",))
    for inp in spec.inputs:
        if inp.paged is not None:
            raise SpecError("a paged input has no backward (the cache is not trained)", loc=("inputs", inp.name))
    for i, step in enumerate(spec.steps):
        if step.reduce == "topk":
            raise SpecError("a topk step has no backward yet", loc=("steps", i, "reduce"), step=step.name)


# ---------------------------------------------------------------- factors (rule 3)


def _factors(e: ex.Expr) -> tuple[int, Counter, Counter]:
    """``e`` as sign * prod(numerator) / prod(denominator), through *, / and negation."""
    if isinstance(e, ex.Neg):
        s, n, d = _factors(e.operand)
        return -s, n, d
    if isinstance(e, ex.BinOp) and e.op in "*/":
        s1, n1, d1 = _factors(e.left)
        s2, n2, d2 = _factors(e.right)
        return (s1 * s2, n1 + n2, d1 + d2) if e.op == "*" else (s1 * s2, n1 + d2, d1 + n2)
    return 1, Counter([e]), Counter()


def _product(sign: int, num: Counter, den: Counter) -> ex.Expr:
    """sign * prod(num) / prod(den), the numerator's numbers multiplied into one (``2 * 0.5``: none)."""
    coefficient = 1.0
    for f in [f for f in num if isinstance(f, ex.Num)]:
        coefficient *= f.value ** num[f]
    out: ex.Expr = ex.Num(coefficient)
    for f in num.elements():
        if not isinstance(f, ex.Num):
            out = mul(out, f)
    for f in den.elements():
        out = div(out, f)
    return neg(out) if sign < 0 else out


def _replace_top_down(e: ex.Expr, table: Mapping[ex.Expr, ex.Expr]) -> ex.Expr:
    """``e`` with every largest subexpression found in ``table`` replaced."""
    if e in table:
        return table[e]
    if isinstance(e, ex.Neg):
        return ex.Neg(_replace_top_down(e.operand, table))
    if isinstance(e, ex.BinOp):
        return ex.BinOp(e.op, _replace_top_down(e.left, table), _replace_top_down(e.right, table))
    if isinstance(e, ex.Call):
        return ex.Call(e.func, tuple(_replace_top_down(a, table) for a in e.args))
    if isinstance(e, ex.Cast):
        return ex.Cast(_replace_top_down(e.operand, table), e.dtype)
    return e  # conditions keep the forward's own text


# ---------------------------------------------------------------- the builder


class _Reverse:
    """Reverse accumulation over one spec's steps (module doc): the backward steps, then the specs."""

    def __init__(self, spec: Spec, shape: Mapping[str, int] | None, sizes: Mapping[str, int] | None = None):
        self.spec = spec
        self.shape = probe_shape(spec, shape)
        self.sizes = sizes
        self.used: set[str] = {i.name for i in spec.inputs} | {p.name for p in spec.params} | {s.name for s in spec.steps}
        self.dims: dict[str, tuple[str, ...]] = {i.name: i.dims for i in spec.inputs} | {s.name: s.dims for s in spec.steps}
        self.kinds: dict[str, str] = {}  # new inputs' kinds
        self.steps: list[BackStep] = []
        self.contrib: dict[str, list[ex.Expr]] = {}
        self.upstream: dict[str, str] = {}
        self.not_differentiated: dict[str, str] = {}
        self.shifts: list[str] = []
        self.vanished: dict[str, str] = {}
        # forward elementwise steps' expressions -> their names: the backward reads them by name
        self.named = {s.expr: ex.Ref(s.name) for s in spec.steps if not s.is_reduction}
        # the forward's elementwise outputs (read by the backward, not recomputed), as factors
        self.outputs_factored = {s.name: _factors(s.expr) for s in spec.steps
                                 if not s.is_reduction and s.name in spec.outputs}

    # -- names and dims
    def fresh(self, base: str) -> str:
        name, i = base, 2
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name

    def expr_dims(self, e: ex.Expr) -> tuple[str, ...]:
        found: set[str] = set()
        for node in ex.walk(e):
            if isinstance(node, ex.Ref):
                found.update(self.dims.get(node.name, ()))
            elif isinstance(node, ex.Index):
                found.add(node.dim)
        return self.spec.order_dims(found)

    def add_step(self, base: str, e: ex.Expr, reduce: str | None = None, over: str | None = None) -> ex.Ref:
        name = self.fresh(base)
        e = _replace_top_down(e, self.named)
        dims = self.expr_dims(e)
        self.dims[name] = tuple(d for d in dims if d != over) if reduce else dims
        self.steps.append(BackStep(name, e, reduce, over))
        return ex.Ref(name)

    # -- rules 2 and 3
    def forward_sum(self, term: ex.Expr, dim: str) -> ex.Expr | None:
        """``sum over dim of term`` as a forward sum times a factor free of ``dim`` (rule 3), or None."""
        sign, num, den = _factors(term)
        for step in self.spec.steps:
            if step.reduce != "sum" or step.over != dim:
                continue
            s2, n2, d2 = _factors(step.expr)
            if n2 - num or d2 - den:  # not all of the summand's factors are in the term
                continue
            rest = _product(sign * s2, num - n2, den - d2)
            if dim not in self.expr_dims(rest):
                return mul(rest, ex.Ref(step.name))
        return None

    def new_sum(self, term: ex.Expr, dim: str) -> ex.Expr:
        """``sum over dim of term`` as a new reduction, the factors free of ``dim`` (a row's
        ``1 / den``) kept outside it: once per row instead of once per element, one rounding less."""
        sign, num, den = _factors(term)
        outside = Counter({f: c for f, c in num.items() if dim not in self.expr_dims(f)}), \
            Counter({f: c for f, c in den.items() if dim not in self.expr_dims(f)})
        inside = _product(1, num - outside[0], den - outside[1])
        return mul(_product(sign, *outside), self.add_step("s", inside, "sum", dim))

    def send(self, term: ex.Expr, target: str) -> None:
        """Add ``term`` to ``target``'s adjoint, summed over the dims ``target`` lacks: first over a
        dim where a forward sum is found (rule 3), else the innermost."""
        if is_zero(term):
            return
        term = _replace_top_down(term, self.named)  # the forward's steps by name: a saved output stays one factor
        own = self.dims[target]
        while extra := [d for d in self.expr_dims(term) if d not in own]:
            found = next(((d, f) for d in reversed(extra) if (f := self.forward_sum(term, d)) is not None), None)
            term = found[1] if found else self.new_sum(term, extra[-1])
        self.contrib.setdefault(target, []).append(term)

    def total(self, name: str) -> ex.Expr | None:
        """The sum of what ``name``'s readers sent it (None: nothing)."""
        terms = self.contrib.get(name)
        if not terms:
            return None
        return self.collected(terms) if len(terms) > 1 else terms[0]

    def collected(self, terms: list[ex.Expr]) -> ex.Expr:
        """``sum(terms)`` with the factors common to every term outside: softmax's
        ``d_y * y + d_den * exp(x - mx)`` (``d_den = -S / den``) is ``y * (d_y - S)``, torch's
        form, with one rounding less on the cancellation at a peaked row's maximum. A factor that
        names a backward step of the row (``d_den``) is looked into for this, and a forward output's
        numerator is written as the output times its denominator (``exp(x - mx) = y den``): the
        backward then reads ``y`` and computes no exp."""
        back = {s.name: s for s in self.steps if s.reduce is None}

        def flat(term: ex.Expr) -> tuple[int, Counter, Counter]:
            sign, num, den = _factors(term)
            for f in [f for f in num if isinstance(f, ex.Ref) and f.name in back]:
                s2, n2, d2 = _factors(back[f.name].expr)
                sign, num, den = sign * s2, num - Counter({f: 1}) + n2, den + d2
            for name, (s2, n2, d2) in self.outputs_factored.items():  # A = y B for an output y = A / B
                if d2 and not n2 - num:
                    sign, num, den = sign * s2, num - n2 + Counter({ex.Ref(name): 1}) + d2, den
            common = num & den
            return sign, num - common, den - common

        parts = [flat(t) for t in terms]
        common_num = Counter(parts[0][1])
        common_den = Counter(parts[0][2])
        for _, num, den in parts[1:]:
            common_num &= num
            common_den &= den
        for c in (common_num, common_den):
            for f in [f for f in c if isinstance(f, ex.Num)]:
                del c[f]
        plain = terms[0]
        for t in terms[1:]:
            plain = add(plain, t)
        if not common_num and not common_den:
            return plain
        rest: ex.Expr = ZERO
        for sign, num, den in parts:
            rest = add(rest, _product(sign, num - common_num, den - common_den))
        return mul(_product(1, common_num, common_den), rest)

    def adjoint(self, name: str) -> ex.Expr | None:
        """:meth:`total`, named as a step when it is more than a name or a number."""
        total = self.total(name)
        if total is None or isinstance(total, ex.Ref | ex.Num):
            return total
        return self.add_step(GRAD_PREFIX + name, total)

    def differentiable(self, name: str) -> bool:
        obj = self.spec.lookup(name)
        if isinstance(obj, Param):
            self.not_differentiated[name] = "a runtime scalar or constant: fixed for the backward" if obj.runtime \
                else "a constant"
            return False
        if isinstance(obj, Input) and obj.is_index:
            self.not_differentiated[name] = "an index input"
            return False
        if isinstance(obj, Step) and obj.is_integer:
            self.not_differentiated[name] = f"an {obj.reduce} (positions: read in conditions only)"
            return False
        return True

    # -- rule 1, 2 and 4: one step
    def back_step(self, step: Step) -> None:
        if step.name not in self.contrib or step.is_integer:
            return
        if step.reduce in ("max", "min") and is_shift(self.spec, step, self.shape):
            self.shifts.append(step.name)
            return
        adjoint = self.adjoint(step.name)
        assert adjoint is not None
        if step.reduce in ("max", "min"):
            # to the elements equal to the extreme, split among ties
            hit = ex.Compare("==", step.expr, ex.Ref(step.name))
            count = self.add_step("n_" + step.name, where(hit, ONE, ZERO), "sum", step.over)
            adjoint = div(where(hit, adjoint, ZERO), count)
        for name in refs(step.expr):
            if not self.differentiable(name):
                continue
            try:
                local = partial(step.expr, name)
            except NotDifferentiable as err:
                raise SpecError(f"no backward: {err}", loc=("steps", self.spec.steps.index(step), "expr"),
                                step=step.name) from None
            self.send(mul(adjoint, local), name)

    # -- the whole
    def build(self) -> BackwardCascade:
        spec = self.spec
        for out in spec.outputs:
            name = self.fresh(GRAD_PREFIX + out)
            self.upstream[out] = name
            self.dims[name] = spec.step(out).dims
            self.contrib[out] = [ex.Ref(name)]
        for step in reversed(spec.steps):
            self.back_step(step)
        gradients: dict[str, ex.Ref] = {}
        zero: list[str] = []
        for inp in spec.inputs:
            if inp.is_index:
                self.not_differentiated[inp.name] = "an index input"
                continue
            total = self.total(inp.name)
            if total is None:
                zero.append(inp.name)
                continue
            missing = [d for d in inp.dims if d not in self.expr_dims(total)]
            for d in missing:  # constant along d: broadcast by naming the dim
                total = ex.BinOp("+", total, ex.BinOp("*", ZERO, ex.Index(d)))
            gradients[inp.name] = self.add_step(GRAD_PREFIX + inp.name, total)
        self.drop_vanishing()
        for inp, ref in list(gradients.items()):
            if is_zero(next(s.expr for s in self.steps if s.name == ref.name)):
                zero.append(inp)
                del gradients[inp]
        return self.assemble(gradients, zero)

    def drop_vanishing(self) -> None:
        """Backward sums that are zero for every input (a statistic's stationarity) replaced by 0
        (:mod:`fuser_core.backward.vanishing`)."""
        found = vanishing_sums(self.spec, self.steps, self.dims, self.upstream, self.shape)
        if not found:
            return
        self.vanished = {s.name: f"sum over {s.over} of {ex.to_text(s.expr)}" for s in self.steps if s.name in found}
        zeros = {ex.Ref(name): ZERO for name in found}
        for s in self.steps:
            s.expr = folded(ex.map_expr(s.expr, lambda n: zeros.get(n)))

    # -- rules 5 to 7 (fuser_core.backward.packing)
    def assemble(self, gradients: dict[str, ex.Ref], zero: list[str]) -> BackwardCascade:
        packer = Packer(self.spec, self.steps, self.dims, self.upstream, self.sizes)
        packs = packer.pack({inp: ref.name for inp, ref in gradients.items()})
        input_of = {ref.name: inp for inp, ref in gradients.items()}
        specs, grads, all_saved, staged = [], [], set(), []
        staged_dims: dict[str, tuple[str, ...]] = {}
        for i, (outs, closure) in enumerate(packs):
            members = [input_of[o] for o in outs if o in input_of]
            if members:
                name = f"{self.spec.name}_backward" + ("" if len(packs) == 1 else f"_{'_'.join(members)}")
                doc = f"Backward of {self.spec.name}: the gradients of {', '.join(members)} (derived by Foldwise)."
            else:
                name = f"{self.spec.name}_backward_stage{i + 1}"
                doc = f"Backward of {self.spec.name}: {', '.join(outs)}, read by the next backward spec (derived by Foldwise)."
                staged += outs
            raw = packer.spec_json(name, doc, outs, closure, staged_dims)
            # a stage's reductions are row statistics (FlashAttention's Delta): float32; a staged
            # elementwise value (rule 8's d_logits) is stored as the data, as torch's backward rounds it
            if statistics := {o: STATISTIC_DTYPE for o in outs if not members and packer.over(o) is not None}:
                raw["output_dtypes"] = statistics
            backward = load_backward(raw)
            staged_dims |= {o: backward.step(o).dims for o in outs}
            all_saved |= closure.saved
            specs.append(backward)
            grads += [Gradient(m, gradients[m].name, name, backward.step(gradients[m].name).dims) for m in members]
        saved_order = tuple(s.name for s in self.spec.steps if s.name in all_saved)
        return BackwardCascade(
            forward=self.saving_forward(saved_order), saved=saved_order, specs=tuple(specs), gradients=tuple(grads),
            upstream=dict(self.upstream), zero=tuple(zero), not_differentiated=dict(self.not_differentiated),
            shifts=tuple(self.shifts), staged=tuple(staged), vanished=dict(self.vanished))

    def saving_forward(self, saved: tuple[str, ...]) -> Spec:
        """The forward spec with the saved statistics as outputs too, stored in float32 (statistics_json)."""
        spec = self.spec
        extra = [s for s in saved if s not in spec.outputs]
        if not extra:
            return spec
        raw = statistics_json(spec, extra)
        raw["name"] = f"{spec.name}_saving"
        raw["doc"] = f"{spec.doc} Also writes {', '.join(extra)} for the backward."
        return load_spec(raw, printed=True)


#: the dtype a statistic the backward reads is stored in, whatever the data's: a row's max or sum in
#: bfloat16 (2^-9 relative) would move exp(s - mx) by |mx| 2^-9 (28% at scores near 100), a norm's rstd
#: every gradient by its rounding; FlashAttention keeps its lse and Delta, Liger its rstd, in float32
STATISTIC_DTYPE = "float32"


def statistics_json(spec: Spec, extra: list[str]) -> dict[str, Any]:
    """``spec``'s JSON also writing the steps ``extra`` (statistics a backward reads), each a value
    stored as :data:`STATISTIC_DTYPE` (an index one stays int32)."""
    raw = spec_json(spec)
    raw["outputs"] = list(spec.outputs) + extra
    stored = {s: STATISTIC_DTYPE for s in extra if not spec.step(s).is_integer}
    if stored:
        raw["output_dtypes"] = {**raw.get("output_dtypes", {}), **stored}
    return raw


def spec_json(spec: Spec) -> dict[str, Any]:
    """``spec`` as its JSON (the specs :func:`derive_backward` accepts and writes: no merged dims,
    pages or topk)."""
    return {
        "foldwise": 1, "name": spec.name, "doc": spec.doc,
        "inputs": {i.name: {"dims": list(i.dims), **({"kind": i.kind} if i.is_index else {})} for i in spec.inputs},
        "params": {p.name: raw_param(p) for p in spec.params},
        "steps": [step_json(s.name, s.expr, s.reduce, s.over) for s in spec.steps],
        "outputs": list(spec.outputs),
        **({"output_dtypes": dict(spec.output_dtypes)} if spec.output_dtypes else {}),
        **({"example": dict(spec.example)} if spec.example else {}),
        **({"constraints": [" ".join(c) for c in spec.constraints]} if spec.constraints else {}),
    }
