"""The walk of each strategy's kernels: row_resident, multi_pass (and its fallback passes),
streaming_fused, split_fused's part and combine kernels; and the finished list of operations.
"""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

from fuser_core.codegen.names import safe_name
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.ops import (
    Chunk,
    Comment,
    Copy,
    Count,
    FallbackFlag,
    InitState,
    Loop,
    Offsets,
    Op,
    PartMerge,
    Program,
    Reduce,
    Value,
    WorkspaceLoad,
    WorkspaceStore,
    walk,
)
from fuser_core.codegen.structure.facts import anchored_deps, placeholder, reads_count, sum_of_anchored_exps, workspace
from fuser_core.codegen.structure.walk_streaming import StreamingWalk
from fuser_core.codegen.tritonize import VarRef
from fuser_core.masks import may_exclude_every
from fuser_core.realisation import (
    COUNT_OLD,
    Realisation,
    new,
    part_acc,
    part_anchor,
    part_count,
)
from fuser_core.reduce_ops import has_slots, is_selection
from fuser_core.spec import Step


class StrategiesWalk(StreamingWalk):
    """Each strategy's kernels (a part of :class:`~fuser_core.codegen.structure.build.Walk`)."""

    def row_resident(self) -> None:
        a = self.axis

        def body():
            self.axis_tile("0")
            for step in self.axis_steps():
                integrand = self.conv.integrand(step)
                # no identity_loads here: the row stays live through every reduction and output, and with
                # -inf in its masked lanes sm_90 spilled more (safe_softmax n=32768: 560 -> 992 bytes)
                self.need([integrand])
                self.add(Comment(text=f"# {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}"))
                self.direct_reduction(step, integrand)
            self.outputs()

        self.loop("axis", "start", bound.ZERO, bound.name(f"size_{a}"), bound.name(f"BLOCK_{a}"), body, resident=True)

    def direct_reduction(self, step: Step, value: sp.Expr) -> None:
        if not is_selection(self.effective_op(step)):  # the whole axis is one tile: its reduction is the value
            env = self.env(value)
            dot, masked, dims = self.tile_fold(step, value, env)
            if dot is not None:
                dot = self.dot_excluded(dot, value, self.effective_op(step))
                env = self.env(dot.p, dot.q, dot.scale)
            var = safe_name(step.name)
            self.add(Reduce(step=step.name, name=var, dims=dims, op=self.effective_op(step), over=self.axis, expr=value,
                            env=env, inner=False, dot=dot, masked=masked))
            self.values[step.name] = self.let(var, dims)
            return
        acc = self.init_state(step)[0]
        self.fold(step, acc, value)
        if is_selection(step.reduce):
            self.set_result(step, self.selected(step, acc), f"{acc}_indices")
        else:
            self.set_result(step, self.var(acc))

    def multi_pass(self) -> None:
        for step in self.axis_steps():
            self.one_pass(step)
        self.outputs()

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

    def streaming_fused(self) -> None:
        a = self.axis
        self.streaming_loop("axis", bound.ZERO, bound.name(f"size_{a}"))
        self.finalize()
        self.outputs()
        self.fallback()

    def split_part(self) -> None:
        self.add(Chunk(part=True))
        a = self.axis
        self.streaming_loop("chunk", bound.name("lo"), bound.minimum(bound.plus(bound.name("lo"), bound.name("chunk")), bound.name(f"size_{a}")))
        for w in workspace(self.plan):
            self.add(WorkspaceStore(entry=w.name, entry_dims=w.dims, dims=self.order(w.dims), value_dims=self.var_dims[w.name]))

    def combine_kernel(self) -> None:
        if self.grid.split:
            self.add(Chunk(part=False))
        self.combine()
        self.finalize()
        self.outputs()
        self.fallback()


    # -- split: partial states over chunks of the axis, then a derived combine
    def combine(self) -> None:
        a = self.axis
        steps = self.axis_steps()
        accs = {s.name: self.init_state(s, len(self.realisation(s).accumulators)) for s in steps}
        anchors = anchored_deps(self.plan)
        for dep in anchors:
            dims = self.order(self.spec.step(dep).dims)
            self.add(InitState(name=f"{safe_name(dep)}_anchor", dims=dims, dtype="float32", fill=None))
            self.let(f"{safe_name(dep)}_anchor", dims)
        counts = reads_count(self.plan)
        if counts:
            self.add(Count(mode="init", axis=a))
        ws = {w.name: w.dims for w in workspace(self.plan)}

        def body():
            self.depth += 1
            if counts:
                self.add(Count(mode="part", axis=a))
            for dep in anchors:
                var = safe_name(dep)
                self.add(Copy(name=f"{var}_anchor_old", dims=self.var_dims[f"{var}_anchor"], source=f"{var}_anchor"))
                self.let(f"{var}_anchor_old", self.var_dims[f"{var}_anchor"])
                self.load_part(f"{var}_anchor", ws[f"{var}_anchor"], other="0.0")
            for step in steps:
                self.merge_part(step, accs[step.name], ws)
                if step.name in anchors:
                    self.update_anchor(step)
            self.depth -= 1

        self.loop("split", "split", bound.ZERO, bound.name("SPLIT"), None, body)
        self.accs = accs

    def load_part(self, name: str, dims: tuple[str, ...], other: str = "0") -> str:
        tile = self.order(dims)
        self.add(WorkspaceLoad(entry=name, dims=tile, entry_dims=dims, other=other))
        self.let(f"{name}_part", tile)
        return f"{name}_part"

    def merge_part(self, step: Step, accs: list[str], ws: dict[str, tuple[str, ...]]) -> None:
        """Fold part `split` into the merged state with the realisation's merge rule:
        acc_k = op(moved_k(merged so far), moved_k(part)), both moved to the merged anchors."""
        real = self.realisation(step)
        self.add(Comment(text=f"# {step.name}: merge part `split` ({real.kind})"))
        parts = []
        for a, acc in zip(real.accumulators, accs):
            if a.selection:
                # the padding slots of a top-k list (BLOCK_as > k) must never win a merge: -inf, not 0
                # (lists are kept largest-first: a bottomk accumulates negated values)
                parts.append(self.load_part(f"{acc}_values", ws[f"{acc}_values"], other='float("-inf")'))
                self.load_part(f"{acc}_indices", ws[f"{acc}_indices"], other="2147483647")
            else:
                parts.append(self.load_part(acc, ws[acc]))
        rules = real.merge()
        self.need([r.left for r in rules] + [r.right for r in rules])
        names: dict = {COUNT_OLD: VarRef("count_old"), part_count("a"): VarRef("count_old"), part_count("b"): VarRef("count_part")}
        for j, (merged, part) in enumerate(zip(self.state_names(real, accs), parts)):
            names[part_acc(j, "a")] = self.var(merged)
            names[part_acc(j, "b")] = self.var(part)
        for dep in anchored_deps(self.plan):
            sym = self.conv.symbols[dep]
            names[part_anchor(sym, "a")] = self.var(f"{safe_name(dep)}_anchor_old")
            names[part_anchor(sym, "b")] = self.var(f"{safe_name(dep)}_anchor_part")
            names[new(sym)] = self.var(f"{safe_name(dep)}_anchor")
        lefts: list[sp.Expr] = [r.left for r in rules]
        extra = dict(names)
        if real.moves_jointly:  # a Taylor shift reads every merged accumulator: none may be updated first
            held = []
            for acc, left in zip(accs, lefts):
                env = self.env(left, extra=names)
                self.add(Value(name=f"{acc}_moved", dims=self.dims_of(left, env), expr=left, env=env))
                holder = placeholder(f"{acc}_moved")
                extra[holder] = self.let(f"{acc}_moved", self.dims_of(left, env))
                held.append(holder)
            lefts = held
        for acc, rule, left in zip(accs, rules, lefts):
            env = self.env(left, rule.right, extra=extra)
            state = self.var_dims[f"{acc}_values"] if is_selection(rule.op) else self.var_dims[acc]
            self.add(PartMerge(step=step.name, name=acc, dims=state, op=rule.op, left=left, right=rule.right, env=env,
                               slots=step.as_dim if has_slots(rule.op) else None,
                               k=step.k if has_slots(rule.op) else None))
        if self.read_in_loop(step):
            self.running_value(step, accs)
        elif not real.selection and real.value not in real.symbols:
            self.hoist([real.value])

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


# ---------------------------------------------------------------------- kernels and arguments
