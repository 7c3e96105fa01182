"""Print the Triton source of a module's kernels: each kernel's operations, one method per type.

The structure (:func:`fuser_core.codegen.structure.build_structure`) decides every kernel as an
ordered list of operations (:mod:`fuser_core.codegen.ops`), each naming the value it defines and
its tile dims, each expression with what its symbols read; this module prints that list as it
is: one loop over the operations, no branch on the strategy, nothing read back from the printed
text.

The source reads like a hand-written kernel in the style of Triton's tutorials: offsets and
masks per dim, one loop over tiles of the loop axis, a comment naming the reduction each
block computes, and small ``@triton.jit`` helpers (top-k merge, argmax merge, safe anchors;
:mod:`fuser_core.codegen.helpers`) copied into the module by name. Every value is float32 on the
fewest tile dims it needs (:mod:`fuser_core.codegen.layout`: attention's ``q`` a
``[BLOCK_m, BLOCK_d]`` tile, its running max a ``[BLOCK_m]`` vector); inputs are loaded and
converted on the way in, outputs converted to their storage dtype on the way out.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable

import sympy as sp

from fuser_core.codegen import ops as o
from fuser_core.codegen.names import FP8, FP8_NATIVE, STORE_HELPERS, TMA_LOADS, WIDE_OFFSETS, fp8_bits_var, safe_name
from fuser_core.codegen.ops.bounds import Bound
from fuser_core.codegen.structure import Kernel, ModuleStructure
from fuser_core.codegen.tritonize import expr_dims, number, to_triton
from fuser_core.symbolic import CAST_FUNCTIONS
from fuser_core.realisation import identity
from fuser_core.reduce_ops import has_slots, is_negated, reduce_op, returns_indices

# ---------------------------------------------------------------------- loads and stores


def bound_source(b: Bound) -> str:
    """A loop bound (:class:`fuser_core.codegen.ops.bounds.Bound`) as Triton source."""
    kind, args = b.kind, b.args
    if kind == "name":
        return args[0]
    if kind == "int":
        return str(args[0])
    if kind in ("min", "max"):
        return f"tl.{'minimum' if kind == 'min' else 'maximum'}({bound_source(args[0])}, {bound_source(args[1])})"
    if kind == "sum":
        (_, first), *rest = args
        return bound_source(first) + "".join(f" {'-' if sign < 0 else '+'} {bound_source(t)}" for sign, t in rest)
    if kind == "group":
        return f"({bound_source(args[0])})"
    if kind == "product":
        return " * ".join(bound_source(f) for f in args)
    if kind == "tiles":
        x, dim = args
        return f"{bound_source(x)} // BLOCK_{dim} * BLOCK_{dim}"
    raise AssertionError(f"no printer for bound kind {kind!r}")


def dot_note(op: o.Reduce | o.Fold) -> str:
    """The comment that says a fold is a matrix product (where the structure decided a tl.dot)."""
    return f"  # tl.dot: sum over {op.over} as a matrix product" if op.dot is not None else ""


def load_expr(load_args: str, dtype: str | None, kind: str) -> str:
    """``tl.load(load_args)`` as float32 (``kind`` int32 for index inputs); fp8 arrives as bits.
    Masked lanes are never used (every reduction and store masks them): ``other`` is 0."""
    if dtype == FP8:
        return fp8_value(f"tl.load({load_args})")
    return f"tl.load({load_args}).to(tl.{kind})"


def fp8_value(bits: str) -> str:
    """The float32 value of e4m3 ``bits``."""
    return f"fp8e4m3_to_float({bits}, {FP8_NATIVE})"


def postfix_operand(text: str) -> str:
    """``text`` ready for a method call (``.to(...)``): parenthesised unless it is one term (an
    operator outside brackets would bind looser than the call: ``a * b.to(tl.float16)`` casts
    ``b`` alone, and a float32 ``a`` then reaches tl.dot, which the compiler refuses)."""
    depth = 0
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and ch in " +-*/<>=&|%":
            return f"({text})"
    return text


def store_expr(value: str, dtype: str, var: str) -> str:
    """``value`` converted for ``{var}_ptr``: fp8 leaves as its bits, bfloat16 through bf16_store (the
    interpreter truncates a float32 to bfloat16 where the GPU rounds to nearest even)."""
    if dtype == FP8:
        return f"{STORE_HELPERS[FP8]}({value}, {FP8_NATIVE})"
    if dtype in STORE_HELPERS:
        return f"{STORE_HELPERS[dtype]}({value})"
    return f"{value}.to({var}_ptr.dtype.element_ty)"


# ---------------------------------------------------------------------- the printer


class KernelPrinter:
    """Prints one kernel's operations (:meth:`lines`), one method per operation type."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.layout = kernel.layout
        self.lines: list[str] = []
        self.depth = 1
        self.fp8_bits: set[str] = set()  # fp8 inputs loaded with their bits kept (fp8_bits_var)
        self.origins: dict[str, str] = {}  # dim -> the first index of the current tile (its Offsets' base)
        self.real = f"tl.{kernel.compute}"  # what the structure's float32 values are computed as (float64 kernels)
        self.printers: dict[type, Callable] = {
            o.Comment: self.comment, o.Program: self.program, o.Offsets: self.offsets, o.Chunk: self.chunk,
            o.Load: self.load, o.Descriptor: self.descriptor, o.Gather: self.gather, o.Loop: self.loop,
            o.InitState: self.init_state, o.Count: self.count, o.Copy: self.copy,
            o.Value: self.value, o.Reduce: self.reduce_op, o.Fold: self.fold, o.Select: self.select,
            o.AnchorUpdate: self.anchor_update, o.LaneMerge: self.lane_merge, o.WorkspaceLoad: self.workspace_load,
            o.PartMerge: self.part_merge, o.Finalise: self.finalise, o.WorkspaceStore: self.workspace_store,
            o.OutputStore: self.output_store, o.FirstChunk: self.first_chunk, o.FallbackFlag: self.fallback_flag,
            o.LastPartCombine: self.last_part_combine,
        }

    # ------------------------------------------------------------ text helpers
    def emit(self, line: str = "") -> None:
        self.lines.append(("    " * self.depth + line) if line else "")

    def print_ops(self, ops: Iterable[o.Op]) -> None:
        for op in ops:
            self.printers[type(op)](op)

    def shape(self, dims) -> str:
        return self.layout.shape(dims)

    def on(self, text: str, dims, want) -> str:
        """``text``, a value on ``dims``, placed on ``want``."""
        return self.layout.expand(text, dims, want)

    def offs(self, dim: str, want) -> str:
        """The offsets of ``dim`` on a tile over ``want`` (a scalar lane's: its program's index)."""
        return self.on(f"offs_{dim}", (dim,) if dim in self.layout.dims else (), want)

    def mask(self, dims, on=None) -> str:
        """The tail mask of ``dims`` placed on a tile over ``on`` (default: ``dims``; "" when none:
        scalar lanes need none)."""
        return " & ".join(self.on(f"mask_{d}", (d,), dims if on is None else on) for d in self.layout.order(dims))

    def addressed(self, base: str, address, dims, skip: str | None = None) -> str:
        """An input's tile of pointers over ``dims`` from its address (fuser_core.merged.address: a merged
        dim's part read at offs // size(inner)), leaving out dim ``skip``."""
        return " + ".join([base, *(f"{self.offset(fmt, self.offs(d, dims), dims)} * {stride}"
                                   for d, fmt, stride, _ in address if d != skip)])

    def offset(self, fmt: str, position: str, dims) -> str:
        """An address entry's offset format filled: ``position`` where it reads its dim's offsets,
        ``offs_X`` fields (a paged input's table, read beside the ``by`` dims) with X's offsets on ``dims``."""
        named = {f for _, f, _, _ in string.Formatter().parse(fmt) if f and not f.isdigit()}
        return fmt.format(position, **{f: self.offs(f.removeprefix("offs_"), dims) for f in named})

    def pointer(self, base: str, offsets: list[tuple[str, str]], dims) -> str:
        """``base`` plus each (dim, stride) offset, as a tile of pointers over ``dims``."""
        return " + ".join([base, *(f"{self.offs(d, dims)} * {stride}" for d, stride in offsets)])

    def tex(self, e: sp.Expr, env: o.Env, to_half: bool = False) -> str:
        """``e`` printed; ``to_half``: a value rounded to 16 bits or fewer next (a 16-bit or e4m3 tl.dot
        operand), whose rounding hides exp's base-2 fold and a divisor's reciprocal (half a float32
        ulp: it moves the rounding only at a midpoint), as a 16-bit output's does
        (structure.build.BASE2_OUTPUT_DTYPES; tritonize.to_triton's ``reciprocals``)."""
        return to_triton(e, dict(env), self.layout, self.kernel.grouping, exp_base2=self.kernel.exp_base2 or to_half,
                         compute=self.kernel.compute,
                         reciprocals=to_half)

    def tex_dims(self, e: sp.Expr, env: o.Env) -> tuple[str, ...]:
        return expr_dims(e, dict(env), self.layout)

    def masked(self, dim: str, value: str, dims, other: str) -> tuple[str, tuple[str, ...]]:
        """``tl.where(mask_dim, value, other)`` (a value on ``dims``) on the union of both."""
        both = self.layout.union(dims, (dim,))
        return f"tl.where({self.on(f'mask_{dim}', (dim,), both)}, {self.on(value, dims, both)}, {other})", both

    def reduce(self, op: str, value: str, dims, over: str) -> tuple[str, tuple[str, ...]]:
        """``tl.{op}`` of a value on ``dims`` along ``over``: the value on the other dims."""
        dims = self.layout.order(dims)
        rest = tuple(d for d in dims if d != over)
        helper = reduce_op(op).nan_helper
        if helper:  # tl.max/tl.min drop NaN: reduce with the NaN-propagating helper
            return f"tl.reduce({value}, {dims.index(over)}, {helper})", rest
        return f"{reduce_op(op).triton_reduce}({value}, axis={dims.index(over)})", rest

    def tile(self, op: str, e: sp.Expr, env: o.Env, over: str, masked: bool) -> tuple[str, tuple[str, ...]]:
        """A sum/max/min of ``e`` over the tile of ``over`` (masked lanes the identity unless filled).
        A sum's factor constant over the tile that is provably finite and nonzero (``1 / size(c)``,
        attention's ``1 / sqrt(size(d))``) multiplies the tile's sum once, not every element, as the
        dot path applies its scale after tl.dot: for any other factor (a runtime scalar that may be 0
        or inf) the product per element is what keeps the formula's special values."""
        scale = None
        if op == "sum":
            scale, e = self.constant_factor(e, env)
        elif op in ("max", "min"):
            scale, e = self.positive_factor(e, env)
        value, dims = self.tex(e, env), self.tex_dims(e, env)
        if masked:
            value, dims = self.masked(over, value, dims, number(identity(op)))
        text, got = self.reduce(op, value, dims, over)
        if scale is not None:
            text = f"{text} * ({self.tex(scale, env)})"
        return text, got

    def constant_factor(self, e: sp.Expr, env: o.Env, positive: bool = False) -> tuple[sp.Expr | None, sp.Expr]:
        """(the factors of ``e`` on no dim that are provably finite and nonzero (``positive``: and
        positive), the rest); (None, e) when there is none, or nothing else."""
        factors = sp.Mul.make_args(e)
        constant = [f for f in factors if not f.is_Number and not self.tex_dims(f, env) and f.is_finite is True
                    and (f.is_positive if positive else f.is_nonzero) is True]
        if not constant or len(constant) == len(factors):
            return None, e
        return sp.Mul(*constant), sp.Mul(*[f for f in factors if f not in constant])

    def positive_factor(self, e: sp.Expr, env: o.Env) -> tuple[sp.Expr | None, sp.Expr]:
        """:meth:`constant_factor`'s positive one, also through a where() whose other branch is +-inf
        (a causal mask). A max or min of c x is c times the max or min of x for such a c, bit for bit
        (rounding is monotone), NaN and +-inf included: the scale a dot deferred (attention's)
        multiplies a row, not a score."""
        if not isinstance(e, sp.Piecewise):
            return self.constant_factor(e, env, positive=True)
        found = [(None, branch) if branch in (sp.oo, -sp.oo) else self.positive_factor(branch, env)
                 for branch, _ in e.args]
        scales = {f for f, _ in found if f is not None}
        if len(scales) != 1 or any(f is None and b not in (sp.oo, -sp.oo) for f, b in found):
            return None, e
        return scales.pop(), sp.Piecewise(*[(b, c) for (_, b), (_, c) in zip(found, e.args)])

    def dot(self, dot: o.Dot, env: o.Env, masked: bool) -> tuple[str, tuple[str, ...]]:
        """A tl.dot decided by the structure: P[i, over] @ Q[over, j], then the scale; with its dims."""
        i, j, over = dot.i, dot.j, dot.over
        halves = dot.precision in ("float16", "bfloat16")  # operands rounded to 16 bits (tex's to_half)
        p, p_dims = self.tex(dot.p, env, to_half=halves), self.tex_dims(dot.p, env)
        if masked:  # a masked lane of P must add 0 to the product
            p, _ = self.masked(over, p, p_dims, "0.0")
        lhs = self.as_matrix(p, self.layout.union(p_dims, (over,)), i, over)
        rhs = self.as_matrix(self.tex(dot.q, env, to_half=halves), self.tex_dims(dot.q, env), over, j)
        if dot.precision == o.FP8_DOT:
            lhs = self.fp8_operand(dot.p, env, masked, over, (i, over))
            rhs = self.fp8_operand(dot.q, env, False, over, (over, j))
            prod = f"tl.dot({lhs}, {rhs})"
        elif dot.precision == "float16":
            prod = f"tl.dot({postfix_operand(lhs)}.to(tl.float16), {postfix_operand(rhs)}.to(tl.float16))"
        elif dot.precision == "bfloat16":  # rounded to nearest even in the interpreter too
            prod = f"tl.dot(bf16_operand({lhs}), bf16_operand({rhs}))"
        else:
            prod = f"tl.dot({lhs}, {rhs}, input_precision=\"{dot.precision}\")"
        if self.layout.order((i, j)) != (i, j):
            prod = f"tl.trans({prod})"
        scale = f" * {self.tex(dot.scale, env)}" if dot.scale is not None else ""
        return f"{prod}{scale}", self.layout.order((i, j))

    def fp8_operand(self, e: sp.Expr, env: o.Env, masked: bool, over: str, rc: tuple[str, str]) -> str:
        """The e4m3 operand ``e`` of an fp8 tl.dot as a [rc] matrix: an fp8 input as its loaded bits,
        a cast to fp8 as its argument rounded once by fp8_operand, anything else rounded there too."""
        if e.is_Symbol and self.tex(e, env) in self.fp8_bits:
            helper, value, zero = "fp8_bits_operand", fp8_bits_var(self.tex(e, env)), "0"
        else:
            helper, zero = "fp8_operand", "0.0"
            if e.func == CAST_FUNCTIONS[FP8]:
                e = e.args[0]
            value = self.tex(e, env, to_half=True)  # rounded to e4m3 next: a row's divisor inverted once
        dims = self.tex_dims(e, env)
        if masked:  # a masked lane of P must add 0 to the product
            value, dims = self.masked(over, value, dims, zero)
        return f"{helper}({self.as_matrix(value, dims, *rc)}, {FP8_NATIVE})"

    def as_matrix(self, t: str, dims, row: str, col: str) -> str:
        """A value on ``dims`` (some of row, col) as a [BLOCK_row, BLOCK_col] matrix."""
        both = self.layout.order((row, col))
        if self.layout.order(dims) != both:
            t = f"tl.broadcast_to({self.on(t, dims, both)}, {self.shape(both)})"
        return t if both == (row, col) else f"tl.trans({t})"

    def combine(self, name: str, op: str, dims, left: str, left_dims, right: str, right_dims, note: str = "") -> None:
        """name = op(left, right) for two states of one accumulator (on ``dims``)."""
        left, right = self.on(left, left_dims, dims), self.on(right, right_dims, dims)
        self.emit(f"{name} = {left} + {right}{note}" if op == "sum" else f"{name} = {reduce_op(op).nan_helper}({left}, {right}){note}")

    # ------------------------------------------------------------ the kernel
    def arg_groups(self) -> list[list[str]]:
        """The parameters, one line per group as hand-written kernels have them: the pointers, the
        sizes, each tensor's strides, the split's numbers, the block sizes."""
        def group(a) -> str:
            if a.constexpr:
                return "constexpr"
            if a.name.startswith("ws_") and a.name.endswith("_ptr"):
                return "ws_ptr"
            if a.name.endswith("_ptr"):
                return "ptr"
            if a.name.startswith("stride_"):
                return a.name.rsplit("_", 1)[0]
            if a.name.startswith("size_"):
                return "size"
            if a.name.startswith("scalar_"):
                return "scalar"
            return "split"
        out: list[list[str]] = []
        last = None
        for a in self.kernel.args:
            key = group(a)
            if key != last:
                out.append([])
                last = key
            out[-1].append(f"{a.name}: tl.constexpr" if a.constexpr else a.name)
        return out

    def text(self) -> str:
        self.lines.append("@triton.jit")
        self.lines.append(f"def {self.kernel.name}(")
        for group in self.arg_groups():
            self.lines.append("    " + " ".join(f"{a}," for a in group))
        self.lines.append("):")
        self.emit(f'"""{self.kernel.doc}"""')
        self.print_ops(self.kernel.ops)
        return "\n".join(self.lines)

    # ------------------------------------------------------------ one method per operation
    def comment(self, op: o.Comment) -> None:
        self.emit(op.text.format(*map(bound_source, op.bounds)) if op.bounds else op.text)

    def program(self, op: o.Program) -> None:
        # a lane in no tile (block 1) has one program per index: its program id is its offset, in
        # range by the grid (no mask)
        pid = {d: f"pid_{d}" if d in op.tile else f"offs_{d}" for d in op.lanes}

        def show(d: str, line: str) -> None:
            if d in op.tile or d in op.used:
                self.emit(line)

        if len(op.lanes) == 1:
            show(op.lanes[0], f"{pid[op.lanes[0]]} = tl.program_id(0)")
        else:
            self.emit("pid = tl.program_id(0)")  # the fastest lane dim last in the grid's order: peel them off
            for d in reversed(op.lanes[1:]):
                show(d, f"{pid[d]} = pid % tl.cdiv(size_{d}, BLOCK_{d})")
                self.emit(f"pid = pid // tl.cdiv(size_{d}, BLOCK_{d})")
            show(op.lanes[0], f"{pid[op.lanes[0]]} = pid")
        for d in op.lanes:
            if d not in op.tile and d in op.used:
                self.widen(f"offs_{d}")

    def widen(self, var: str) -> None:
        """``var``, a position, in 64 bits where the launcher found a view past 2**31 elements
        (WIDE_OFFSETS, a constexpr: otherwise nothing is compiled for it)."""
        self.emit(f"if {WIDE_OFFSETS}:")
        self.emit(f"    {var} = {var}.to(tl.int64)")

    def offsets(self, op: o.Offsets) -> None:
        d = op.dim
        origin = {"pid": f"pid_{d} * BLOCK_{d}", "": "0"}.get(op.base, op.base)  # else a loop's variable
        self.origins[d] = origin
        self.emit(f"offs_{d} = {'' if origin == '0' else origin + ' + '}tl.arange(0, BLOCK_{d})")
        self.widen(f"offs_{d}")
        if op.mask and op.inside:
            self.emit(f"mask_{d} = tl.full([BLOCK_{d}], 1, tl.int1)  # every tile of this loop lies inside {d}")
        elif op.mask:
            self.emit(f"mask_{d} = offs_{d} < size_{d}")

    def chunk(self, op: o.Chunk) -> None:
        if op.part:
            self.emit("split = tl.program_id(1)")
            self.emit("lo = split * chunk")
        else:
            self.emit("lo = tl.program_id(1) * chunk")

    def load(self, op: o.Load) -> None:
        var = op.name
        ptr = self.addressed(f"{var}_ptr", op.address, op.input_dims)
        mask = self.mask(op.input_dims)
        other = number(identity(op.fill)) if op.fill else "0"
        args = f"{ptr}, mask={mask}, other={other}" if mask else ptr
        note = "  # loop-invariant: loaded once per program" if op.hoisted else ""
        if op.descriptor:  # the whole tile by TMA where the launcher chose it, else as pointers
            tile = f"{var}_desc.load([{', '.join(self.origins[d] for d in op.descriptor)}])"
            if self.layout.order(op.dims) != op.descriptor:
                tile = f"tl.trans({tile})"
            self.emit(f"if {TMA_LOADS}:")
            self.emit(f"    {var} = {tile}.to(tl.{op.kind})")
            self.emit("else:")
            self.depth += 1
            self.emit(f"{var} = {load_expr(args, op.dtype, op.kind)}")
            self.depth -= 1
            return
        if op.dtype == FP8:  # the bits too: a tl.dot takes them as its operand (fp8_bits_operand)
            self.emit(f"{fp8_bits_var(var)} = tl.load({args}){note}")
            self.emit(f"{var} = {fp8_value(fp8_bits_var(var))}")
            self.fp8_bits.add(var)
        else:
            self.emit(f"{var} = {load_expr(args, op.dtype, op.kind)}{note}")

    def descriptor(self, op: o.Descriptor) -> None:
        outer, inner = op.memory
        base = self.addressed(f"{op.var}_ptr", [a for a in op.address if a[0] not in op.memory], ())
        stride = next(stride for d, _, stride, _ in op.address if d == outer)
        self.emit(f"if {TMA_LOADS}:  # {op.var}'s tiles by the tensor memory accelerator (sm_90+)")
        self.emit(f"    {op.name} = tl.make_tensor_descriptor({base}, shape=[size_{outer}, size_{inner}], "
                  f"strides=[{stride}, 1], block_shape=[BLOCK_{outer}, BLOCK_{inner}])")

    def gather(self, op: o.Gather) -> None:
        at = f"{op.name}_at"
        at_dims = self.tex_dims(op.at, op.env)
        self.emit(f"{at} = {self.tex(op.at, op.env)}")
        self.widen(at)
        self.emit(f"{at}_ok = ({at} >= 0) & ({at} < size_{op.axis})  # an index outside the axis: no term")
        for inp, dims, dtype, kind, var, where in op.inputs:
            src = safe_name(inp)
            tile = self.layout.union([d for d in dims if d != op.axis], at_dims)
            ptr = " + ".join([self.addressed(f"{src}_ptr", where, tile, skip=op.axis),
                              *(f"{self.offset(fmt, self.on(at, at_dims, tile), tile)} * {stride}"
                                for d, fmt, stride, _ in where if d == op.axis)])
            # the input's own tail masks on the whole tile (the index's lanes included), as its pointers are
            mask = " & ".join(m for m in (self.mask([d for d in dims if d != op.axis], tile),
                                          self.on(f"{at}_ok", at_dims, tile)) if m)
            self.emit(f"{var} = {load_expr(f'{ptr}, mask={mask}, other=0', dtype, kind)}")
        value, dims = self.tex(op.expr, op.env), self.tex_dims(op.expr, op.env)
        both = self.layout.union(dims, at_dims)
        self.emit(f"{op.name} = tl.where({self.on(f'{at}_ok', at_dims, both)}, {self.on(value, dims, both)}, 0.0)")

    def loop(self, op: o.Loop) -> None:
        if op.resident:  # one tile holds the whole axis
            self.print_ops(op.body)
            return
        bounds = ", ".join(bound_source(x) for x in (op.lo, op.hi, op.step) if x is not None)
        self.emit(f"for {op.var} in range({bounds}):")
        self.depth += 1
        self.print_ops(op.body)
        self.depth -= 1
        self.print_ops(op.lanes)

    def fallback_flag(self, op: o.FallbackFlag) -> None:
        flags = []
        for ref, what in op.checks:
            v = ref.text
            bad = f"tl.abs({v}) == float('inf')" if what == "inf" else f"({v} != {v}) | (tl.abs({v}) == float('inf'))"
            flag = f"tl.where({bad}, 1, 0)"
            flags.append(f"tl.max({flag})" if ref.dims else flag)  # over every lane of the program's tile
        text = flags[0]
        for f in flags[1:]:
            text = f"tl.maximum({text}, {f})"
        self.emit(f"{op.name} = {text}")

    def init_state(self, op: o.InitState) -> None:
        shape = self.shape(op.dims)
        if op.fill is None:
            self.emit(f"{op.name} = tl.zeros({shape}, {self.real}){op.note}")
        elif op.dtype == "int32":
            self.emit(f"{op.name} = tl.full({shape}, {op.fill}, tl.int32){op.note}")
        else:
            self.emit(f"{op.name} = tl.full({shape}, {number(op.fill)}, {self.real}){op.note}")

    def count(self, op: o.Count) -> None:
        a = op.axis
        if op.mode == "init":
            self.emit("count = 0.0" if self.kernel.compute == "float32" else f"count = tl.zeros([], {self.real})")
        elif op.mode == "tile":
            self.emit("count_old = count")
            self.emit(f"count += tl.minimum(BLOCK_{a}, {bound_source(op.hi)} - start).to({self.real})")
        else:
            self.emit("count_old = count")
            self.emit(f"count_part = (tl.minimum(split * chunk + chunk, size_{a}) - tl.minimum(split * chunk, size_{a}))"
                      f".to({self.real})")
            self.emit("count += count_part")

    def copy(self, op: o.Copy) -> None:
        self.emit(f"{op.name} = {op.source}")

    def value(self, op: o.Value) -> None:
        self.emit(f"{op.name} = {self.tex(op.expr, op.env)}{op.note}")

    def reduce_op(self, op: o.Reduce) -> None:
        if op.dot is not None:
            text, _ = self.dot(op.dot, op.env, op.masked)
        else:
            text, _ = self.tile(op.op, op.expr, op.env, op.over, op.masked)
        total = f"{op.name} + {text}" if op.into else text  # a K loop's sum (a dot's accumulator, once compiled)
        self.emit(f"{op.name} = {total}{op.note}{dot_note(op)}")

    def fold(self, op: o.Fold) -> None:
        if op.per_lane:  # elementwise: each lane folds its own element
            right, right_dims = self.tex(op.expr, op.env), self.tex_dims(op.expr, op.env)
            if op.masked:
                right, right_dims = self.masked(op.over, right, right_dims, number(identity(op.op)))
        elif op.dot is not None:
            right, right_dims = self.dot(op.dot, op.env, op.masked)
        else:
            right, right_dims = self.tile(op.op, op.expr, op.env, op.over, op.masked)
        if op.prev is None:
            left, left_dims = op.name, op.dims
        else:
            left, left_dims = self.tex(op.prev, op.env), self.tex_dims(op.prev, op.env)
        self.combine(op.name, op.op, op.dims, left, left_dims, right, right_dims, op.note + dot_note(op))

    def select(self, op: o.Select) -> None:
        a = op.over
        prev = self.tex(op.prev, op.env) if op.prev is not None else f"{op.name}_values"
        value, dims = self.tex(op.expr, op.env), self.tex_dims(op.expr, op.env)
        sign = is_negated(op.op)
        tile, got = self.masked(a, f"-({value})" if sign else value, dims, 'float("-inf")')
        if op.broadcast:  # a value that varies over fewer dims than the state: a whole tile of it
            tile = f"tl.broadcast_to({self.on(tile, got, op.tile_dims)}, {self.shape(op.tile_dims)})"
        axis = self.layout.axis(op.tile_dims, a)
        # a masked lane's index is "empty": never chosen, not even over NaN (topk ranks NaN last)
        tile_idx = f"tl.where({self.on(f'mask_{a}', (a,), op.tile_dims)}, {self.offs(a, op.tile_dims)}, 2147483647)"
        if op.slots is None:
            merge = f"argmax_merge({prev}, {op.name}_indices, {tile}, {tile_idx}, {axis})"
        else:
            merge = (f"topk_merge({prev}, {op.name}_indices, {tile}, {tile_idx}, "
                     f"{self.offs(op.slots, op.dims)}, {axis}, {self.layout.axis(op.dims, op.slots)}, {op.k})")
        self.emit(f"{op.name}_values, {op.name}_indices = {merge}")

    def anchor_update(self, op: o.AnchorUpdate) -> None:
        if op.estimate:
            self.emit(f"{op.name} = {op.value.text} * size_{op.axis} / tl.maximum(count, 1.0){op.note}")
        else:
            self.emit(f"{op.name} = safe_anchor({op.value.text}){op.note}")

    def lane_merge(self, op: o.LaneMerge) -> None:
        text, _ = self.reduce(op.op, self.tex(op.expr, op.env), self.tex_dims(op.expr, op.env), op.axis)
        self.emit(f"{op.name} = {text}")

    def ws_pointer(self, entry: str, dims: tuple[str, ...]) -> str:
        return self.pointer(f"ws_{entry}_ptr + split * stride_ws_{entry}_split",
                            [(d, f"stride_ws_{entry}_{d}") for d in dims], dims)

    def workspace_load(self, op: o.WorkspaceLoad) -> None:
        mask = self.mask(op.entry_dims)
        args = self.ws_pointer(op.entry, op.entry_dims) + (f", mask={mask}, other={op.other}" if mask else "")
        # from L2 (.cg), never an SM's L1: a combine in the part kernel's launch reads what other
        # programs of the launch wrote
        self.emit(f'{op.name} = tl.load({args}, cache_modifier=".cg")')

    def last_part_combine(self, op: o.LastPartCombine) -> None:
        self.emit("# the last of this lane block's SPLIT programs to finish merges the partial states, in this launch")
        self.emit("tl.debug_barrier()  # every thread's partial state stored before the ticket is taken")
        self.emit('ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel")')
        self.emit("if ticket == SPLIT - 1:")
        self.emit("    tl.atomic_xchg(tickets_ptr + tl.program_id(0), 0)  # back to 0 for the next launch")
        args = [*op.args, *(f"{c}={c}" for c in op.constexprs)]
        self.emit(f"    {op.kernel}({', '.join(args)})")

    def part_merge(self, op: o.PartMerge) -> None:
        left, right = self.tex(op.left, op.env), self.tex(op.right, op.env)
        acc = op.name
        if has_slots(op.op):
            p = self.layout.axis(op.dims, op.slots)
            self.emit(f"{acc}_values, {acc}_indices = topk_merge({left}, {acc}_indices, {right}, {acc}_indices_part, "
                      f"{self.offs(op.slots, op.dims)}, {p}, {p}, {op.k})")
        elif returns_indices(op.op):  # the part's state as a tile of one along a new axis 0
            self.emit(f"{acc}_values, {acc}_indices = argmax_merge({left}, {acc}_indices, tl.expand_dims({right}, 0), "
                      f"tl.expand_dims({acc}_indices_part, 0), 0)")
        else:
            self.combine(acc, op.op, op.dims, left, self.tex_dims(op.left, op.env), right, self.tex_dims(op.right, op.env))

    def finalise(self, op: o.Finalise) -> None:
        if not op.name:  # the final value is a variable already
            return
        if op.expr is not None:
            self.emit(f"{op.name} = {self.tex(op.expr, op.env)}")
        else:
            self.emit(f"{op.name} = {'-' if op.source.form == 'neg' else ''}{op.source.name}")

    def workspace_store(self, op: o.WorkspaceStore) -> None:
        mask = self.mask(op.entry_dims)
        value = self.layout.whole(op.entry, op.value_dims, op.entry_dims)
        self.emit(f"tl.store({self.ws_pointer(op.entry, op.entry_dims)}, {value}" + (f", mask={mask})" if mask else ")"))

    def output_store(self, op: o.OutputStore) -> None:
        var, dims = op.name, op.part_dims
        ptr = self.pointer(f"{var}_ptr", [(d, f"stride_{var}_{d}") for d in dims], dims)
        mask = self.mask(dims)
        if op.gate:  # a where, not `mask & flag`: the interpreter makes that of a tile and a scalar int32
            mask = f"tl.where({op.gate} != 0, {mask}, False)" if mask else f"{op.gate} != 0"
        value = self.tex(op.expr, op.env) if op.expr is not None else op.value.text
        if op.constant:  # a constant step: .to() takes tensors only
            value = f"tl.full({self.shape(dims)}, {value}, {self.real})"
        else:
            value = self.layout.whole(value, op.value_dims, dims)
        if op.dtype in STORE_HELPERS and self.kernel.compute != "float32":  # the helpers convert a float32
            value = f"({value}).to(tl.float32)"
        line = f"tl.store({ptr}, {store_expr(value, op.dtype, var)}"
        self.emit(line + (f", mask={mask})" if mask else ")"))

    def first_chunk(self, op: o.FirstChunk) -> None:
        self.emit("if lo == 0:")
        self.depth += 1
        self.print_ops(op.body)
        self.depth -= 1


def kernels_source(structure: ModuleStructure) -> str:
    """The ``@triton.jit`` kernels of a structure, in launch order."""
    return "\n\n\n".join(KernelPrinter(k).text() for k in structure.kernels) + "\n"
