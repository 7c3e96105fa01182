"""The passes a walk makes besides the streamed loop: one loop over the axis per reduction with its
dependencies final (multi_pass's pass, and the fused strategies' fallback passes where a dependency
ended +-inf or NaN), and the finished list of a kernel's operations. Each strategy's own walk is in
its module (:mod:`fuser_core.codegen.strategies`), made of these primitives and the streamed loop's.
"""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

from fuser_core.codegen.ops import Comment, FallbackFlag, Loop, Offsets, Op, Program, walk
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.structure.facts import sum_of_anchored_exps
from fuser_core.codegen.structure.walk_streaming import StreamingWalk
from fuser_core.masks import may_exclude_every
from fuser_core.realisation import Realisation
from fuser_core.reduce_ops import is_selection
from fuser_core.spec import Step


class PassesWalk(StreamingWalk):
    """One pass per reduction, the fallback passes, the finished kernel (a part of
    :class:`~fuser_core.codegen.structure.build.Walk`)."""

    def one_pass(self, step: Step, gate: str | None = None) -> None:
        """A loop over the axis that reduces ``step``'s integrand with every dependency at its final
        value (multi_pass's pass); ``gate``: a 0/1 flag the loop's trip count is multiplied by (a
        fallback pass, :meth:`fallback`)."""
        a = self.axis
        integrand = self.conv.integrand(step)
        kind = "fallback pass" if gate else "pass"
        self.add(Comment(text=f"# {kind}: {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}"))
        acc = self.init_state(step)[0]

        def body():
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            self.identity_loads([(step.reduce or "", integrand)])
            self.need([integrand])
            self.fold(step, acc, integrand)
            self.depth -= 1
            self.begin_scope()

        folds = [(step.reduce or "", integrand)]
        lo, hi = self.windowed(folds, bound.ZERO, bound.name(f"size_{a}"))
        if gate:
            hi = bound.product(bound.group(hi), bound.name(gate))
            self.loop("fallback", "start", lo, hi, bound.name(f"BLOCK_{a}"), body)
        else:  # as the streamed loop (tutorial 06): whole or unmasked tiles first, without the masks
            dots = step.reduce == "sum" and self.dot(integrand, a) is not None
            if not self.split_at_mask(folds, "axis", lo, hi, body, dots=dots):
                self.loop("axis", "start", lo, hi, bound.name(f"BLOCK_{a}"), body)
        if is_selection(step.reduce):
            self.set_result(step, self.selected(step, acc), f"{acc}_indices")
        else:
            self.set_result(step, self.var(acc))

    def fallback(self) -> None:
        """After the fused loop and its stores: where a dependency (or a shifted result) ended at a value the
        fused forms do not hold, the reductions that read dependencies again, one pass each with the final
        values (as multi_pass), and the outputs that read them written again over the fused ones, for the
        whole program tile. The fused values are dead by then: the passes add no register pressure to the
        fused loop (sm_90: layernorm, GroupNorm and MoE routing keep their registers, no spill in a loop).

        The fused forms are exact for finite values. An infinite or NaN one breaks what they factor out or
        shift: ``sum(a * mask)`` kept as ``mask * sum(a)`` is +inf at mask = -inf where the formula's terms
        mix +inf and -inf (NaN); a max offset ``max(k + v)`` as ``max(k) + v``; a top-k's order under a NaN
        offset; a Taylor shift to a NaN centre, or of infinite data at a centre that changes sign. The
        checks (:meth:`fallback_checks`) leave out what the forms do hold: a running max/min anchor of a
        scaled sum that ``settle`` moves to the formula's value at +-inf, and a NaN that a scaled sum's end
        factor or offset propagates. So softmax and attention rows fully masked to -inf take no second pass
        (unless the mask is a where() in the spec). The fallback loops run 0 times elsewhere (their trip
        count is multiplied by the flag), their stores are masked off, and the tuner counts neither (fuzz
        seeds 60, 61)."""
        dependent = [s for s in self.axis_steps() if self.realisation(s).deps]
        checks = self.fallback_checks(dependent)
        if not checks:
            return
        self.add(Comment(text="# fallback: where a dependency ended +-inf or NaN, the fused forms' factored and "
                              "shifted terms do not hold; those reductions again, one pass each, and their outputs"))
        self.add(FallbackFlag(name="fallback", checks=tuple((self.values[d], what) for d, what in checks.items())))
        self.let("fallback", ())
        self.direct = True
        for step in dependent:
            self.one_pass(step, gate="fallback")
        self.direct = False
        redone = {s.name for s in dependent}
        self.outputs(gate="fallback", only={p for p in self.spec.output_parts if self.reads_any(p.split(".")[0], redone)})

    def finite_end(self, real: Realisation, sym: sp.Symbol) -> bool:
        """Is a scaled sum's end (its value from the accumulators: end factors, offsets) provably finite
        with dependency ``sym`` at +-inf, the accumulators and other dependencies finite (a sum of anchored
        exponentials positive)? An attention sink's ``acc / (den + exp(sink - maximum(mx, sink)))`` is:
        at mx = -inf its end is ``acc / (den + 1)``. Then an infinite ``sym`` is no reason for a fallback."""
        repl: dict[sp.Basic, sp.Basic] = {a: sp.Dummy(real=True, finite=True) for a in real.symbols}
        for dep in real.deps:
            other = self.conv.symbols[dep]
            if other != sym:
                positive = sum_of_anchored_exps(self.forms[dep])
                repl[other] = sp.Dummy(positive=True, finite=True) if positive else sp.Dummy(real=True, finite=True)
        for inf in (sp.oo, -sp.oo):
            if real.value.xreplace({**repl, sym: inf}).is_finite is not True:
                return False
        return True

    def reads_any(self, name: str, steps: set[str]) -> bool:
        """Does step ``name`` (its value, once earlier elementwise steps are inlined) read one of ``steps``?"""
        if name in steps:
            return True
        step = self.spec.step(name)
        # a reduction over another axis, computed in the output pass (``max over t of where(index(e) == g, q, 0)``),
        # reads what its integrand reads (fuzz seed 73: it kept the fused g where the fallback had redone g)
        value = self.conv.integrand(step) if step.is_reduction else self.conv.value(name)
        return any(s.name.split(".")[0] in steps for s in value.free_symbols)  # sel.indices: sel

    def fallback_checks(self, dependent: list[Step]) -> dict[str, str]:
        """Each dependency a fallback pass is taken for, and when: ``inf`` (+-inf) or ``nonfinite``."""
        checks: dict[str, str] = {}
        for step in dependent:
            real = self.realisation(step)
            # a row whose every element a where() on indices drops (fuser_core.masks) sums to 0, but its running max
            # ends -inf and the settle's 0 * exp(0 - -inf) is NaN: such rows take the fallback pass
            empty = any(may_exclude_every(a.contribution, a.op, self.axis, self.spec.constraints)
                        for a in real.accumulators)
            for dep in real.deps:
                if real.rescales and real.op == "sum":
                    sym = self.conv.symbols[dep]
                    at_end = sym in real.value.free_symbols
                    if (not at_end and real.anchors.get(dep) == "running" and self.forms[step.name].settles_at({sym})
                            and not empty):
                        continue  # only rescaled, by exp(anchor - final) at the end (settle): the formula's value at +-inf
                    # an end factor or offset: NaN propagates as in the formula; a running anchor under a where()
                    # is not settled (its condition need not exclude the infinite values)
                    what = "inf" if at_end else "nonfinite"
                    if what == "inf" and (sum_of_anchored_exps(self.forms[dep]) or self.finite_end(real, sym)):
                        continue  # never +-inf (a softmax denominator), or the end stays finite where it is
                else:
                    what = "nonfinite"
                if checks.get(dep) != "nonfinite":
                    checks[dep] = what
            if real.shifts:
                # an infinite value in the data: the accumulators' shifts skip an infinite accumulator, right
                # where the centre's sign does not matter, wrong where it does (-mx * v at v = -inf, mx
                # crossing 0 between tiles): a non-finite result is computed again
                checks[step.name] = "nonfinite"
        return checks

    # ------------------------------------------------------------ the kernel
    def kernel_ops(self) -> tuple[Op, ...]:
        """The set-up, hoisted loads and operations, less the offsets and masks no operation reads (a
        combine kernel has no use for the inner dims' offsets): one defined once and read nowhere is
        not set up, until none is left."""
        ops = [*self.head, *self.prologue, *self.ops]
        removed: set[str] = set()
        while True:
            defined: dict[str, int] = {}
            read: set[str] = set()
            for op in walk(ops):
                names = []
                if isinstance(op, Offsets):
                    names = [op.name] + ([f"mask_{op.dim}"] if op.mask else [])
                elif isinstance(op, Program):
                    names = [f"offs_{d}" for d in op.lanes if d not in op.tile and f"offs_{d}" not in removed]
                for n in names:
                    defined[n] = defined.get(n, 0) + 1
                read |= op.uses()
            unused = {n for n, k in defined.items() if k == 1 and n not in read}
            if not unused:
                break
            removed |= unused
            ops = _without(ops, unused)
        return tuple(_without(ops, set(), removed))


def _without(ops: list[Op], unused: set[str], removed: set[str] | None = None) -> list[Op]:
    """``ops`` with the offsets and masks named in ``unused`` not set up; ``removed``: every name taken
    out, for a program's scalar lane offsets."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Offsets) and op.name in unused:
            continue
        if isinstance(op, Offsets) and op.mask and f"mask_{op.dim}" in unused:
            op = Offsets(dim=op.dim, base=op.base, mask=False)
        elif isinstance(op, Program) and removed is not None:
            op = Program(lanes=op.lanes, tile=op.tile,
                         used=frozenset(d for d in op.lanes if d not in op.tile and f"offs_{d}" not in removed))
        elif isinstance(op, Loop):
            op = replace(op, body=tuple(_without(list(op.body), unused, removed)),
                         lanes=tuple(_without(list(op.lanes), unused, removed)))
        out.append(op)
    return out
