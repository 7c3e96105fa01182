"""What the kernels of a strategy do, read from the derivation without generating code.

The search space (resource checks) and the cost model (bytes, FLOPs) both need to know, for a
(strategy, block sizes) pair, what :mod:`fuser_core.codegen.emit` will write: which passes
over the loop axis a kernel makes, which inputs each pass loads, which reductions become
``tl.dot`` (the same rule as ``KernelWriter.try_dot``: a sum of a product whose factors
carry one blocked free dim each, two in all, every block >= 16), the elementwise work per
tile, and which tensors a program holds at once. :class:`Anatomy` builds that as a list of
:class:`KernelSketch` (one per launched kernel: split_fused has two), symbolic in the block
sizes; the numbers come from :func:`pass_iterations` and :func:`resources`.

Every decision depends only on whether each block is 1, between 2 and 15, or at least 16, so
sketches are cached per (strategy, that pattern).

Example:
    >>> from fuser_core.catalog import load_catalog_spec
    >>> from fuser_core.derive import derive_cascade
    >>> spec = load_catalog_spec("safe_softmax")
    >>> an = Anatomy(spec, derive_cascade(spec), {"x": "float16"})
    >>> [(p.kind, p.loads) for p in an.kernels("streaming_fused", {"m": 1, "n": 1024})[0].passes]
    [('axis', ('x',)), ('once', ()), ('axis', ('x',))]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sympy as sp

from fuser_core.codegen.plan import STRATEGIES, loop_axis, next_pow2
from fuser_core.derive import Derivation
from fuser_core.spec import Input, Spec, Step
from fuser_core.symbolic import CAST_FUNCTIONS, Round, SymbolicSpec

ORDER_SELECTIONS = ("topk", "bottomk", "argmax", "argmin")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int32": 4, "int64": 8}
DOT_BYTES = {"tl.float16": 2, "tf32": 4, "ieee": 4}  # operand bytes in shared memory per tl.dot precision
LOAD_ALU = 4  # per loaded element: address (multiply-add per dim, folded), mask, conversion to float32
REDUCE_ALU = 2  # per element of a reduced tile: the mask select and the combine
RESCALE_ALU = 4  # rescale(acc, c): compare, select, multiply (emit.HELPERS)
TOPK_TILE_ALU = 5  # per tile element and per k: max, compare, min-index, select (emit.topk_merge)
TOPK_SLOT_ALU = 8  # per list slot and per k
ITERATION_ALU = 30  # per thread and loop iteration: offsets, bounds, loop control


@dataclass(frozen=True)
class DotOp:
    """One ``tl.dot``: sum over ``over`` of P[i, over] Q[over, j] (batch dims blocked at 1)."""

    i: str
    j: str
    over: str
    dims: frozenset[str]  # every dim of the product: FLOPs = 2 * prod(blocks over dims) per tile
    p_dims: frozenset[str]
    q_dims: frozenset[str]
    precision: str  # "tl.float16" | "tf32" | "ieee" (emit.KernelWriter.dot_dtype)
    direct: tuple[str, ...] = ()  # inputs that are an operand as loaded (staged in shared memory once)


@dataclass
class Pass:
    """One stretch of a kernel: a loop over the axis (``axis``), over one split chunk
    (``chunk``), over the SPLIT partial states (``split``), or straight-line code (``once``)."""

    kind: str
    loads: tuple[str, ...] = ()  # inputs loaded (once per iteration)
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


def dot_precision(spec: Spec, dtypes: Mapping[str, str]) -> str:
    """emit.KernelWriter.dot_dtype: fp16 inputs -> fp16 operands, bf16 -> TF32, else IEEE fp32."""
    floats = {dtypes.get(i.name, "float32") for i in spec.inputs if i.kind == "float"}
    if floats == {"float16"}:
        return "tl.float16"
    if floats == {"bfloat16"}:
        return "tf32"
    return "ieee"


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
    """Kernel sketches of a (spec, derivation, input dtypes) for every strategy and the chain."""

    def __init__(self, spec: Spec, derivation: Derivation, dtypes: Mapping[str, str]):
        self.spec = spec
        self.derivation = derivation
        self.conv: SymbolicSpec = derivation.symbols
        self.forms = derivation.forms
        self.dtypes = dict(dtypes)
        self.axis, self.inner = loop_axis(spec)
        self.as_dims = tuple(s.as_dim for s in spec.steps if s.as_dim)
        self.lanes = tuple(d for d in spec.dims if d != self.axis and d not in self.inner and d not in self.as_dims)
        self.axis_steps = [s for s in spec.steps if s.is_reduction and s.over == self.axis]
        self.precision = dot_precision(spec, dtypes)
        self._sym_dims: dict[sp.Symbol, frozenset[str]] = {}
        self._cache: dict[tuple, list[KernelSketch]] = {}

    # ------------------------------------------------------------------ dims of expressions
    def sym_dims(self, s: sp.Symbol) -> frozenset[str]:
        out = self._sym_dims.get(s)
        if out is None:
            name = s.name
            if name.endswith(("[old]", "[new]")) and self.spec.lookup(name[:-5]) is not None:
                out = frozenset(self.spec.step(name[:-5]).dims)
            elif name.startswith("index("):
                out = frozenset((name[6:-1],))
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
        """Every dim's block: the given ones, inner and topk dims whole (next power of two)."""
        out = dict(blocks)
        for d in self.spec.dims:
            if d not in out:
                out[d] = next_pow2(shape[d]) if shape is not None and (d in self.inner or d in self.as_dims) else 1
        return out

    # ------------------------------------------------------------------ the tl.dot rule
    def dot_of(self, e: sp.Expr, over: str, blocks: Mapping[str, int],
               precision: str | None = None) -> tuple[DotOp, list, list] | None:
        """The ``tl.dot`` emit would use for sum over ``over`` of ``e``, with its P and Q factors."""
        blocked = {d for d, b in blocks.items() if b > 1}
        factors = sp.Mul.make_args(e)
        dims = [(self.dims_of(f) & blocked) - {over} for f in factors]
        free = set().union(*dims) if dims else set()
        if len(free) != 2 or any(len(d) > 1 for d in dims):
            return None
        i, j = sorted(free, key=self.spec.dims.index)
        if min(blocks.get(i, 1), blocks.get(j, 1), blocks.get(over, 1)) < 16:
            return None
        p = [f for f, d in zip(factors, dims) if d != {j}]
        q = [f for f, d in zip(factors, dims) if d == {j}]
        direct = tuple(
            f.name for side in (p, q) for f in side
            if isinstance(f, sp.Symbol) and isinstance(self.spec.lookup(f.name), Input)
        )
        op = DotOp(i, j, over, frozenset({i, j, over}), frozenset({i, over}), frozenset({over, j}),
                   precision or self.precision, direct)
        return op, p, q

    # ------------------------------------------------------------------ sketches
    def kernels(self, strategy: str, blocks: Mapping[str, int]) -> list[KernelSketch]:
        """The kernels ``strategy`` launches with these blocks (every dim; see :meth:`full_blocks`)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}")
        key = (strategy, block_pattern(blocks))
        if key not in self._cache:
            self._cache[key] = SketchBuilder(self, strategy, dict(blocks)).build()
        return self._cache[key]


class SketchBuilder:
    """Walks the derivation the way emit.KernelWriter does, recording instead of printing."""

    def __init__(self, an: Anatomy, strategy: str, blocks: dict[str, int]):
        self.an = an
        self.strategy = strategy
        self.blocks = blocks
        self.spec = an.spec
        self.conv = an.conv
        self.forms = an.forms
        self.axis = an.axis
        self.p: Pass = Pass("once")
        self.scope: set[str] = set()
        self.seen: set[sp.Basic] = set()

    # -- scopes
    def open(self, kind: str) -> Pass:
        self.p = Pass(kind)
        self.scope = set()
        self.seen = set()
        return self.p

    def need(self, exprs: Iterable[sp.Expr]) -> None:
        for e in exprs:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name in self.scope:
                    continue
                step = self.conv.leaf_step.get(s)
                if step is not None and step.over != self.axis:
                    self.scope.add(s.name)
                    integrand = self.conv.integrand(step)
                    self.need([integrand])
                    self.fold(integrand, step.over, step.reduce or "sum", step)
                elif step is None and isinstance(self.spec.lookup(s.name), Input):
                    self.scope.add(s.name)
                    self.p.loads = (*self.p.loads, s.name)
                    dims = frozenset(self.spec.input(s.name).dims)
                    self.p.add(dims, LOAD_ALU)
                    self.p.tensors.append(dims)

    def expr(self, e: sp.Basic) -> None:
        """Elementwise work of ``e``, each node at its own dims; shared subexpressions once."""
        if e in self.seen or e.is_Atom:
            return
        self.seen.add(e)
        for a in e.args:
            self.expr(a)
        alu, sfu = node_cost(e)
        if alu or sfu:
            self.p.add(self.an.dims_of(e), alu, sfu)

    def fold(self, e: sp.Expr, over: str, op: str, step: Step) -> None:
        """acc (op)= reduce over ``over`` of ``e``: a tl.dot, or the tile and a tl.sum/max."""
        if op == "sum":
            dot = self.an.dot_of(e, over, self.blocks)
            if dot is not None:
                d, p, q = dot
                for f in [*p, *q]:
                    self.expr(f)
                self.p.add(d.p_dims, 2 + max(0, len(p) - 1))  # mask select, conversion, product of P's factors
                self.p.add(d.q_dims, 1 + max(0, len(q) - 1))
                self.p.dots.append(d)
                self.p.tensors += [d.p_dims, d.q_dims, frozenset({d.i, d.j})]
                return
        self.expr(e)
        tile = self.an.dims_of(e) | {over}
        self.p.tensors.append(tile)
        if op in ("topk", "bottomk"):
            k = step.k or 1
            self.p.add(tile, TOPK_TILE_ALU * k)
            self.p.add(frozenset(step.dims), TOPK_SLOT_ALU * k)
        elif op in ("argmax", "argmin"):
            self.p.add(tile, 4)
        else:
            self.p.add(tile, REDUCE_ALU)

    # -- outputs
    def output_parts(self) -> tuple[list[str], list[str]]:
        row, along = [], []
        for part in self.spec.output_parts:
            dims = self.spec.step(part.split(".")[0]).dims
            (along if self.axis in dims else row).append(part)
        return row, along

    def output(self, part: str) -> None:
        name = part.split(".")[0]
        step = self.spec.step(name)
        dims = frozenset(step.dims)
        if not (step.is_reduction and step.over == self.axis):
            e = self.conv.value(name, part.split(".")[1] if "." in part else None)
            self.need([e])
            self.expr(e)
        self.p.stores.append((part, dims))
        self.p.add(dims, 2)  # pointer and conversion of the stored value

    def outputs(self, kernels: list[KernelSketch], kernel: KernelSketch) -> None:
        """Row outputs after the loop; outputs along the axis in one more pass over it."""
        row, along = self.output_parts()
        for part in row:
            self.output(part)
        if along:
            kernel.passes.append(self.open("axis"))
            for part in along:
                self.output(part)

    # -- accumulators
    def acc_dims(self, step: Step) -> frozenset[str]:
        return frozenset(step.dims)

    def n_accs(self, step: Step, fused: bool) -> int:
        form = self.forms[step.name]
        op = form.effective_op if fused and form.effective_op else step.reduce
        if op in ORDER_SELECTIONS:
            return 2  # values and indices
        if not fused or form.kind == "shifted":
            return 1
        return max(1, len(form.contributions))

    # -- strategies
    def build(self) -> list[KernelSketch]:
        return getattr(self, f"build_{self.strategy}")()

    def state(self, fused: bool) -> list[frozenset[str]]:
        return [self.acc_dims(s) for s in self.an.axis_steps for _ in range(self.n_accs(s, fused))]

    def build_row_resident(self) -> list[KernelSketch]:
        k = KernelSketch("row_resident", "lanes", [self.open("axis")], self.state(False))
        for step in self.an.axis_steps:
            integrand = self.conv.integrand(step)
            self.need([integrand])
            self.fold(integrand, self.axis, step.reduce or "sum", step)
        row, along = self.output_parts()
        for part in row + along:  # row-resident stores every output from registers
            self.output(part)
        return [k]

    def build_multi_pass(self) -> list[KernelSketch]:
        k = KernelSketch("multi_pass", "lanes", [], self.state(False))
        for step in self.an.axis_steps:
            k.passes.append(self.open("axis"))
            integrand = self.conv.integrand(step)
            self.need([integrand])
            self.fold(integrand, self.axis, step.reduce or "sum", step)
        k.passes.append(self.open("once"))
        self.outputs([k], k)
        return [k]

    def streaming_loop(self, kind: str) -> Pass:
        p = self.open(kind)
        anchors = [dep for s in self.an.axis_steps for dep in self.forms[s.name].anchors]
        for step in self.an.axis_steps:
            form = self.forms[step.name]
            acc = self.acc_dims(step)
            if form.kind == "shifted":
                assert form.delta is not None
                self.need([form.integrand, form.delta])
                self.expr(form.delta)
                p.add(acc, 1)
                self.fold(form.integrand, self.axis, "sum", step)
                continue
            if form.kind == "taylor":  # accumulators of Taylor coefficients, moved by a binomial shift
                self.need(list(form.contributions) + list(form.reanchor))
                self.reanchor(form, acc, 1)
                for contribution in form.contributions:
                    self.fold(contribution, self.axis, "sum", step)
                self.need(list(form.deferred))
                p.add(acc, 2 * len(form.deferred))
                if step.name in anchors:
                    p.add(acc, 3)
                continue
            self.need(list(form.contributions) + list(form.corrections))
            for contribution, correction in zip(form.contributions, form.corrections):
                if correction != 1:
                    self.expr(correction)
                    p.add(acc, RESCALE_ALU)
                self.fold(contribution, self.axis, form.effective_op or step.reduce or "sum", step)
            if form.effective_op not in ORDER_SELECTIONS:
                self.need(list(form.deferred) + [form.offset])
                for deferred in form.deferred:
                    self.expr(deferred)
                p.add(acc, 2 * len(form.deferred))  # value = sum_j deferred_j * acc_j + offset
            if step.name in anchors:
                p.add(acc, 3)  # the anchor update
        return p

    def reanchor(self, form, acc: frozenset[str], times: int) -> None:
        """The re-anchoring expressions (each mixes the accumulators) at the accumulators' dims."""
        for e in form.reanchor:
            alu, sfu = tree_cost(e)
            self.p.add(acc, times * alu, times * sfu)

    def finalize(self) -> None:
        for step in self.an.axis_steps:
            form = self.forms[step.name]
            if form.effective_op in ORDER_SELECTIONS:
                self.need([form.deferred[0], form.offset])
                self.expr(form.deferred[0])
                self.expr(form.offset)
                self.p.add(frozenset(step.dims), 2)

    def build_streaming_fused(self) -> list[KernelSketch]:
        k = KernelSketch("streaming_fused", "lanes", [self.streaming_loop("axis")], self.state(True))
        k.passes.append(self.open("once"))
        self.finalize()
        self.outputs([k], k)
        return [k]

    def workspace(self) -> list[frozenset[str]]:
        """emit.KernelWriter.workspace: every piece of partial state, by dims (4 bytes each)."""
        out = []
        for step in self.an.axis_steps:
            out += [self.acc_dims(step)] * self.n_accs(step, True)
        deps = list(dict.fromkeys(dep for s in self.an.axis_steps for dep in self.forms[s.name].anchors))
        out += [frozenset(self.spec.step(dep).dims) for dep in deps]
        return out

    def build_split_fused(self) -> list[KernelSketch]:
        ws = self.workspace()
        part1 = KernelSketch("split_fused", "lanes x split", [self.streaming_loop("chunk")], self.state(True), ws)
        merge = self.open("split")
        merge.ws_loads = list(ws)
        for step in self.an.axis_steps:
            form = self.forms[step.name]
            acc = self.acc_dims(step)
            for correction in (form.corrections if form.kind != "taylor" else ()):
                if correction != 1:
                    self.expr(correction)  # printed twice (merged and part side): count it twice
                    self.seen.discard(correction)
                    self.expr(correction)
                    merge.add(acc, 2 * RESCALE_ALU)
            if form.kind == "taylor":
                self.reanchor(form, acc, 2)  # the merged state and the part, each moved to the new anchors
                merge.add(acc, len(form.contributions))
            elif form.effective_op in ("topk", "bottomk"):
                merge.add(acc, 2 * TOPK_SLOT_ALU * (step.k or 1))
            else:
                merge.add(acc, 2 * self.n_accs(step, True))
            if form.kind == "shifted" and form.delta is not None:
                merge.add(acc, 2 * 4)
        part2 = KernelSketch("split_fused_combine", "lanes", [merge], self.state(True))
        part2.passes.append(self.open("once"))
        self.finalize()
        self.outputs([part2], part2)
        return [part1, part2]


