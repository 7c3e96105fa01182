"""What the kernels of a strategy do, in numbers, read from the kernel structure.

The search space (resource checks) and the cost model (bytes, FLOPs) both need to know, for a
(strategy, block sizes) pair, what the generated kernels do. The code generator decides that
once, in :func:`fuser_core.codegen.structure.build_structure`: each kernel as the ordered list
of operations the printer prints (:mod:`fuser_core.codegen.ops`: loads, loops, folds, merges,
stores...), with the inputs hoisted out of its loops, which reductions are ``tl.dot``
contractions, the accumulators and the split workspace. :class:`Anatomy` counts that list and
turns each kernel into a :class:`KernelSketch` for the cost model (:func:`sketch`): per pass (a
loop, the lane merge after a per-lane loop, the straight-line code between loops) the inputs
read, the elementwise work per tile (each expression node at its own dims), the dots, and the
tensors a program holds at once; the numbers come from :func:`pass_iterations` and
:func:`resources`.

Every decision of the structure depends only on whether each block is 1, between 2 and 15, or
at least 16, so sketches are cached per (strategy, that pattern).

Example:
    >>> from fuser_core.catalog import load_catalog_spec
    >>> from fuser_core.derive import derive_cascade
    >>> from fuser_core.codegen.strategies import STREAMING_FUSED
    >>> spec = load_catalog_spec("safe_softmax")
    >>> an = Anatomy(spec, derive_cascade(spec), {"x": "float16"})
    >>> [(p.loop, p.loads) for p in an.kernels(STREAMING_FUSED.name, {"m": 1, "n": 1024})[0].passes]
    [('axis', ('x',)), ('once', ()), ('axis', ('x',))]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from fuser_core import has_slots, returns_indices
from fuser_core.codegen import ops
from fuser_core import is_dim_symbol, symbol_kind
from fuser_core.codegen import structure as st
from fuser_core.codegen.plan import (
    KernelConfig, KernelPlan, contraction_loop_dims, default_inner_block, loop_axis, loopable_inner_dims, next_pow2,
)
from fuser_core.codegen.strategies import STRATEGIES
from fuser_core.derive import Derivation
from fuser_core.realisation import Realisation
from fuser_core.spec import Spec, Step
from fuser_core.symbolic import CAST_FUNCTIONS, Round, SymbolicSpec
from fuser_core.targets import CUDA, WARP_SIZES, Target

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int32": 4, "int64": 8, "float64": 8}
# operand bytes in shared memory per tl.dot precision (an fp8 dot's: 1 where the hardware has fp8)
DOT_BYTES = {ops.FP8_DOT: 1, "float16": 2, "bfloat16": 2, "tf32": 4, "ieee": 4}
LOAD_ALU = 4  # per loaded element: address (multiply-add per dim, folded), mask, conversion to float32
REDUCE_ALU = 2  # per element of a reduced tile: the mask select and the combine
RESCALE_ALU = 4  # rescale(acc, c): compare, select, multiply (fuser_core/codegen/helpers.py)
TOPK_TILE_ALU = 5  # per tile element and per k: max, compare, min-index, select (helpers.topk_merge)
TOPK_SLOT_ALU = 8  # per list slot and per k
ITERATION_ALU = 30  # per thread and loop iteration: offsets, bounds, loop control


DotOp = ops.Dot  # one tl.dot, as the structure decided it


@dataclass
class Pass:
    """One stretch of a kernel: a loop over the axis (``axis``), over one split chunk
    (``chunk``), over the SPLIT partial states (``split``), or straight-line code (``once``)."""

    loop: str  # axis | chunk | split | once
    loads: tuple[str, ...] = ()  # inputs loaded (once per iteration)
    # a K loop's dim (KernelPlan.contraction_loops): the pass is its body, run cdiv(size, BLOCK)
    # times per iteration of ``loop``
    inner: str | None = None
    ops: dict[frozenset[str], list[float]] = field(default_factory=dict)  # dims -> [alu, sfu] per element
    dots: list[DotOp] = field(default_factory=list)
    tensors: list[frozenset[str]] = field(default_factory=list)  # dims of tensors held at once
    ws_loads: list[frozenset[str]] = field(default_factory=list)  # workspace entries read per iteration
    stores: list[tuple[str, frozenset[str]]] = field(default_factory=list)  # output parts written here

    def add(self, dims: Iterable[str], alu: float = 0.0, sfu: float = 0.0) -> None:
        key = frozenset(dims)
        slot = self.ops.setdefault(key, [0.0, 0.0])
        slot[0] += alu
        slot[1] += sfu


@dataclass
class KernelSketch:
    """One launched kernel: its grid (``lanes`` or ``lanes x split``), passes and state."""

    name: str
    grid: str
    passes: list[Pass]
    state: list[frozenset[str]]  # float32 accumulators carried through the loop
    ws_stores: list[frozenset[str]] = field(default_factory=list)  # partial states written (split part 1)


def block_pattern(blocks: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """What every structural decision depends on: 1, 2..15, or >= 16 per dim."""
    return tuple(sorted((d, 0 if b <= 1 else (1 if b < 16 else 2)) for d, b in blocks.items()))


def node_cost(e: sp.Basic) -> tuple[float, float]:
    """(ALU ops, SFU ops) per element for one expression node, its children not included."""
    n = len(e.args)
    if e.is_Atom or isinstance(e, sp.logic.boolalg.BooleanAtom):
        return 0.0, 0.0
    if isinstance(e, (sp.Add, sp.Max, sp.Min, sp.And, sp.Or)):
        return float(n - 1), 0.0
    if isinstance(e, sp.Mul):
        return float(n - 1), 0.0
    if isinstance(e, sp.Pow):
        base, ex = e.args
        if ex == -1:
            return 1.0, 0.0  # a division
        if ex.is_Integer:
            p = abs(int(ex))
            return float(min(p, 12) - 1 + (int(ex) < 0)), 0.0
        if ex in (sp.Rational(1, 2), sp.Rational(-1, 2)):
            return 0.0, 1.0  # sqrt / rsqrt
        if base.is_number:
            return 1.0, 1.0  # exp2 of a scaled argument
        return 4.0, 2.0  # pow_real: exp2(e * log2(b)) with guards
    if isinstance(e, (sp.exp, sp.log)):
        return 1.0, 1.0  # ex2 / lg2 and the change of base
    if isinstance(e, (sp.sin, sp.cos)):
        return 1.0, 1.0
    if isinstance(e, (sp.tanh, sp.erf)):
        return 8.0, 2.0
    if isinstance(e, sp.Abs) or isinstance(e, sp.core.relational.Relational) or isinstance(e, sp.Not):
        return 1.0, 0.0
    if isinstance(e, sp.Piecewise):
        return float(n), 0.0  # one select per branch
    if isinstance(e, sp.functions.elementary.piecewise.ExprCondPair):
        return 0.0, 0.0
    if e.func in CAST_FUNCTIONS.values():
        return 3.0, 0.0  # clamp and two conversions
    if e.func == Round:
        return 4.0, 0.0
    return 1.0, 0.0


def tree_cost(e: sp.Basic) -> tuple[float, float]:
    """(ALU, SFU) ops of a whole expression, every node counted (no sharing)."""
    alu, sfu = node_cost(e)
    for a in e.args:
        x, y = tree_cost(a)
        alu, sfu = alu + x, sfu + y
    return alu, sfu


class Anatomy:
    """Kernel sketches of a (spec, derivation, input dtypes), read from the kernel structure."""

    def __init__(self, spec: Spec, derivation: Derivation, dtypes: Mapping[str, str]):
        self.spec = spec
        self.derivation = derivation
        self.conv: SymbolicSpec = derivation.symbols
        self.forms = derivation.forms
        self.dtypes = dict(dtypes)
        self.axis, self.inner = loop_axis(spec)
        self.as_dims = tuple(s.as_dim for s in spec.steps if s.as_dim)
        self.lanes = tuple(d for d in spec.dims if d != self.axis and d not in self.inner and d not in self.as_dims)
        self.loopable = loopable_inner_dims(spec, self.inner)
        self.axis_steps = [s for s in spec.steps if s.is_reduction and s.over == self.axis]
        self._sym_dims: dict[sp.Symbol, frozenset[str]] = {}
        self._cache: dict[tuple, list] = {}

    # ------------------------------------------------------------------ dims of expressions
    def sym_dims(self, s: sp.Symbol) -> frozenset[str]:
        out = self._sym_dims.get(s)
        if out is None:
            name = s.name
            base = name[:name.rindex("[")] if name.endswith("]") and "[" in name else None
            if base is not None and isinstance(self.spec.lookup(base), Step):  # an anchor: dep[old], dep[a], ...
                out = frozenset(self.spec.step(base).dims)
            elif is_dim_symbol(s, "index"):
                out = frozenset((symbol_kind(s)[1],))
            else:
                out = frozenset(self.conv.leaf_dims.get(s, ()))
            self._sym_dims[s] = out
        return out

    def dims_of(self, e: sp.Basic) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for s in e.free_symbols:
            out |= self.sym_dims(s)  # type: ignore[arg-type]
        return out

    def full_blocks(self, blocks: Mapping[str, int], shape: Mapping[str, int] | None = None) -> dict[str, int]:
        """Every dim's block: the given ones, inner dims the plan's default (whole, or a K loop's tile:
        fuser_core.codegen.plan.default_inner_block), topk dims whole (next power of two)."""
        out = dict(blocks)
        for d in self.spec.dims:
            if d in out:
                continue
            if shape is not None and d in self.inner:
                out[d] = default_inner_block(d, self.loopable, shape)
            else:
                out[d] = next_pow2(shape[d]) if shape is not None and d in self.as_dims else 1
        return out

    def contraction_loops(self, blocks: Mapping[str, int], shape: Mapping[str, int]) -> tuple[str, ...]:
        """The inner dims these blocks sum in a K loop (:attr:`KernelPlan.contraction_loops`)."""
        return contraction_loop_dims(self.inner, blocks, shape)

    # ------------------------------------------------------------------ sketches
    def structure(self, strategy: str, blocks: Mapping[str, int], parallel_combine: bool = False,
                  per_lane: bool = True, loops: tuple[str, ...] = ()) -> st.ModuleStructure:
        """The code generator's structure of ``strategy`` with these blocks (every dim), unvalidated:
        the search space checks validity itself. ``parallel_combine``: the plan's decision
        (:func:`fuser_core.codegen.plan.parallel_combine`, which needs the shape); ``per_lane``: the
        configuration's (:attr:`KernelConfig.per_lane`); ``loops``: the inner dims summed in a K loop
        (:meth:`contraction_loops`, which needs the shape)."""
        config = KernelConfig(dict(blocks), split=STRATEGIES[strategy].least_split, per_lane=per_lane)
        plan = KernelPlan(self.spec, self.derivation, strategy, self.axis, self.inner, dict(blocks), self.lanes, config,
                          parallel_combine, loops)
        return st.build_structure(plan, self.dtypes)

    def kernels(self, strategy: str, blocks: Mapping[str, int], parallel_combine: bool = False,
                per_lane: bool = True, loops: tuple[str, ...] = ()) -> list[KernelSketch]:
        """The kernels ``strategy`` launches with these blocks (every dim; see :meth:`full_blocks`)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}")
        key = (strategy, block_pattern(blocks), parallel_combine, per_lane, loops)
        if key not in self._cache:
            structure = self.structure(strategy, blocks, parallel_combine, per_lane, loops)
            self._cache[key] = [sketch(self, k, structure) for k in structure.kernels]
        return self._cache[key]


    def dot_rows(self, strategy: str, blocks: Mapping[str, int], per_lane: bool = True,
                 loops: tuple[str, ...] = ()) -> list[frozenset[str]]:
        """Per launched kernel, the row dims (``i`` of ``tl.dot(P[i, over], Q[over, j])``) of its
        chained dots, those Triton gives every warp along the rows: on sm_90 it lays a dot whose
        result reaches another dot (attention's scores, then p.v) as ``num_warps x 1`` warps
        (AccelerateMatmul's warpsPerTileV3), while a lone dot (a GEMM) spreads warpgroups beyond
        its rows' over its columns: the fp8 GEMM at 64 x 256 on 8 warps issues the tensor work of
        128 x 128, not twice it. Dots chain where they contract different dims (attention: d, then
        n); one contraction in two loops (whole tiles, then the tail) is one GEMM."""
        key = ("dot_rows", strategy, block_pattern(blocks), per_lane, loops)
        if key not in self._cache:
            structure = self.structure(strategy, blocks, per_lane=per_lane, loops=loops)
            chained = [len({d.over for d in k.dots}) > 1 for k in structure.kernels]
            self._cache[key] = [frozenset(d.i for d in k.dots) if c else frozenset()
                                for k, c in zip(structure.kernels, chained)]
        return self._cache[key]


