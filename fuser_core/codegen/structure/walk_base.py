"""The walk of one kernel, its base: the values in scope, set-up, loops, loads and inner reductions.

The walk's other primitives (:mod:`.walk_folds`, :mod:`.walk_streaming`, :mod:`.walk_passes`) add
to this class; :class:`~fuser_core.codegen.structure.build.Walk` is all of them together, and each
strategy's module (:mod:`fuser_core.codegen.strategies`) walks its kernels with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import sympy as sp

from fuser_core.codegen.layout import Layout
from fuser_core.codegen.names import FP8, safe_name, scalar_arg
from fuser_core.codegen.ops import (
    Comment, Dot, Env, Fold, Gather, InitState, Load, Loop, Offsets, Op, Program, Reduce,
)
from fuser_core.codegen.ops import bounds as bound
from fuser_core.codegen.ops.bounds import Bound
from fuser_core.codegen.plan import KernelPlan
from fuser_core.codegen.structure.facts import (
    anchored_deps, decide_dot, effective_op, placeholder, reads_count, tile_dims, workspace,
)
from fuser_core.codegen.structure.model import Grid, State
from fuser_core.codegen.tritonize import VarRef, lookup
from fuser_core.masks import excluded
from fuser_core.merged import address
from fuser_core.problem import compute_dtype
from fuser_core.realisation import Realisation
from fuser_core.reduce_ops import in_tile, is_extremum
from fuser_core.spec import Input, Step


class WalkBase:
    """One kernel's operations, in the order they run (and are printed).

    ``values`` maps what expressions read (a spec name, or a symbol: ``count[old]``, a part's
    accumulator) to the :class:`VarRef` holding it in the kernel; ``loaded`` are the inputs and inner
    reductions computed in the current scope (a loop's body forgets them after it, except
    ``persistent`` ones: loaded at the kernel's top level or hoisted); ``filled``: inputs loaded
    with a fold's identity in their masked lanes."""

    def __init__(self, plan: KernelPlan, dtypes: Mapping[str, str], stores: Mapping[str, str], dots: dict,
                 role: str, grid: Grid, no_fill: frozenset[str] = frozenset()):
        self.plan = plan
        self.spec = plan.spec
        self.axis = plan.axis
        self.conv = plan.derivation.symbols
        self.forms = plan.derivation.forms
        self.dtypes = dtypes
        self.stores = stores
        self.dots = dots  # (over, expr) -> its tl.dot or None, shared by a module's kernels
        self.role = role
        self.grid = grid
        self.no_fill = no_fill  # inputs a tl.dot of this kernel reads: never identity-filled
        self.layout = Layout(tile_dims(plan))
        self.var_dims: dict[str, tuple[str, ...]] = {}  # variable -> the tile dims its value lives on
        self.values: dict[str | sp.Basic, VarRef] = {}
        self.loaded: set[str] = set()
        self.persistent: set[str] = set()
        self.filled: dict[str, str] = {}
        self.merged: set[str] = set()  # reductions whose final value a lane merge computed
        self.lanes = False  # walking a per-lane loop (states and anchors per lane of the axis's tile)
        self.lanes_states = False  # its streamed loop keeps per-lane states (the kernel carries those)
        self.direct = False  # walking fallback passes (:meth:`fallback`): reductions of the integrands as written
        self.head: list[Op] = []  # program ids and offsets
        self.prologue: list[Op] = []  # hoisted loads
        self.ops: list[Op] = []
        self.out = self.ops  # where operations go now (a loop's body while it is walked)
        self.depth = 1
        self.hoisted: list[str] | None = None  # the loop being walked: inputs hoisted for it
        self.inputs: list[str] = []
        self.accs: dict[str, list[str]] = {}
        # the safe anchors (running, lane, old, merged and part values of a max/min's safe_anchor): finite
        self.finite_prefixes = tuple(f"{safe_name(dep)}_{lane}anchor" for dep in anchored_deps(plan)
                                     if not any(str(f.anchors.get(dep, "")).startswith("running estimate")
                                                for f in self.forms.values()) for lane in ("", "lane_"))

    # ------------------------------------------------------------ small helpers
    def add(self, op: Op) -> Op:
        if isinstance(op, (Fold, Reduce)) and op.dot is None:
            # an element a where() on indices masks to the identity is not folded, even as 0 * NaN
            # (fuser_core.masks): what the loops that skip masked tiles give, in every loop
            expr = excluded(op.expr, op.op)
            if expr is not op.expr:
                op = replace(op, expr=expr)
        self.out.append(op)
        return op

    # the plan's facts a strategy's walk reads (fuser_core.codegen.strategies imports nothing of the structure)
    def anchored_deps(self) -> list[str]:
        """The dependencies whose running value anchors others (:func:`facts.anchored_deps`)."""
        return anchored_deps(self.plan)

    def reads_count(self) -> bool:
        """Does a move read the count of values seen (:func:`facts.reads_count`)?"""
        return reads_count(self.plan)

    def workspace(self) -> tuple[State, ...]:
        """A split's partial states, handed from its part kernel to its combine (:func:`facts.workspace`)."""
        return workspace(self.plan)

    @staticmethod
    def placeholder(name: str) -> sp.Symbol:
        """A symbol standing for the variable ``name`` in an operation's expression (:func:`facts.placeholder`)."""
        return placeholder(name)

    def order(self, dims: Iterable[str]) -> tuple[str, ...]:
        return self.layout.order(dims)

    def let(self, name: str, dims: Iterable[str]) -> VarRef:
        """``name`` now holds a value on ``dims``."""
        self.var_dims[name] = self.order(dims)
        return self.var(name)

    def var(self, name: str) -> VarRef:
        """The variable ``name``, defined earlier in the kernel, on its dims."""
        return VarRef(name, self.var_dims[name], finite=name.startswith(self.finite_prefixes))

    def env(self, *exprs: sp.Expr | None, extra: Mapping | None = None) -> Env:
        """What each free symbol of ``exprs`` reads: ``extra`` first, then the values in scope."""
        names = {**self.values, **(extra or {})}
        out: dict[sp.Basic, VarRef] = {}
        for e in exprs:
            if e is None:
                continue
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                out[s] = lookup(names, s)
        return tuple(out.items())

    def dims_of(self, e: sp.Expr, env: Env) -> tuple[str, ...]:
        return self.layout.union(*(ref.dims for sym, ref in env if sym in e.free_symbols))

    def effective_op(self, step: Step) -> str:
        if self.direct:  # a fallback pass reduces the integrand itself, not a fused form's terms
            return step.reduce or ""
        return effective_op(self.plan, step)

    def realisation(self, step: Step) -> Realisation:
        real = self.forms[step.name].realisation
        assert real is not None, f"{step.name} is streamed but not fused"
        return real

    def axis_steps(self) -> list[Step]:
        return self.plan.axis_reductions()

    def dot(self, e: sp.Expr, over: str) -> Dot | None:
        key = (over, e)
        if key not in self.dots:
            self.dots[key] = decide_dot(self.plan, e, over, self.dtypes)
        return self.dots[key]

    # ------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Program ids, offsets and masks of every tile dim but the axis; sizes and indices by name."""
        lanes, dims = self.plan.lanes, self.layout.dims
        if lanes:
            self.head.append(Program(lanes=lanes, tile=frozenset(d for d in lanes if d in dims), used=frozenset()))
        for d in self.plan.dims:
            if d == self.axis or d not in dims or d in self.plan.contraction_loops:  # a K loop's offsets are its own
                continue
            self.head.append(Offsets(dim=d, base="pid" if d in lanes else "", mask=True))
            self.let(f"offs_{d}", (d,))
            self.let(f"mask_{d}", (d,))
        for d in self.spec.part_dims:  # size(c) of a merged dim's part: an argument of its own
            self.values[f"size({d})"] = VarRef(f"size_{d}", (), "size")
        for d in self.plan.dims:
            self.values[f"size({d})"] = VarRef(f"size_{d}", (), "size")
            self.values[f"index({d})"] = VarRef(f"offs_{d}", (d,) if d in dims else ())
        for p in self.spec.runtime_params:  # a scalar passed at call time: a kernel argument (fp32)
            self.values[p.name] = VarRef(scalar_arg(p.name), ())

    def axis_tile(self, start: str) -> None:
        a = self.axis
        self.add(Offsets(dim=a, base="start" if start != "0" else "", mask=True))
        self.let(f"offs_{a}", (a,))
        self.let(f"mask_{a}", (a,))

    # ------------------------------------------------------------ loops
    def loop(self, span: str, var: str, lo: Bound, hi: Bound, step: Bound | None,
             body: Callable[[], Callable[[], None] | None], resident: bool = False) -> Loop:
        """Walk ``body()`` as the body of a loop; what it returns (a per-lane loop's lane merge), if
        anything, is walked as the operations after the loop that merge its lanes."""
        outer, outer_hoisted = self.out, self.hoisted
        ops: list[Op] = []
        self.out = ops
        if not resident:
            self.hoisted = []
        per_lane_loop = body()
        lanes: list[Op] = []
        hoisted = tuple(self.hoisted or ()) if not resident else ()
        self.hoisted = outer_hoisted
        if per_lane_loop:
            self.out = lanes
            per_lane_loop()
        self.out = outer
        return self.add(Loop(span=span, var=var, lo=lo, hi=hi, step=step, body=tuple(ops),
                             resident=resident, per_lane=bool(per_lane_loop), lanes=tuple(lanes), hoisted=hoisted))

    def begin_scope(self) -> None:
        for name in self.loaded - self.persistent:
            self.values.pop(name, None)
        self.loaded = set(self.persistent)

    # ------------------------------------------------------------ loads and inner reductions
    def need(self, exprs: Iterable[sp.Expr]) -> None:
        """Loads and inner reductions so that every symbol of ``exprs`` has a value here."""
        for e in exprs:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name in self.values:
                    continue
                step = self.conv.leaf_step.get(s)
                if step is not None and step.name in self.plan.gathers:
                    self.gather(step)
                elif step is not None and step.over != self.axis:
                    self.inner_reduction(step)
                elif step is None and self.spec.lookup(s.name) is not None:
                    self.load(s.name)

    def gather(self, step: Step) -> None:
        """A reduction that is one term (:attr:`KernelPlan.gathers`): X loaded at index ``at`` of the
        axis, per lane, instead of folded over it (cross-entropy's target logit)."""
        x, at = self.plan.gathers[step.name]
        a = self.axis
        self.need([at])
        var = safe_name(step.name)
        lanes = self.dims_of(at, self.env(at))
        inputs, extra = [], {}
        for sym in sorted(x.free_symbols, key=lambda s: s.name):
            inp = self.spec.lookup(sym.name)
            if isinstance(inp, Input) and a in inp.dims:
                name = f"{var}_{safe_name(inp.name)}"
                dims = self.order([*(d for d in inp.dims if d != a), *lanes])
                inputs.append((inp.name, inp.dims, self.dtypes.get(inp.name), "int32" if inp.is_index else compute_dtype(self.dtypes),
                               name, address(self.spec, inp.name, safe_name(inp.name))))
                extra[sym] = self.let(name, dims)
        others = [s for s in x.free_symbols if s not in extra]
        self.need([sp.Add(*others)] if others else [])
        env = self.env(x, at, extra={**extra, sp.Symbol(f"{var}_at"): VarRef(f"{var}_at", lanes)})
        dims = self.order(set(self.dims_of(x, env)) | set(lanes))
        self.add(Comment(text=f"# {step.name}: sum over {a} of where(index({a}) == {sp.sstr(at)}, {sp.sstr(x)}, 0): "
                              f"its one term, loaded at that index"))
        self.add(Gather(step=step.name, name=var, dims=dims, axis=a, at=at, expr=x, env=env, inputs=tuple(inputs),
                        tile=self.layout.dims))
        for inp, *_ in inputs:  # its pointer and strides are arguments of this kernel
            if inp not in self.inputs:
                self.inputs.append(inp)
        self.values[step.name] = self.let(var, dims)
        self.loaded.add(step.name)

    def hoist(self, exprs: Iterable[sp.Expr]) -> None:
        """The loop-invariant loads ``exprs`` would need, hoisted, without computing ``exprs`` here (a
        running value computed only after the loop: its inputs are loaded once, before the loops)."""
        if self.hoisted is None:
            return
        for e in exprs:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name in self.values:
                    continue
                step = self.conv.leaf_step.get(s)
                if step is not None and step.over != self.axis:
                    self.hoist([self.conv.integrand(step)])
                elif (step is None and isinstance(self.spec.lookup(s.name), Input)
                      and self.axis not in self.spec.input(s.name).dims):
                    self.load(s.name)

    def identity_loads(self, folds: list[tuple[str, sp.Expr]]) -> None:
        """Each load masked once: an input that a max/min over the axis folds as it is, is loaded
        with the fold's identity in its masked lanes (``other``), so the fold needs no tl.where.
        Not for an input a tl.dot reads (its masked lanes must be 0 there), nor for index inputs
        and fp8 bits (no infinity); every other use of it masks its lanes itself."""
        for op, e in folds:
            if not is_extremum(op) or not isinstance(e, sp.Symbol) or e.name in self.values:
                continue
            inp = self.spec.lookup(e.name)
            if not isinstance(inp, Input) or not inp.is_float or self.dtypes.get(e.name) == FP8:
                continue
            if self.axis not in inp.dims or e.name in self.no_fill:
                continue
            self.load(e.name, fill=op)

    def load(self, name: str, fill: str | None = None) -> None:
        inp = self.spec.input(name)
        var = safe_name(name)
        tile = self.order(inp.dims)
        hoisted = (self.hoisted is not None and self.axis not in inp.dims
                   and not set(inp.dims) & set(self.plan.contraction_loops))  # a K loop's tiles move with it
        if fill and tile:
            self.filled[name] = fill
        else:
            self.filled.pop(name, None)
        op = Load(input=name, name=var, dims=tile, input_dims=inp.dims, kind="int32" if inp.is_index else compute_dtype(self.dtypes),
                  dtype=self.dtypes.get(name), address=address(self.spec, name, var), fill=fill, hoisted=hoisted)
        self.values[name] = self.let(var, inp.dims)
        self.loaded.add(name)
        if hoisted:  # loaded once per program, before the loops
            self.prologue.append(op)
            self.hoisted.append(name)
            self.persistent.add(name)
        else:
            self.add(op)
            if self.depth == 1:  # the kernel's top level: in scope for the rest of the kernel
                self.persistent.add(name)
        if name not in self.inputs:
            self.inputs.append(name)

    def inner_reduction(self, step: Step) -> None:
        integrand = self.conv.integrand(step)
        var = safe_name(step.name)
        comment = Comment(text=f"# {step.name}: {step.reduce} over {step.over} of {sp.sstr(integrand)}")
        if step.over in self.plan.contraction_loops:  # its inputs' tiles are loaded inside its loop
            self.add(comment)
            self.contraction_loop(step, integrand, var)
        else:
            self.need([integrand])
            self.add(comment)
            self.add(self.inner_reduce(step, integrand, var))
        self.values[step.name] = self.var(var)
        self.loaded.add(step.name)

    def inner_reduce(self, step: Step, integrand: sp.Expr, var: str, into: bool = False) -> Reduce:
        """The reduction of ``integrand`` over its inner dim's tile, as ``var`` (``into``: added to it)."""
        self.need([integrand])
        op = step.reduce or "sum"
        dot = self.dot(integrand, step.over) if op == "sum" else None
        if not in_tile(op):
            raise NotImplementedError(f"{op} inside a tile")  # validated earlier: inner reductions are sum/max/min
        env = self.env(dot.p, dot.q, dot.scale) if dot is not None else self.env(integrand)
        if dot is not None:
            dims = self.order((dot.i, dot.j))
            masked = not self.zero_filled(dot.p, step.over)
        else:
            dims = tuple(d for d in self.layout.union(self.dims_of(integrand, env), (step.over,)) if d != step.over)
            masked = True
        self.let(var, dims)
        return Reduce(step=step.name, name=var, dims=dims, op=op, over=step.over, expr=integrand, env=env, inner=True,
                      dot=dot, masked=masked, into=into)

    def contraction_loop(self, step: Step, integrand: sp.Expr, var: str) -> None:
        """A sum over an inner dim a block at a time (:attr:`KernelPlan.contraction_loops`), a GEMM's K
        loop: ``var`` starts at 0 and each tile's sum (a tl.dot) is added to it; the tiles of the
        inputs carrying the dim are loaded inside the loop and are out of scope after it."""
        d = step.over
        outer, before = self.out, set(self.values)
        self.out = body = []
        self.depth += 1
        self.add(Offsets(dim=d, base=f"start_{d}", mask=True))
        self.let(f"offs_{d}", (d,))
        self.let(f"mask_{d}", (d,))
        reduce = self.inner_reduce(step, integrand, var, into=True)
        self.add(reduce)
        self.depth -= 1
        self.out = outer
        for scoped in set(self.values) - before:  # the tiles loaded for the loop
            self.values.pop(scoped)
            self.loaded.discard(scoped)
        self.add(InitState(name=var, dims=reduce.dims, dtype="float32", fill=None,
                           note=f"  # {step.name}: {d} summed BLOCK_{d} at a time"))
        self.add(Loop(span="contraction", var=f"start_{d}", lo=bound.ZERO, hi=bound.name(f"size_{d}"),
                      step=bound.name(f"BLOCK_{d}"), body=tuple(body), dim=d))

    def zero_filled(self, e: sp.Expr, over: str) -> bool:
        """Is ``e`` an input loaded here with 0 in the masked lanes of ``over``?"""
        return (isinstance(e, sp.Symbol) and e.name in self.loaded and e.name not in self.filled
                and isinstance(self.spec.lookup(e.name), Input) and over in self.spec.input(e.name).dims)
