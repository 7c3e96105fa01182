"""The kernels of a generated module, decided once from a plan, before anything is printed.

:func:`build_structure` turns a :class:`~fuser_core.codegen.plan.KernelPlan` (and the input and
output storage dtypes) into a :class:`ModuleStructure`: the kernels a strategy launches, each an
ordered list of typed operations (:mod:`fuser_core.codegen.ops`: program ids, offsets, loads,
loops, folds, anchor updates, lane and part merges, final values, workspace and output stores),
each naming the value it defines and the tile dims it lives on; the states a kernel carries, the
workspace a split kernel hands to its combine kernel, the argument list of each kernel (exactly
the parameters its operations read) and the launches with their grids (a split part kernel and
its combine kernel as one :class:`SplitLaunch`).

This is the one walk of each strategy: it decides the loads (loop-invariant ones hoisted:
attention's ``q`` does not vary along ``n``, so it is loaded once per program, before the loop),
the inner reductions and which sums are ``tl.dot`` contractions, per-lane or per-tile states,
each value's name and dims, the helpers each kernel calls. Three readers share it: the Triton
printer (:mod:`fuser_core.codegen.emit`, one method per operation type, no strategy branch), the
launcher printer (:mod:`fuser_core.codegen.module`) and the tuner's analysis
(:mod:`tuner.analysis`), which counts the same operations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import sympy as sp

from fuser_core.codegen.bounds import Window, axis_mask, bound_text, window_of
from fuser_core.codegen.layout import Layout
from fuser_core.codegen.names import FP8, kernel_arg, safe_name, scalar_arg
from fuser_core.codegen.ops import (
    AnchorUpdate,
    Chunk,
    Comment,
    Copy,
    Count,
    Dot,
    Env,
    Finalise,
    FallbackFlag,
    FirstChunk,
    Fold,
    Gather,
    InitState,
    LaneMerge,
    Load,
    Loop,
    Offsets,
    Op,
    OutputStore,
    PartMerge,
    Program,
    Reduce,
    Select,
    Value,
    WorkspaceLoad,
    WorkspaceStore,
    assuming,
    walk,
)
from fuser_core.codegen.plan import KernelPlan
from fuser_core.codegen.tritonize import Ref, is_literal, lookup
from fuser_core.derive import ReductionForm
from fuser_core.grouping import Grouping
from fuser_core.masks import excluded, exclusion, may_exclude_every
from fuser_core.merged import address, kernel_dims
from fuser_core.realisation import (
    COUNT_OLD, SELECTIONS, Realisation, identity, new, old, part_acc, part_anchor, part_count, settled,
    state_symbols,
)
from fuser_core.spec import Input, Step

ORDER_SELECTIONS = SELECTIONS
FUSED_STRATEGIES = ("streaming_fused", "split_fused")


def var_name(name: str) -> str:
    """The generated-code identifier of a spec name."""
    return safe_name(name)


# ---------------------------------------------------------------------- the pieces


@dataclass(frozen=True)
class State:
    """One float32/int32 accumulator carried by a kernel (and, split, handed over in the workspace)."""

    name: str  # identifier in the generated code
    step: str
    dims: tuple[str, ...]
    dtype: str  # "float32" | "int32"


@dataclass(frozen=True)
class Arg:
    """One kernel parameter and the launcher's value for it (``constexpr``: passed by keyword)."""

    name: str  # the parameter's name in the kernel
    value: str  # the launcher's expression
    constexpr: bool = False

    @property
    def param(self) -> str:
        return f"{self.name}: tl.constexpr" if self.constexpr else self.name

    @property
    def launch_arg(self) -> str:
        return f"{self.name}={self.value}" if self.constexpr else self.value


@dataclass(frozen=True)
class Grid:
    """Programs of a launch: one per block of every lane dim (``lanes``, slowest first), times
    SPLIT chunks of the axis as a second grid dim when ``split``."""

    lanes: tuple[tuple[str, int], ...]  # (dim, block)
    split: bool = False


@dataclass(frozen=True)
class Kernel:
    """One ``@triton.jit`` kernel of the module: its operations, in order (:mod:`fuser_core.codegen.ops`)."""

    name: str
    role: str  # "main" | "split_part" | "combine"
    grid: Grid
    doc: str  # its docstring
    layout: Layout  # its tile dims: a lane with block 1 is a scalar offset, in no tile
    ops: tuple[Op, ...]
    states: tuple[State, ...]
    args: tuple[Arg, ...]  # exactly the parameters its operations read
    inputs: tuple[str, ...]  # inputs it loads (spec names)
    outputs: tuple[str, ...]  # output parts it writes
    grouping: Grouping = field(default_factory=Grouping, compare=False)  # the user's sums, printed as written

    def walk(self) -> Iterable[Op]:
        """Every operation, nested ones (a loop's body) after the one that holds them."""
        return walk(self.ops)

    def loops(self) -> tuple[Loop, ...]:
        return tuple(op for op in self.walk() if isinstance(op, Loop))

    @property
    def hoisted(self) -> tuple[Load, ...]:
        return tuple(op for op in self.ops if isinstance(op, Load) and op.hoisted)

    @property
    def dots(self) -> tuple[Dot, ...]:
        return tuple(op.dot for op in self.walk() if isinstance(op, (Reduce, Fold)) and op.dot is not None)

    def helpers(self) -> list[str]:
        """The ``@triton.jit`` helpers its operations call (each once, first use first)."""
        return list(dict.fromkeys(h for op in self.walk() for h in op.helpers()))


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: Grid


@dataclass(frozen=True)
class SplitLaunch:
    """split_fused: the part kernel (grid lanes x SPLIT, each program folds a chunk of ``chunk``
    axis elements into its partial state in ``workspace``) then the combine kernel (grid lanes,
    times SPLIT when outputs keep the axis: each program then writes one chunk of them)."""

    part: Launch
    combine: Launch
    split: int
    axis: str
    block: int  # chunk = cdiv(cdiv(size_axis, split), block) * block
    workspace: tuple[State, ...]


