"""The walk's reductions over the loop axis (states, folds, selections, results) and its output stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import numpy as np
import sympy as sp

from fuser_core.codegen.names import safe_name
from fuser_core.codegen.ops import Comment, Dot, Env, Finalise, FirstChunk, Fold, InitState, Op, OutputStore, Select
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.structure.facts import axis_outputs, state_name
from fuser_core.codegen.structure.walk_base import WalkBase
from fuser_core.codegen.tritonize import VarRef, is_literal, lookup
from fuser_core.masks import exclusion
from fuser_core.realisation import identity
from fuser_core.reduce_ops import has_slots, is_negated, is_selection, returns_indices
from fuser_core.spec import Input, Step
from fuser_core.dim_symbols import symbol_kind


class FoldsWalk(WalkBase):
    """Reductions over the loop axis and output stores (a part of :class:`~fuser_core.codegen.structure.build.Walk`)."""

    def state_dims(self, dims: Iterable[str]) -> set[str]:
        return set(dims) | ({self.axis} if self.lanes else set())

    def anchor_var(self, dep: str) -> str:
        return f"{safe_name(dep)}_lane_anchor" if self.lanes else f"{safe_name(dep)}_anchor"

    def init_state(self, step: Step, parts: int = 1) -> list[str]:
        """The initial (empty) accumulators of an axis reduction; returns their names."""
        var = safe_name(step.name)
        dims = self.order(self.state_dims(step.dims))
        op = self.effective_op(step)
        if is_selection(op):  # (values, indices), selected on values (negated for bottom-k/argmin)
            self.add(InitState(name=f"{var}_acc_values", dims=dims, dtype="float32", fill=-sp.oo))
            self.add(InitState(name=f"{var}_acc_indices", dims=dims, dtype="int32", fill=2147483647,
                               note="  # empty: no index yet"))
            self.let(f"{var}_acc_values", dims)
            self.let(f"{var}_acc_indices", dims)
            return [f"{var}_acc"]
        names = [state_name(step, j, parts, self.lanes) for j in range(parts)]
        for n in names:
            self.add(InitState(name=n, dims=dims, dtype="float32", fill=identity(op)))
            self.let(n, dims)
        return names

    def tile_fold(self, step: Step, e: sp.Expr, env: Env) -> tuple[Dot | None, bool, tuple[str, ...]]:
        """A sum/max/min of ``e`` over the axis's tile: (its tl.dot, whether its masked lanes are set to
        the identity, the dims of its value)."""
        a = self.axis
        op = self.effective_op(step)
        dot = self.dot(e, a) if op == "sum" else None
        if dot is not None:
            return dot, not self.zero_filled(dot.p, a), self.order((dot.i, dot.j))
        dims = self.dims_of(e, env)
        masked = self.needs_mask(e, op)
        if masked:
            dims = self.layout.union(dims, (a,))
        return None, masked, tuple(d for d in dims if d != a)

    def needs_mask(self, e: sp.Expr, op: str) -> bool:
        """Must a fold of ``e`` set the tail's masked lanes to ``op``'s identity? Not where the values
        its loads put in those lanes already give it: an input loaded with -inf there (for its max)
        makes a streamed ``exp(x - mx)`` 0, the sum's identity. Inputs loaded without a fill hold 0
        there. Decided only when ``e`` at those values is a number, with every other symbol a
        running anchor (finite: safe_anchor) that sympy takes as a finite real."""
        if isinstance(e, sp.Symbol) and self.filled.get(e.name) == op and e.name in self.values:
            return False
        fills, others = {}, set()
        for s in e.free_symbols:
            inp = self.spec.lookup(s.name)
            if isinstance(inp, Input) and s.name in self.values and self.axis in inp.dims:
                fills[s] = identity(self.filled[s.name]) if s.name in self.filled else sp.Integer(0)
            else:
                others.add(s)
        if not fills or any(not self._is_anchor(s) for s in others):
            return True
        # an anchor is finite but may be any finite value, 0 included: the identity for each of a few,
        # evaluated in IEEE float64 as the kernel does (sympy takes exp(-oo) * sin(-oo) as 0, IEEE gives
        # 0 * NaN = NaN; so does (round(x) - mx) * exp(x - mx) at x = -inf: such a fold is masked)
        syms = sorted(e.free_symbols, key=str)
        try:
            f = sp.lambdify(syms, e, modules=[{"round": np.rint}, "numpy"])
        except Exception:  # noqa: BLE001 (a function numpy lacks: mask it)
            return True
        want = float(identity(op))
        # anchors of any size, in float32 as the kernel computes: 0 * exp(mx - 0) is NaN at a running min of 98
        # (exp overflows float32 past 88.7), where float64 still gives 0 (CI fuzz, the offset100 family)
        for value in (0.0, 1.0, -1.0, 2.5, 100.0, -100.0, 1e30, -1e30):
            args = [np.float32(fills[s]) if s in fills else np.float32(value) for s in syms]
            try:
                with np.errstate(all="ignore"):
                    got = float(f(*args))
            except Exception:  # noqa: BLE001 (not evaluable as a float: mask it)
                return True
            if not got == want:
                return True
        return False

    def _is_anchor(self, s: sp.Symbol) -> bool:
        """Is ``s`` read from a max/min's safe anchor (finite)? By the value's flag, not its name: a step named
        ``den_anchor`` is a value like any other (fuzz seed 70: its -inf times a tail lane's 0 went unmasked),
        and a sum's running estimate may be infinite."""
        try:
            return lookup(self.values, s).finite
        except Exception:  # noqa: BLE001 (no value here: not an anchor)
            return False

    def fold(self, step: Step, acc: str, e: sp.Expr, prev: sp.Expr | None = None, prev_names: Mapping | None = None) -> None:
        """acc = prev (op) reduce over the tile of e (a tl.dot when e is a contraction that fits one);
        ``prev`` is the accumulator moved before the tile (None: itself)."""
        op = self.effective_op(step)
        env_e = self.env(e)
        env_prev = self.env(prev, extra=prev_names) if prev is not None else ()
        if is_selection(op):
            self.select(step, acc, e, env_e + env_prev, prev)
            return
        dot, masked, _ = self.tile_fold(step, e, env_e)
        if dot is not None:
            dot = self.dot_excluded(dot, e, op)
        env = (self.env(dot.p, dot.q, dot.scale) if dot is not None else env_e) + env_prev
        self.add(Fold(step=step.name, name=acc, dims=self.var_dims[acc], op=op, over=self.axis, expr=e, env=env, prev=prev,
                      dot=dot, masked=masked))

    def dot_excluded(self, dot: Dot, e: sp.Expr, op: str) -> Dot:
        """``dot`` with its P set to 0 where a where() on indices masks ``e`` (fuser_core.masks), when that
        condition does not vary along Q's own dim: a fallback pass's ``exp(where(C, s, -inf) - mx)`` is NaN
        where C is false at mx = -inf (a query that sees no key), and its product must be 0 there, as the
        streamed form's is. Q's values at masked elements still reach the product (0 * NaN: module
        docstring of fuser_core.masks)."""
        cond = exclusion(e, op)
        if cond is None or (isinstance(dot.p, sp.Piecewise) and dot.p.args[0][1] == cond):
            return dot  # nothing masked, or P is masked by it already (the streamed form)
        dims: set[str] = set()
        for sym in cond.free_symbols:
            kind = symbol_kind(sym)
            dims |= {kind[1]} if kind and kind[0] == "index" else set(self.conv.leaf_dims.get(sym, ()))
        if dot.j in dims:
            return dot
        return replace(dot, p=sp.Piecewise((dot.p, cond), (sp.Integer(0), True)))

    def lane_fold(self, step: Step, acc: str, e: sp.Expr, prev: sp.Expr | None, prev_names: Mapping | None) -> None:
        """acc = prev (op) e, elementwise: each lane of the tile folds its own element into its own state;
        masked-off lanes fold the identity (unless its load filled them)."""
        op = self.effective_op(step)
        masked = self.needs_mask(e, op)
        env = self.env(e) + (self.env(prev, extra=prev_names) if prev is not None else ())
        self.add(Fold(step=step.name, name=acc, dims=self.var_dims[acc], op=op, over=self.axis, expr=e, env=env, prev=prev,
                      masked=masked, per_lane=True))

    def select(self, step: Step, acc: str, e: sp.Expr, env: Env, prev: sp.Expr | None) -> None:
        """Merge a tile into a running argmax/argmin or top-k/bottom-k (on negated values for the
        smallest): the tile over the state's dims and the axis, as the merge helpers take it."""
        a = self.axis
        op = self.effective_op(step)
        state = self.var_dims[f"{acc}_values"]
        lanes = tuple(d for d in state if d != step.as_dim)  # a top-k list's slots are not the tile's
        tile_dims = self.layout.union(lanes, (a,))
        got = self.layout.union(self.dims_of(e, env), (a,))
        slots = step.as_dim if has_slots(op) else None
        self.add(Select(step=step.name, name=acc, dims=state, op=op, over=a, expr=e, env=env, prev=prev, slots=slots,
                        k=step.k if slots else None, tile_dims=tile_dims, broadcast=got != tile_dims))

    def selected(self, step: Step, acc: str) -> VarRef:
        """The accumulated values of an order reduction, signs undone."""
        op = self.effective_op(step)
        return VarRef(f"{acc}_values", self.var_dims[f"{acc}_values"], "neg" if is_negated(op) else "var")

    def set_result(self, step: Step, value: VarRef | None, indices: str | None = None, expr: sp.Expr | None = None,
                   env: Env = ()) -> None:
        """Name a reduction's final value: ``expr`` (fused: its realisation's value) or ``value`` (a
        selection's values, or its accumulator); a variable already is read as it is."""
        var = safe_name(step.name)
        if returns_indices(step.reduce):
            self.values[step.name] = self.var(indices)
            self.add(Finalise(step=step.name, name="", dims=(), expr=expr, env=env))
            return
        target = f"{var}_values" if step.reduce == "topk" else var
        if expr is not None:
            bare = isinstance(expr, sp.Symbol) and lookup(dict(env), expr).form == "var"
            dims = self.dims_of(expr, env)
            ref = lookup(dict(env), expr) if bare else self.let(target, dims)
            self.add(Finalise(step=step.name, name="" if bare else target, dims=ref.dims, expr=expr, env=env))
        else:
            bare = value.form == "var"
            ref = VarRef(value.name, value.dims) if bare else self.let(target, value.dims)
            self.add(Finalise(step=step.name, name="" if bare else target, dims=ref.dims, expr=None, source=value))
        if step.reduce == "topk":
            self.values[f"{step.name}.values"] = ref
            self.values[f"{step.name}.indices"] = self.var(indices)
        else:
            self.values[step.name] = ref

    # ------------------------------------------------------------ outputs
    def store(self, part: str, gate: str | None = None) -> OutputStore:
        """The store of an output part (a whole tile of it where it varies over fewer dims); the loads
        and inner reductions its value needs are added first."""
        name = part.split(".")[0]
        step = self.spec.step(name)
        dims = step.dims
        if name in self.plan.gathers and part not in self.values:  # an output that is one term: loaded here
            self.gather(step)
        if step.is_reduction and step.over == self.axis:
            expr, env, value = None, (), self.values[part]
            value_dims, constant = value.dims, False
        else:
            expr = self.conv.value(name, part.split(".")[1] if "." in part else None)
            self.need([expr])
            env, value = self.env(expr), None
            value_dims, constant = self.dims_of(expr, env), is_literal(expr)
        return OutputStore(part=part, name=safe_name(part), part_dims=dims, dims=self.order(dims), expr=expr, env=env,
                           value=value, value_dims=value_dims, dtype=self.stores[part], constant=constant, gate=gate)

    def outputs(self, gate: str | None = None, only: set[str] | None = None) -> None:
        """Row outputs once; outputs that still have the loop axis in a last pass over it (a
        parallel combine kernel: over its program's chunk, row outputs from chunk 0 only).
        ``gate``: written only where that 0/1 flag is set, ``only`` those parts (a fallback's)."""
        a = self.axis
        along = [p for p in axis_outputs(self.plan) if only is None or p in only]
        row = [p for p in self.spec.output_parts if p not in axis_outputs(self.plan) and (only is None or p in only)]
        chunked = self.role == "combine" and self.grid.split
        if chunked and row:  # every program of a lane block has the row outputs: chunk 0's writes them
            stores = [self.store(part, gate) for part in row]  # loads stay outside the if
            body: list[Op] = []
            for part, op in zip(row, stores):
                body += [Comment(text=f"# output {part}"), op]
            self.add(FirstChunk(body=tuple(body)))
        for part in row if not chunked else ():
            self.add(Comment(text=f"# output {part}" + (f", where {gate}" if gate else "")))
            self.add(self.store(part, gate))
        if not along:
            return
        if self.plan.rules.holds_axis_whole:
            for part in along:
                self.add(Comment(text=f"# output {part}"))
                self.add(self.store(part))
            return
        if chunked:
            self.add(Comment(text=f"# second pass, over this program's chunk of {a}: outputs {', '.join(along)} need "
                                  "the final reductions"))
            span, lo, hi = "chunk_outputs", bound.name("lo"), bound.minimum(bound.plus(bound.name("lo"), bound.name("chunk")), bound.name(f"size_{a}"))
        else:
            self.add(Comment(text=f"# second pass over {a}: outputs {', '.join(along)} need the final reductions"))
            span, lo, hi = "outputs", bound.ZERO, bound.name(f"size_{a}")
        if gate:  # the pass runs only where the flag is set
            span, hi = "fallback", bound.product(bound.group(hi), bound.name(gate))

        def body():
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            for part in along:
                self.add(self.store(part))
            self.depth -= 1
            self.begin_scope()

        self.loop(span, "start", lo, hi, bound.name(f"BLOCK_{a}"), body)
