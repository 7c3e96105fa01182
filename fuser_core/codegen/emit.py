"""Write the Triton source of a module's kernels from its :class:`~fuser_core.codegen.structure.ModuleStructure`.

The structure decides the kernels, their names and arguments, the loads hoisted out of the
loops, which sums are ``tl.dot`` and the split workspace; this module prints them.

The source reads like a hand-written kernel in the style of Triton's tutorials: offsets and
masks per dim, one loop over tiles of the loop axis, a comment naming the reduction each
block computes, and small ``@triton.jit`` helpers (top-k merge, argmax merge, safe anchors)
shared by all kernels of a module. Every value is float32 on the fewest tile dims it needs
(:mod:`fuser_core.codegen.layout`: attention's ``q`` a ``[BLOCK_m, BLOCK_d]`` tile, its running
max a ``[BLOCK_m]`` vector); inputs are loaded and converted on the way in, outputs converted to
their storage dtype on the way out.
"""

from __future__ import annotations

import re

import sympy as sp

from fuser_core.codegen.layout import Layout, is_atom
from fuser_core.codegen.names import FP8, safe_name
from fuser_core.codegen.structure import (
    Dot,
    Kernel,
    ModuleStructure,
    Pass,
    anchored_deps,
    axis_outputs,
    effective_op,
    reads_count,
    state_name,
    tile_dims,
)
from fuser_core.codegen.tritonize import expr_dims, number, to_triton
from fuser_core.realisation import (
    COUNT_OLD,
    Realisation,
    identity,
    new,
    part_acc,
    part_anchor,
    part_count,
)
from fuser_core.spec import Input, Step