class WorkCounter:
    """Elementwise work of one pass: each expression node once, at its own dims."""

    def __init__(self, an: Anatomy, p: Pass, lane_axis: str | None = None):
        self.an = an
        self.p = p
        self.seen: set[sp.Basic] = set()
        # a per-lane pass (structure.per_lane): states, anchors and moves are per lane of the axis's tile
        self.widen = frozenset({lane_axis} if lane_axis else ())

    def state_dims(self, step: Step) -> frozenset[str]:
        return frozenset(step.dims) | self.widen

    def expr(self, e: sp.Basic) -> None:
        if e in self.seen or e.is_Atom:
            return
        self.seen.add(e)
        for a in e.args:
            self.expr(a)
        alu, sfu = node_cost(e)
        if alu or sfu:
            self.p.add(self.an.dims_of(e) | self.widen, alu, sfu)

    def fold(self, f: ops.Reduce | ops.Fold | ops.Select, step: Step) -> None:
        """acc (op)= reduce over the tile: a tl.dot (its operands' factors), or the tile and a tl.sum/max."""
        dot = getattr(f, "dot", None)
        if dot is not None:
            d = dot
            for factor in (*sp.Mul.make_args(d.p), *sp.Mul.make_args(d.q)):
                self.expr(factor)
            self.p.add(d.p_dims, 2 + max(0, d.n_p_factors - 1))  # mask select, conversion, product of P's factors
            self.p.add(d.q_dims, 1 + max(0, d.n_q_factors - 1))
            self.p.dots.append(d)
            self.p.tensors += [d.p_dims, d.q_dims, frozenset({d.i, d.j})]
            return
        self.expr(f.expr)
        tile = self.an.dims_of(f.expr) | {f.over}
        self.p.tensors.append(tile)
        if has_slots(f.op):
            k = step.k or 1
            self.p.add(tile, TOPK_TILE_ALU * k)
            self.p.add(frozenset(step.dims), TOPK_SLOT_ALU * k)
        elif returns_indices(f.op):
            self.p.add(tile, 4)
        else:
            self.p.add(tile, REDUCE_ALU)

    def moves(self, real: Realisation, acc: frozenset[str], times: int) -> None:
        """The work of moving the accumulators to new anchors (``times`` states moved) beyond the move
        terms the pass prints (counted as its values): a rescale, an added shift, or a joint (Taylor)
        shift, whose whole moved expression is counted here."""
        for a in real.accumulators:
            if a.move == "joint":  # each moved accumulator mixes all of them
                alu, sfu = tree_cost(a.moved)
                self.p.add(acc, times * alu, times * sfu)
            elif a.move == "rescale":
                self.p.add(acc, times * RESCALE_ALU)
            elif a.move == "shift":
                self.p.add(acc, times * 4)  # acc + shift

    def realisation(self, step: Step) -> Realisation:
        real = self.an.forms[step.name].realisation
        assert real is not None, f"{step.name} is streamed but not fused"
        return real

    def update(self, step: Step, anchored: bool) -> None:
        """The state update of a streamed tile beyond its folds and printed values: the moves,
        the running value's combination, the anchor update."""
        real = self.realisation(step)
        acc = self.state_dims(step)
        self.moves(real, acc, 1)
        if not real.selection and real.value not in real.symbols:
            self.p.add(acc, 2 * len(real.accumulators))  # value = sum_j final_factor_j * acc_j + offset
        if anchored:
            self.p.add(acc, 3)  # the anchor update

    def merge_lanes(self, step: Step) -> None:
        """A per-lane state's lanes folded over the axis once (each lane moved to the merged anchors)."""
        real = self.realisation(step)
        lanes = self.state_dims(step)
        self.moves(real, lanes, 1)
        self.p.add(lanes, len(real.accumulators))  # the fold of the moved lanes
        self.p.tensors.append(lanes)

    def merge(self, step: Step, n_accs: int) -> None:
        """Merging one partial state into the running one (both moved to the merged anchors first)."""
        real = self.realisation(step)
        acc = frozenset(step.dims)
        self.moves(real, acc, 2)  # the merged state and the part, each moved to the merged anchors
        if has_slots(real.op):
            self.p.add(acc, 2 * TOPK_SLOT_ALU * (step.k or 1))
        else:
            self.p.add(acc, 2 * n_accs)


