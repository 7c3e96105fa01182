"""The kernels of a generated module, decided once from a plan, before anything is printed.

:func:`build_structure` turns a :class:`~fuser_core.codegen.plan.KernelPlan` (and the input and
output storage dtypes) into a :class:`ModuleStructure`: the kernels a strategy launches, and
per kernel its passes over the loop axis, the loads of each pass (loop-invariant ones hoisted:
attention's ``q`` does not vary along ``n``, so it is loaded once per program, before the
loop), the reductions folded in each pass and which of them are ``tl.dot`` contractions, the
accumulators it carries, the workspace a split kernel hands to its combine kernel, the
argument list of each kernel (only what it uses), and the launches with their grids (a split
part kernel and its combine kernel as one :class:`SplitLaunch`).

Three readers share it: the Triton printer (:mod:`fuser_core.codegen.emit`), the launcher
printer (:mod:`fuser_core.codegen.module`) and the tuner's analysis (:mod:`tuner.analysis`),
so the rule that makes a sum a ``tl.dot``, the loads of a pass and the kernels' arguments are
written here only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import sympy as sp

from fuser_core.codegen.bounds import Window, axis_window
from fuser_core.codegen.names import kernel_arg, safe_name
from fuser_core.codegen.plan import KernelPlan
from fuser_core.derive import ReductionForm
from fuser_core.realisation import COUNT_OLD, SELECTIONS, Realisation
from fuser_core.spec import Input, Step

ORDER_SELECTIONS = SELECTIONS
FUSED_STRATEGIES = ("streaming_fused", "split_fused")


def var_name(name: str) -> str:
    """The generated-code identifier of a spec name."""
    return safe_name(name)


# ---------------------------------------------------------------------- the pieces


@dataclass(frozen=True)
class Load:
    """One input loaded (converted to float32) in a pass. ``hoisted``: it does not vary along
    the loop axis, so it is loaded once per program before the kernel's first loop."""

    name: str  # the input's spec name
    dims: tuple[str, ...]
    hoisted: bool = False


@dataclass(frozen=True)
class Dot:
    """sum over ``over`` of P * Q computed as ``tl.dot(P[i, over], Q[over, j])`` (times ``scale``,
    the factors that vary over no blocked dim, applied after the product)."""

    over: str
    i: str
    j: str
    p: sp.Expr
    q: sp.Expr
    scale: sp.Expr | None
    precision: str  # "tl.float16" | "tl.bfloat16" | "ieee": the operands' precision
    direct: tuple[str, ...] = ()  # inputs that are a factor as loaded (staged in shared memory once)

    @property
    def dims(self) -> frozenset[str]:
        return frozenset({self.i, self.j, self.over})

    @property
    def p_dims(self) -> frozenset[str]:
        return frozenset({self.i, self.over})

    @property
    def q_dims(self) -> frozenset[str]:
        return frozenset({self.over, self.j})

    @property
    def n_p_factors(self) -> int:
        return len(sp.Mul.make_args(self.p))

    @property
    def n_q_factors(self) -> int:
        return len(sp.Mul.make_args(self.q))


@dataclass(frozen=True)
class Fold:
    """A reduction of ``expr`` over ``over`` in a pass: an inner reduction (a whole tile) or one
    tile of a reduction over the loop axis folded into its accumulator."""

    step: str
    over: str
    op: str  # the op run (a fused form's effective op)
    expr: sp.Expr
    dot: Dot | None
    inner: bool  # over an inner axis (held whole), not the loop axis


@dataclass(frozen=True)
class State:
    """One float32/int32 accumulator carried by a kernel (and, split, handed over in the workspace)."""

    name: str  # identifier in the generated code
    step: str
    dims: tuple[str, ...]
    dtype: str  # "float32" | "int32"


