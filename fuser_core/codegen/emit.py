"""Write the Triton source of one kernel from a :class:`~fuser_core.codegen.plan.KernelPlan`.

The source reads like a hand-written kernel in the style of Triton's tutorials: offsets and
masks per dim, one loop over tiles of the loop axis, a comment naming the reduction each
block computes, and small ``@triton.jit`` helpers (top-k merge, argmax merge, safe anchors)
shared by all kernels of a module. Every value is float32 in the aligned layout
(:mod:`fuser_core.codegen.plan`); inputs are loaded and converted on the way in, outputs
converted to their storage dtype on the way out.
"""

from __future__ import annotations

import keyword
import re

import sympy as sp

from fuser_core.codegen.plan import KernelPlan
from fuser_core.codegen.tritonize import to_triton
from fuser_core.derive import COUNT_OLD, ReductionForm
from fuser_core.spec import Step

HELPERS = '''
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

@triton.jit
def finite_or_zero(c):
    """A correction that is inf or nan only multiplies an empty accumulator: use 0."""
    return tl.where((c == c) & (c != float("inf")) & (c != float("-inf")), c, 0.0)


@triton.jit
def safe_anchor(v):
    """A running max/min that is still infinite (only masked values seen) anchors at 0."""
    return tl.where((v != float("inf")) & (v != float("-inf")) & (v == v), v, 0.0)


@triton.jit
def rescale(acc, c):
    """acc * c, leaving empty (0) and infinite accumulators as they are."""
    keep = (acc == 0.0) | (acc == float("inf")) | (acc == float("-inf"))
    return tl.where(keep, acc, acc * finite_or_zero(c))


@triton.jit
def argmax_merge(best, best_idx, tile, tile_idx, AXIS: tl.constexpr):
    """Running (max value, first index) along AXIS; the earlier index wins ties. NaN is the
    extreme, as NumPy's argmax/argmin (the reference) have it: the first NaN wins (tl.max
    alone would skip NaN on the GPU)."""
    nan_t = tile != tile
    has_nan = tl.max(nan_t.to(tl.int32), axis=AXIS, keep_dims=True) > 0
    m = tl.max(tl.where(nan_t, float("-inf"), tile), axis=AXIS, keep_dims=True)
    i = tl.min(tl.where(tile == m, tile_idx, 2147483647), axis=AXIS, keep_dims=True)
    m = tl.where(has_nan, float("nan"), m)
    i = tl.where(has_nan, tl.min(tl.where(nan_t, tile_idx, 2147483647), axis=AXIS, keep_dims=True), i)
    take = (best == best) & (has_nan | (m > best))
    return tl.where(take, m, best), tl.where(take, i, best_idx)


@triton.jit
def topk_merge(vals, idx, tile, tile_idx, slot, AXIS: tl.constexpr, SLOTS: tl.constexpr, K: tl.constexpr):
    """Merge a tile (along AXIS) into a running top-K list (along SLOTS).

    The list stays sorted descending; among equal values the lower index comes first
    (the list holds earlier positions than the tile, so it wins ties).
    """
    new_vals = tl.where(slot < 0, vals, float("-inf"))
    new_idx = tl.where(slot < 0, idx, 0)
    for i in tl.static_range(K):
        best_s = tl.max(vals, axis=SLOTS, keep_dims=True)
        best_t = tl.max(tile, axis=AXIS, keep_dims=True)
        i_s = tl.min(tl.where(vals == best_s, idx, 2147483647), axis=SLOTS, keep_dims=True)
        i_t = tl.min(tl.where(tile == best_t, tile_idx, 2147483647), axis=AXIS, keep_dims=True)
        take_t = best_t > best_s
        new_vals = tl.where(slot == i, tl.where(take_t, best_t, best_s), new_vals)
        new_idx = tl.where(slot == i, tl.where(take_t, i_t, i_s), new_idx)
        vals = tl.where((idx == i_s) & (~take_t), float("-inf"), vals)
        tile = tl.where((tile_idx == i_t) & take_t, float("-inf"), tile)
    return new_vals, new_idx


# float8 e4m3fn crosses into and out of kernels as its bits (uint8): sm_80 has no fp8 type, and
# Triton's interpreter converts without round-to-even, saturation or subnormals. The conversion
# is done here, exactly, in integer and power-of-two arithmetic, the same on every target.
@triton.jit
def fp8e4m3_bits(x):
    """The e4m3fn bits of x rounded to nearest even (saturating at 448, subnormals kept)."""
    a = tl.minimum(tl.abs(x), 448.0)
    e = tl.maximum((a.to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127, -6)  # subnormals share -6
    scale = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e): exact
    m = round_half_even(a * scale).to(tl.int32)  # the significand in eighths; 16 carries into e + 1
    code = (e + 6) * 8 + m
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) * 0x80  # -0.0 keeps its sign
    code = tl.where(x != x, 0x7F, code) + sign
    return code.to(tl.uint8)


@triton.jit
def fp8e4m3_to_float(bits):
    """The float32 value of e4m3fn bits (uint8)."""
    b = bits.to(tl.int32)
    code = b & 0x7F
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2**-9
    value = tl.where(code == 0x7F, float("nan"), value)
    return tl.where(b >= 0x80, -value, value)


@triton.jit
def fp8e4m3_round(x):
    """x rounded to float8 e4m3fn, as a float32."""
    return fp8e4m3_to_float(fp8e4m3_bits(x))


if INTERPRETED:
    # Triton's interpreter truncates float32 -> bfloat16 (1.01171875 -> 1.0078125); round to
    # nearest even on the bits, as the GPU's conversion does.
    @triton.jit
    def bf16_round(x):
        """x rounded to bfloat16 (nearest even; inf and nan kept)."""
        bits = x.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, up.to(tl.float32, bitcast=True))
else:
    @triton.jit
    def bf16_round(x):
        """x rounded to bfloat16 (the GPU's round-to-nearest-even conversion)."""
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def log1p_accurate(x):
    """log(1 + x), accurate for small x: log(u) * x / (u - 1) with u = 1 + x (Kahan)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.where(u == float("inf"), u, tl.log(u) * (x / (u - 1.0))))


@triton.jit
def tanh_accurate(x):
    """tanh(x), accurate near 0: 2 sigmoid(2x) - 1 cancels to 0 for tiny x, so a Taylor series
    (truncation below 1e-11 relative) serves |x| < 1/16."""
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 - x2 * 0.05396825396825397)))
    return tl.where(tl.abs(x) < 0.0625, series, 2.0 * tl.sigmoid(2.0 * x) - 1.0)


@triton.jit
def round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def pow_real(b, e):
    return tl.where(b > 0.0, tl.exp2(e * tl.log2(b)), tl.where(b == 0.0, tl.where(e > 0.0, 0.0, float("inf")), float("nan")))
'''