# the structure's output loops loop like the loops the model knows (over the axis, or a chunk of
# it); a per-lane loop's lane merge runs once
LOOP_OF_SPAN = {"outputs": "axis", "chunk_outputs": "chunk", "lanes": "once"}


def sketch(an: Anatomy, kernel: st.Kernel, structure: st.ModuleStructure) -> KernelSketch:
    """The cost model's view of one kernel of the structure: its operations counted, per pass (each
    loop, the lane merge after a per-lane loop, and the straight-line code between loops when it
    loads, reduces, computes or stores anything).

    A hoisted load counts once per program (its address and conversion work) and in the loop that
    reads it. A fold of a reduction the kernel realises incrementally (streamed, or a split part
    merged, or lanes merged) counts, once per reduction and pass, the work its realisation adds
    around the folds: the accumulators moved to the new anchors (the move terms and the moves),
    the running value and the anchor update; a final value counts its realisation's value. The
    ``Value``, ``AnchorUpdate``, ``Copy`` and ``Count`` operations those print are not counted again."""
    spec = an.spec
    plan = structure.plan
    anchored = set(st.anchored_deps(plan))
    ws_dims = {w.name: frozenset(w.dims) for w in structure.workspace}
    n_accs = {s.name: sum(1 for x in kernel.states if x.step == s.name) for s in an.axis_steps}
    grid = "lanes x split" if kernel.grid.split else "lanes"
    hoisted = {op.input: op for op in kernel.ops if isinstance(op, ops.Load) and op.hoisted}
    prologue = Pass("once")  # hoisted loads: their address and conversion work, once per program
    passes: list[Pass] = []
    ws_stores: list[frozenset[str]] = []

    def flat(items):
        for op in items:
            if isinstance(op, ops.FirstChunk):
                yield from flat(op.body)
            else:
                yield op

    def count(items, span: str, per_lane: bool = False, always: bool = True, loads: tuple[str, ...] = (),
              inner: str | None = None) -> None:
        p = Pass(LOOP_OF_SPAN.get(span, span), inner=inner)
        w = WorkCounter(an, p, an.axis if per_lane or span == "lanes" else None)
        counted = False
        done: set[str] = set()  # reductions whose update (or merge) this pass counted
        for name in loads:  # the loop's hoisted loads
            dims = frozenset(hoisted[name].input_dims)
            p.loads = (*p.loads, name)
            prologue.add(dims, LOAD_ALU)
            p.tensors.append(dims)
            counted = True
        for op in flat(items):
            if isinstance(op, ops.Loop) and op.span == "contraction":  # a K loop: a pass of its own
                count(op.body, span, inner=op.dim)
            elif isinstance(op, ops.Load) and not op.hoisted:
                dims = frozenset(op.input_dims)
                p.loads = (*p.loads, op.input)
                p.add(dims, LOAD_ALU)
                p.tensors.append(dims)
                counted = True
            elif isinstance(op, (ops.Reduce, ops.Fold, ops.Select)):
                step = spec.step(op.step)
                w.fold(op, step)
                counted = True
                real = st.realisation(plan, step) if not isinstance(op, ops.Reduce) else None
                if real is not None and op.step not in done:  # streamed with the realisation's step rule
                    done.add(op.step)
                    for a in real.accumulators:
                        for t in a.move_terms:
                            w.expr(t)
                    if not real.selection and real.value not in real.symbols:
                        w.expr(real.value)
                    w.update(step, op.step in anchored)
            elif isinstance(op, (ops.LaneMerge, ops.PartMerge)):
                step = spec.step(op.step)
                real = w.realisation(step)
                counted = True
                if op.step in done:
                    continue
                done.add(op.step)
                sides = ("b",) if isinstance(op, ops.LaneMerge) else ("a", "b")
                for a in real.accumulators:
                    for side in sides:
                        for t in a.move_terms:
                            w.expr(real.at_part(t, side))
                if not real.selection and real.value not in real.symbols:
                    w.expr(real.value)
                if isinstance(op, ops.LaneMerge):
                    w.merge_lanes(step)
                else:
                    w.merge(step, n_accs[op.step])
            elif isinstance(op, ops.Finalise):
                if op.expr is not None and not op.expr.is_Atom:
                    w.expr(op.expr)
                    counted = True
            elif isinstance(op, ops.OutputStore):
                if op.gate:  # a fallback's store: masked off on the rows that are tuned on
                    continue
                if op.expr is not None:
                    w.expr(op.expr)
                dims = frozenset(op.part_dims)
                p.stores.append((op.part, dims))
                p.add(dims, 2)  # pointer and conversion of the stored value
                counted = True
            elif isinstance(op, ops.WorkspaceLoad):
                p.ws_loads.append(ws_dims[op.entry])
            elif isinstance(op, ops.WorkspaceStore):
                ws_stores.append(ws_dims[op.entry])
        if always or counted:
            passes.append(p)

    straight: list[ops.Op] = []
    for op in kernel.ops:
        if not isinstance(op, ops.Loop):
            straight.append(op)
            continue
        if op.unmasked:  # the first part of a loop split at its mask: the masked part counts the whole pass
            continue
        if op.span == "fallback":  # runs only for rows whose dependencies ended non-finite: not the tuned case
            continue
        if straight:
            count(straight, "once", always=False)
            straight = []
        count(op.body, op.span, per_lane=op.per_lane, loads=op.hoisted)
        if op.lanes:
            count(op.lanes, "lanes")
    if straight:
        count(straight, "once", always=False)
    if prologue.ops:
        passes.insert(0, prologue)
    return KernelSketch(kernel.name, grid, passes, [frozenset(s.dims) for s in kernel.states], ws_stores)