# ---------------------------------------------------------------------- numbers from sketches


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def elements(dims: Iterable[str], blocks: Mapping[str, int]) -> int:
    return math.prod(blocks.get(d, 1) for d in dims)


def pass_iterations(p: Pass, axis: str, shape: Mapping[str, int], blocks: Mapping[str, int], split: int) -> int:
    """Loop iterations one program makes in this pass."""
    if p.kind == "axis":
        return cdiv(shape[axis], blocks[axis])
    if p.kind == "chunk":
        chunk = cdiv(cdiv(shape[axis], split), blocks[axis]) * blocks[axis]
        return chunk // blocks[axis]
    if p.kind == "split":
        return split
    return 1


@dataclass(frozen=True)
class Resources:
    """Per-program resources of one kernel, estimated (registers) or counted (shared memory)."""

    regs_per_thread: int
    smem_bytes: int
    tile_elements: int  # the largest tensor a program holds
    live_elements: int  # float32 values live at once (state + loaded tiles + the largest temporary)

    def to_dict(self) -> dict:
        return {"regs_per_thread": self.regs_per_thread, "smem_bytes": self.smem_bytes,
                "tile_elements": self.tile_elements, "live_elements": self.live_elements}


REG_OVERHEAD = 32  # pointers, offsets, loop counters, masks
SCRATCH_BYTES = 1024  # cross-warp reduction scratch