@dataclass(frozen=True)
class Pass:
    """One stretch of a kernel.

    ``span``: ``axis`` (a loop over the whole axis; row_resident: its one resident tile),
    ``chunk`` (a split program's chunk of the axis), ``split`` (the combine kernel's loop over
    the SPLIT partial states), ``once`` (straight-line code after the loops), ``outputs``
    (the second loop over the axis that writes the outputs keeping it), ``chunk_outputs``
    (that loop over one chunk of the axis: a combine program writes its own chunk's outputs) or
    ``lanes`` (straight-line code after a per-lane streamed pass: its lane states folded over the
    axis with the merge rule)."""

    span: str
    loop: bool  # printed as a loop (False: row_resident's tile and ``once``)
    per_lane: bool = False  # a streamed pass whose states are per lane (:func:`per_lane`); its ``lanes`` pass merges them
    loads: tuple[Load, ...] = ()  # first needed in this pass (hoisted ones are printed before the loops)
    folds: tuple[Fold, ...] = ()
    values: tuple[sp.Expr, ...] = ()  # elementwise expressions printed besides the folds
    updates: tuple[str, ...] = ()  # axis reductions whose state this pass updates (streams or merges)
    stores: tuple[str, ...] = ()  # output parts written
    ws_loads: tuple[str, ...] = ()  # workspace entries read (per iteration)
    ws_stores: tuple[str, ...] = ()  # workspace entries written
    window: Window | None = None  # a loop's part of the axis its programs can see (masks: fuser_core.codegen.bounds)


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
    """One ``@triton.jit`` kernel of the module."""

    name: str
    role: str  # "main" | "split_part" | "combine"
    grid: Grid
    passes: tuple[Pass, ...]
    states: tuple[State, ...]
    args: tuple[Arg, ...]
    inputs: tuple[str, ...]  # inputs it loads (spec names)
    outputs: tuple[str, ...]  # output parts it writes

    @property
    def hoisted(self) -> tuple[Load, ...]:
        return tuple(ld for p in self.passes for ld in p.loads if ld.hoisted)

    @property
    def dots(self) -> tuple[Dot, ...]:
        return tuple(f.dot for p in self.passes for f in p.folds if f.dot is not None)


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
    dots: tuple[tuple[str, sp.Expr, Dot | None], ...]  # (over, reduced expression, its tl.dot or None)

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)

    def dot(self, e: sp.Expr, over: str) -> Dot | None:
        """The tl.dot decided for a sum over ``over`` of ``e`` (None: a tile reduction)."""
        for o, x, d in self.dots:
            if o == over and x == e:
                return d
        raise LookupError(f"no dot decision for a sum over {over} of {sp.sstr(e)} (structure and printer disagree)")


# ---------------------------------------------------------------------- small rules


def realisation(plan: KernelPlan, step: Step) -> Realisation | None:
    """The realisation a fused strategy runs for an axis reduction (None: computed unfused)."""
    form = plan.derivation.forms.get(step.name)
    if plan.strategy not in FUSED_STRATEGIES or form is None:
        return None
    return form.realisation


def accumulator_count(form: ReductionForm | None, fused: bool) -> int:
    """Accumulators of one reduction over the loop axis (a selection's (values, indices) as one):
    the realisation's when it is fused, else one."""
    if form is None or not fused or form.realisation is None:
        return 1
    return len(form.realisation.accumulators)


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


def per_lane(plan: KernelPlan, folds: Iterable[Fold]) -> tuple[bool, str]:
    """THE rule for per-lane states in a streamed pass, decided here once (the printer and the tuner's
    analysis read :attr:`Pass.per_lane`): (whether, why).

    Per lane, every lane of the loop axis's tile (``[BLOCK_m, BLOCK_n]``) keeps its own running state,
    updated elementwise in the loop with the realisation's step rule (no cross-warp reduction per tile),
    and the lanes are folded once after the loop with its merge rule (lanes are parts). Conservative:
    every fused reduction of the loop must allow it (``Realisation.per_lane``), keep a plain state
    (no selection: argmax/top-k states merge by their helpers, per tile), move by nothing or a rescale
    only (a shift or a joint Taylor move, ``shifted``/``taylor``, stays per tile: each lane would need
    its own count), anchor at running values (a running estimate reads the count), have no state dims
    besides the lanes, and fold elementwise (a ``tl.dot`` fold, attention's ``o``, stays per tile)."""
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
        if f.inner:
            continue
        if f.dot is not None:
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