# ---------------------------------------------------------------------- numbers from sketches


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def elements(dims: Iterable[str], blocks: Mapping[str, int]) -> int:
    return math.prod(blocks.get(d, 1) for d in dims)


def pass_iterations(p: Pass, axis: str, shape: Mapping[str, int], blocks: Mapping[str, int], split: int) -> int:
    """Loop iterations one program makes in this pass (a K loop's: times its own trips)."""
    inner = cdiv(shape[p.inner], blocks[p.inner]) if p.inner else 1
    if p.loop == "axis":
        return cdiv(shape[axis], blocks[axis]) * inner
    if p.loop == "chunk":
        chunk = cdiv(cdiv(shape[axis], split), blocks[axis]) * blocks[axis]
        return chunk // blocks[axis] * inner
    if p.loop == "split":
        return split * inner
    return inner


@dataclass(frozen=True)
class ResourceEstimate:
    """Per-program resources of one kernel, estimated (registers) or counted (shared memory)."""

    regs_per_thread: int
    smem_bytes: int
    tile_elements: int  # the largest tensor a program holds
    live_elements: int  # float32 values live at once (state + loaded tiles + the largest temporary)
    min_regs_per_thread: int = 0  # a lower bound: the state and one loaded tile live at once, no overhead

    def to_dict(self) -> dict:
        return {"regs_per_thread": self.regs_per_thread, "smem_bytes": self.smem_bytes,
                "tile_elements": self.tile_elements, "live_elements": self.live_elements,
                "min_regs_per_thread": self.min_regs_per_thread}