def resources(kernel: KernelSketch, inputs: Mapping[str, tuple[tuple[str, ...], int]], axis: str | None,
              blocks: Mapping[str, int], num_warps: int, num_stages: int) -> Resources:
    """Per-program resources; ``inputs`` maps each loadable name to (dims, bytes per element).

    Registers: live float32 elements (accumulators + loaded tiles + the largest temporary,
    counted twice for the value it is computed from) / (32 * num_warps) threads, + overhead.
    Shared memory: tl.dot operand tiles * stages * operand bytes, plus, in loops over the axis
    with num_stages > 1, the other loads of the axis pipelined num_stages - 1 tiles ahead."""
    state = sum(elements(d, blocks) for d in kernel.state)
    smem, tile, live_max = SCRATCH_BYTES, max([1] + [elements(d, blocks) for d in kernel.state]), 0
    for p in kernel.passes:
        loaded = sum(elements(inputs[n][0], blocks) for n in p.loads)
        held = [*p.tensors, *p.ws_loads, *(dims for _, dims in p.stores)]
        biggest = max((elements(t, blocks) for t in held), default=1)
        tile = max(tile, biggest)
        live_max = max(live_max, state + loaded + 2 * biggest)
        dot_smem = sum((elements(d.p_dims, blocks) + elements(d.q_dims, blocks)) * DOT_BYTES[d.precision] * num_stages
                       for d in p.dots)
        staged = 0
        if num_stages > 1 and p.kind in ("axis", "chunk") and axis is not None and blocks.get(axis, 1) > 1:
            direct = {n for d in p.dots for n in d.direct}
            staged = (num_stages - 1) * sum(
                elements(inputs[n][0], blocks) * inputs[n][1]
                for n in p.loads if n not in direct and axis in inputs[n][0]
            )
        smem = max(smem, SCRATCH_BYTES + dot_smem + staged)
    regs = REG_OVERHEAD + math.ceil(live_max / (32 * num_warps))
    return Resources(int(regs), int(smem), int(tile), int(live_max))


def input_info(spec: Spec, dtypes: Mapping[str, str]) -> dict[str, tuple[tuple[str, ...], int]]:
    """name -> (dims, bytes per element) for every input of ``spec``."""
    return {i.name: (i.dims, ELEMENT_BYTES[dtypes.get(i.name, "int64" if i.kind == "index" else "float32")])
            for i in spec.inputs}