ORDER_SELECTIONS = ("topk", "bottomk", "argmax", "argmin")
FP8 = "float8_e4m3fn"  # kernels see it as uint8 bits: see fp8e4m3_bits in HELPERS
_CONSTANT = re.compile(r'\(*-?(?:[0-9.]+(?:e[+-]?[0-9]+)?|float\("-?(?:inf|nan)"\))\)*')
_RESERVED = {"tl", "triton", "pid", "start", "count", "count_old", "float", "range", "int", "math", "torch"}
_PREFIXES = ("offs_", "mask_", "size_", "stride_", "BLOCK_", "nblk_", "pid_")


def aligned_index(all_dims: tuple[str, ...], dim: str, expr: str) -> str:
    """A 1-d range over `dim` placed on its axis of the aligned layout: ``(expr)[:, None]``."""
    if len(all_dims) == 1:
        return expr
    pos = all_dims.index(dim)
    return f"({expr})[{', '.join(':' if i == pos else 'None' for i in range(len(all_dims)))}]"


def block_shape(all_dims: tuple[str, ...], dims) -> str:
    """The aligned shape of a tensor over `dims`: ``[BLOCK_m, 1]``."""
    return "[" + ", ".join(f"BLOCK_{d}" if d in dims else "1" for d in all_dims) + "]"


def safe_name(name: str) -> str:
    """A Python identifier for a spec name inside generated code."""
    name = name.replace(".", "_")
    if keyword.iskeyword(name) or name in _RESERVED or name.startswith(_PREFIXES) or name.endswith(("_ptr", "_anchor", "_old")):
        return f"v_{name}"
    return name


def load_expr(load_args: str, dtype: str | None, kind: str) -> str:
    """``tl.load(load_args)`` as float32 (``kind`` tl.int32 for index inputs); fp8 arrives as bits.
    Masked lanes are never used (every reduction and store masks them): ``other`` is 0."""
    if dtype == FP8:
        return f"fp8e4m3_to_float(tl.load({load_args}))"
    return f"tl.load({load_args}).to({kind})"


def store_expr(value: str, dtype: str, var: str) -> str:
    """``value`` converted for ``{var}_ptr``: fp8 leaves as its bits."""
    if dtype == FP8:
        return f"fp8e4m3_bits({value})"
    return f"{value}.to({var}_ptr.dtype.element_ty)"


def kernel_arg(var: str, dtype: str | None) -> str:
    """A launcher's tensor argument: an fp8 tensor is passed as its bits (uint8)."""
    return f"{var}.view(torch.uint8)" if dtype == FP8 else var