class _KernelWalk:
    """Collects one kernel's passes: what each needs, in the order the printer needs it."""

    def __init__(self, plan: KernelPlan, dtypes: Mapping[str, str], dots: dict):
        self.plan = plan
        self.conv = plan.derivation.symbols
        self.forms = plan.derivation.forms
        self.dtypes = dtypes
        self.dots = dots
        self.passes: list[Pass] = []
        self.per_lane = False  # the pass being collected keeps per-lane states (see lane_states)
        self.persistent: set[str] = set()  # loads at the kernel's top level or hoisted: kept for every pass
        self.inputs: list[str] = []
        self._open("once", False)

    def _open(self, span: str, loop: bool) -> None:
        self.span, self.loop, self.per_lane = span, loop, False
        self.scope: set[str] = set(self.persistent)
        self.loads: list[Load] = []
        self.folds: list[Fold] = []
        self.values: list[sp.Expr] = []
        self.updates: list[str] = []
        self.stores: list[str] = []
        self.ws_loads: list[str] = []
        self.ws_stores: list[str] = []

    def close(self) -> None:
        if self.span == "once" and not (self.loads or self.folds or self.values or self.updates or self.stores):
            return
        self.passes.append(Pass(self.span, self.loop, self.per_lane, tuple(self.loads), tuple(self.folds), tuple(self.values),
                                tuple(self.updates), tuple(self.stores), tuple(self.ws_loads), tuple(self.ws_stores),
                                self.window()))

    def window(self) -> Window | None:
        """The part of the axis this loop's programs can see (:mod:`fuser_core.codegen.bounds`): a
        reduction loop whose every fold is masked the same way skips the tiles no lane sees."""
        if not (self.loop and self.span in ("axis", "chunk")):
            return None
        steps = self.plan.axis_reductions()
        selections = any(effective_op(self.plan, s) in ORDER_SELECTIONS or s.reduce in ORDER_SELECTIONS for s in steps)
        counts = self.plan.strategy in FUSED_STRATEGIES and reads_count(self.plan)
        folds = [(f.op, f.expr) for f in self.folds if not f.inner]
        return axis_window(self.plan.axis, folds, counts=counts, selections=selections)

    def open(self, span: str, loop: bool) -> None:
        self.close()
        self._open(span, loop)

    def need(self, exprs: Iterable[sp.Expr]) -> None:
        """Loads and inner reductions that give every symbol of ``exprs`` a value (emit.need)."""
        for e in exprs:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name in self.scope:
                    continue
                step = self.conv.leaf_step.get(s)
                if step is not None and step.over != self.plan.axis:
                    self.scope.add(s.name)
                    integrand = self.conv.integrand(step)
                    self.need([integrand])
                    self.fold(step, step.over, step.reduce or "sum", integrand, inner=True)
                elif step is None and isinstance(self.plan.spec.lookup(s.name), Input):
                    self.load(s.name)

    def load(self, name: str) -> None:
        dims = self.plan.spec.input(name).dims
        hoisted = self.loop and self.plan.axis not in dims
        self.scope.add(name)
        if hoisted or not self.loop:
            self.persistent.add(name)
        self.loads.append(Load(name, dims, hoisted))
        if name not in self.inputs:
            self.inputs.append(name)

    def fold(self, step: Step, over: str, op: str, e: sp.Expr, inner: bool = False) -> None:
        dot = None
        if op == "sum":
            key = (over, e)
            if key not in self.dots:
                self.dots[key] = decide_dot(self.plan, e, over, self.dtypes)
            dot = self.dots[key]
        self.folds.append(Fold(step.name, over, op, e, dot, inner))

    def value(self, exprs: Iterable[sp.Expr]) -> None:
        exprs = [e for e in exprs if e is not None]
        self.need(exprs)
        self.values += [e for e in exprs if not e.is_Atom]

    # -- reductions over the loop axis
    def direct(self, step: Step) -> None:
        integrand = self.conv.integrand(step)
        self.need([integrand])
        self.fold(step, self.plan.axis, effective_op(self.plan, step), integrand)

    def realisation(self, step: Step) -> Realisation:
        real = self.forms[step.name].realisation
        assert real is not None, f"{step.name} is streamed but not fused"
        return real

    def running_value(self, real: Realisation) -> None:
        """The reduction's value from its accumulators, for the reductions that read it in the loop."""
        if not real.selection and real.value not in real.symbols:
            self.value([real.value])

    def stream(self, step: Step) -> None:
        """One tile with the realisation's step rule: the accumulators moved to the new anchors,
        each contribution folded over the tile, then the running value."""
        real = self.realisation(step)
        self.updates.append(step.name)
        rules = real.step()
        self.need([r.left for r in rules] + [r.right for r in rules])
        for a in real.accumulators:
            self.values += [t for t in a.move_terms if not t.is_Atom]
        for rule in rules:
            self.fold(step, self.plan.axis, rule.op, rule.right)
        self.running_value(real)

    def merge(self, step: Step) -> None:
        """One partial state folded into the merged one with the realisation's merge rule."""
        real = self.realisation(step)
        self.updates.append(step.name)
        self.ws_loads += [s.name for s in accumulators(self.plan, step)]
        rules = real.merge()
        self.need([r.left for r in rules] + [r.right for r in rules])
        for a in real.accumulators:
            for side in ("a", "b"):
                self.values += [real.at_part(t, side) for t in a.move_terms if not t.is_Atom]
        self.running_value(real)

    def lane_states(self) -> bool:
        """Decide (:func:`per_lane`) whether the streamed pass being collected keeps per-lane states; if
        so, the ``lanes`` pass after it merges them (:meth:`merge_lanes`)."""
        lanes = self.per_lane = per_lane(self.plan, self.folds)[0]
        if lanes:
            self.open("lanes", False)
            for step in self.plan.axis_reductions():
                self.merge_lanes(step)
        return lanes

    def merge_lanes(self, step: Step) -> None:
        """The lanes of a per-lane state folded over the axis with the merge rule (each lane one part)."""
        real = self.realisation(step)
        self.updates.append(step.name)
        rules = real.merge()
        self.need([r.right for r in rules])
        for a in real.accumulators:
            self.values += [real.at_part(t, "b") for t in a.move_terms if not t.is_Atom]
        self.running_value(real)

    def finalize(self) -> None:
        for step in self.plan.axis_reductions():
            real = self.realisation(step)
            if real.selection:
                self.value([real.value])
            else:
                self.running_value(real)

    # -- outputs
    def output(self, part: str) -> None:
        name = part.split(".")[0]
        step = self.plan.spec.step(name)
        if not (step.is_reduction and step.over == self.plan.axis):
            self.value([self.conv.value(name, part.split(".")[1] if "." in part else None)])
        self.stores.append(part)

    def outputs(self, resident: bool = False, chunked: bool = False) -> None:
        """Row outputs after the loops; outputs along the axis in one more loop over it (``chunked``:
        over the program's own chunk of it)."""
        parts = list(self.plan.spec.output_parts)
        along = axis_outputs(self.plan)
        for part in parts:
            if part not in along or resident:
                self.output(part)
        if along and not resident:
            self.open("chunk_outputs" if chunked else "outputs", True)
            for part in along:
                self.output(part)
        self.close()