@dataclass(frozen=True)
class ModuleStructure:
    plan: KernelPlan
    kernels: tuple[Kernel, ...]
    launches: tuple[Launch | SplitLaunch, ...]
    workspace: tuple[State, ...]  # empty unless split_fused

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)

    def helpers(self) -> list[str]:
        """The helpers the module's kernels call."""
        return list(dict.fromkeys(h for k in self.kernels for h in k.helpers()))


# ---------------------------------------------------------------------- small rules


def realisation(plan: KernelPlan, step: Step) -> Realisation | None:
    """The realisation a fused strategy runs for an axis reduction (None: computed unfused)."""
    form = plan.derivation.forms.get(step.name)
    if plan.strategy not in FUSED_STRATEGIES or form is None:
        return None
    return form.realisation


def effective_op(plan: KernelPlan, step: Step) -> str:
    form = plan.derivation.forms.get(step.name)
    if plan.strategy in FUSED_STRATEGIES and form is not None and form.effective_op:
        return form.effective_op
    return step.reduce or ""


def state_name(step: Step, j: int, parts: int, lanes: bool = False) -> str:
    """The identifier of accumulator j (of ``parts``) of an axis reduction: ``den_acc``, ``den_acc1``;
    ``den_lane``... for its per-lane state in a per-lane loop (:func:`per_lane`)."""
    base = f"{var_name(step.name)}_{'lane' if lanes else 'acc'}"
    return base if parts == 1 else f"{base}{j}"


def accumulators(plan: KernelPlan, step: Step, lanes: bool = False) -> tuple[State, ...]:
    """The accumulators of an axis reduction, named as the printer names them; ``lanes``: its per-lane
    states (one per lane of the loop axis's tile, :func:`per_lane`)."""
    real = realisation(plan, step)
    selections = [a.selection for a in real.accumulators] if real is not None else [step.reduce in ORDER_SELECTIONS]
    dims = tuple(d for d in plan.dims if d in step.dims or (lanes and d == plan.axis))
    out: list[State] = []
    for j, selection in enumerate(selections):
        name = state_name(step, j, len(selections), lanes)
        if selection:  # (values, indices)
            out += [State(f"{name}_values", step.name, dims, "float32"),
                    State(f"{name}_indices", step.name, dims, "int32")]
        else:
            out.append(State(name, step.name, dims, "float32"))
    return tuple(out)


def per_lane(plan: KernelPlan, folds: Iterable) -> tuple[bool, str]:
    """THE rule for per-lane states in a streamed loop, decided here once (the printer and the tuner's
    analysis read :attr:`~fuser_core.codegen.ops.Loop.per_lane`): (whether, why). ``folds``: the
    loop's operations (its folds are read: :class:`~fuser_core.codegen.ops.Fold`, ``Select``, ``Reduce``).

    Per lane, every lane of the loop axis's tile (``[BLOCK_m, BLOCK_n]``) keeps its own running state,
    updated elementwise in the loop with the realisation's step rule (no cross-warp reduction per tile),
    and the lanes are folded once after the loop with its merge rule (lanes are parts). Conservative:
    every fused reduction of the loop must allow it (``Realisation.per_lane``), keep a plain state
    (no selection: argmax/top-k states merge by their helpers, per tile), move by nothing or a rescale
    only (a shift or a joint Taylor move, ``shifted``/``taylor``, stays per tile: each lane would need
    its own count), anchor at running values (a running estimate reads the count), have no state dims
    besides the lanes, and fold elementwise (a ``tl.dot`` fold, attention's ``o``, stays per tile)."""
    if not plan.config.per_lane:
        return False, "the configuration keeps the states per tile (per_lane: false)"
    lanes = set(plan.lanes)
    for step in plan.axis_reductions():
        real = realisation(plan, step)
        if real is None:
            return False, f"{step.name} is not fused"
        if not real.per_lane:
            return False, f"{step.name}: {real.per_lane_reason}"
        if real.selection:
            return False, f"{step.name}: a selection's (values, indices) state is merged per tile by its helper"
        moves = sorted({a.move for a in real.accumulators} - {"none", "rescale"})
        if moves:
            return False, f"{step.name}: its accumulators move by a {moves[0]} (per lane it would need each lane's count)"
        if any(k.startswith("running estimate") for k in real.anchors.values()):
            return False, f"{step.name}: anchored at a running estimate (reads the count)"
        exprs = [real.value, *(a.moved for a in real.accumulators), *(a.contribution for a in real.accumulators)]
        if any(COUNT_OLD in e.free_symbols for e in exprs):
            return False, f"{step.name}: reads the count of values seen"
        if not set(step.dims) <= lanes:
            return False, f"{step.name}: its state has dims besides the lanes ({', '.join(sorted(set(step.dims) - lanes))})"
    for f in folds:
        if not isinstance(f, (Fold, Select, Reduce, _FoldFact)) or getattr(f, "inner", False):
            continue
        if getattr(f, "dot", None) is not None:
            return False, f"{f.step} folds by tl.dot"
        if f.op == "sum" and contracts(plan, f.expr, f.over):  # a tl.dot at larger blocks; per lane, an outer product
            return False, f"{f.step} is a matrix product over {f.over} (its lanes would hold an outer product)"
    return True, "every reduction of the loop folds elementwise with an exact merge"


def reads_count(plan: KernelPlan) -> bool:
    """Does a fused kernel read the count of values seen: a move or value by ``count[old]``, or an
    anchor kept as a running estimate (value * size / count)? If not, it keeps no count."""
    for step in plan.axis_reductions():
        real = realisation(plan, step)
        if real is None:
            continue
        exprs = [real.value, *(a.moved for a in real.accumulators), *(a.contribution for a in real.accumulators)]
        if any(COUNT_OLD in e.free_symbols for e in exprs):
            return True
        if any(k.startswith("running estimate") for k in real.anchors.values()):
            return True
    return False