REG_OVERHEAD = 32  # pointers, offsets, loop counters, masks
SCRATCH_BYTES = 1024  # cross-warp reduction scratch


def resources(kernel: KernelSketch, inputs: Mapping[str, tuple[tuple[str, ...], int]], axis: str | None,
              blocks: Mapping[str, int], num_warps: int, num_stages: int, target: Target | None = None) -> ResourceEstimate:
    """Per-program resources; ``inputs`` maps each loadable name to (dims, bytes per element).

    Registers: live float32 elements (accumulators + loaded tiles + the largest temporary,
    counted twice for the value it is computed from) / (warp size * num_warps) threads (the
    ``target``'s: a warp is 32 threads, an AMD wavefront 64; None: NVIDIA), + overhead: an
    upper bound the cost model charges; ``min_regs_per_thread`` is the lower bound (state and
    one tile, nothing else) that the search space prunes by, leaving the rest to ptxas's own
    count in the compile gate (a 32768-wide softmax row on 32 warps needs ~47, the upper bound says 129).
    Shared memory: tl.dot operand tiles * operand bytes, those loaded along the loop axis in
    num_stages - 1 buffers (Triton's pipeliner; compiled: attention bf16 128 x 64 x 128 on 3 stages,
    129 KiB, where every operand times num_stages said 241), plus, in loops over the axis
    with num_stages > 1, the other loads of the axis pipelined num_stages - 1 tiles ahead, on
    NVIDIA only: Triton's AMD stream pipeliner stages only tl.dot operands in the LDS and keeps
    other loads in registers (compiled for gfx942: a 16384-wide float16 softmax tile on 3 stages
    takes 32 bytes of LDS). Against gfx942's compiler the tl.dot part is an upper bound
    (attention 64 x 64 x 64 on 3 stages: 40 KiB compiled, 49 estimated); gfx950 pads its LDS
    tiles and may take up to a quarter more than estimated: the compile gate has the count."""
    warp_size = target.warp_size if target is not None else WARP_SIZES[CUDA]
    stages_other_loads = target is None or target.backend == CUDA
    state = sum(elements(d, blocks) for d in kernel.state)
    smem, tile, live_max, live_min = SCRATCH_BYTES, max([1] + [elements(d, blocks) for d in kernel.state]), 0, 0
    for p in kernel.passes:
        loaded = sum(elements(inputs[n][0], blocks) for n in p.loads)
        held = [*p.tensors, *p.ws_loads, *(dims for _, dims in p.stores)]
        biggest = max((elements(t, blocks) for t in held), default=1)
        tile = max(tile, biggest)
        live_max = max(live_max, state + loaded + 2 * biggest)
        # a lower bound: a tl.dot's operands loaded as they are may live in shared memory only
        # (attention 64 x 128 at d = 128 on 4 warps: ptxas 248 registers; K and V counted, 385)
        direct = {n for d in p.dots for n in d.direct}
        in_registers = sum(elements(inputs[n][0], blocks) for n in p.loads if n not in direct)
        live_min = max(live_min, state + max(in_registers, biggest))
        dot_smem = sum((elements(d.p_dims, blocks) * _buffers(d, d.p, d.p_dims, axis, num_stages)
                        + elements(d.q_dims, blocks) * _buffers(d, d.q, d.q_dims, axis, num_stages))
                       * DOT_BYTES[d.precision] for d in p.dots)
        staged = 0
        if stages_other_loads and num_stages > 1 and p.loop in ("axis", "chunk") and axis is not None \
                and blocks.get(axis, 1) > 1:
            staged = (num_stages - 1) * sum(
                elements(inputs[n][0], blocks) * inputs[n][1]
                for n in p.loads if n not in direct and axis in inputs[n][0]
            )
        smem = max(smem, SCRATCH_BYTES + dot_smem + staged)
    threads = warp_size * num_warps
    regs = REG_OVERHEAD + math.ceil(live_max / threads)
    return ResourceEstimate(int(regs), int(smem), int(tile), int(live_max), math.ceil(live_min / threads))


def _buffers(dot: Any, side: sp.Expr, side_dims: frozenset[str], axis: str | None, num_stages: int) -> int:
    """Shared-memory copies of one tl.dot operand: an input loaded as it is (``dot.direct``) that
    moves with the loop axis is pipelined in num_stages - 1 buffers; a loop-invariant or computed
    operand (attention's q, its P) takes one."""
    loaded = {f.name for f in sp.Mul.make_args(side) if isinstance(f, sp.Symbol)} & set(dot.direct)
    return max(1, num_stages - 1) if loaded and axis in side_dims else 1


def input_info(spec: Spec, dtypes: Mapping[str, str]) -> dict[str, tuple[tuple[str, ...], int]]:
    """name -> (dims, bytes per element) for every input of ``spec``."""
    return {i.name: (i.dims, ELEMENT_BYTES[dtypes.get(i.name, "int64" if i.is_index else "float32")])
            for i in spec.inputs}