HELPERS = '''
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
    """acc * c, a non-finite c taken as 0 (it only multiplies an empty accumulator), and an
    infinite accumulator that a zero correction would turn into NaN kept as it is. The
    correction is guarded on its own (per row: attention's c is [BLOCK_m, 1]), the accumulator
    by one NaN test of the product, the cheapest guard there is per element."""
    t = acc * finite_or_zero(c)
    return tl.where(t != t, acc, t)


@triton.jit
def argmax_merge(best, best_idx, tile, tile_idx, AXIS: tl.constexpr):
    """A tile's (max value, first index) along its AXIS merged into the running (best, best_idx)
    (the tile's shape without AXIS); the earlier index wins ties (an empty state has index
    2147483647, so a tile of -inf still gives its first index). NaN is the extreme, as NumPy's
    argmax/argmin (the reference) have it: the first NaN wins (tl.max alone would skip NaN on the GPU)."""
    nan_t = tile != tile
    has_nan = tl.max(nan_t.to(tl.int32), axis=AXIS) > 0
    m = tl.max(tl.where(nan_t, float("-inf"), tile), axis=AXIS)
    i = tl.min(tl.where(tile == tl.expand_dims(m, AXIS), tile_idx, 2147483647), axis=AXIS)
    m = tl.where(has_nan, float("nan"), m)
    i = tl.where(has_nan, tl.min(tl.where(nan_t, tile_idx, 2147483647), axis=AXIS), i)
    take = (best == best) & (has_nan | (m > best) | ((m == best) & (i < best_idx)))  # empty: index 2147483647
    return tl.where(take, m, best), tl.where(take, i, best_idx)


@triton.jit
def topk_merge(vals, idx, tile, tile_idx, slot, AXIS: tl.constexpr, SLOTS: tl.constexpr, K: tl.constexpr):
    """Merge a tile (along its AXIS) into a running top-K list (along its SLOTS); the tile and the
    list have the same shape besides those dims.

    The list stays sorted descending; among equal values the lower index comes first. An
    empty slot, and an element already taken, has index 2147483647 (a value of -inf is a
    real candidate: a row masked to -inf still yields k distinct indices, as the reference's).
    """
    new_vals = tl.where(slot < 0, vals, float("-inf"))
    new_idx = tl.where(slot < 0, idx, 2147483647)
    for i in tl.static_range(K):
        best_s = tl.max(vals, axis=SLOTS)
        best_t = tl.max(tile, axis=AXIS)
        i_s = tl.min(tl.where(vals == tl.expand_dims(best_s, SLOTS), idx, 2147483647), axis=SLOTS)
        i_t = tl.min(tl.where(tile == tl.expand_dims(best_t, AXIS), tile_idx, 2147483647), axis=AXIS)
        take_t = (best_t > best_s) | ((best_t == best_s) & (i_t < i_s))
        new_vals = tl.where(slot == i, tl.expand_dims(tl.where(take_t, best_t, best_s), SLOTS), new_vals)
        new_idx = tl.where(slot == i, tl.expand_dims(tl.where(take_t, i_t, i_s), SLOTS), new_idx)
        # the winner leaves its list (matching index 2147483647 instead only re-empties empty slots)
        taken_s = idx == tl.expand_dims(tl.where(take_t, 2147483647, i_s), SLOTS)
        vals = tl.where(taken_s, float("-inf"), vals)
        idx = tl.where(taken_s, 2147483647, idx)
        taken_t = tile_idx == tl.expand_dims(tl.where(take_t, i_t, 2147483647), AXIS)
        tile = tl.where(taken_t, float("-inf"), tile)
        tile_idx = tl.where(taken_t, 2147483647, tile_idx)
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


INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRETED:
    # Triton's interpreter truncates float32 -> bfloat16 (1.01171875 -> 1.0078125); round to
    # nearest even on the bits, as the GPU's conversion does.
    @triton.jit
    def bf16_round(x):
        """x rounded to bfloat16 (nearest even; inf and nan kept)."""
        bits = x.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, up.to(tl.float32, bitcast=True))

    @triton.jit
    def bf16_operand(x):
        """x as a bfloat16 tl.dot operand, rounded to nearest even first (exact conversion after)."""
        return bf16_round(x).to(tl.bfloat16)
else:
    @triton.jit
    def bf16_round(x):
        """x rounded to bfloat16 (the GPU's round-to-nearest-even conversion)."""
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def bf16_operand(x):
        """x as a bfloat16 tl.dot operand (the GPU's round-to-nearest-even conversion)."""
        return x.to(tl.bfloat16)


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



def helper_blocks() -> list[tuple[frozenset[str], str]]:
    """HELPERS as blocks (separated by two blank lines), each with the functions it defines."""
    blocks = [b.strip("\n") for b in HELPERS.split("\n\n\n") if b.strip()]
    return [(frozenset(re.findall(r"^\s*def (\w+)\(", b, re.M)), b) for b in blocks]


def helpers_for(code: str) -> str:
    """The HELPERS blocks that ``code`` calls, and those they call in turn, in HELPERS' order."""
    blocks = helper_blocks()
    used: set[int] = set()
    text, grown = code, True
    while grown:
        grown = False
        for i, (names, block) in enumerate(blocks):
            if i not in used and any(re.search(rf"\b{n}\(", text) for n in names):
                used.add(i)
                text += block
                grown = True
    chosen = [block for i, (_, block) in enumerate(blocks) if i in used]
    return "\n" + "\n\n\n".join(chosen) + "\n" if chosen else ""


ORDER_SELECTIONS = ("topk", "bottomk", "argmax", "argmin")
_CONSTANT = re.compile(r'\(*-?(?:[0-9.]+(?:e[+-]?[0-9]+)?|float\("-?(?:inf|nan)"\))\)*')


_OFFSETS = re.compile(r"^\s+((?:offs|mask)_\w+) = ")


def without_unused_offsets(lines: list[str]) -> list[str]:
    """Each kernel's lines without the offsets and masks it never reads (a combine kernel has no
    use for the inner dims' offsets its header sets up for every tile dim)."""
    out: list[str] = []
    kernels = [i for i, line in enumerate(lines) if line == "@triton.jit"] + [len(lines)]
    out += lines[:kernels[0]]
    for start, end in zip(kernels, kernels[1:]):
        body = lines[start:end]
        while True:
            text = "\n".join(body)
            unused = {i for i, line in enumerate(body) if (m := _OFFSETS.match(line))
                      and len(re.findall(rf"\b{m.group(1)}\b", text)) == 1}
            if not unused:
                break
            body = [line for i, line in enumerate(body) if i not in unused]
        out += body
    return out


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


class KernelWriter:
    """Prints the ``@triton.jit`` kernels of a structure (two for split_fused); :meth:`write` gives the text."""

    def __init__(self, structure: ModuleStructure, store_dtypes: dict[str, str], input_dtypes: dict[str, str]):
        plan = structure.plan
        self.structure = structure
        self.kernel: Kernel = structure.kernels[0]
        self.plan = plan
        self.spec = plan.spec
        self.conv = plan.derivation.symbols
        self.forms = plan.derivation.forms
        self.layout = Layout(tile_dims(plan))  # a lane with block 1 is a scalar offset, in no tile
        self.dims = self.layout.dims
        self.var_dims: dict[str, tuple[str, ...]] = {}  # variable -> the tile dims its value lives on
        self.lines: list[str] = []
        self.depth = 1
        self.loaded: set[str] = set()  # inputs / inner reductions already in the current scope
        self.persistent: set[str] = set()  # loads at the kernel's top level (hoisted ones included): never forgotten
        self.filled: dict[str, str] = {}  # input -> the fold op whose identity its masked lanes hold (see identity_loads)
        self.values: dict[str | sp.Symbol, str] = {}  # sympy symbol (or its name) -> Triton expression, current scope
        self.store_dtypes = store_dtypes
        self.input_dtypes = input_dtypes
        self.lanes = False  # printing a per-lane loop: states and anchors are per lane (structure.per_lane)
        self.merged: set[str] = set()  # reductions whose final value the lane merge already printed

    def begin_kernel(self, kernel: Kernel) -> None:
        """Forget what the previous kernel of the module had in scope: its values, loads and lane
        merges (a combine kernel recomputes every final value from its own merged states)."""
        self.kernel = kernel
        self.values = {}
        self.var_dims = {}
        self.loaded = set()
        self.persistent = set()
        self.filled = {}
        self.merged = set()

    # ------------------------------------------------------------ text helpers
    def emit(self, line: str = "") -> None:
        self.lines.append(("    " * self.depth + line) if line else "")

    def shape(self, dims) -> str:
        return self.layout.shape(dims)

    def let(self, var: str, text: str, dims, note: str = "") -> str:
        """Emit ``var = text`` for a value on ``dims``; returns ``var``."""
        self.emit(f"{var} = {text}{note}")
        self.var_dims[var] = self.layout.order(dims)
        return var

    def dims_of(self, text: str) -> tuple[str, ...]:
        """The dims of a value printed without a reduction in it: the union of its variables' dims."""
        return self.layout.dims_of(text, self.var_dims)

    def on(self, text: str, dims, want) -> str:
        """``text``, a value on ``dims``, placed on ``want``."""
        return self.layout.expand(text, dims, want)

    def offs(self, dim: str, want) -> str:
        """The offsets of ``dim`` on a tile over ``want`` (a scalar lane's: its program's index)."""
        return self.on(f"offs_{dim}", self.var_dims.get(f"offs_{dim}", ()), want)

    def mask(self, dims) -> str:
        """The tail mask of a tile over ``dims`` ("" when none: scalar lanes need none)."""
        return " & ".join(self.on(f"mask_{d}", (d,), dims) for d in self.layout.order(dims))

    def pointer(self, base: str, offsets: list[tuple[str, str]], dims) -> str:
        """``base`` plus each (dim, stride) offset, as a tile of pointers over ``dims``."""
        return " + ".join([base, *(f"{self.offs(d, dims)} * {stride}" for d, stride in offsets)])

    def tex(self, e: sp.Expr, names=None) -> str:
        return to_triton(e, self.values if names is None else names, self.layout, self.dims_of)

    def tex_dims(self, e: sp.Expr, names=None) -> tuple[str, ...]:
        return expr_dims(e, self.values if names is None else names, self.layout, self.dims_of)

    def masked(self, dim: str, value: str, dims, other: str) -> tuple[str, tuple[str, ...]]:
        """``tl.where(mask_dim, value, other)`` (a value on ``dims``) on the union of both."""
        both = self.layout.union(dims, (dim,))
        return f"tl.where({self.on(f'mask_{dim}', (dim,), both)}, {self.on(value, dims, both)}, {other})", both

    def reduce(self, op: str, value: str, dims, over: str) -> tuple[str, tuple[str, ...]]:
        """``tl.{op}`` of a value on ``dims`` along ``over``: the value on the other dims."""
        dims = self.layout.order(dims)
        return f"tl.{op}({value}, axis={dims.index(over)})", tuple(d for d in dims if d != over)

    # ------------------------------------------------------------ signature and set-up
    def signature(self) -> list[str]:
        return [a.param for a in self.kernel.args]

    def arg_groups(self) -> list[list[str]]:
        """The parameters, one line per group as hand-written kernels have them: the pointers, the
        sizes, each tensor's strides, the split's numbers, the block sizes."""
        def group(a) -> str:
            if a.constexpr:
                return "constexpr"
            if a.name.endswith("_ptr"):
                return "ptr"
            if a.name.startswith("stride_"):
                return a.name.rsplit("_", 1)[0]
            if a.name.startswith("size_"):
                return "size"
            return "split"
        out: list[list[str]] = []
        last = None
        for a in self.kernel.args:
            key = group(a)
            if key != last:
                out.append([])
                last = key
            out[-1].append(a.param)
        return out

    def output_parts(self) -> list[str]:
        return list(self.spec.output_parts)

    def part_dims(self, part: str) -> tuple[str, ...]:
        return self.spec.step(part.split(".")[0]).dims

    def header(self, doc: str) -> None:
        self.lines.append("@triton.jit")
        self.lines.append(f"def {self.kernel.name}(")
        for group in self.arg_groups():
            self.lines.append("    " + " ".join(f"{a}," for a in group))
        self.lines.append("):")
        self.emit(f'"""{doc}"""')
        lanes = self.plan.lanes
        # a lane in no tile (block 1) has one program per index: its program id is its offset, in
        # range by the grid (no mask)
        pid = {d: f"pid_{d}" if d in self.dims else f"offs_{d}" for d in lanes}
        if len(lanes) == 1:
            self.emit(f"{pid[lanes[0]]} = tl.program_id(0)")
        elif lanes:  # the fastest lane dim last in the grid's order: peel them off, the slowest is what is left
            self.emit("pid = tl.program_id(0)")
            for d in reversed(lanes[1:]):
                self.emit(f"{pid[d]} = pid % tl.cdiv(size_{d}, BLOCK_{d})")
                self.emit(f"pid = pid // tl.cdiv(size_{d}, BLOCK_{d})")
            self.emit(f"{pid[lanes[0]]} = pid")
        for d in self.plan.dims:
            if d == self.plan.axis or d not in self.dims:
                continue
            base = f"pid_{d} * BLOCK_{d} + " if d in lanes else ""
            self.let(f"offs_{d}", f"{base}tl.arange(0, BLOCK_{d})", (d,))
            self.let(f"mask_{d}", f"offs_{d} < size_{d}", (d,))
        for d in self.plan.dims:
            self.values[f"size({d})"] = f"(size_{d} * 1.0)"  # float: sizes enter float arithmetic
            self.values[f"index({d})"] = f"offs_{d}"
        for ld in self.kernel.hoisted:
            self.load(ld.name, "  # loop-invariant: loaded once per program")

    def axis_tile(self, start: str) -> None:
        a = self.plan.axis
        self.let(f"offs_{a}", f"{start} + tl.arange(0, BLOCK_{a})" if start != "0" else f"tl.arange(0, BLOCK_{a})", (a,))
        self.let(f"mask_{a}", f"offs_{a} < size_{a}", (a,))

    # ------------------------------------------------------------ scopes: loads and inner reductions
    def begin_scope(self) -> None:
        for name in self.loaded - self.persistent:
            self.values.pop(name, None)
        self.loaded = set(self.persistent)

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

    def identity_loads(self, folds: list[tuple[str, sp.Expr]]) -> None:
        """Each load masked once: an input that a max/min over the axis folds as it is, is loaded
        with the fold's identity in its masked lanes (``other``), so the fold needs no tl.where.
        Not for an input a tl.dot reads (its masked lanes must be 0 there), nor for index inputs
        and fp8 bits (no infinity); every other use of it masks its lanes itself."""
        for op, e in folds:
            if op not in ("max", "min") or not isinstance(e, sp.Symbol) or e.name in self.values:
                continue
            inp = self.spec.lookup(e.name)
            if not isinstance(inp, Input) or not inp.is_float or self.input_dtypes.get(e.name) == FP8:
                continue
            if self.plan.axis not in inp.dims or any(e in d.p.free_symbols | d.q.free_symbols for d in self.kernel.dots):
                continue
            self.load(e.name, fill=op)

    def load(self, name: str, note: str = "", fill: str | None = None) -> None:
        if name not in self.kernel.inputs:  # its pointer would not be an argument
            raise AssertionError(f"{self.kernel.name} loads {name}, which its structure does not list")
        inp = self.spec.input(name)
        var = safe_name(name)
        ptr = self.pointer(f"{var}_ptr", [(d, f"stride_{var}_{d}") for d in inp.dims], inp.dims)
        mask = self.mask(inp.dims)
        kind = "tl.int32" if inp.is_index else "tl.float32"
        other = number(identity(fill)) if fill else "0"
        args = f"{ptr}, mask={mask}, other={other}" if mask else ptr
        if fill and mask:
            self.filled[name] = fill
        else:
            self.filled.pop(name, None)
        self.let(var, load_expr(args, self.input_dtypes.get(name), kind), inp.dims, note)
        self.values[name] = var
        self.loaded.add(name)
        if self.depth == 1:  # the kernel's top level: in scope for the rest of the kernel
            self.persistent.add(name)

    def inner_reduction(self, step: Step) -> None:
        integrand = self.conv.integrand(step)
        self.need([integrand])
        var = safe_name(step.name)
        self.emit(f"# {step.name}: {step.reduce} over {step.over} of {sp.sstr(integrand)}")
        dot = self.dot_text(self.structure.dot(integrand, step.over)) if step.reduce == "sum" else None
        text, dims = dot or self.tile_reduce(step.reduce, integrand, step.over)
        self.let(var, text, dims, f"  # tl.dot: sum over {step.over} as a matrix product" if dot else "")
        self.values[step.name] = var
        self.loaded.add(step.name)

    def dot_text(self, dot: Dot | None) -> tuple[str, tuple[str, ...]] | None:
        """A tl.dot decided by the structure, printed: P[i, over] @ Q[over, j], then the scale; with
        the dims of its value."""
        if dot is None:
            return None
        i, j, over = dot.i, dot.j, dot.over
        p = self.tex(dot.p)
        if not self.zero_filled(dot.p, over):  # a masked lane of P must add 0 to the product
            p, _ = self.masked(over, p, self.tex_dims(dot.p), "0.0")
        lhs = self.as_matrix(p, self.layout.union(self.tex_dims(dot.p), (over,)), i, over)
        rhs = self.as_matrix(self.tex(dot.q), self.tex_dims(dot.q), over, j)
        if dot.precision == "tl.float16":
            prod = f"tl.dot({lhs}.to(tl.float16), {rhs}.to(tl.float16))"
        elif dot.precision == "tl.bfloat16":  # rounded to nearest even in the interpreter too
            prod = f"tl.dot(bf16_operand({lhs}), bf16_operand({rhs}))"
        else:
            prod = f"tl.dot({lhs}, {rhs}, input_precision=\"{dot.precision}\")"
        if self.layout.order((i, j)) != (i, j):
            prod = f"tl.trans({prod})"
        scale = f" * {self.tex(dot.scale)}" if dot.scale is not None else ""
        return f"{prod}{scale}", self.layout.order((i, j))

    def zero_filled(self, e: sp.Expr, over: str) -> bool:
        """Is ``e`` an input loaded here with 0 in the masked lanes of ``over``?"""
        return (isinstance(e, sp.Symbol) and e.name in self.loaded and e.name not in self.filled
                and isinstance(self.spec.lookup(e.name), Input) and over in self.spec.input(e.name).dims)

    def as_matrix(self, t: str, dims, row: str, col: str) -> str:
        """A value on ``dims`` (some of row, col) as a [BLOCK_row, BLOCK_col] matrix."""
        both = self.layout.order((row, col))
        if self.layout.order(dims) != both:
            t = f"tl.broadcast_to({self.on(t, dims, both)}, {self.shape(both)})"
        return t if both == (row, col) else f"tl.trans({t})"

    def tile_reduce(self, op: str, e: sp.Expr, over: str) -> tuple[str, tuple[str, ...]]:
        """A reduction over the whole tile of ``over`` of ``e``, with the dims of its value."""
        if op not in ("sum", "max", "min"):
            raise NotImplementedError(f"{op} inside a tile")  # validated earlier: inner reductions are sum/max/min
        value, dims = self.masked(over, self.tex(e), self.tex_dims(e), number(identity(op)))
        return self.reduce(op, value, dims, over)

    # ------------------------------------------------------------ reductions over the loop axis
    def init_state(self, step: Step, parts: int = 1) -> list[str]:
        """Emit the initial (empty) accumulators of an axis reduction; returns their names (per lane of
        the axis's tile while printing a per-lane loop)."""
        var = safe_name(step.name)
        dims = self.state_dims(step.dims)
        shape = self.shape(dims)
        op = self.effective_op(step)
        if op in ORDER_SELECTIONS:  # (values, indices), selected on values (negated for bottom-k/argmin)
            self.let(f"{var}_acc_values", f'tl.full({shape}, float("-inf"), tl.float32)', dims)
            self.let(f"{var}_acc_indices", f"tl.full({shape}, 2147483647, tl.int32)", dims, "  # empty: no index yet")
            return [f"{var}_acc"]
        fill = number(identity(op))
        names = [state_name(step, j, parts, self.lanes) for j in range(parts)]
        for n in names:
            self.let(n, f"tl.full({shape}, {fill}, tl.float32)", dims)
        return names

    def effective_op(self, step: Step) -> str:
        return effective_op(self.plan, step)

    def fold(self, step: Step, acc: str, e: sp.Expr, prev: str | None = None) -> None:
        """acc = prev (op) reduce over the tile of e (a tl.dot when e is a contraction that fits one);
        ``prev`` is the accumulator's text before the tile (default: itself, not moved)."""
        op = self.effective_op(step)
        if op in ORDER_SELECTIONS:
            self.select(step, acc, self.tex(e), self.tex_dims(e), prev)
            return
        self.emit_combine(step, op, acc, prev or acc, *self.tile_fold(step, e))

    def tile_fold(self, step: Step, e: sp.Expr) -> tuple[str, tuple[str, ...], str]:
        """A sum/max/min of ``e`` over the axis's tile (a tl.dot when the structure decided one): its
        text, dims and a note for the line."""
        a = self.plan.axis
        op = self.effective_op(step)
        value, dims = self.tex(e), self.tex_dims(e)
        dot = self.dot_text(self.structure.dot(e, a)) if op == "sum" else None
        if dot is not None:
            return *dot, f"  # tl.dot: sum over {a} as a matrix product"
        if isinstance(e, sp.Symbol) and self.filled.get(e.name) == op and e.name in self.values:
            return *self.reduce(op, value, dims, a), ""  # its masked lanes hold the identity (identity_loads)
        return *self.reduce(op, *self.masked(a, value, dims, number(identity(op))), a), ""

    def select(self, step: Step, acc: str, value: str, dims, prev: str | None) -> None:
        """Merge a tile into a running argmax/argmin or top-k/bottom-k (on negated values for the
        smallest): the tile over the state's dims and the axis, as the merge helpers take it."""
        a = self.plan.axis
        op = self.effective_op(step)
        prev = prev or f"{acc}_values"
        sign = op in ("argmin", "bottomk")
        state = self.var_dims[f"{acc}_values"]
        lanes = tuple(d for d in state if d != step.as_dim)  # a top-k list's slots are not the tile's
        tile_dims = self.layout.union(lanes, (a,))
        tile, got = self.masked(a, f"-({value})" if sign else value, dims, 'float("-inf")')
        if got != tile_dims:  # a value that varies over fewer dims than the state: a whole tile of it
            tile = f"tl.broadcast_to({self.on(tile, got, tile_dims)}, {self.shape(tile_dims)})"
        axis = self.layout.axis(tile_dims, a)
        if op in ("argmax", "argmin"):
            merge = f"argmax_merge({prev}, {acc}_indices, {tile}, {self.offs(a, tile_dims)}, {axis})"
        else:
            slots = step.as_dim
            merge = (f"topk_merge({prev}, {acc}_indices, {tile}, {self.offs(a, tile_dims)}, {self.offs(slots, state)}, "
                     f"{axis}, {self.layout.axis(state, slots)}, {step.k})")
        self.emit(f"{acc}_values, {acc}_indices = {merge}")

    def lane_fold(self, step: Step, acc: str, e: sp.Expr, prev: str | None) -> None:
        """acc = prev (op) e, elementwise: each lane of the tile folds its own element into its own state
        (per lane, no reduction across the tile); masked-off lanes fold the identity."""
        a = self.plan.axis
        op = self.effective_op(step)
        value, dims = self.tex(e), self.tex_dims(e)
        if not (isinstance(e, sp.Symbol) and self.filled.get(e.name) == op and e.name in self.values):
            value, dims = self.masked(a, value, dims, number(identity(op)))  # else its load filled the identity
        self.emit_combine(step, op, acc, prev or acc, value, dims)

    def selected(self, step: Step, acc: str) -> str:
        """The accumulated value of an order reduction, signs undone."""
        op = self.effective_op(step)
        return f"-{acc}_values" if op in ("bottomk", "argmin") else f"{acc}_values"

    def set_result(self, step: Step, value: str, indices: str | None = None) -> None:
        """Name a reduction's final value (a variable already: read as it is)."""
        var = safe_name(step.name)
        if step.reduce == "topk":
            self.values[f"{step.name}.values"] = self.named(value, f"{var}_values")
            self.values[f"{step.name}.indices"] = indices
        elif step.reduce in ("argmax", "argmin"):
            self.values[step.name] = indices
        else:
            self.values[step.name] = self.named(value, var)

    def named(self, text: str, name: str) -> str:
        """A variable holding ``text``: itself if it is one, else ``name`` assigned it."""
        return text if re.fullmatch(r"\w+", text) else self.let(name, text, self.dims_of(text))

    # ------------------------------------------------------------ outputs
    def store(self, part: str, value: str) -> None:
        """Store a value to an output part (a whole tile of it where it varies over fewer dims)."""
        var = safe_name(part)
        dims = self.part_dims(part)
        ptr = self.pointer(f"{var}_ptr", [(d, f"stride_{var}_{d}") for d in dims], dims)
        mask = self.mask(dims)
        value = self.whole(value, dims)
        line = f"tl.store({ptr}, {store_expr(value, self.store_dtypes[part], var)}"
        self.emit(line + (f", mask={mask})" if mask else ")"))

    def whole(self, value: str, dims) -> str:
        """A value (printed without a reduction in it) as a whole tile over ``dims``, to be stored."""
        if _CONSTANT.fullmatch(value.strip()):  # a constant step: .to() takes tensors only
            return f"tl.full({self.shape(dims)}, {value}, tl.float32)"
        return self.layout.whole(value, self.dims_of(value), dims)

    def output_value(self, part: str) -> str:
        name = part.split(".")[0]
        step = self.spec.step(name)
        if step.is_reduction and step.over == self.plan.axis:
            return self.values[part]
        e = self.conv.value(name, part.split(".")[1] if "." in part else None)
        self.need([e])
        return self.tex(e)

    def emit_outputs(self) -> None:
        """Row outputs once; outputs that still have the loop axis in a last pass over it (a
        parallel combine kernel: over its program's chunk, row outputs from chunk 0 only)."""
        a = self.plan.axis
        along = axis_outputs(self.plan)
        row = [p for p in self.output_parts() if p not in along]
        chunked = self.kernel.role == "combine" and self.kernel.grid.split
        if chunked and row:  # every program of a lane block has the row outputs: chunk 0's writes them
            values = [(part, self.output_value(part)) for part in row]  # loads stay outside the if
            self.emit("if lo == 0:")
            self.depth += 1
            for part, value in values:
                self.emit(f"# output {part}")
                self.store(part, value)
            self.depth -= 1
        for part in row if not chunked else ():
            self.emit(f"# output {part}")
            self.store(part, self.output_value(part))
        if not along:
            return
        if self.plan.strategy == "row_resident":
            for part in along:
                self.emit(f"# output {part}")
                self.store(part, self.output_value(part))
            return
        if chunked:
            self.emit(f"# second pass, over this program's chunk of {a}: outputs {', '.join(along)} need the final reductions")
            self.emit(f"for start in range(lo, tl.minimum(lo + chunk, size_{a}), BLOCK_{a}):")
        else:
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
        return "\n".join(without_unused_offsets(self.lines)) + "\n"

    # ------------------------------------------------------------ strategies
    def write(self) -> str:
        writers = {"row_resident": self.write_row_resident, "multi_pass": self.write_multi_pass,
                   "streaming_fused": self.write_streaming_fused, "split_fused": self.write_split_fused}
        writers[self.plan.strategy]()
        return self.source()

    def axis_steps(self) -> list[Step]:
        return self.plan.axis_reductions()

    def write_row_resident(self) -> None:
        a = self.plan.axis
        self.header(f"{self.spec.name}, row-resident: the whole {a} axis of a row in one tile; one read, one write.")
        self.axis_tile("0")
        for step in self.axis_steps():
            integrand = self.conv.integrand(step)
            # no identity_loads here: the row stays live through every reduction and output, and with
            # -inf in its masked lanes sm_90 spilled more (safe_softmax n=32768: 560 -> 992 bytes)
            self.need([integrand])
            self.emit(f"# {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}")
            self.direct_reduction(step, integrand)
        self.emit_outputs()

    def direct_reduction(self, step: Step, value: sp.Expr) -> None:
        if self.effective_op(step) not in ORDER_SELECTIONS:  # the whole axis is one tile: its reduction is the value
            text, dims, note = self.tile_fold(step, value)
            self.values[step.name] = self.let(safe_name(step.name), text, dims, note)
            return
        acc = self.init_state(step)[0]
        self.fold(step, acc, value)
        if step.reduce in ("topk", "argmax", "argmin"):
            self.set_result(step, self.selected(step, acc), f"{acc}_indices")
        else:
            self.set_result(step, acc)

    def write_multi_pass(self) -> None:
        a = self.plan.axis
        self.header(f"{self.spec.name}, multi-pass: one loop over {a} per reduction, re-reading the inputs.")
        loops = iter([p for p in self.kernel.passes if p.loop and p.span == "axis"])  # one per reduction, in order
        for step in self.axis_steps():
            integrand = self.conv.integrand(step)
            self.emit(f"# pass: {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}")
            acc = self.init_state(step)[0]
            lo, hi = self.windowed(next(loops), "0", f"size_{a}")
            self.emit(f"for start in range({lo}, {hi}, BLOCK_{a}):")
            self.depth += 1
            self.begin_scope()
            self.axis_tile("start")
            self.identity_loads([(step.reduce or "", integrand)])
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
        return anchored_deps(self.plan)

    def write_streaming_fused(self) -> None:
        a = self.plan.axis
        self.header(
            f"{self.spec.name}, streaming-fused: one pass over {a}; later reductions are kept with running "
            "values of earlier ones and corrected when those move (derived by foldwise)."
        )
        self.streaming_loop("0", f"size_{a}")
        self.finalize()
        self.emit_outputs()

    def streamed_pass(self) -> Pass:
        """The kernel's pass that streams the axis reductions (a whole axis, or a split chunk)."""
        return next(p for p in self.kernel.passes if p.span in ("axis", "chunk"))

    def state_dims(self, dims) -> set[str]:
        """The dims of a running state over ``dims``: per lane, the loop axis's tile besides."""
        return set(dims) | ({self.plan.axis} if self.lanes else set())

    def anchor_var(self, dep: str) -> str:
        """The variable holding a dependency's anchor (per lane in a per-lane loop)."""
        return f"{safe_name(dep)}_lane_anchor" if self.lanes else f"{safe_name(dep)}_anchor"

    def streaming_loop(self, lo: str, hi: str) -> None:
        """The loop over the axis with the realisations' step rule; per tile (each tile reduced into the
        state) or, where the structure decided it (structure.per_lane), per lane (each lane of the tile
        keeps its own state, updated elementwise) with the lanes merged once after the loop."""
        a = self.plan.axis
        steps = self.axis_steps()
        self.lanes = self.streamed_pass().per_lane
        accs = {s.name: self.init_state(s, len(self.realisation(s).accumulators)) for s in steps}
        anchors = self.anchored_deps()
        for dep in anchors:
            dims = self.state_dims(self.spec.step(dep).dims)
            self.let(self.anchor_var(dep), f"tl.zeros({self.shape(dims)}, tl.float32)", dims)
        counts = reads_count(self.plan)
        if counts:
            self.emit("count = 0.0")
        lo, hi = self.windowed(self.streamed_pass(), lo, hi)
        self.emit(f"for start in range({lo}, {hi}, BLOCK_{a}):")
        self.depth += 1
        self.begin_scope()
        self.axis_tile("start")
        if counts:
            self.emit("count_old = count")
            self.emit(f"count += tl.minimum(BLOCK_{a}, {hi} - start).to(tl.float32)")
        for dep in anchors:
            self.let(f"{self.anchor_var(dep)}_old", self.anchor_var(dep), self.var_dims[self.anchor_var(dep)])
            self.values[f"{dep}[old]"] = f"{self.anchor_var(dep)}_old"
            self.values[f"{dep}[new]"] = self.anchor_var(dep)
        self.values[COUNT_OLD] = "count_old"  # by symbol: a step named `count` has its own count[old]
        for step in steps:
            self.streaming_update(step, accs[step.name])
            if step.name in anchors:
                self.update_anchor(step)
        self.depth -= 1
        self.begin_scope()
        self.accs = accs
        if self.lanes:
            self.merge_lanes(accs)

    def windowed(self, p: Pass, lo: str, hi: str) -> tuple[str, str]:
        """A loop's ``lo``/``hi`` clamped to the part of the axis its program can see (the
        structure's :attr:`Pass.window`): the lower end rounded down to a tile boundary."""
        w = p.window
        if w is None:
            return lo, hi
        a = self.plan.axis
        if w.lo is not None:
            start = f"tl.maximum({self.bound_text(w.lo)}, 0) // BLOCK_{a} * BLOCK_{a}"
            lo = start if lo == "0" else f"tl.maximum({lo}, {start})"
            self.emit(f"# masked: this program's lanes see no {a} before {self.bound_text(w.lo)}")
        if w.hi is not None:
            hi = f"tl.minimum({hi}, {self.bound_text(w.hi)})"
            self.emit(f"# masked: this program's lanes see no {a} from {self.bound_text(w.hi)} on")
        return lo, hi

    def bound_text(self, e: sp.Expr) -> str:
        """An integer bound of fuser_core.codegen.bounds (first(d), last(d), size(d), integers);
        ``last(d) + 1`` reads as the end of the program's block of d."""
        ends = {s: sp.Symbol(f"end({s.name[5:-1]})", integer=True) - 1 for s in e.free_symbols if s.name.startswith("last(")}
        return self._bound(sp.expand(e.subs(ends)) if ends else e)

    def _bound(self, e: sp.Expr) -> str:
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            name = e.name
            dim = name[name.index("(") + 1:-1]
            if name.startswith("size("):
                return f"size_{dim}"
            if dim not in self.dims:  # a scalar lane: one index per program (its end: the next one)
                return f"(offs_{dim} + 1)" if name.startswith("end(") else f"offs_{dim}"
            if name.startswith("first("):
                return f"pid_{dim} * BLOCK_{dim}"
            return f"tl.minimum(pid_{dim} * BLOCK_{dim} + BLOCK_{dim}, size_{dim})"  # end(d)
        if isinstance(e, (sp.Min, sp.Max)):
            fn = "tl.minimum" if isinstance(e, sp.Min) else "tl.maximum"
            text = self._bound(e.args[0])
            for arg in e.args[1:]:
                text = f"{fn}({text}, {self._bound(arg)})"
            return text
        if e.is_Mul:
            return " * ".join(self._bound(f) if not f.is_Add else f"({self._bound(f)})" for f in e.args)
        if e.is_Add:
            terms = sorted(e.args, key=lambda t: (t.is_Integer, sp.default_sort_key(t)))  # the constant last
            out = self._bound(terms[0])
            for t in terms[1:]:
                if (t.is_Integer and t < 0) or (t.is_Mul and t.args[0].is_Integer and t.args[0] < 0):
                    out += f" - {self._bound(-t)}"
                else:
                    out += f" + {self._bound(t)}"
            return f"({out})"
        raise AssertionError(f"not a loop bound: {e}")

    def merge_lanes(self, lanes: dict[str, list[str]]) -> None:
        """After a per-lane loop, each reduction's lanes folded over the axis once with the realisation's
        merge rule (each lane a part, [old] = its anchors, [new] = the merged ones): the merged
        accumulators have the names and shapes a per-tile loop leaves, so what follows reads them as
        it would. Masked-off lanes hold the fold's identity, which every move keeps (rescale's guard)."""
        a = self.plan.axis
        anchors = self.anchored_deps()
        lane_anchors = {dep: self.anchor_var(dep) for dep in anchors}
        self.lanes = False
        names: dict = {}
        for dep in anchors:
            sym = self.conv.symbols[dep]
            names[part_anchor(sym, "b")] = lane_anchors[dep]
            names[new(sym)] = self.anchor_var(dep)
        merged: dict[str, list[str]] = {}
        for step in self.axis_steps():
            real = self.realisation(step)
            moved = " re-anchored to the merged " + ", ".join(real.deps) if real.moves else ""
            self.emit(f"# {step.name}: its lanes merged, {real.op} over {a} of each lane's state{moved}")
            accs = merged[step.name] = [state_name(step, j, len(real.accumulators)) for j in range(len(real.accumulators))]
            rules = real.merge()
            self.need([r.right for r in rules])
            env = {**self.values, **names, **{part_acc(j, "b"): lane for j, lane in enumerate(lanes[step.name])}}
            for acc, rule in zip(accs, rules):
                self.let(acc, *self.reduce(rule.op, self.tex(rule.right, env), self.tex_dims(rule.right, env), a))
            if self.read_in_loop(step):  # the merged value, for the merged anchor or a later merge
                self.running_value(step, accs)
                self.merged.add(step.name)
            if step.name in anchors:
                self.update_anchor(step, "merged")
        self.accs = merged

    def update_anchor(self, step: Step, what: str = "running") -> None:
        anchor, value = self.anchor_var(step.name), self.values[step.name]
        kinds = {self.forms[s.name].anchors.get(step.name) for s in self.axis_steps()} - {None}
        if any(k and k.startswith("running estimate") for k in kinds):
            self.let(anchor, f"{value} * size_{self.plan.axis} / tl.maximum(count, 1.0)", self.dims_of(value),
                     f"  # running estimate of {step.name}")
        else:
            self.let(anchor, f"safe_anchor({value})", self.dims_of(value), f"  # {what} {step.reduce} of {step.name}")

    def realisation(self, step: Step) -> Realisation:
        real = self.forms[step.name].realisation
        assert real is not None, f"{step.name} is streamed but not fused"
        return real

    def with_anchors(self, real: Realisation) -> dict[str, str]:
        """Values for a tile's contribution: dependencies at their (new) anchors."""
        saved = {}
        for dep in real.anchors:
            saved[dep] = self.values.get(dep)
            self.values[dep] = self.anchor_var(dep)
        return saved

    def restore(self, saved: dict[str, str | None]) -> None:
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
        self.emit(f"# {step.name}: {real.op} over {self.plan.axis}{per} ({real.kind}{reads})")
        saved = self.with_anchors(real)
        rules = real.step()
        self.identity_loads([(r.op, r.right) for r in rules])
        self.need([r.left for r in rules] + [r.right for r in rules])
        names = dict(zip(real.symbols, self.state_names(real, accs)))
        prevs = self.emit_moves(real, accs, [r.left for r in rules], names)
        for acc, rule, prev in zip(accs, rules, prevs):
            if self.lanes:
                self.lane_fold(step, acc, rule.right, prev)
            else:
                self.fold(step, acc, rule.right, prev)
        self.restore(saved)
        if self.read_in_loop(step):
            self.running_value(step, accs)

    def read_in_loop(self, step: Step) -> bool:
        """Is a reduction's running value read inside its loop: by its anchor, or by a later
        reduction's update or value? (If not, it is computed once, after the loop.)"""
        if step.name in self.anchored_deps():
            return True
        steps = self.axis_steps()
        for later in steps[steps.index(step) + 1:]:
            real = self.realisation(later)
            exprs = [real.value, *(a.moved for a in real.accumulators), *(a.contribution for a in real.accumulators)]
            if any(s.name == step.name for e in exprs for s in e.free_symbols):
                return True
        return False

    def emit_moves(self, real: Realisation, accs: list[str], exprs: list[sp.Expr], names: dict) -> list[str | None]:
        """The text of each moved accumulator (None: unmoved). Where one reads another (a Taylor
        shift), each is first computed into ``{acc}_moved``, so that none reads an updated one."""
        env = {**self.values, **names}
        texts: list[str | None] = [None if e == sym else self.tex(e, env) for e, sym in zip(exprs, real.symbols)]
        if not real.moves_jointly:
            return texts
        for acc, text, sym in zip(accs, texts, real.symbols):
            text = text or env[sym]
            self.let(f"{acc}_moved", text, self.dims_of(text))
        return [f"{acc}_moved" for acc in accs]

    def running_value(self, step: Step, accs: list[str]) -> None:
        """The realisation's value (sum_j final_factor_j * acc_j + offset), dependencies at their current values."""
        real = self.realisation(step)
        var = safe_name(step.name)
        if real.selection:
            return  # order results are never dependencies (derive refuses them)
        if real.value in real.symbols:  # the value is an accumulator: read it, no copy
            self.values[step.name] = accs[real.symbols.index(real.value)]
            return
        self.need([real.value])
        env = {**self.values, **dict(zip(real.symbols, accs))}
        self.let(var, self.tex(real.value, env), self.tex_dims(real.value, env))
        self.values[step.name] = var

    def finalize(self) -> None:
        for step in self.axis_steps():
            real = self.realisation(step)
            acc = self.accs[step.name][0]
            if step.name in self.merged:
                continue  # its lane merge printed its final value
            if real.selection:
                self.need([real.value])
                sel = self.selected(step, acc)
                value = self.tex(real.value, {**self.values, real.symbols[0]: sel if is_atom(sel) else f"({sel})"})
                self.emit(f"# {step.name}: final values from the accumulated {real.op}")
                self.set_result(step, value, f"{acc}_indices")
            else:
                # Triton's compiler scopes names assigned inside a loop to its body: the final
                # value is recomputed here from the loop-carried accumulators
                self.running_value(step, self.accs[step.name])

    # -- split: partial states over chunks of the axis, then a derived combine
    def workspace(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(name, dims, dtype) of every piece of state a split program hands to the combine (the structure's)."""
        return [(w.name, w.dims, w.dtype) for w in self.structure.workspace]

    def ws_ptr(self, name: str, dims: tuple[str, ...], split: str) -> str:
        return self.pointer(f"ws_{name}_ptr + {split} * stride_ws_{name}_split",
                            [(d, f"stride_ws_{name}_{d}") for d in dims], dims)

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
            mask = self.mask(dims)
            value = self.whole(name, dims)
            self.emit(f"tl.store({self.ws_ptr(name, dims, 'split')}, {value}" + (f", mask={mask})" if mask else ")"))
        self.lines.append("")
        self.lines.append("")
        # kernel 2: merge the parts with the derived merge rule, then the outputs
        self.begin_kernel(self.structure.kernels[1])
        if self.kernel.grid.split:
            self.header(
                f"{self.spec.name}, split-fused part 2: program (lanes, s) merges the SPLIT partial states (each "
                "re-anchored to the merged dependencies with the derived corrections), then writes chunk s of the outputs."
            )
            self.emit("lo = tl.program_id(1) * chunk")
        else:
            self.header(
                f"{self.spec.name}, split-fused part 2: merge the SPLIT partial states (each re-anchored to the "
                "merged dependencies with the derived corrections), then write the outputs."
            )
        self.combine()
        self.finalize()
        self.emit_outputs()

    def combine(self) -> None:
        a = self.plan.axis
        steps = self.axis_steps()
        accs = {s.name: self.init_state(s, len(self.realisation(s).accumulators)) for s in steps}
        anchors = self.anchored_deps()
        for dep in anchors:
            dims = self.spec.step(dep).dims
            self.let(f"{safe_name(dep)}_anchor", f"tl.zeros({self.shape(dims)}, tl.float32)", dims)
        counts = reads_count(self.plan)
        if counts:
            self.emit("count = 0.0")
        self.emit("for split in range(0, SPLIT):")
        self.depth += 1
        if counts:
            self.emit("count_old = count")
            self.emit(f"count_part = (tl.minimum(split * chunk + chunk, size_{a}) - tl.minimum(split * chunk, size_{a})).to(tl.float32)")
            self.emit("count += count_part")
        ws = {name: dims for name, dims, _ in self.workspace()}
        for dep in anchors:
            var = safe_name(dep)
            self.let(f"{var}_anchor_old", f"{var}_anchor", self.var_dims[f"{var}_anchor"])
            self.load_part(f"{var}_anchor", ws[f"{var}_anchor"], other="0.0")
        for step in steps:
            self.merge_part(step, accs[step.name], ws)
            if step.name in anchors:
                self.update_anchor(step)
        self.depth -= 1
        self.accs = accs

    def load_part(self, name: str, dims: tuple[str, ...], other: str = "0") -> str:
        mask = self.mask(dims)
        args = f"{self.ws_ptr(name, dims, 'split')}" + (f", mask={mask}, other={other}" if mask else "")
        return self.let(f"{name}_part", f"tl.load({args})", dims)

    def merge_part(self, step: Step, accs: list[str], ws: dict[str, tuple[str, ...]]) -> None:
        """Fold part `split` into the merged state with the realisation's merge rule:
        acc_k = op(moved_k(merged so far), moved_k(part)), both moved to the merged anchors."""
        real = self.realisation(step)
        self.emit(f"# {step.name}: merge part `split` ({real.kind})")
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
        names: dict = {COUNT_OLD: "count_old", part_count("a"): "count_old", part_count("b"): "count_part"}
        for j, (merged, part) in enumerate(zip(self.state_names(real, accs), parts)):
            names[part_acc(j, "a")] = merged
            names[part_acc(j, "b")] = part
        for dep in self.anchored_deps():
            sym = self.conv.symbols[dep]
            names[part_anchor(sym, "a")] = f"{safe_name(dep)}_anchor_old"
            names[part_anchor(sym, "b")] = f"{safe_name(dep)}_anchor_part"
            names[new(sym)] = f"{safe_name(dep)}_anchor"
        env = {**self.values, **names}
        lefts = [self.tex(r.left, env) for r in rules]
        if real.moves_jointly:  # a Taylor shift reads every merged accumulator: none may be updated first
            lefts = [self.let(f"{acc}_moved", text, self.dims_of(text)) for acc, text in zip(accs, lefts)]
        for acc, rule, left in zip(accs, rules, lefts):
            right = self.tex(rule.right, env)
            self.emit_combine(step, rule.op, acc, left, right, self.dims_of(right))
        if self.read_in_loop(step):
            self.running_value(step, accs)

    def emit_combine(self, step: Step, op: str, acc: str, left: str, right: str, right_dims, note: str = "") -> None:
        """acc = op(left, right) for two states of one accumulator (``right`` on ``right_dims``, the
        accumulator's or fewer; a selection: its values, with indices)."""
        if op in ("topk", "bottomk"):
            state = self.var_dims[f"{acc}_values"]
            p = self.layout.axis(state, step.as_dim)
            self.emit(f"{acc}_values, {acc}_indices = topk_merge({left}, {acc}_indices, {right}, {acc}_indices_part, "
                      f"{self.offs(step.as_dim, state)}, {p}, {p}, {step.k})")
        elif op in ("argmax", "argmin"):  # the part's state as a tile of one along a new axis 0
            self.emit(f"{acc}_values, {acc}_indices = argmax_merge({left}, {acc}_indices, tl.expand_dims({right}, 0), "
                      f"tl.expand_dims({acc}_indices_part, 0), 0)")
        else:
            dims = self.var_dims[acc]
            left, right = self.on(left, self.dims_of(left), dims), self.on(right, right_dims, dims)
            self.let(acc, f"{left} + {right}" if op == "sum" else f"tl.{op}imum({left}, {right})", dims, note)
