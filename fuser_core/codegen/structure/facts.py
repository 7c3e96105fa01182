"""Plan-level decisions the walk of every kernel shares: realisations, accumulators and their
names, per-lane states, the workspace, which sums are ``tl.dot`` contractions and at what precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import sympy as sp

from fuser_core.codegen.ops import FP8_DOT, Dot, Fold, Reduce, Select
from fuser_core.codegen.plan import KernelPlan, contractions
from fuser_core.codegen.structure.model import State, var_name
from fuser_core.derive import ReductionForm
from fuser_core.problem import compute_dtype
from fuser_core.realisation import (
    COUNT_OLD,
    Realisation,
)
from fuser_core.reduce_ops import is_selection
from fuser_core.spec import Input, Step
from fuser_core.dim_symbols import symbol_kind


def realisation(plan: KernelPlan, step: Step) -> Realisation | None:
    """The realisation a fused strategy runs for an axis reduction (None: computed unfused)."""
    form = plan.derivation.forms.get(step.name)
    if not plan.rules.fused or form is None:
        return None
    return form.realisation


def effective_op(plan: KernelPlan, step: Step) -> str:
    form = plan.derivation.forms.get(step.name)
    if plan.rules.fused and form is not None and form.effective_op:
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
    selections = [a.selection for a in real.accumulators] if real is not None else [is_selection(step.reduce)]
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
        if not isinstance(f, (Fold, Select, Reduce, FoldFact)) or getattr(f, "inner", False):
            continue
        if getattr(f, "dot", None) is not None:
            return False, f"{f.step} folds by a matrix product"
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
        kind = symbol_kind(s)
        if kind is not None and kind[0] == "index":
            dims.add(kind[1])
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


def _fp8_value(e: sp.Expr, input_dtypes: Mapping[str, str]) -> bool:
    """``e`` is one e4m3 value: an fp8 input or a cast to fp8."""
    from fuser_core.symbolic import CAST_FUNCTIONS

    return (e.is_Symbol and input_dtypes.get(e.name) == "float8_e4m3fn") or e.func == CAST_FUNCTIONS["float8_e4m3fn"]


FP8_MIN_DEPTH = 32  # K of the e4m3 MMA instructions (QGMMA 64xNx32, Ada's m16n8k32): Triton refuses less


def dot_precision(plan: KernelPlan, p: sp.Expr, q: sp.Expr, over: str, input_dtypes: Mapping[str, str]) -> str:
    """Operand precision of tl.dot, as FlashAttention and the tutorials choose it: two e4m3
    operands (the fp8 GEMM's cast activations and fp8 weights) over a block of at least
    FP8_MIN_DEPTH -> FP8_DOT (fp8 tensor cores where the target has them, else fp16's, exact
    either way; a shallower block multiplies them as fp16, as exactly); other operands exactly
    representable in fp16 (fp8 products, fp16 casts) -> fp16 tensor cores, exact;
    float16 inputs -> float16, bfloat16 inputs -> bfloat16 (P rounded to the inputs' dtype,
    float32 accumulation: 16-bit tensor cores at twice TF32's rate); float32 and mixed inputs ->
    IEEE float32. The inputs that decide are those of the most dims: a backward's float32 row
    statistics (``output_dtypes``: mx, den, Delta) beside its 16-bit q, k, v and dO leave its products
    16-bit, as FlashAttention's backward."""
    if _fp8_value(p, input_dtypes) and _fp8_value(q, input_dtypes) and plan.blocks.get(over, 1) >= FP8_MIN_DEPTH:
        return FP8_DOT
    if _exact_in_fp16(p, input_dtypes) and _exact_in_fp16(q, input_dtypes):
        return "float16"
    data = [i for i in plan.spec.inputs if i.is_float]
    most = max((len(i.dims) for i in data), default=0)
    floats = {input_dtypes.get(i.name, "float32") for i in data if len(i.dims) == most}
    if floats == {"float16"}:
        return "float16"
    if floats == {"bfloat16"}:
        return "bfloat16"
    return "ieee"


def decide_dot(plan: KernelPlan, e: sp.Expr, over: str, input_dtypes: Mapping[str, str]) -> Dot | None:
    """sum over ``over`` of ``e`` as a tl.dot when the tile allows it: the factors that vary carry
    one blocked dim each besides ``over``, two in all (I and J), and every block of I, J and
    ``over`` is at least 16 (tl.dot's minimum).

    A masked product ``where(c, P * Q, 0)`` (causal attention's ``o``) is the dot of
    ``where(c, P, 0)`` and ``Q`` when the mask varies over P's dims only (``index(n) <= index(m)``
    over the scores' [m, n]): zeroing P's masked entries zeroes exactly those terms. None in a float64
    kernel: its sums are elementwise products and tl.sum, exact to float64 (no float64 tensor-core
    path is asked of Triton)."""
    if compute_dtype(input_dtypes) == "float64":
        return None
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
    i, j = sorted(free, key=tile_dims(plan).index)  # the rows first (tile_dims): the product lands as the tile holds it
    if min(plan.blocks[i], plan.blocks[j], plan.blocks[over]) < 16:
        return None
    p = sp.Mul(*[f for f, d in zip(factors, dims) if d != {j}])
    q = sp.Mul(*[f for f, d in zip(factors, dims) if d == {j}])
    direct = tuple(f.name for f in factors if isinstance(f, sp.Symbol) and isinstance(plan.spec.lookup(f.name), Input))
    precision = dot_precision(plan, p, q, over, input_dtypes)
    return Dot(over, i, j, p, q, sp.Mul(*scalars) if scalars else None, precision, direct)


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
class FoldFact:
    """A fold a streamed loop will make, for :func:`per_lane` before the loop is walked."""

    step: str
    over: str
    op: str
    expr: sp.Expr
    dot: Dot | None
    inner: bool = False


def placeholder(name: str) -> sp.Symbol:
    """A symbol standing for the variable ``name`` in an operation's expression (its env maps it)."""
    return sp.Symbol(f"<{name}>")


def sum_of_anchored_exps(form: ReductionForm) -> bool:
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


def tile_dims(plan: KernelPlan) -> tuple[str, ...]:
    """The dims a kernel's tiles have: every dim but a lane whose block is 1 (one program per index
    of it: its offset is the program id, a scalar, as hand-written kernels have ``off_hz``), in the
    spec's order, except that a product's rows over the loop axis (:func:`dot_rows`) come first:
    attention's dK/dV loop over the queries holds its scores as ``[n, m]`` (``k @ q^T``, tutorial 06's
    ``qkT``), so that P^T and dS^T feed the products over m from the accumulator's registers, not
    transposed through shared memory. A forward's rows (the queries) come first in the spec already."""
    dims = [d for d in plan.dims if not (d in plan.lanes and plan.blocks[d] == 1)]
    rows = [d for d in dims if d in dot_rows(plan)]
    return tuple(rows + [d for d in dims if d not in rows])


def dot_rows(plan: KernelPlan) -> frozenset[str]:
    """The lanes (blocked by more than 1) that are a product's free dim beside the loop axis: the rows
    of each tile of that product the loop makes (q.k's queries in a forward, its keys in dK/dV)."""
    out: set[str] = set()
    for free, _ in contractions(plan.spec, plan.derivation):
        if plan.axis in free:
            out |= {d for d in free if d in plan.lanes and plan.blocks[d] > 1}
    return frozenset(out)


def axis_outputs(plan: KernelPlan) -> list[str]:
    """The output parts that keep the loop axis (written in a pass over it after the reductions)."""
    return [p for p in plan.spec.output_parts if plan.axis in plan.spec.step(p.split(".")[0]).dims]


def kernel_names(plan: KernelPlan) -> tuple[str, str]:
    """(main or split part kernel, combine kernel): the one place kernel names are made."""
    base = f"{plan.spec.name}_{plan.strategy}"
    return f"{base}_kernel", f"{base}_combine_kernel"