class KernelWriter:
    """Builds one ``@triton.jit`` kernel; call :meth:`source` for the text."""

    def __init__(self, plan: KernelPlan, kernel_name: str, store_dtypes: dict[str, str], input_dtypes: dict[str, str]):
        self.plan = plan
        self.spec = plan.spec
        self.conv = plan.derivation.symbols
        self.forms = plan.derivation.forms
        self.name = kernel_name
        self.dims = plan.dims
        self.rank = len(self.dims)
        self.lines: list[str] = []
        self.depth = 1
        self.loaded: set[str] = set()  # inputs / inner reductions already in the current scope
        self.values: dict[str | sp.Symbol, str] = {}  # sympy symbol (or its name) -> Triton expression, current scope
        self.store_dtypes = store_dtypes
        self.input_dtypes = input_dtypes

    # ------------------------------------------------------------ text helpers
    def emit(self, line: str = "") -> None:
        self.lines.append(("    " * self.depth + line) if line else "")

    def aligned(self, dim: str, expr: str) -> str:
        return aligned_index(self.dims, dim, expr)

    def shape(self, dims) -> str:
        return block_shape(self.dims, dims)

    def pos(self, dim: str) -> int:
        return self.dims.index(dim)

    def tex(self, e: sp.Expr) -> str:
        return to_triton(e, self.values)

    # ------------------------------------------------------------ signature and set-up
    def signature(self) -> list[str]:
        args = [f"{safe_name(i.name)}_ptr" for i in self.spec.inputs]
        args += [f"{safe_name(p)}_ptr" for p in self.output_parts()]
        args += [f"size_{d}" for d in self.dims]
        for i in self.spec.inputs:
            args += [f"stride_{safe_name(i.name)}_{d}" for d in i.dims]
        for p in self.output_parts():
            args += [f"stride_{safe_name(p)}_{d}" for d in self.part_dims(p)]
        if self.plan.strategy == "split_fused":
            args += self.workspace_args()
        args += [f"BLOCK_{d}: tl.constexpr" for d in self.dims]
        return args

    def output_parts(self) -> list[str]:
        return list(self.spec.output_parts)

    def part_dims(self, part: str) -> tuple[str, ...]:
        return self.spec.step(part.split(".")[0]).dims

    def header(self, doc: str) -> None:
        self.lines.append("@triton.jit")
        self.lines.append(f"def {self.name}(")
        for a in self.signature():
            self.lines.append(f"    {a},")
        self.lines.append("):")
        self.emit(f'"""{doc}"""')
        lanes = self.plan.lanes
        if lanes:
            self.emit("pid = tl.program_id(0)")
            for d in reversed(lanes):
                self.emit(f"nblk_{d} = tl.cdiv(size_{d}, BLOCK_{d})")
                self.emit(f"pid_{d} = pid % nblk_{d}")
                self.emit(f"pid = pid // nblk_{d}")
        for d in self.dims:
            if d == self.plan.axis:
                continue
            base = f"pid_{d} * BLOCK_{d} + " if d in lanes else ""
            self.emit(f"offs_{d} = {self.aligned(d, f'{base}tl.arange(0, BLOCK_{d})')}")
            self.emit(f"mask_{d} = offs_{d} < size_{d}")
        for d in self.dims:
            self.values[f"size({d})"] = f"(size_{d} * 1.0)"  # float: sizes enter float arithmetic
            self.values[f"index({d})"] = f"offs_{d}"

    def axis_tile(self, start: str) -> None:
        a = self.plan.axis
        self.emit(f"offs_{a} = {self.aligned(a, f'{start} + tl.arange(0, BLOCK_{a})')}")
        self.emit(f"mask_{a} = offs_{a} < size_{a}")

    # ------------------------------------------------------------ scopes: loads and inner reductions
    def begin_scope(self) -> None:
        for name in self.loaded:
            self.values.pop(name, None)
        self.loaded = set()

    def need(self, exprs: list[sp.Expr]) -> None:
        """Emit loads and inner reductions so that every symbol of ``exprs`` has a value here."""
        for e in exprs:
            for s in sorted(e.free_symbols, key=lambda s: s.name):
                if s.name in self.values:
                    continue
                inp = self.spec.lookup(s.name)
                step = self.conv.leaf_step.get(s)
                if step is not None and step.over != self.plan.axis:
                    self.inner_reduction(step)
                elif step is None and inp is not None:
                    self.load(s.name)

    def load(self, name: str) -> None:
        inp = self.spec.input(name)
        var = safe_name(name)
        ptr = f"{var}_ptr + " + " + ".join(f"offs_{d} * stride_{var}_{d}" for d in inp.dims) if inp.dims else f"{var}_ptr"
        mask = " & ".join(f"mask_{d}" for d in inp.dims)
        kind = "tl.int32" if inp.kind == "index" else "tl.float32"
        args = f"{ptr}, mask={mask}, other=0" if mask else ptr
        self.emit(f"{var} = {load_expr(args, self.input_dtypes.get(name), kind)}")
        self.values[name] = var
        self.loaded.add(name)

    def inner_reduction(self, step: Step) -> None:
        integrand = self.conv.integrand(step)
        self.need([integrand])
        var = safe_name(step.name)
        p = self.pos(step.over)
        self.emit(f"# {step.name}: {step.reduce} over {step.over} of {sp.sstr(integrand)}")
        dot = self.try_dot(integrand, step.over) if step.reduce == "sum" else None
        self.emit(f"{var} = {dot or self.tile_reduce(step.reduce, self.tex(integrand), step.over, p)}")
        self.values[step.name] = var
        self.loaded.add(step.name)

    def expr_dims(self, e: sp.Expr) -> set[str]:
        """Dims an expression varies over within a tile (dims blocked as 1 do not count)."""
        dims: set[str] = set()
        for s in e.free_symbols:
            dims.update(self.conv.leaf_dims.get(s, ()))
            if s.name.startswith(("index(",)):
                dims.add(s.name[6:-1])
            if s.name in self.dep_dims:
                dims.update(self.dep_dims[s.name])
        return {d for d in dims if self.plan.blocks.get(d, 1) > 1}

    @property
    def dep_dims(self) -> dict[str, tuple[str, ...]]:
        out = {}
        for step in self.spec.steps:
            for key in (f"{step.name}[old]", f"{step.name}[new]"):
                out[key] = step.dims
        return out

    def try_dot(self, e: sp.Expr, over: str) -> str | None:
        """sum over `over` of P * Q as tl.dot(P[I, over], Q[over, J]) when the tile allows it.

        P carries one blocked dim I besides `over`, Q one other J; all three blocks >= 16
        (tl.dot's minimum). Accumulates in float32; operand precision: :meth:`dot_dtype`.
        """
        scalars = [f for f in sp.Mul.make_args(e) if not self.expr_dims(f)]  # applied after the dot, unrounded
        factors = [f for f in sp.Mul.make_args(e) if self.expr_dims(f)]
        dims = [self.expr_dims(f) - {over} for f in factors]
        free = set().union(*dims) if dims else set()
        if len(free) != 2 or any(len(d) > 1 for d in dims):
            return None
        i, j = sorted(free, key=self.dims.index)
        if min(self.plan.blocks[i], self.plan.blocks[j], self.plan.blocks[over]) < 16:
            return None
        p_expr = sp.Mul(*[f for f, d in zip(factors, dims) if d != {j}])
        q_expr = sp.Mul(*[f for f, d in zip(factors, dims) if d == {j}])
        p = f"tl.broadcast_to(tl.where(mask_{over}, {self.tex(p_expr)}, 0.0), {self.shape({i, over})})"
        q = f"tl.broadcast_to({self.tex(q_expr)}, {self.shape({over, j})})"
        lhs = self.as_matrix(p, i, over)
        rhs = self.as_matrix(q, over, j)
        dtype = self.dot_dtype(p_expr, q_expr)
        if dtype == "tl.float16":
            prod = f"tl.dot({lhs}.to(tl.float16), {rhs}.to(tl.float16))"
        else:
            prod = f"tl.dot({lhs}, {rhs}, input_precision=\"{dtype}\")"
        scale = f" * {self.tex(sp.Mul(*scalars))}" if scalars else ""
        return f"tl.reshape({prod}, {self.shape({i, j})}){scale}  # tl.dot: sum over {over} as a matrix product"

    def exact_in_fp16(self, e: sp.Expr) -> bool:
        """Every factor is an fp8/fp16 input or a cast to fp8/fp16: fp16 operands lose nothing."""
        from fuser_core.symbolic import CAST_FUNCTIONS

        narrow = (CAST_FUNCTIONS["float8_e4m3fn"], CAST_FUNCTIONS["float16"])
        for f in sp.Mul.make_args(e):
            if f.is_Symbol and self.input_dtypes.get(f.name) in ("float8_e4m3fn", "float16"):
                continue
            if f.func in narrow:
                continue
            return False
        return True

    def as_matrix(self, t: str, row: str, col: str) -> str:
        """An aligned tile over {row, col} as a [row, col] matrix."""
        if self.dims.index(row) < self.dims.index(col):
            return f"tl.reshape({t}, [BLOCK_{row}, BLOCK_{col}])"
        return f"tl.trans(tl.reshape({t}, [BLOCK_{col}, BLOCK_{row}]))"

    def dot_dtype(self, p: sp.Expr, q: sp.Expr) -> str:
        """Operand precision of tl.dot: operands exactly representable in fp16 (fp8 values, as in
        the fp8 GEMM) -> fp16 tensor cores, exact; float16 inputs -> float16; bfloat16 inputs ->
        TF32 (bf16 values are exact in TF32, and probabilities keep 10 mantissa bits instead of
        bf16's 7, which cancelling p.v sums need); float32 and mixed inputs -> IEEE float32."""
        if self.exact_in_fp16(p) and self.exact_in_fp16(q):
            return "tl.float16"
        floats = {self.input_dtypes[i.name] for i in self.spec.inputs if i.kind == "float"}
        if floats == {"float16"}:
            return "tl.float16"
        if floats == {"bfloat16"}:
            return "tf32"
        return "ieee"

    def tile_reduce(self, op: str, value: str, over: str, p: int) -> str:
        if op == "sum":
            return f"tl.sum(tl.where(mask_{over}, {value}, 0.0), axis={p}, keep_dims=True)"
        if op == "max":
            return f'tl.max(tl.where(mask_{over}, {value}, float("-inf")), axis={p}, keep_dims=True)'
        if op == "min":
            return f'tl.min(tl.where(mask_{over}, {value}, float("inf")), axis={p}, keep_dims=True)'
        raise NotImplementedError(f"{op} inside a tile")  # validated earlier: inner reductions are sum/max/min

    # ------------------------------------------------------------ reductions over the loop axis
    def init_state(self, step: Step, parts: int = 1) -> list[str]:
        """Emit the initial (empty) accumulators of an axis reduction; returns their names."""
        var = safe_name(step.name)
        shape = self.shape(step.dims)
        op = self.effective_op(step)
        if op in ORDER_SELECTIONS:  # (values, indices), selected on values (negated for bottom-k/argmin)
            self.emit(f'{var}_acc_values = tl.full({shape}, float("-inf"), tl.float32)')
            self.emit(f"{var}_acc_indices = tl.zeros({shape}, tl.int32)")
            return [f"{var}_acc"]
        fill = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}[op]
        names = [f"{var}_acc" if parts == 1 else f"{var}_acc{j}" for j in range(parts)]
        for n in names:
            self.emit(f"{n} = tl.full({shape}, {fill}, tl.float32)")
        return names

    def effective_op(self, step: Step) -> str:
        form = self.forms.get(step.name)
        if self.plan.strategy in ("streaming_fused", "split_fused") and form is not None and form.effective_op:
            return form.effective_op
        return step.reduce or ""

    def fold(self, step: Step, acc: str, e: sp.Expr) -> None:
        """acc = acc (op) reduce over the tile of e (a tl.dot when e is a contraction that fits one)."""
        a = self.plan.axis
        p = self.pos(a)
        op = self.effective_op(step)
        value = self.tex(e)
        if op == "sum":
            dot = self.try_dot(e, a)
            if dot is not None:
                self.emit(f"{acc} = {acc} + {dot}")
                return
            self.emit(f"{acc} = {acc} + tl.sum(tl.where(mask_{a}, {value}, 0.0), axis={p}, keep_dims=True)")
        elif op == "max":
            self.emit(f'{acc} = tl.maximum({acc}, tl.max(tl.where(mask_{a}, {value}, float("-inf")), axis={p}, keep_dims=True))')
        elif op == "min":
            self.emit(f'{acc} = tl.minimum({acc}, tl.min(tl.where(mask_{a}, {value}, float("inf")), axis={p}, keep_dims=True))')
        elif op in ("argmax", "argmin"):
            sign = "" if op == "argmax" else "-"
            self.emit(
                f"{acc}_values, {acc}_indices = argmax_merge({acc}_values, {acc}_indices, "
                f'tl.where(mask_{a}, {sign}({value}), float("-inf")), offs_{a}, {p})'
            )
        else:  # topk / bottomk: select on the negated values for bottom-k
            sign = "" if op == "topk" else "-"
            slots = step.as_dim
            self.emit(
                f"{acc}_values, {acc}_indices = topk_merge({acc}_values, {acc}_indices, "
                f'tl.where(mask_{a}, {sign}({value}), float("-inf")), offs_{a}, offs_{slots}, '
                f"{p}, {self.pos(slots)}, {step.k})"
            )

    def selected(self, step: Step, acc: str) -> str:
        """The accumulated value of an order reduction, signs undone."""
        op = self.effective_op(step)
        return f"-{acc}_values" if op in ("bottomk", "argmin") else f"{acc}_values"

    def set_result(self, step: Step, value: str, indices: str | None = None) -> None:
        var = safe_name(step.name)
        if step.reduce == "topk":
            self.emit(f"{var}_values = {value}")
            self.emit(f"{var}_indices = {indices}")
            self.values[f"{step.name}.values"] = f"{var}_values"
            self.values[f"{step.name}.indices"] = f"{var}_indices"
        elif step.reduce in ("argmax", "argmin"):
            self.emit(f"{var} = {indices}")
            self.values[step.name] = var
        else:
            if value != var:
                self.emit(f"{var} = {value}")
            self.values[step.name] = var

    # ------------------------------------------------------------ outputs
    def store(self, part: str, value: str) -> None:
        var = safe_name(part)
        dims = self.part_dims(part)
        # a scalar output still needs a block pointer: the value is a (size-1) block
        ptr = f"{var}_ptr + " + " + ".join(f"offs_{d} * stride_{var}_{d}" for d in dims) if dims else f"{var}_ptr + tl.zeros({self.shape(())}, tl.int32)"
        mask = " & ".join(f"mask_{d}" for d in dims)
        if _CONSTANT.fullmatch(value.strip()):  # a constant step: tl.broadcast_to takes tensors only
            value = f"tl.full({self.shape(())}, {value}, tl.float32)"
        full = f"tl.broadcast_to({value}, {self.shape(dims)})"
        line = f"tl.store({ptr}, {store_expr(full, self.store_dtypes[part], var)}"
        self.emit(line + (f", mask={mask})" if mask else ")"))

    def output_value(self, part: str) -> str:
        name = part.split(".")[0]
        step = self.spec.step(name)
        if step.is_reduction and step.over == self.plan.axis:
            return self.values[part]
        e = self.conv.value(name, part.split(".")[1] if "." in part else None)
        self.need([e])
        return self.tex(e)

    def emit_outputs(self) -> None:
        """Row outputs once; outputs that still have the loop axis in a last pass over it."""
        a = self.plan.axis
        row = [p for p in self.output_parts() if a not in self.part_dims(p)]
        along = [p for p in self.output_parts() if a in self.part_dims(p)]
        for part in row:
            self.emit(f"# output {part}")
            self.store(part, self.output_value(part))
        if not along:
            return
        if self.plan.strategy == "row_resident":
            for part in along:
                self.emit(f"# output {part}")
                self.store(part, self.output_value(part))
            return
        self.emit(f"# second pass over {a}: outputs {', '.join(along)} need the final reductions")
        self.emit(f"for start in range(0, size_{a}, BLOCK_{a}):")
        self.depth += 1
        self.begin_scope()
        self.axis_tile("start")
        for part in along:
            self.store(part, self.output_value(part))
        self.depth -= 1
        self.begin_scope()

    def source(self) -> str:
        return "\n".join(self.lines) + "\n"

    # ------------------------------------------------------------ strategies
    def write(self) -> str:
        strategy = self.plan.strategy
        getattr(self, f"write_{strategy}")()
        return self.source()

    def axis_steps(self) -> list[Step]:
        return self.plan.axis_reductions()

    def write_row_resident(self) -> None:
        a = self.plan.axis
        self.header(f"{self.spec.name}, row-resident: the whole {a} axis of a row in one tile; one read, one write.")
        self.axis_tile("0")
        for step in self.axis_steps():
            integrand = self.conv.integrand(step)
            self.need([integrand])
            self.emit(f"# {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}")
            self.direct_reduction(step, integrand)
        self.emit_outputs()

    def direct_reduction(self, step: Step, value: sp.Expr) -> None:
        acc = self.init_state(step)[0]
        self.fold(step, acc, value)
        if step.reduce in ("topk", "argmax", "argmin"):
            self.set_result(step, self.selected(step, acc), f"{acc}_indices")
        else:
            self.set_result(step, acc)

    def write_multi_pass(self) -> None:
        a = self.plan.axis
        self.header(f"{self.spec.name}, multi-pass: one loop over {a} per reduction, re-reading the inputs.")
        for step in self.axis_steps():
            integrand = self.conv.integrand(step)
            self.emit(f"# pass: {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}")
            acc = self.init_state(step)[0]
            self.emit(f"for start in range(0, size_{a}, BLOCK_{a}):")
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            self.need([integrand])
            self.fold(step, acc, integrand)
            self.depth -= 1
            self.begin_scope()
            if step.reduce in ("topk", "argmax", "argmin"):
                self.set_result(step, self.selected(step, acc), f"{acc}_indices")
            else:
                self.set_result(step, acc)
        self.emit_outputs()

    # -- streaming: the derived incremental form
    def anchored_deps(self) -> list[str]:
        """Dependencies some reduction anchors at (max/min: running value; sums: running estimate)."""
        out: list[str] = []
        for step in self.axis_steps():
            for dep in self.forms[step.name].anchors:
                if dep not in out:
                    out.append(dep)
        return out

    def write_streaming_fused(self) -> None:
        a = self.plan.axis
        self.header(
            f"{self.spec.name}, streaming-fused: one pass over {a}; later reductions are kept with running "
            "values of earlier ones and corrected when those move (derived by foldwise)."
        )
        self.streaming_loop("0", f"size_{a}")
        self.finalize()
        self.emit_outputs()

    def streaming_loop(self, lo: str, hi: str) -> None:
        a = self.plan.axis
        steps = self.axis_steps()
        accs = {s.name: self.init_state(s, len(self.forms[s.name].contributions) if self.forms[s.name].kind != "shifted" else 1)
                for s in steps}
        anchors = self.anchored_deps()
        for dep in anchors:
            self.emit(f"{safe_name(dep)}_anchor = tl.zeros({self.shape(self.spec.step(dep).dims)}, tl.float32)")
        self.emit("count = 0.0")
        self.emit(f"for start in range({lo}, {hi}, BLOCK_{a}):")
        self.depth += 1
        self.begin_scope()
        self.axis_tile("start")
        self.emit("count_old = count")
        self.emit(f"count += tl.minimum(BLOCK_{a}, {hi} - start).to(tl.float32)")
        for dep in anchors:
            self.emit(f"{safe_name(dep)}_anchor_old = {safe_name(dep)}_anchor")
            self.values[f"{dep}[old]"] = f"{safe_name(dep)}_anchor_old"
            self.values[f"{dep}[new]"] = f"{safe_name(dep)}_anchor"
        self.values[COUNT_OLD] = "count_old"  # by symbol: a step named `count` has its own count[old]
        for step in steps:
            self.streaming_update(step, accs[step.name])
            if step.name in anchors:
                self.update_anchor(step)
        self.depth -= 1
        self.begin_scope()
        self.accs = accs

    def update_anchor(self, step: Step) -> None:
        var = safe_name(step.name)
        kinds = {self.forms[s.name].anchors.get(step.name) for s in self.axis_steps()} - {None}
        if any(k and k.startswith("running estimate") for k in kinds):
            self.emit(f"{var}_anchor = {var} * size_{self.plan.axis} / tl.maximum(count, 1.0)  # running estimate of {step.name}")
        else:
            self.emit(f"{var}_anchor = safe_anchor({var})  # running {step.reduce} of {step.name}")

    def with_anchors(self, form: ReductionForm) -> dict[str, str]:
        """Values for a tile's contribution: dependencies at their (new) anchors."""
        saved = {}
        for dep in form.anchors:
            saved[dep] = self.values.get(dep)
            self.values[dep] = f"{safe_name(dep)}_anchor"
        return saved

    def restore(self, saved: dict[str, str | None]) -> None:
        for k, v in saved.items():
            if v is None:
                self.values.pop(k, None)
            else:
                self.values[k] = v

    def streaming_update(self, step: Step, accs: list[str]) -> None:
        form = self.forms[step.name]
        a = self.plan.axis
        var = safe_name(step.name)
        if form.kind == "shifted":
            self.emit(f"# {step.name}: shifted accumulator of {sp.sstr(form.integrand)}")
            saved = self.with_anchors(form)
            self.need([form.integrand, form.delta])
            self.emit(f"{accs[0]} = {accs[0]} + ({self.tex(form.delta)})  # move to the new anchors")
            self.fold(step, accs[0], form.integrand)
            self.restore(saved)
            self.emit(f"{var} = {accs[0]}")
            self.values[step.name] = var
            return
        if form.kind == "taylor":
            self.emit(f"# {step.name}: Taylor-shifted accumulators of {sp.sstr(form.integrand)} (centred at the anchors)")
            saved = self.with_anchors(form)
            self.need(list(form.contributions) + list(form.reanchor))
            self.emit_reanchor(form, accs, accs, "old")
            for acc, contribution in zip(accs, form.contributions):
                self.fold(step, acc, contribution)
            self.restore(saved)
            self.running_value(step, accs)
            return
        what = "first reduction" if form.kind == "first" else f"reads {', '.join(form.deps)}"
        self.emit(f"# {step.name}: {step.reduce} over {a} ({what})")
        saved = self.with_anchors(form)
        self.need(list(form.contributions) + list(form.corrections))
        for j, (acc, contribution, correction) in enumerate(zip(accs, form.contributions, form.corrections)):
            if correction != 1:
                c = self.tex(correction)
                if form.effective_op in ORDER_SELECTIONS:
                    self.emit(f"{acc}_values = rescale({acc}_values, {c})")
                else:
                    self.emit(f"{acc} = rescale({acc}, {c})  # correction: {sp.sstr(correction)}")
            self.fold(step, acc, contribution)
        self.restore(saved)
        self.running_value(step, accs)

    def emit_reanchor(self, form: ReductionForm, targets: list[str], sources: list[str], side: str) -> None:
        """targets = the Taylor accumulators `sources` moved from the `side` anchors to the new ones."""
        names = {f"acc[{k}]": src for k, src in enumerate(sources)}
        moved = []
        for k, e in enumerate(form.reanchor):
            self.values.update(names)
            text = self.tex_moved(e, side)
            moved.append(f"{targets[k]}_moved")
            self.emit(f"{targets[k]}_moved = {text}")
        for target, m in zip(targets, moved):
            self.emit(f"{target} = {m}")

    def running_value(self, step: Step, accs: list[str]) -> None:
        """value = sum_j final_factor_j * acc_j + offset, with the dependencies' current values."""
        form = self.forms[step.name]
        var = safe_name(step.name)
        if form.effective_op in ORDER_SELECTIONS:
            return  # order results are never dependencies (derive refuses them)
        self.need(list(form.deferred) + [form.offset])
        syms = [sp.Symbol(f"__acc{j}") for j in range(len(accs))]
        total = form.final_value(syms)
        self.values.update({sym.name: acc for sym, acc in zip(syms, accs)})
        self.emit(f"{var} = {self.tex(total)}")
        self.values[step.name] = var

    def finalize(self) -> None:
        for step in self.axis_steps():
            form = self.forms[step.name]
            acc = self.accs[step.name][0]
            if form.effective_op in ORDER_SELECTIONS:
                self.need([form.deferred[0], form.offset])
                scale, offset = self.tex(form.deferred[0]), self.tex(form.offset)
                value = f"{scale} * {self.selected(step, acc)} + {offset}"
                self.emit(f"# {step.name}: final values from the accumulated {form.effective_op}")
                self.set_result(step, value, f"{acc}_indices")
            elif form.kind == "shifted":
                self.emit(f"{safe_name(step.name)} = {acc}")
                self.values[step.name] = safe_name(step.name)
            else:
                # Triton's compiler scopes names assigned inside a loop to its body: the final
                # value is recomputed here from the loop-carried accumulators
                self.running_value(step, self.accs[step.name])

    # -- split: partial states over chunks of the axis, then a derived combine
    def workspace(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(name, dims, dtype) of every piece of state a split program hands to the combine."""
        out = []
        for step in self.axis_steps():
            form = self.forms[step.name]
            var = safe_name(step.name)
            if form.effective_op in ORDER_SELECTIONS:
                out.append((f"{var}_acc_values", step.dims, "float32"))
                out.append((f"{var}_acc_indices", step.dims, "int32"))
            else:
                n = 1 if form.kind == "shifted" else len(form.contributions)
                out += [((f"{var}_acc" if n == 1 else f"{var}_acc{j}"), step.dims, "float32") for j in range(n)]
        for dep in self.anchored_deps():
            out.append((f"{safe_name(dep)}_anchor", self.spec.step(dep).dims, "float32"))
        return out

    def workspace_args(self) -> list[str]:
        args = []
        for name, dims, _ in self.workspace():
            args.append(f"ws_{name}_ptr")
        for name, dims, _ in self.workspace():
            args += [f"stride_ws_{name}_split"] + [f"stride_ws_{name}_{d}" for d in dims]
        return args + ["SPLIT", "chunk"]

    def ws_ptr(self, name: str, dims: tuple[str, ...], split: str) -> str:
        # a state without dims (a scalar result) still needs a block pointer, as in store()
        return f"ws_{name}_ptr + {split} * stride_ws_{name}_split" + "".join(
            f" + offs_{d} * stride_ws_{name}_{d}" for d in dims
        ) + ("" if dims else f" + tl.zeros({self.shape(())}, tl.int32)")

    def write_split_fused(self) -> None:
        a = self.plan.axis
        # kernel 1: one program per (lanes, chunk of the axis)
        self.header(
            f"{self.spec.name}, split-fused part 1: program (lanes, s) folds chunk s of {a} with the derived "
            "incremental form and writes its partial state."
        )
        self.emit("split = tl.program_id(1)")
        self.emit("lo = split * chunk")
        self.streaming_loop("lo", f"tl.minimum(lo + chunk, size_{a})")
        for name, dims, _ in self.workspace():
            mask = " & ".join(f"mask_{d}" for d in dims)
            self.emit(f"tl.store({self.ws_ptr(name, dims, 'split')}, {name}" + (f", mask={mask})" if mask else ")"))
        self.lines.append("")
        self.lines.append("")
        # kernel 2: merge the parts with the derived merge rule, then the outputs
        first_part = list(self.lines)
        self.lines = []
        self.values = {}
        self.loaded = set()
        self.name = self.name.replace("_kernel", "_combine_kernel")
        self.header(
            f"{self.spec.name}, split-fused part 2: merge the SPLIT partial states (each re-anchored to the "
            "merged dependencies with the derived corrections), then write the outputs."
        )
        self.combine()
        self.finalize()
        self.emit_outputs()
        self.lines = first_part + self.lines

    def combine(self) -> None:
        a = self.plan.axis
        steps = self.axis_steps()
        accs = {s.name: self.init_state(s, 1 if self.forms[s.name].kind == "shifted" else len(self.forms[s.name].contributions))
                for s in steps}
        anchors = self.anchored_deps()
        for dep in anchors:
            self.emit(f"{safe_name(dep)}_anchor = tl.zeros({self.shape(self.spec.step(dep).dims)}, tl.float32)")
        self.emit("count = 0.0")
        self.emit("for split in range(0, SPLIT):")
        self.depth += 1
        self.emit("count_old = count")
        self.emit(f"count_part = (tl.minimum(split * chunk + chunk, size_{a}) - tl.minimum(split * chunk, size_{a})).to(tl.float32)")
        self.emit("count += count_part")
        ws = {name: dims for name, dims, _ in self.workspace()}
        for dep in anchors:
            var = safe_name(dep)
            self.emit(f"{var}_anchor_old = {var}_anchor")
            dims = ws[f"{var}_anchor"]
            mask = " & ".join(f"mask_{d}" for d in dims)
            self.emit(f"{var}_anchor_part = tl.load({self.ws_ptr(f'{var}_anchor', dims, 'split')}" + (f", mask={mask}, other=0.0)" if mask else ")"))
        for step in steps:
            self.merge_part(step, accs[step.name], ws)
            if step.name in anchors:
                self.update_anchor(step)
        self.depth -= 1
        self.accs = accs

    def load_part(self, name: str, dims: tuple[str, ...], other: str = "0") -> str:
        mask = " & ".join(f"mask_{d}" for d in dims)
        self.emit(f"{name}_part = tl.load({self.ws_ptr(name, dims, 'split')}" + (f", mask={mask}, other={other})" if mask else ")"))
        return f"{name}_part"

    def merge_part(self, step: Step, accs: list[str], ws: dict[str, tuple[str, ...]]) -> None:
        form = self.forms[step.name]
        var = safe_name(step.name)
        op = form.effective_op
        self.emit(f"# {step.name}: merge part `split` ({form.kind})")
        if form.kind == "shifted":
            part = self.load_part(accs[0], ws[accs[0]])
            self.need([form.delta])
            merged_move = self.tex_moved(form.delta, "old", "count_old")
            part_move = self.tex_moved(form.delta, "part", "count_part")
            self.emit(f"{accs[0]} = {accs[0]} + ({merged_move}) + {part} + ({part_move})")
            self.emit(f"{var} = {accs[0]}")
            self.values[step.name] = var
            return
        if op in ORDER_SELECTIONS:
            acc = accs[0]
            # the padding slots of a top-k list (BLOCK_as > k) must never win a merge: -inf, not 0
            # (lists are kept largest-first: a bottomk accumulates negated values)
            vals = self.load_part(f"{acc}_values", ws[f"{acc}_values"], other='float("-inf")')
            idx = self.load_part(f"{acc}_indices", ws[f"{acc}_indices"])
            c_m, c_p = self.tex_moved(form.corrections[0], "old"), self.tex_moved(form.corrections[0], "part")
            if form.corrections[0] != 1:
                self.emit(f"{acc}_values = rescale({acc}_values, {c_m})")
                self.emit(f"{vals} = rescale({vals}, {c_p})")
            if op in ("topk", "bottomk"):
                p = self.pos(step.as_dim)
                self.emit(f"{acc}_values, {acc}_indices = topk_merge({acc}_values, {acc}_indices, {vals}, {idx}, offs_{step.as_dim}, {p}, {p}, {step.k})")
            else:
                p = self.pos(self.plan.axis)
                self.emit(f"{acc}_values, {acc}_indices = argmax_merge({acc}_values, {acc}_indices, {vals}, {idx}, {p})")
            return
        if form.kind == "taylor":
            parts = [self.load_part(acc, ws[acc]) for acc in accs]
            self.need(list(form.reanchor))
            self.emit_reanchor(form, accs, accs, "old")
            self.emit_reanchor(form, parts, parts, "part")
            for acc, part in zip(accs, parts):
                self.emit(f"{acc} = {acc} + {part}")
            self.running_value(step, accs)
            return
        combine = {"sum": "{a} + {b}", "max": "tl.maximum({a}, {b})", "min": "tl.minimum({a}, {b})"}[op]
        for acc, correction in zip(accs, form.corrections):
            part = self.load_part(acc, ws[acc])
            if correction != 1:
                self.emit(f"{acc} = rescale({acc}, {self.tex_moved(correction, 'old')})")
                self.emit(f"{part} = rescale({part}, {self.tex_moved(correction, 'part')})")
            self.emit(f"{acc} = {combine.format(a=acc, b=part)}")
        self.running_value(step, accs)

    def tex_moved(self, e: sp.Expr, side: str, count: str = "count_old") -> str:
        """Print a correction with [old] = the merged state's previous anchor or the part's anchor."""
        names = dict(self.values)
        for dep in self.anchored_deps():
            names[f"{dep}[old]"] = f"{safe_name(dep)}_anchor_{side}"
            names[f"{dep}[new]"] = f"{safe_name(dep)}_anchor"
        names[COUNT_OLD] = count
        return to_triton(e, names)