# ---------------------------------------------------------------------- kernels and arguments


def _args(plan: KernelPlan, inputs: Iterable[str], outputs: Iterable[str], ws: tuple[State, ...], role: str,
          input_dtypes: Mapping[str, str], store_dtypes: Mapping[str, str]) -> tuple[Arg, ...]:

    spec = plan.spec
    used = [i for i in spec.inputs if i.name in set(inputs)]
    parts = [p for p in spec.output_parts if p in set(outputs)]
    out = [Arg(f"{var_name(i.name)}_ptr", kernel_arg(var_name(i.name), input_dtypes.get(i.name))) for i in used]
    out += [Arg(f"{var_name(p)}_ptr", kernel_arg(var_name(p), store_dtypes[p])) for p in parts]
    out += [Arg(f"size_{d}", f"size_{d}") for d in spec.dims]
    for i in used:
        out += [Arg(f"stride_{var_name(i.name)}_{d}", f"{var_name(i.name)}.stride({k})") for k, d in enumerate(i.dims)]
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
    return tuple(out)


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


def build_structure(plan: KernelPlan, input_dtypes: Mapping[str, str],
                    store_dtypes: Mapping[str, str] | None = None) -> ModuleStructure:
    """The module's kernels, passes, loads, dots, states, workspace, arguments and launches.

    ``store_dtypes``: each output part's storage dtype (only the launcher's fp8 views read it;
    default float32)."""
    stores = dict(store_dtypes or {p: "float32" for p in plan.spec.output_parts})
    dots: dict = {}
    a = plan.axis
    steps = plan.axis_reductions()
    lanes = Grid(tuple((d, plan.blocks[d]) for d in plan.lanes))
    states = tuple(s for step in steps for s in accumulators(plan, step))
    name, combine_name = kernel_names(plan)
    w = _KernelWalk(plan, input_dtypes, dots)
    kernels: list[Kernel] = []
    if plan.strategy == "row_resident":
        w.open("axis", False)
        for step in steps:
            w.direct(step)
        w.outputs(resident=True)
    elif plan.strategy == "multi_pass":
        for step in steps:
            w.open("axis", True)
            w.direct(step)
        w.open("once", False)
        w.outputs()
    elif plan.strategy == "streaming_fused":
        w.open("axis", True)
        for step in steps:
            w.stream(step)
        if w.lane_states():
            states = tuple(s for step in steps for s in accumulators(plan, step, lanes=True))
        w.open("once", False)
        w.finalize()
        w.outputs()
    else:  # split_fused: the part kernel, then the combine kernel
        ws = workspace(plan)
        w.open("chunk", True)
        for step in steps:
            w.stream(step)
        part_states = states
        if w.lane_states():  # the chunk's lanes are merged before its partial state is stored
            part_states = tuple(s for step in steps for s in accumulators(plan, step, lanes=True))
        w.ws_stores = [s.name for s in ws]
        w.close()
        kernels.append(Kernel(name, "split_part", Grid(lanes.lanes, split=True), tuple(w.passes), part_states,
                              _args(plan, w.inputs, (), ws, "split_part", input_dtypes, stores), tuple(w.inputs), ()))
        c = _KernelWalk(plan, input_dtypes, dots)
        c.open("split", True)
        c.ws_loads = [f"{var_name(dep)}_anchor" for dep in anchored_deps(plan)]
        for step in steps:
            c.merge(step)
        c.open("once", False)
        c.finalize()
        # outputs along the axis, few lane blocks: SPLIT programs per lane block, each merges the
        # (few) partial states and writes its own chunk (plan.parallel_combine says when)
        parallel = plan.parallel_combine and bool(axis_outputs(plan))
        c.outputs(chunked=parallel)
        combine_grid = Grid(lanes.lanes, split=parallel)
        parts = tuple(plan.spec.output_parts)
        kernels.append(Kernel(combine_name, "combine", combine_grid, tuple(c.passes), states,
                              _args(plan, c.inputs, parts, ws, "combine", input_dtypes, stores), tuple(c.inputs), parts))
        launch = SplitLaunch(Launch(name, kernels[0].grid), Launch(combine_name, combine_grid), plan.config.split, a,
                             plan.blocks[a], ws)
        return ModuleStructure(plan, tuple(kernels), (launch,), ws, tuple((o, e, d) for (o, e), d in dots.items()))
    parts = tuple(plan.spec.output_parts)
    kernel = Kernel(name, "main", lanes, tuple(w.passes), states,
                    _args(plan, w.inputs, parts, (), "main", input_dtypes, stores), tuple(w.inputs), parts)
    return ModuleStructure(plan, (kernel,), (Launch(name, lanes),), (),
                           tuple((o, e, d) for (o, e), d in dots.items()))