def anchored_deps(plan: KernelPlan) -> list[str]:
    """Dependencies some reduction over the axis anchors at (a running value or estimate)."""
    out: list[str] = []
    for step in plan.axis_reductions():
        for dep in plan.derivation.forms[step.name].anchors:
            if dep not in out:
                out.append(dep)
    return out


def workspace(plan: KernelPlan) -> tuple[State, ...]:
    """Every piece of state a split program hands to the combine kernel."""
    out = [s for step in plan.axis_reductions() for s in accumulators(plan, step)]
    out += [State(f"{var_name(dep)}_anchor", dep, plan.spec.step(dep).dims, "float32") for dep in anchored_deps(plan)]
    return tuple(out)


def expr_dims(plan: KernelPlan, e: sp.Expr) -> set[str]:
    """Dims an expression varies over within a tile (dims blocked as 1 do not count)."""
    conv = plan.derivation.symbols
    dims: set[str] = set()
    for s in e.free_symbols:
        name = s.name
        dims.update(conv.leaf_dims.get(s, ()))
        if name.startswith("index("):
            dims.add(name[6:-1])
        if name.endswith(("[old]", "[new]")) and isinstance(plan.spec.lookup(name[:-5]), Step):
            dims.update(plan.spec.step(name[:-5]).dims)
    return {d for d in dims if plan.blocks.get(d, 1) > 1}


def contracts(plan: KernelPlan, e: sp.Expr, over: str) -> bool:
    """Is the sum over ``over`` of ``e`` a matrix product, whatever the blocks: two factors each varying
    over a dim (besides ``over``) the other lacks (attention's exp(s - mx) * v: m and e)?"""
    if isinstance(e, sp.Piecewise):  # a masked product (causal attention's where(c, exp(s - mx) * v, 0))
        return any(contracts(plan, branch, over) for branch, _ in e.args)
    conv = plan.derivation.symbols
    dims = []
    for f in sp.Mul.make_args(e):
        fd = {d for s in f.free_symbols for d in conv.leaf_dims.get(s, ())} - {over}
        if fd:
            dims.append(fd)
    return any(a - b and b - a for i, a in enumerate(dims) for b in dims[i + 1:])


def _exact_in_fp16(e: sp.Expr, input_dtypes: Mapping[str, str]) -> bool:
    """Every factor is an fp8/fp16 input or a cast to fp8/fp16: fp16 operands lose nothing."""
    from fuser_core.symbolic import CAST_FUNCTIONS

    narrow = (CAST_FUNCTIONS["float8_e4m3fn"], CAST_FUNCTIONS["float16"])
    for f in sp.Mul.make_args(e):
        if f.is_Symbol and input_dtypes.get(f.name) in ("float8_e4m3fn", "float16"):
            continue
        if f.func in narrow:
            continue
        return False
    return True


def dot_precision(plan: KernelPlan, p: sp.Expr, q: sp.Expr, input_dtypes: Mapping[str, str]) -> str:
    """Operand precision of tl.dot, as FlashAttention and the tutorials choose it: operands
    exactly representable in fp16 (fp8 values, as in the fp8 GEMM) -> fp16 tensor cores, exact;
    float16 inputs -> float16, bfloat16 inputs -> bfloat16 (P rounded to the inputs' dtype,
    float32 accumulation: 16-bit tensor cores at twice TF32's rate); float32 and mixed inputs ->
    IEEE float32."""
    if _exact_in_fp16(p, input_dtypes) and _exact_in_fp16(q, input_dtypes):
        return "tl.float16"
    floats = {input_dtypes.get(i.name, "float32") for i in plan.spec.inputs if i.is_float}
    if floats == {"float16"}:
        return "tl.float16"
    if floats == {"bfloat16"}:
        return "tl.bfloat16"
    return "ieee"


def decide_dot(plan: KernelPlan, e: sp.Expr, over: str, input_dtypes: Mapping[str, str]) -> Dot | None:
    """sum over ``over`` of ``e`` as a tl.dot when the tile allows it: the factors that vary carry
    one blocked dim each besides ``over``, two in all (I and J), and every block of I, J and
    ``over`` is at least 16 (tl.dot's minimum).

    A masked product ``where(c, P * Q, 0)`` (causal attention's ``o``) is the dot of
    ``where(c, P, 0)`` and ``Q`` when the mask varies over P's dims only (``index(n) <= index(m)``
    over the scores' [m, n]): zeroing P's masked entries zeroes exactly those terms."""
    masked = _masked_product(e)
    if masked is not None:
        product, cond = masked
        dot = decide_dot(plan, product, over, input_dtypes)
        if dot is None:
            return None
        cond_dims = expr_dims(plan, cond)
        if cond_dims <= dot.p_dims:
            return replace(dot, p=sp.Piecewise((dot.p, cond), (0, True)), direct=_unmasked(dot.direct, dot.q))
        if cond_dims <= dot.q_dims:
            return replace(dot, q=sp.Piecewise((dot.q, cond), (0, True)), direct=_unmasked(dot.direct, dot.p))
        return None
    args = sp.Mul.make_args(e)
    scalars = [f for f in args if not expr_dims(plan, f)]
    factors = [f for f in args if expr_dims(plan, f)]
    dims = [expr_dims(plan, f) - {over} for f in factors]
    free = set().union(*dims) if dims else set()
    if len(free) != 2 or any(len(d) > 1 for d in dims):
        return None
    i, j = sorted(free, key=plan.dims.index)
    if min(plan.blocks[i], plan.blocks[j], plan.blocks[over]) < 16:
        return None
    p = sp.Mul(*[f for f, d in zip(factors, dims) if d != {j}])
    q = sp.Mul(*[f for f, d in zip(factors, dims) if d == {j}])
    direct = tuple(f.name for f in factors if isinstance(f, sp.Symbol) and isinstance(plan.spec.lookup(f.name), Input))
    return Dot(over, i, j, p, q, sp.Mul(*scalars) if scalars else None, dot_precision(plan, p, q, input_dtypes), direct)


