"""The walk of the streaming loop: the derived incremental form, anchors, running values, settling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import sympy as sp

from fuser_core.codegen.bounds import Window, axis_mask, window_bound, window_of
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.ops.bounds import Bound
from fuser_core.codegen.names import safe_name
from fuser_core.codegen.ops import (
    AnchorUpdate,
    Comment,
    Copy,
    Count,
    Finalise,
    InitState,
    LaneMerge,
    Offsets,
    Value,
    assuming,
)
from fuser_core.codegen.structure.facts import (
    FoldFact,
    anchored_deps,
    effective_op,
    per_lane,
    placeholder,
    reads_count,
    state_name,
)
from fuser_core.codegen.structure.walk_folds import FoldsWalk
from fuser_core.codegen.tritonize import VarRef
from fuser_core.realisation import (
    COUNT_OLD,
    Realisation,
    new,
    old,
    part_acc,
    part_anchor,
    settled,
    state_symbols,
)
from fuser_core.reduce_ops import is_selection
from fuser_core.spec import Step


class StreamingWalk(FoldsWalk):
    """The streaming loop (a part of :class:`~fuser_core.codegen.structure.build.Walk`)."""

    def stream_folds(self) -> list[FoldFact]:
        """The folds of the streamed loop (its reductions' tile contributions), for :func:`per_lane`."""
        out = []
        for step in self.axis_steps():
            for rule in self.realisation(step).step():
                dot = self.dot(rule.right, self.axis) if rule.op == "sum" else None
                out.append(FoldFact(step.name, self.axis, rule.op, rule.right, dot))
        return out

    def streaming_loop(self, span: str, lo: Bound, hi: Bound) -> None:
        """The loop over the axis with the realisations' step rule; per tile (each tile reduced into the
        state) or, where :func:`per_lane` allows it, per lane (each lane of the tile keeps its own state,
        updated elementwise) with the lanes merged once after the loop."""
        a = self.axis
        steps = self.axis_steps()
        self.lanes = self.lanes_states = per_lane(self.plan, self.stream_folds())[0]
        accs = {s.name: self.init_state(s, len(self.realisation(s).accumulators)) for s in steps}
        anchors = anchored_deps(self.plan)
        for dep in anchors:
            dims = self.order(self.state_dims(self.spec.step(dep).dims))
            self.add(InitState(name=self.anchor_var(dep), dims=dims, dtype="float32", fill=None))
            self.let(self.anchor_var(dep), dims)
        counts = reads_count(self.plan)
        if counts:
            self.add(Count(mode="init", axis=a))
        lanes = self.lanes

        def body():
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            if counts:
                self.add(Count(mode="tile", axis=a, hi=hi))
            for dep in anchors:
                anchor = self.anchor_var(dep)
                self.add(Copy(name=f"{anchor}_old", dims=self.var_dims[anchor], source=anchor))
                self.values[f"{dep}[old]"] = self.let(f"{anchor}_old", self.var_dims[anchor])
                self.values[f"{dep}[new]"] = self.var(anchor)
            self.values[COUNT_OLD] = VarRef("count_old")  # by symbol: a step named `count` has its own count[old]
            for step in steps:
                self.streaming_update(step, accs[step.name])
                if step.name in anchors:
                    self.update_anchor(step)
            self.depth -= 1
            self.begin_scope()
            self.accs = accs
            return (lambda: self.merge_lanes(accs)) if lanes else None

        folds = [(f.op, f.expr) for f in self.stream_folds() if not f.inner]
        start = lo
        lo, hi = self.windowed(folds, lo, hi)
        if lanes or not start.is_zero() or not self.split_at_mask(folds, span, lo, hi, body):
            self.loop(span, "start", lo, hi, bound.name(f"BLOCK_{a}"), body)

    def split_at_mask(self, folds: list[tuple[str, sp.Expr]], span: str, lo: Bound, hi: Bound,
                      body: Callable[[], Callable[[], None] | None], dots: bool | None = None) -> bool:
        """Walk the loop as two, as tutorial 06 does, where that saves work per element: the first
        covers whole tiles that need no mask, the second the rest with the masks.

        - A mask that bounds the loop from above only (causal attention: ``index(n) <= index(m)``):
          the tiles below every lane's bound (``first(m) + 1``) fold with the mask taken as true,
          the diagonal with it.
        - Otherwise, in a loop of tensor-core tiles (issue-bound: its masks cost as much as its
          dots): the whole tiles fold without the tail mask, the last partial tile with it.

        Both first loops stop at a tile boundary at or below ``size(axis)``: no tail mask in them.
        ``dots``: does the loop fold a tl.dot (default: the streamed loop's folds; a multi_pass pass
        says for its own). False when neither applies (the caller walks one loop)."""
        a = self.axis
        cond = self.axis_mask(folds)
        block, size = self.plan.blocks[a], sp.Symbol(f"size({a})", integer=True, positive=True)
        seen = window_of(self.axis_index(), [cond]) if cond is not None else None
        full = window_of(self.axis_index(), [cond], every_lane=True) if cond is not None else None
        if seen is not None and full is not None and seen.lo is None and full.lo is None and full.hi is not None:
            end = self.window_bound(full.hi)
            mid = bound.tiles(bound.maximum(bound.minimum(hi, end), bound.ZERO), a)
            at = sp.floor(sp.Max(sp.Min(full.hi, size), 0) / block) * block  # `mid`, for counting trips
            subs, tail_hi = {cond: sp.true}, seen.hi
            self.add(Comment(text=f"# unmasked: every lane of this program sees the {a} below {{}}", bounds=(end,)))
        elif cond is None and hi == bound.name(f"size_{a}") and (any(f.dot is not None for f in self.stream_folds())
                                                                 if dots is None else dots):
            mid, at, subs, tail_hi = bound.tiles(hi, a), sp.floor(size / block) * block, {}, None
            self.add(Comment(text=f"# whole tiles of {a} first, no tail mask; then the last partial tile"))
        else:
            return False
        step = bound.name(f"BLOCK_{a}")
        unmasked = self.loop(span, "start", lo, mid, step, body)
        # every tile below `mid` lies inside the axis too (mid <= hi <= size): no tail mask either
        body_ops = tuple(replace(op, inside=True) if isinstance(op, Offsets) and op.dim == a else op
                         for op in assuming(unmasked, subs).body)
        self.out[-1] = replace(unmasked, body=body_ops, unmasked=True, window=Window(None, at))
        self.loop(span, "start", mid, hi, step, body)
        self.out[-1] = replace(self.out[-1], window=Window(at, tail_hi))
        return True

    def axis_mask(self, folds: list[tuple[str, sp.Expr]]) -> sp.Expr | None:
        """The mask outside which every fold of the loop adds its identity (:func:`bounds.axis_mask`)."""
        return axis_mask(folds, counts=self.plan.rules.fused and reads_count(self.plan),
                         selections=any(is_selection(effective_op(self.plan, s)) or is_selection(s.reduce)
                                        for s in self.axis_steps()))

    def axis_index(self) -> sp.Symbol:
        return sp.Symbol(f"index({self.axis})", integer=True, nonnegative=True)

    def window_bound(self, e: sp.Expr) -> Bound:
        """A window end as a loop bound (:func:`bounds.window_bound`); the tile dims without a program
        id (held whole) start at 0."""
        whole = [d for d in self.layout.dims if d != self.axis and d not in self.plan.lanes]
        return window_bound(e, self.layout.dims, whole)

    def windowed(self, folds: list[tuple[str, sp.Expr]], lo: Bound, hi: Bound) -> tuple[Bound, Bound]:
        """A reduction loop's ``lo``/``hi`` clamped to the part of the axis its program's lanes can
        see (:mod:`fuser_core.codegen.bounds`; the lower end rounded down to a tile boundary)."""
        cond = self.axis_mask(folds)
        w = window_of(self.axis_index(), [cond]) if cond is not None else None
        if w is None:
            return lo, hi
        a = self.axis
        if w.lo is not None:
            first = self.window_bound(w.lo)
            start = bound.tiles(bound.maximum(first, bound.ZERO), a)
            lo = start if lo.is_zero() else bound.maximum(lo, start)
            self.add(Comment(text=f"# masked: this program's lanes see no {a} before {{}}", bounds=(first,)))
        if w.hi is not None:
            end = self.window_bound(w.hi)
            hi = bound.minimum(hi, end)
            self.add(Comment(text=f"# masked: this program's lanes see no {a} from {{}} on", bounds=(end,)))
        return lo, hi

    def merge_lanes(self, lanes: dict[str, list[str]]) -> None:
        """After a per-lane loop, each reduction's lanes folded over the axis once with the realisation's
        merge rule (each lane a part, [old] = its anchors, [new] = the merged ones): the merged
        accumulators have the names and shapes a per-tile loop leaves, so what follows reads them as
        it would. Masked-off lanes hold the fold's identity, which every move keeps (rescale's guard)."""
        a = self.axis
        anchors = anchored_deps(self.plan)
        lane_anchors = {dep: self.anchor_var(dep) for dep in anchors}
        self.lanes = False
        merged: dict[str, list[str]] = {}
        for step in self.axis_steps():
            names: dict = {}  # the merged anchors set so far (a dep's is set after its own merge)
            for dep in anchors:
                sym = self.conv.symbols[dep]
                names[part_anchor(sym, "b")] = self.var(lane_anchors[dep])
                if self.anchor_var(dep) in self.var_dims:
                    names[new(sym)] = self.var(self.anchor_var(dep))
            real = self.realisation(step)
            moved = " re-anchored to the merged " + ", ".join(real.deps) if real.moves else ""
            self.add(Comment(text=f"# {step.name}: its lanes merged, {real.op} over {a} of each lane's state{moved}"))
            accs = merged[step.name] = [state_name(step, j, len(real.accumulators)) for j in range(len(real.accumulators))]
            rules = real.merge()
            self.need([r.right for r in rules])
            extra = {**names, **{part_acc(j, "b"): self.var(lane) for j, lane in enumerate(lanes[step.name])}}
            for acc, rule in zip(accs, rules):
                env = self.env(rule.right, extra=extra)
                dims = tuple(d for d in self.dims_of(rule.right, env) if d != a)
                self.add(LaneMerge(step=step.name, name=acc, dims=dims, op=rule.op, axis=a, expr=rule.right, env=env))
                self.let(acc, dims)
            if self.read_in_loop(step):  # the merged value, for the merged anchor or a later merge
                self.running_value(step, accs)
                self.merged.add(step.name)
            if step.name in anchors:
                self.update_anchor(step, "merged")
        self.accs = merged

    def update_anchor(self, step: Step, what: str = "running") -> None:
        anchor, value = self.anchor_var(step.name), self.values[step.name]
        kinds = {self.forms[s.name].anchors.get(step.name) for s in self.axis_steps()} - {None}
        estimate = any(k and k.startswith("running estimate") for k in kinds)
        note = f"  # running estimate of {step.name}" if estimate else f"  # {what} {step.reduce} of {step.name}"
        self.add(AnchorUpdate(dep=step.name, name=anchor, dims=value.dims, value=value, estimate=estimate, axis=self.axis,
                              note=note))
        self.let(anchor, value.dims)

    def with_anchors(self, real: Realisation) -> dict[str, VarRef | None]:
        """Values for a tile's contribution: dependencies at their (new) anchors."""
        saved = {}
        for dep in real.anchors:
            saved[dep] = self.values.get(dep)
            self.values[dep] = self.var(self.anchor_var(dep))
        return saved

    def restore(self, saved: dict[str, VarRef | None]) -> None:
        for k, v in saved.items():
            if v is None:
                self.values.pop(k, None)
            else:
                self.values[k] = v

    def state_names(self, real: Realisation, accs: list[str]) -> list[str]:
        """The variable each accumulator's moved expression reads (a selection's: its values)."""
        return [f"{acc}_values" if a.selection else acc for a, acc in zip(real.accumulators, accs)]

    def streaming_update(self, step: Step, accs: list[str]) -> None:
        """One tile with the realisation's step rule: acc_k = op(moved_k(acc), fold(contribution_k))."""
        real = self.realisation(step)
        reads = f", reads {', '.join(real.deps)}" if real.deps else ""
        per = " per lane" if self.lanes else ""
        self.add(Comment(text=f"# {step.name}: {real.op} over {self.axis}{per} ({real.kind}{reads})"))
        saved = self.with_anchors(real)
        rules = real.step()
        self.identity_loads([(r.op, r.right) for r in rules])
        self.need([r.left for r in rules] + [r.right for r in rules])
        names = {sym: self.var(n) for sym, n in zip(real.symbols, self.state_names(real, accs))}
        prevs, prev_names = self.moves(real, accs, [r.left for r in rules], names)
        for acc, rule, prev in zip(accs, rules, prevs):
            if self.lanes:
                self.lane_fold(step, acc, rule.right, prev, prev_names)
            else:
                self.fold(step, acc, rule.right, prev, prev_names)
        self.restore(saved)
        if self.read_in_loop(step):
            self.running_value(step, accs)
        elif not real.selection and real.value not in real.symbols:
            self.hoist([real.value])

    def read_in_loop(self, step: Step) -> bool:
        """Is a reduction's running value read inside its loop: by its anchor, or by a later
        reduction's update or value? (If not, it is computed once, after the loop.)"""
        if step.name in anchored_deps(self.plan):
            return True
        steps = self.axis_steps()
        for later in steps[steps.index(step) + 1:]:
            real = self.realisation(later)
            exprs = [real.value, *(a.moved for a in real.accumulators), *(a.contribution for a in real.accumulators)]
            if any(s.name == step.name for e in exprs for s in e.free_symbols):
                return True
        return False

    def moves(self, real: Realisation, accs: list[str], exprs: list[sp.Expr], names: dict
              ) -> tuple[list[sp.Expr | None], dict]:
        """Each moved accumulator (None: unmoved) and what its symbols read. Where one reads another (a
        Taylor shift), each is first computed into ``{acc}_moved``, so that none reads an updated one."""
        moved: list[sp.Expr | None] = [None if e == sym else e for e, sym in zip(exprs, real.symbols)]
        if not real.moves_jointly:
            return moved, names
        out, refs = [], {}
        for acc, e, sym in zip(accs, moved, real.symbols):
            e = sym if e is None else e
            env = self.env(e, extra=names)
            name = f"{acc}_moved"
            self.add(Value(name=name, dims=self.dims_of(e, env), expr=e, env=env))
            holder = placeholder(name)
            refs[holder] = self.let(name, self.dims_of(e, env))
            out.append(holder)
        return out, refs

    def running_value(self, step: Step, accs: list[str]) -> None:
        """The realisation's value (sum_j final_factor_j * acc_j + offset), dependencies at their current values."""
        real = self.realisation(step)
        var = safe_name(step.name)
        if real.selection:
            return  # order results are never dependencies (derive refuses them)
        if real.value in real.symbols:  # the value is an accumulator: read it, no copy
            self.values[step.name] = self.var(accs[real.symbols.index(real.value)])
            return
        self.need([real.value])
        env = self.env(real.value, extra={s: self.var(a) for s, a in zip(real.symbols, accs)})
        dims = self.dims_of(real.value, env)
        self.add(Value(name=var, dims=dims, expr=real.value, env=env))
        self.values[step.name] = self.let(var, dims)

    def settle(self, step: Step) -> None:
        """Move a scaled reduction's accumulators from its running anchors (a max/min's safe_anchor:
        0 while that max is infinite) to the final max itself, with a plain product, not rescale:
        ``den_acc = den_acc * exp(mx_anchor - mx_acc)``. Where the max is finite the anchor is the max
        and the factor exp(0) = 1 exactly; where it is +-inf or NaN (a row holding +inf, a fully
        masked row) the accumulator becomes what the spec's own formula gives there (inf - inf: NaN),
        as the reference and the unfused strategies do, instead of the anchor's 0-based value."""
        real = self.realisation(step)
        running = {self.conv.symbols[d]: d for d, how in real.anchors.items() if how == "running"}
        if not running or real.selection or not self.forms[step.name].settles_at(set(running)):
            return
        if real.moves_jointly:  # a Taylor form: its shift, from every anchor to the final values (0 where finite)
            self.settle_jointly(step)
            return
        names = {old(sym): self.var(f"{safe_name(dep)}_anchor") for sym, dep in running.items()}
        names.update({new(sym): self.values[dep] for sym, dep in running.items()})
        moved = False
        for sym, acc, a in zip(real.symbols, self.accs[step.name], real.accumulators):
            if (a.correction is None or a.correction == 1
                    or not a.correction.free_symbols & state_symbols(real.dep_symbols) <= set(names)):
                continue  # it reads other state (a sum's estimate); loop constants (a sink) are read as they are
            expr = settled(a, real.dep_symbols)
            self.add(Value(name=acc, dims=self.var_dims[acc], expr=expr, env=self.env(expr, extra={**names, sym: self.var(acc)}),
                           note=f"  # {step.name} at the final {', '.join(running.values())} (1 where it is finite)"))
            moved = True
        if moved and step.name in self.merged:  # its running value read the accumulators before they moved
            self.running_value(step, self.accs[step.name])

    def settle_jointly(self, step: Step) -> None:
        """:meth:`settle` for accumulators that move together (Taylor): each is computed from all of them
        before any changes (``{acc}_moved``), the anchors [old] and the final values [new]. Where the final
        values are finite the shift is 0 and the correction 1, exactly; where a max is -inf (an all -inf
        row), ``sum (x - mx)^2`` becomes the formula's NaN instead of its value at the anchor 0, inf."""
        real = self.realisation(step)
        accs = self.accs[step.name]
        names: dict = {}
        for dep in real.anchors:
            sym = self.conv.symbols[dep]
            names[old(sym)] = self.var(f"{safe_name(dep)}_anchor")
            names[new(sym)] = self.values[dep]
        names.update({sym: self.var(a) for sym, a in zip(real.symbols, accs)})
        # after the loop the state holds every value seen: a move by the count reads the total, not the
        # count before the last tile (`count_old`, still in scope)
        names[COUNT_OLD] = VarRef("count")
        self.need([a.moved for a in real.accumulators])
        moved, refs = self.moves(real, accs, [a.moved for a in real.accumulators], names)
        for acc, m in zip(accs, moved):
            if m is not None:
                self.add(Value(name=acc, dims=self.var_dims[acc], expr=m, env=self.env(m, extra=refs),
                               note=f"  # {step.name} at the final {', '.join(real.anchors)} (unmoved where finite)"))
        if step.name in self.merged:
            self.running_value(step, accs)

    def finalize(self) -> None:
        for step in self.axis_steps():
            self.settle(step)
            real = self.realisation(step)
            acc = self.accs[step.name][0]
            if step.name in self.merged:  # its lane merge computed its final value
                self.add(Finalise(step=step.name, name="", dims=self.values[step.name].dims, expr=real.value,
                                  env=self.env(real.value, extra={s: self.var(a) for s, a in zip(real.symbols, self.accs[step.name])})))
                continue
            if real.selection:
                self.need([real.value])
                self.add(Comment(text=f"# {step.name}: final values from the accumulated {real.op}"))
                env = self.env(real.value, extra={real.symbols[0]: self.selected(step, acc)})
                self.set_result(step, None, f"{acc}_indices", real.value, env)
            else:
                # Triton's compiler scopes names assigned inside a loop to its body: the final
                # value is recomputed here from the loop-carried accumulators
                accs = self.accs[step.name]
                var = safe_name(step.name)
                extra = {s: self.var(a) for s, a in zip(real.symbols, accs)}
                if real.value in real.symbols:
                    self.values[step.name] = self.var(accs[real.symbols.index(real.value)])
                    self.add(Finalise(step=step.name, name="", dims=self.values[step.name].dims, expr=real.value,
                                      env=self.env(real.value, extra=extra)))
                    continue
                self.need([real.value])
                env = self.env(real.value, extra=extra)
                dims = self.dims_of(real.value, env)
                self.add(Finalise(step=step.name, name=var, dims=dims, expr=real.value, env=env))
                self.values[step.name] = self.let(var, dims)