def _masked_product(e: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
    """(product, condition) of ``where(condition, product, 0)``, else None."""
    if isinstance(e, sp.Piecewise) and len(e.args) == 2 and e.args[1] == (0, True) and e.args[0][0].is_Mul:
        return e.args[0][0], e.args[0][1]
    return None


def _unmasked(direct: tuple[str, ...], side: sp.Expr) -> tuple[str, ...]:
    """The inputs loaded straight into a dot operand: those of the side the mask left alone."""
    names = {f.name for f in sp.Mul.make_args(side) if isinstance(f, sp.Symbol)}
    return tuple(d for d in direct if d in names)


# ---------------------------------------------------------------------- the walk


@dataclass(frozen=True)
class _FoldFact:
    """A fold a streamed loop will make, for :func:`per_lane` before the loop is walked."""

    step: str
    over: str
    op: str
    expr: sp.Expr
    dot: Dot | None
    inner: bool = False


def _placeholder(name: str) -> sp.Symbol:
    """A symbol standing for the variable ``name`` in an operation's expression (its env maps it)."""
    return sp.Symbol(f"<{name}>")


class _Walk:
    """One kernel's operations, in the order they run (and are printed).

    ``values`` maps what expressions read (a spec name, or a symbol: ``count[old]``, a part's
    accumulator) to the :class:`Ref` holding it in the kernel; ``loaded`` are the inputs and inner
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
        self.values: dict[str | sp.Basic, Ref] = {}
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

    def order(self, dims: Iterable[str]) -> tuple[str, ...]:
        return self.layout.order(dims)

    def let(self, name: str, dims: Iterable[str]) -> Ref:
        """``name`` now holds a value on ``dims``."""
        self.var_dims[name] = self.order(dims)
        return self.var(name)

    def var(self, name: str) -> Ref:
        """The variable ``name``, defined earlier in the kernel, on its dims."""
        return Ref(name, self.var_dims[name], finite=name.startswith(self.finite_prefixes))

    def env(self, *exprs: sp.Expr | None, extra: Mapping | None = None) -> Env:
        """What each free symbol of ``exprs`` reads: ``extra`` first, then the values in scope."""
        names = {**self.values, **(extra or {})}
        out: dict[sp.Basic, Ref] = {}
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
            if d == self.axis or d not in dims:
                continue
            self.head.append(Offsets(dim=d, base="pid" if d in lanes else "", mask=True))
            self.let(f"offs_{d}", (d,))
            self.let(f"mask_{d}", (d,))
        for d in self.spec.part_dims:  # size(c) of a merged dim's part: an argument of its own
            self.values[f"size({d})"] = Ref(f"size_{d}", (), "size")
        for d in self.plan.dims:
            self.values[f"size({d})"] = Ref(f"size_{d}", (), "size")
            self.values[f"index({d})"] = Ref(f"offs_{d}", (d,) if d in dims else ())
        for p in self.spec.runtime_params:  # a scalar passed at call time: a kernel argument (fp32)
            self.values[p.name] = Ref(scalar_arg(p.name), ())

    def axis_tile(self, start: str) -> None:
        a = self.axis
        self.add(Offsets(dim=a, base="start" if start != "0" else "", mask=True))
        self.let(f"offs_{a}", (a,))
        self.let(f"mask_{a}", (a,))

    # ------------------------------------------------------------ loops
    def loop(self, span: str, var: str, lo: str, hi: str, step: str | None, bounds: Iterable[str],
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
        return self.add(Loop(span=span, var=var, lo=lo, hi=hi, step=step, bounds=frozenset(bounds), body=tuple(ops),
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
                inputs.append((inp.name, inp.dims, self.dtypes.get(inp.name), "tl.int32" if inp.is_index else "tl.float32",
                               name, address(self.spec, inp.name, safe_name(inp.name))))
                extra[sym] = self.let(name, dims)
        others = [s for s in x.free_symbols if s not in extra]
        self.need([sp.Add(*others)] if others else [])
        env = self.env(x, at, extra={**extra, sp.Symbol(f"{var}_at"): Ref(f"{var}_at", lanes)})
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
            if op not in ("max", "min") or not isinstance(e, sp.Symbol) or e.name in self.values:
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
        hoisted = self.hoisted is not None and self.axis not in inp.dims
        if fill and tile:
            self.filled[name] = fill
        else:
            self.filled.pop(name, None)
        op = Load(input=name, name=var, dims=tile, input_dims=inp.dims, kind="tl.int32" if inp.is_index else "tl.float32",
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
        self.need([integrand])
        var = safe_name(step.name)
        self.add(Comment(text=f"# {step.name}: {step.reduce} over {step.over} of {sp.sstr(integrand)}"))
        op = step.reduce or "sum"
        dot = self.dot(integrand, step.over) if op == "sum" else None
        if op not in ("sum", "max", "min"):
            raise NotImplementedError(f"{op} inside a tile")  # validated earlier: inner reductions are sum/max/min
        env = self.env(dot.p, dot.q, dot.scale) if dot is not None else self.env(integrand)
        if dot is not None:
            dims = self.order((dot.i, dot.j))
            masked = not self.zero_filled(dot.p, step.over)
        else:
            dims = tuple(d for d in self.layout.union(self.dims_of(integrand, env), (step.over,)) if d != step.over)
            masked = True
        note = f"  # tl.dot: sum over {step.over} as a matrix product" if dot is not None else ""
        self.add(Reduce(step=step.name, name=var, dims=dims, op=op, over=step.over, expr=integrand, env=env, inner=True,
                        dot=dot, masked=masked, note=note))
        self.values[step.name] = self.let(var, dims)
        self.loaded.add(step.name)

    def zero_filled(self, e: sp.Expr, over: str) -> bool:
        """Is ``e`` an input loaded here with 0 in the masked lanes of ``over``?"""
        return (isinstance(e, sp.Symbol) and e.name in self.loaded and e.name not in self.filled
                and isinstance(self.spec.lookup(e.name), Input) and over in self.spec.input(e.name).dims)

    # ------------------------------------------------------------ reductions over the loop axis
    def state_dims(self, dims: Iterable[str]) -> set[str]:
        return set(dims) | ({self.axis} if self.lanes else set())

    def anchor_var(self, dep: str) -> str:
        return f"{safe_name(dep)}_lane_anchor" if self.lanes else f"{safe_name(dep)}_anchor"

    def init_state(self, step: Step, parts: int = 1) -> list[str]:
        """The initial (empty) accumulators of an axis reduction; returns their names."""
        var = safe_name(step.name)
        dims = self.order(self.state_dims(step.dims))
        op = self.effective_op(step)
        if op in ORDER_SELECTIONS:  # (values, indices), selected on values (negated for bottom-k/argmin)
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

    def tile_fold(self, step: Step, e: sp.Expr, env: Env) -> tuple[Dot | None, bool, tuple[str, ...], str]:
        """A sum/max/min of ``e`` over the axis's tile: (its tl.dot, whether its masked lanes are set to
        the identity, the dims of its value, a note)."""
        a = self.axis
        op = self.effective_op(step)
        dot = self.dot(e, a) if op == "sum" else None
        if dot is not None:
            return dot, not self.zero_filled(dot.p, a), self.order((dot.i, dot.j)), f"  # tl.dot: sum over {a} as a matrix product"
        dims = self.dims_of(e, env)
        masked = self.needs_mask(e, op)
        if masked:
            dims = self.layout.union(dims, (a,))
        return None, masked, tuple(d for d in dims if d != a), ""

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
        if op in ORDER_SELECTIONS:
            self.select(step, acc, e, env_e + env_prev, prev)
            return
        dot, masked, _, note = self.tile_fold(step, e, env_e)
        if dot is not None:
            dot = self.dot_excluded(dot, e, op)
        env = (self.env(dot.p, dot.q, dot.scale) if dot is not None else env_e) + env_prev
        self.add(Fold(step=step.name, name=acc, dims=self.var_dims[acc], op=op, over=self.axis, expr=e, env=env, prev=prev,
                      dot=dot, masked=masked, note=note))

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
            dims |= {sym.name[6:-1]} if sym.name.startswith("index(") else set(self.conv.leaf_dims.get(sym, ()))
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
        slots = step.as_dim if op in ("topk", "bottomk") else None
        self.add(Select(step=step.name, name=acc, dims=state, op=op, over=a, expr=e, env=env, prev=prev, slots=slots,
                        k=step.k if slots else None, tile_dims=tile_dims, broadcast=got != tile_dims))

    def selected(self, step: Step, acc: str) -> Ref:
        """The accumulated values of an order reduction, signs undone."""
        op = self.effective_op(step)
        return Ref(f"{acc}_values", self.var_dims[f"{acc}_values"], "neg" if op in ("bottomk", "argmin") else "var")

    def set_result(self, step: Step, value: Ref | None, indices: str | None = None, expr: sp.Expr | None = None,
                   env: Env = ()) -> None:
        """Name a reduction's final value: ``expr`` (fused: its realisation's value) or ``value`` (a
        selection's values, or its accumulator); a variable already is read as it is."""
        var = safe_name(step.name)
        if step.reduce in ("argmax", "argmin"):
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
            ref = Ref(value.name, value.dims) if bare else self.let(target, value.dims)
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
        if self.plan.strategy == "row_resident":
            for part in along:
                self.add(Comment(text=f"# output {part}"))
                self.add(self.store(part))
            return
        if chunked:
            self.add(Comment(text=f"# second pass, over this program's chunk of {a}: outputs {', '.join(along)} need "
                                  "the final reductions"))
            span, lo, hi, bounds = "chunk_outputs", "lo", f"tl.minimum(lo + chunk, size_{a})", ("lo", "chunk", f"size_{a}")
        else:
            self.add(Comment(text=f"# second pass over {a}: outputs {', '.join(along)} need the final reductions"))
            span, lo, hi, bounds = "outputs", "0", f"size_{a}", (f"size_{a}",)
        if gate:  # the pass runs only where the flag is set
            span, hi, bounds = "fallback", f"({hi}) * {gate}", (*bounds, gate)

        def body():
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            for part in along:
                self.add(self.store(part))
            self.depth -= 1
            self.begin_scope()

        self.loop(span, "start", lo, hi, f"BLOCK_{a}", (*bounds, f"BLOCK_{a}"), body)

    # ------------------------------------------------------------ strategies
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

        self.loop("axis", "start", "0", f"size_{a}", f"BLOCK_{a}", (), body, resident=True)

    def direct_reduction(self, step: Step, value: sp.Expr) -> None:
        if self.effective_op(step) not in ORDER_SELECTIONS:  # the whole axis is one tile: its reduction is the value
            env = self.env(value)
            dot, masked, dims, note = self.tile_fold(step, value, env)
            if dot is not None:
                dot = self.dot_excluded(dot, value, self.effective_op(step))
                env = self.env(dot.p, dot.q, dot.scale)
            var = safe_name(step.name)
            self.add(Reduce(step=step.name, name=var, dims=dims, op=self.effective_op(step), over=self.axis, expr=value,
                            env=env, inner=False, dot=dot, masked=masked, note=note))
            self.values[step.name] = self.let(var, dims)
            return
        acc = self.init_state(step)[0]
        self.fold(step, acc, value)
        if step.reduce in ("topk", "argmax", "argmin"):
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

        lo, hi, bounds = self.windowed([(step.reduce or "", integrand)], "0", f"size_{a}", (f"size_{a}", f"BLOCK_{a}"))
        if gate:
            hi, bounds = f"({hi}) * {gate}", (*bounds, gate)
        self.loop("fallback" if gate else "axis", "start", lo, hi, f"BLOCK_{a}", bounds, body)
        if step.reduce in ("topk", "argmax", "argmin"):
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
                positive = _sum_of_anchored_exps(self.forms[dep])
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
            empty = any(may_exclude_every(a.contribution, a.op, self.axis) for a in real.accumulators)
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
                    if what == "inf" and (_sum_of_anchored_exps(self.forms[dep]) or self.finite_end(real, sym)):
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
        self.streaming_loop("axis", "0", f"size_{a}", (f"size_{a}",))
        self.finalize()
        self.outputs()
        self.fallback()

    def split_part(self) -> None:
        self.add(Chunk(part=True))
        a = self.axis
        self.streaming_loop("chunk", "lo", f"tl.minimum(lo + chunk, size_{a})", ("lo", "chunk", f"size_{a}"))
        for w in workspace(self.plan):
            self.add(WorkspaceStore(entry=w.name, entry_dims=w.dims, dims=self.order(w.dims), value_dims=self.var_dims[w.name]))

    def combine_kernel(self) -> None:
        if self.grid.split:
            self.add(Chunk(part=False))
        self.combine()
        self.finalize()
        self.outputs()
        self.fallback()

    # -- streaming: the derived incremental form
    def stream_folds(self) -> list[_FoldFact]:
        """The folds of the streamed loop (its reductions' tile contributions), for :func:`per_lane`."""
        out = []
        for step in self.axis_steps():
            for rule in self.realisation(step).step():
                dot = self.dot(rule.right, self.axis) if rule.op == "sum" else None
                out.append(_FoldFact(step.name, self.axis, rule.op, rule.right, dot))
        return out

    def streaming_loop(self, span: str, lo: str, hi: str, hi_reads: tuple[str, ...]) -> None:
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
                self.add(Count(mode="tile", axis=a, hi=hi, hi_reads=frozenset(hi_reads)))
            for dep in anchors:
                anchor = self.anchor_var(dep)
                self.add(Copy(name=f"{anchor}_old", dims=self.var_dims[anchor], source=anchor))
                self.values[f"{dep}[old]"] = self.let(f"{anchor}_old", self.var_dims[anchor])
                self.values[f"{dep}[new]"] = self.var(anchor)
            self.values[COUNT_OLD] = Ref("count_old")  # by symbol: a step named `count` has its own count[old]
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
        lo, hi, bounds = self.windowed(folds, lo, hi, (*hi_reads, f"BLOCK_{a}"))
        if lanes or start != "0" or not self.split_at_mask(folds, span, lo, hi, bounds, body):
            self.loop(span, "start", lo, hi, f"BLOCK_{a}", bounds, body)

    def split_at_mask(self, folds: list[tuple[str, sp.Expr]], span: str, lo: str, hi: str, bounds: tuple[str, ...],
                      body: Callable[[], Callable[[], None] | None]) -> bool:
        """Walk the loop as two, as tutorial 06 does, where that saves work per element: the first
        covers whole tiles that need no mask, the second the rest with the masks.

        - A mask that bounds the loop from above only (causal attention: ``index(n) <= index(m)``):
          the tiles below every lane's bound (``first(m) + 1``) fold with the mask taken as true,
          the diagonal with it.
        - Otherwise, in a loop of tensor-core tiles (issue-bound: its masks cost as much as its
          dots): the whole tiles fold without the tail mask, the last partial tile with it.

        Both first loops stop at a tile boundary at or below ``size(axis)``: no tail mask in them.
        False when neither applies (the caller walks one loop)."""
        a = self.axis
        cond = self.axis_mask(folds)
        block, size = self.plan.blocks[a], sp.Symbol(f"size({a})", integer=True, positive=True)
        seen = window_of(self.axis_index(), [cond]) if cond is not None else None
        full = window_of(self.axis_index(), [cond], every_lane=True) if cond is not None else None
        if seen is not None and full is not None and seen.lo is None and full.lo is None and full.hi is not None:
            text, used = self.bound_text(full.hi)
            mid = f"tl.maximum(tl.minimum({hi}, {text}), 0) // BLOCK_{a} * BLOCK_{a}"
            reads = (*bounds, *sorted(used - set(bounds)))
            at = sp.floor(sp.Max(sp.Min(full.hi, size), 0) / block) * block  # `mid`, for counting trips
            subs, tail_hi = {cond: sp.true}, seen.hi
            self.add(Comment(text=f"# unmasked: every lane of this program sees the {a} below {text}"))
        elif cond is None and hi == f"size_{a}" and any(f.dot is not None for f in self.stream_folds()):
            mid, reads, at, subs, tail_hi = f"size_{a} // BLOCK_{a} * BLOCK_{a}", bounds, sp.floor(size / block) * block, {}, None
            self.add(Comment(text=f"# whole tiles of {a} first, no tail mask; then the last partial tile"))
        else:
            return False
        unmasked = self.loop(span, "start", lo, mid, f"BLOCK_{a}", reads, body)
        # every tile below `mid` lies inside the axis too (mid <= hi <= size): no tail mask either
        body_ops = tuple(replace(op, inside=True) if isinstance(op, Offsets) and op.dim == a else op
                         for op in assuming(unmasked, subs).body)
        self.out[-1] = replace(unmasked, body=body_ops, unmasked=True, window=Window(None, at))
        self.loop(span, "start", mid, hi, f"BLOCK_{a}", reads, body)
        self.out[-1] = replace(self.out[-1], window=Window(at, tail_hi))
        return True

    def axis_mask(self, folds: list[tuple[str, sp.Expr]]) -> sp.Expr | None:
        """The mask outside which every fold of the loop adds its identity (:func:`bounds.axis_mask`)."""
        return axis_mask(folds, counts=self.plan.strategy in FUSED_STRATEGIES and reads_count(self.plan),
                         selections=any(effective_op(self.plan, s) in ORDER_SELECTIONS or s.reduce in ORDER_SELECTIONS
                                        for s in self.axis_steps()))

    def axis_index(self) -> sp.Symbol:
        return sp.Symbol(f"index({self.axis})", integer=True, nonnegative=True)

    def bound_text(self, e: sp.Expr) -> tuple[str, set[str]]:
        """A window end as Triton text (:func:`bounds.bound_text`); the tile dims without a program
        id (held whole) start at 0."""
        whole = [d for d in self.layout.dims if d != self.axis and d not in self.plan.lanes]
        return bound_text(e, self.layout.dims, whole)

    def windowed(self, folds: list[tuple[str, sp.Expr]], lo: str, hi: str,
                 reads: tuple[str, ...]) -> tuple[str, str, tuple[str, ...]]:
        """A reduction loop's ``lo``/``hi`` clamped to the part of the axis its program's lanes can
        see (:mod:`fuser_core.codegen.bounds`; the lower end rounded down to a tile boundary), with
        the names the bounds read."""
        cond = self.axis_mask(folds)
        w = window_of(self.axis_index(), [cond]) if cond is not None else None
        if w is None:
            return lo, hi, reads
        a, extra = self.axis, set()
        if w.lo is not None:
            text, used = self.bound_text(w.lo)
            start = f"tl.maximum({text}, 0) // BLOCK_{a} * BLOCK_{a}"
            lo = start if lo == "0" else f"tl.maximum({lo}, {start})"
            extra |= used
            self.add(Comment(text=f"# masked: this program's lanes see no {a} before {text}"))
        if w.hi is not None:
            text, used = self.bound_text(w.hi)
            hi = f"tl.minimum({hi}, {text})"
            extra |= used
            self.add(Comment(text=f"# masked: this program's lanes see no {a} from {text} on"))
        return lo, hi, (*reads, *sorted(extra - set(reads)))

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

    def with_anchors(self, real: Realisation) -> dict[str, Ref | None]:
        """Values for a tile's contribution: dependencies at their (new) anchors."""
        saved = {}
        for dep in real.anchors:
            saved[dep] = self.values.get(dep)
            self.values[dep] = self.var(self.anchor_var(dep))
        return saved

    def restore(self, saved: dict[str, Ref | None]) -> None:
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
            holder = _placeholder(name)
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
        names[COUNT_OLD] = Ref("count")
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

        self.loop("split", "split", "0", "SPLIT", None, ("SPLIT",), body)
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
        names: dict = {COUNT_OLD: Ref("count_old"), part_count("a"): Ref("count_old"), part_count("b"): Ref("count_part")}
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
                holder = _placeholder(f"{acc}_moved")
                extra[holder] = self.let(f"{acc}_moved", self.dims_of(left, env))
                held.append(holder)
            lefts = held
        for acc, rule, left in zip(accs, rules, lefts):
            env = self.env(left, rule.right, extra=extra)
            state = self.var_dims[f"{acc}_values"] if rule.op in ORDER_SELECTIONS else self.var_dims[acc]
            self.add(PartMerge(step=step.name, name=acc, dims=state, op=rule.op, left=left, right=rule.right, env=env,
                               slots=step.as_dim if rule.op in ("topk", "bottomk") else None,
                               k=step.k if rule.op in ("topk", "bottomk") else None))
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
                read |= op.reads()
            unused = {n for n, k in defined.items() if k == 1 and n not in read}
            if not unused:
                break
            removed |= unused
            ops = _without(ops, unused)
        return tuple(_without(ops, set(), removed))


def _sum_of_anchored_exps(form: ReductionForm) -> bool:
    """Is a dependency a scaled sum of anchored exponentials and nothing else (a softmax or attention
    denominator, ``sum exp(s - mx)``, masked terms 0)? Its terms are bounded at their running anchor
    (derive's range check), so it is never +-inf: NaN only, from NaN data, which an end factor 1/den
    propagates as the formula does."""
    real = form.realisation
    if real is None or not real.rescales or real.op != "sum" or form.offset != 0 or any(d != 1 for d in form.deferred):
        return False
    for c in form.contributions:
        values = [v for v, _ in c.args] if isinstance(c, sp.Piecewise) else [c]
        if not all(v == 0 or isinstance(v, sp.exp) for v in values):
            return False
    return True


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


def _args(plan: KernelPlan, inputs: Iterable[str], outputs: Iterable[str], ws: tuple[State, ...], role: str,
          input_dtypes: Mapping[str, str], store_dtypes: Mapping[str, str], ops: Iterable[Op]) -> tuple[Arg, ...]:
    """The kernel's parameters, in the order hand-written kernels have them (pointers, sizes, each
    tensor's strides, the split's numbers, the blocks): exactly those its operations read."""
    spec = plan.spec
    used = [i for i in spec.inputs if i.name in set(inputs)]
    parts = [p for p in spec.output_parts if p in set(outputs)]
    out = [Arg(f"{var_name(i.name)}_ptr", kernel_arg(var_name(i.name), input_dtypes.get(i.name))) for i in used]
    out += [Arg(f"{var_name(p)}_ptr", kernel_arg(var_name(p), store_dtypes[p])) for p in parts]
    out += [Arg(f"size_{d}", f"size_{d}") for d in spec.sized_dims]
    out += [Arg(scalar_arg(p.name), scalar_arg(p.name)) for p in spec.runtime_params]
    for i in used:
        out += [Arg(f"stride_{var_name(i.name)}_{d}", f"{var_name(i.name)}.stride({k})")
                for k, d in enumerate(kernel_dims(spec, i.name))]
    for p in parts:
        dims = spec.step(p.split(".")[0]).dims
        out += [Arg(f"stride_{var_name(p)}_{d}", f"{var_name(p)}.stride({k})") for k, d in enumerate(dims)]
    out += [Arg(f"ws_{s.name}_ptr", f"ws_{s.name}") for s in ws]
    for s in ws:
        out.append(Arg(f"stride_ws_{s.name}_split", f"ws_{s.name}.stride(0)"))
        out += [Arg(f"stride_ws_{s.name}_{d}", f"ws_{s.name}.stride({k + 1})") for k, d in enumerate(s.dims)]
    if role == "combine":
        out.append(Arg("SPLIT", "SPLIT"))
    if role in ("split_part", "combine"):
        out.append(Arg("chunk", "chunk"))
    out += [Arg(f"BLOCK_{d}", str(plan.blocks[d]), constexpr=True) for d in spec.dims]
    read = set().union(*(op.reads() for op in walk(ops)))
    return tuple(a for a in out if a.name in read)


def tile_dims(plan: KernelPlan) -> tuple[str, ...]:
    """The dims a kernel's tiles have, in the spec's order: every dim but a lane whose block is 1
    (one program per index of it: its offset is the program id, a scalar, as hand-written kernels
    have ``off_hz``)."""
    return tuple(d for d in plan.dims if not (d in plan.lanes and plan.blocks[d] == 1))


def axis_outputs(plan: KernelPlan) -> list[str]:
    """The output parts that keep the loop axis (written in a pass over it after the reductions)."""
    return [p for p in plan.spec.output_parts if plan.axis in plan.spec.step(p.split(".")[0]).dims]


def kernel_names(plan: KernelPlan) -> tuple[str, str]:
    """(main or split part kernel, combine kernel): the one place kernel names are made."""
    base = f"{plan.spec.name}_{plan.strategy}"
    return f"{base}_kernel", f"{base}_combine_kernel"


_DOCS = {
    "row_resident": "{name}, row-resident: the whole {a} axis of a row in one tile; one read, one write.",
    "multi_pass": "{name}, multi-pass: one loop over {a} per reduction, re-reading the inputs.",
    "streaming_fused": "{name}, streaming-fused: one pass over {a}; later reductions are kept with running values of "
                       "earlier ones and corrected when those move (derived by foldwise).",
    "split_part": "{name}, split-fused part 1: program (lanes, s) folds chunk s of {a} with the derived incremental form "
                  "and writes its partial state.",
    "combine": "{name}, split-fused part 2: merge the SPLIT partial states (each re-anchored to the merged dependencies "
               "with the derived corrections), then write the outputs.",
    "parallel_combine": "{name}, split-fused part 2: program (lanes, s) merges the SPLIT partial states (each re-anchored "
                        "to the merged dependencies with the derived corrections), then writes chunk s of the outputs.",
}


def _kernel(plan: KernelPlan, name: str, role: str, grid: Grid, walker, input_dtypes: Mapping[str, str],
            stores: Mapping[str, str], dots: dict, ws: tuple[State, ...], outputs: tuple[str, ...]) -> tuple[Kernel, _Walk]:
    """One kernel: walked by ``walker`` (a _Walk method), walked again if an input it fills with a fold's
    identity turned out to be read by one of its tl.dots (whose masked lanes must be 0)."""
    no_fill: frozenset[str] = frozenset()
    while True:
        w = _Walk(plan, input_dtypes, stores, dots, role, grid, no_fill)
        w.setup()
        walker(w)
        ops = w.kernel_ops()
        dotted = {s.name for op in walk(ops) if isinstance(op, (Reduce, Fold)) and op.dot is not None
                  for s in op.dot.p.free_symbols | op.dot.q.free_symbols}
        filled = {op.input for op in walk(ops) if isinstance(op, Load) and op.fill} & dotted
        if not filled - no_fill:
            break
        no_fill = no_fill | filled
    key = "parallel_combine" if role == "combine" and grid.split else plan.strategy if role == "main" else role
    doc = _DOCS[key].format(name=plan.spec.name, a=plan.axis)
    states = tuple(s for step in plan.axis_reductions() for s in accumulators(plan, step, lanes=w.lanes_states))
    args = _args(plan, w.inputs, outputs, ws, role, input_dtypes, stores, ops)
    return Kernel(name, role, grid, doc, w.layout, ops, states, args, tuple(w.inputs), outputs,
                  plan.derivation.symbols.grouping), w


def build_structure(plan: KernelPlan, input_dtypes: Mapping[str, str],
                    store_dtypes: Mapping[str, str] | None = None) -> ModuleStructure:
    """The module's kernels (each an ordered list of operations), states, workspace, arguments and launches.

    ``store_dtypes``: each output part's storage dtype (default float32)."""
    stores = dict(store_dtypes or {p: "float32" for p in plan.spec.output_parts})
    dots: dict = {}
    a = plan.axis
    lanes = Grid(tuple((d, plan.blocks[d]) for d in plan.lanes))
    name, combine_name = kernel_names(plan)
    parts = tuple(plan.spec.output_parts)
    if plan.strategy != "split_fused":
        walker = {"row_resident": _Walk.row_resident, "multi_pass": _Walk.multi_pass,
                  "streaming_fused": _Walk.streaming_fused}[plan.strategy]
        kernel, _ = _kernel(plan, name, "main", lanes, walker, input_dtypes, stores, dots, (), parts)
        return ModuleStructure(plan, (kernel,), (Launch(name, lanes),), ())
    ws = workspace(plan)
    part, _ = _kernel(plan, name, "split_part", Grid(lanes.lanes, split=True), _Walk.split_part, input_dtypes, stores,
                      dots, ws, ())
    # outputs along the axis, few lane blocks: SPLIT programs per lane block, each merges the
    # (few) partial states and writes its own chunk (plan.parallel_combine says when)
    parallel = plan.parallel_combine and bool(axis_outputs(plan))
    combine_grid = Grid(lanes.lanes, split=parallel)
    combine, _ = _kernel(plan, combine_name, "combine", combine_grid, _Walk.combine_kernel, input_dtypes, stores, dots,
                         ws, parts)
    launch = SplitLaunch(Launch(name, part.grid), Launch(combine_name, combine_grid), plan.config.split, a,
                         plan.blocks[a], ws)
    return ModuleStructure(plan, (part, combine), (launch,), ws)
