"""Print sympy expressions as Triton code.

Everything a generated kernel computes -- the user's elementwise steps, reduction
integrands, and the derived pieces (tile contributions, corrections, final factors,
Welford-style deltas) -- is a sympy expression (:mod:`fuser_core.symbolic`), printed here
in one way. Symbols are looked up in ``names`` (symbol name -> Triton expression), so the
caller decides what ``mx`` or ``index(n)`` means in the kernel being written.

Arithmetic is float32: integer symbols (indices, sizes) promote on contact with floats.

Each name's value is a :class:`VarRef`: the variable it reads and the tile dims it lives on. Given a
:class:`~fuser_core.codegen.layout.Layout`, every operation's operands are placed on the union of
their dims (``mx[:, None]``), so each value stays on the fewest dims it needs.

The ``@triton.jit`` helpers an expression's code calls (``rescale``, ``tanh_accurate``, ...) are
known without printing it: :func:`helpers_of` runs the same printer with any names.

Example:
    >>> import sympy as sp
    >>> x, m = sp.symbols("x mx", real=True)
    >>> to_triton(sp.exp(x - m) / sp.Symbol("den"), {"x": VarRef("x"), "mx": VarRef("mx"), "den": VarRef("den")})
    'tl.exp(x - mx) / den'
    >>> to_triton(sp.exp(x - m), {"x": VarRef("x", ("m", "n")), "mx": VarRef("mx", ("m",))}, Layout(("m", "n")))
    'tl.exp(x - mx[:, None])'
    >>> sorted(helpers_of(sp.tanh(x) + sp.log(1 + x)))
    ['log1p_accurate', 'tanh_accurate']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import sympy as sp

from fuser_core.codegen.layout import Layout
from fuser_core.codegen.names import FP8_NATIVE
from fuser_core.dim_symbols import is_dim_symbol
from fuser_core.grouping import Grouping
from fuser_core.realisation import NanToZero, Rescale, ShiftTerm
from fuser_core.symbolic import CAST_FUNCTIONS, InfCompare, NanOf, Round, Unordered
from fuser_core.reduce_ops import reduce_op

_FUNCS = {
    sp.exp: "tl.exp",
    sp.log: "tl.log",
    sp.sin: "tl.sin",
    sp.cos: "tl.cos",
    sp.erf: "tl.erf",
    sp.Abs: "tl.abs",
}
_TRITON_DTYPE = {
    "float8_e4m3fn": "tl.float8e4nv",
    "float16": "tl.float16",
    "bfloat16": "tl.bfloat16",
    "float32": "tl.float32",
}
_REL = {sp.Eq: "==", sp.Ne: "!=", sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">="}
_CAST_DTYPE = {fn: dtype for dtype, fn in CAST_FUNCTIONS.items()}

# precedence for parenthesising
_ADD, _MUL, _UNARY, _ATOM = 1, 2, 3, 4


class UnsupportedExpression(ValueError):
    pass


def number(value: sp.Expr) -> str:
    if value is sp.oo:
        return 'float("inf")'
    if value is -sp.oo:
        return 'float("-inf")'
    if value is sp.nan:
        return 'float("nan")'
    if value.is_Integer:
        return f"{int(value)}.0"
    return repr(float(value))


@dataclass(frozen=True)
class VarRef:
    """What an expression reads for one symbol: the variable ``name`` on the tile ``dims``; ``form``
    ``size``: the size parameter ``name`` as a float (``(size_n * 1.0)``: sizes enter float
    arithmetic); ``neg``: a selection's values, negated (``(-g_acc_values)``: bottom-k and arg-min
    select on negated values)."""

    name: str
    dims: tuple[str, ...] = ()
    form: str = "var"
    finite: bool = False  # never +-inf or NaN (a max/min's safe anchor): a comparison with inf is decided

    @property
    def text(self) -> str:
        if self.form == "size":
            return f"({self.name} * 1.0)"
        if self.form == "neg":
            return f"(-{self.name})"
        return self.name


Names = Mapping[str | sp.Basic, VarRef]


def lookup(names: Names, e: sp.Symbol) -> VarRef:
    """The value of symbol ``e``: an exact symbol key first (two symbols may share a name, as a step
    named ``count`` does with the count of values seen), then its name."""
    if e in names:
        return names[e]
    try:
        return names[e.name]
    except KeyError:
        raise UnsupportedExpression(f"no value for symbol {e.name!r} in this kernel") from None


def to_triton(e: sp.Expr, names: Names, layout: Layout | None = None, grouping: Grouping | None = None,
              exp_base2: bool = False, reciprocals: bool = False, compute: str = "float32") -> str:
    """Triton source for ``e``; every free symbol, or its name, must be a key of ``names``
    (:func:`lookup`). With ``layout``, operands on different dims are placed on their union; the
    result is on :func:`expr_dims`. With ``grouping`` (the spec's, :mod:`fuser_core.grouping`), sums
    keep the user's grouping and order of additions. With ``exp_base2``, ``exp(a + b)`` is
    ``tl.exp2(a * LOG2E + b * LOG2E)`` (the compiler fuses one multiply and the add into an FMA).
    With ``reciprocals`` (and a layout), a divisor on fewer dims than its quotient (a row's sum, a
    constant) is inverted on its own dims and multiplied: ``x * (1.0 / den)[:, None]``, one division
    per row instead of one per element (a float32 division is a dozen instructions), for a value
    rounded to 16 bits next, whose rounding the reciprocal's extra half ulp of float32 moves only at a
    midpoint; 0, inf and NaN divisors give what ``/`` gives. ``compute``: the kernel's float type
    (float64 where an input is: fuser_core.problem.compute_dtype)."""
    return _Printer(names, layout, grouping, exp_base2, reciprocals, compute).go(decide_finite(e, names))[0]


LOG2E = 1.4426950408889634  # log2(e), as float64: the printed constant rounds once, to float32


def decide_finite(e: sp.Expr, names: Names) -> sp.Expr:
    """``e`` with each comparison of a finite value (``VarRef.finite``: ``x``, ``-x`` or ``abs(x)``) with
    +-inf decided: a where() guarding a max against inf costs nothing on the running anchor, which
    safe_anchor keeps finite (``tl.abs(mx_anchor) == inf`` per element, otherwise)."""
    decided = {}
    for c in e.atoms(InfCompare):
        for side in c.args[1:]:
            inner = side.args[0] if isinstance(side, sp.Abs) or (side.is_Mul and side.args[0] == -1 and len(side.args) == 2
                                                                 ) else side
            if isinstance(inner, sp.Symbol) and lookup(names, inner).finite:
                c2 = c.xreplace({inner: sp.Integer(0)})
                if c2 in (sp.true, sp.false):
                    decided[c] = c2
    return e.xreplace(decided) if decided else e


def expr_dims(e: sp.Expr, names: Names, layout: Layout) -> tuple[str, ...]:
    """The dims the value of ``e`` lives on: every operation is elementwise, so the union of its symbols'."""
    return layout.union(*(lookup(names, s).dims for s in e.free_symbols))


def is_literal(e: sp.Expr) -> bool:
    """Does ``e`` print as a number (a Python float or ``float("inf")``, no tensor): a constant step,
    stored through ``tl.full`` since ``.to()`` takes tensors only."""
    if e.is_Symbol:
        return False
    if e.is_Number or e in (sp.oo, -sp.oo, sp.nan):
        text = number(e)
    elif e.args and not e.free_symbols and not isinstance(e, sp.logic.boolalg.Boolean) and _constant_value(e) is not None:
        text = number(sp.Float(_constant_value(e)))
    elif isinstance(e, sp.NumberSymbol):  # pi, E
        text = repr(float(e))
    else:
        return False
    return not text.lstrip("-").startswith(("inf", "nan"))


class _AnyName(dict):
    """Every symbol read as one scalar variable (the helpers a printed expression calls do not depend on names)."""

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> VarRef:
        return VarRef("v")


def helpers_of(e: sp.Expr) -> list[str]:
    """The ``@triton.jit`` helpers (fuser_core/codegen/helpers.py) the code of ``e`` calls, in order."""
    printer = _Printer(_AnyName())
    printer.go(e)
    return list(dict.fromkeys(printer.helpers))


MAX_SQUARED_POWER = 32  # integer powers up to this by squaring; beyond, pow_real (exp2 of n log2 |b|)


def _squarings(b: str, n: int) -> str:
    """``b ** n`` (n >= 1) by repeated squaring: ``(b * b) * (b * b)`` for n = 4, at most 2 log2(n) roundings where
    a chain of products rounds n - 1 times and exp2(n log2 |b|) multiplies log2's error by n log2 |b| (fuzz seed
    73: ``sin(6.5) ** 12`` 2.3x the formula's error). Equal halves are one value to the compiler (CSE)."""
    if n == 1:
        return b
    half = _squarings(b, n // 2)
    square = f"{half} * {half}" if n // 2 == 1 else f"({half}) * ({half})"
    return f"({square}) * {b}" if n % 2 else square


def _sigmoid_arg(e: sp.Expr) -> sp.Expr | None:
    """x when ``e`` is ``1 / (1 + exp(-x))`` (sympy's form of the spec's ``sigmoid(x)``), else None."""
    if not (e.is_Pow and e.exp == -1 and e.base.is_Add and len(e.base.args) == 2):
        return None
    one, other = sorted(e.base.args, key=lambda a: not a.is_Number)
    return -other.args[0] if one == 1 and isinstance(other, sp.exp) else None


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: a literal beyond it is inf in a kernel


class _Printer:
    def __init__(self, names: Names, layout: Layout | None = None, grouping: Grouping | None = None,
                 exp_base2: bool = False, reciprocals: bool = False, compute: str = "float32"):
        self.names = names
        self.real = f"tl.{compute}"  # the kernel's float type: an integer or a cast comes back to it
        self.exp_base2 = exp_base2
        self.reciprocals = reciprocals and layout is not None
        self.layout = layout
        self.grouping = grouping or Grouping()
        self.want: tuple[str, ...] | None = None  # the dims of the operation being printed
        self.helpers: list[str] = []  # the helpers the printed code calls

    def symbol(self, e: sp.Symbol) -> str:
        ref = lookup(self.names, e)
        if ref.form == "size" and self.real != "tl.float32":  # `size * 1.0` is float32: a float64 one, exactly
            return f"({ref.name} * tl.full([], 1.0, {self.real}))"
        return ref.text

    def dims(self, e: sp.Expr) -> tuple[str, ...]:
        if self.layout is None:
            return ()
        return expr_dims(e, self.names, self.layout)

    def call(self, helper: str, args: str) -> tuple[str, int]:
        self.helpers.append(helper)
        return f"{helper}({args})", _ATOM

    def go(self, e: sp.Expr) -> tuple[str, int]:
        """``e`` printed, placed on the dims of the operation it is an operand of."""
        if self.layout is None:
            return self.node(e)
        dims = self.dims(e)
        want, self.want = self.want, dims
        try:
            text, prec = self.node(e)
        finally:
            self.want = want
        if want is not None and dims and dims != want:
            return self.layout.expand(text, dims, want), _ATOM
        return text, prec

    def wrap(self, e: sp.Expr, prec: int) -> str:
        text, p = self.go(e)
        return f"({text})" if p < prec else text

    def arg(self, e: sp.Expr) -> str:
        """A float function's argument: integer values (indices, argmax results, index
        inputs) are int32 tensors in a kernel, and tl.exp & co. take floating point only."""
        text = self.go(e)[0]
        if e.is_integer and not e.is_Number and any(not is_dim_symbol(s, "size") for s in e.free_symbols):
            return f"({text}).to({self.real})"
        return text

    def node(self, e: sp.Expr) -> tuple[str, int]:
        if e.is_Symbol:
            return self.symbol(e), _ATOM
        if e.is_Number or e in (sp.oo, -sp.oo, sp.nan):
            if e.is_negative or e is -sp.oo:
                return number(e), _UNARY
            return number(e), _ATOM
        if e.args and not e.free_symbols and not isinstance(e, sp.logic.boolalg.Boolean):
            # log(1.00001) and the like in float64, as the reference computes them: in float32 a
            # constant comparison with them may decide the other way
            x = _constant_value(e)
            if x is not None:
                return self.go(sp.Float(x))
        if isinstance(e, sp.NumberSymbol):  # pi, E (exp(1) folded by sympy)
            return repr(float(e)), _ATOM
        if e.is_Add:
            return self.add(e), _ADD
        if e.is_Mul:
            return self.mul(e)
        if e.is_Pow:
            return self.pow(e)
        if isinstance(e, sp.Piecewise):
            return self.piecewise(e), _ATOM
        if isinstance(e, sp.Max | sp.Min):  # NaN-propagating, as torch.maximum/minimum and the reference
            fn = reduce_op("max" if isinstance(e, sp.Max) else "min").nan_helper
            self.helpers.append(fn)
            args = [self.go(a)[0] for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = f"{fn}({out}, {a})"
            return out, _ATOM
        if isinstance(e, sp.tanh):
            return self.call("tanh_accurate", self.arg(e.args[0]))
        if isinstance(e, sp.log) and e.args[0].is_Add and e.args[0].as_coeff_Add()[0] == 1:
            # log(1 + a) (the spec's log1p): tl.log(1.0 + a) would lose a small a in float32
            return self.call("log1p_accurate", self.arg(e.args[0] - 1))
        if self.exp_base2 and isinstance(e, sp.exp):
            return self.exp2(e.args[0]), _ATOM
        if e.func in _FUNCS:
            return f"{_FUNCS[e.func]}({self.arg(e.args[0])})", _ATOM
        if e.func in _CAST_DTYPE:
            dtype = _CAST_DTYPE[e.func]
            a = self.arg(e.args[0])
            if not e.args[0].free_symbols:  # a constant: round it here (a Python float has no .to())
                x = _constant_value(e.args[0])
                if x is not None:
                    return self.go(sp.Float(_rounded(x, dtype)))
                a = f"tl.full([], {a}, {self.real})"  # not a real number: round it as a tensor
            elif all(is_dim_symbol(s, "size") for s in e.args[0].free_symbols):
                # sizes only: Triton passes a size of 1 as a constant, so this may be a Python float too
                a = f"tl.full([], {a}, {self.real})"
            if dtype in ("float8_e4m3fn", "bfloat16") and self.real != "tl.float32":  # the helpers round a float32
                a = f"({a}).to(tl.float32)"
            if dtype == "float8_e4m3fn":  # saturating, as the GPU's conversion and our reference
                return self.call("fp8e4m3_round", f"{a}, {FP8_NATIVE}")
            if dtype == "bfloat16":  # nearest even (the interpreter's own conversion truncates)
                return self.call("bf16_round", a)
            return f"({a}).to({_TRITON_DTYPE[dtype]}).to({self.real})", _ATOM
        if e.func == Rescale:  # the generated module's `rescale` helper: the same guard as the certificate's
            return self.call("rescale", f"{self.go(e.args[0])[0]}, {self.go(e.args[1])[0]}")
        if e.func == ShiftTerm:  # a Taylor shift's term: 0 for a zero shift, as the certificate's
            return self.call("shift_term", f"{self.go(e.args[0])[0]}, {self.go(e.args[1])[0]}")
        if e.func == NanToZero:  # a Welford move that is NaN only where an anchor stayed at one infinity
            return self.call("nan_to_zero", self.go(e.args[0])[0])
        if e.func == NanOf:  # v - v as IEEE computes it (NaN for an infinite v), which sympy had cancelled
            return self.call("nan_of", self.go(e.args[0])[0])
        if e.func == Round:
            return self.call("round_half_even", self.arg(e.args[0]))
        if isinstance(e, sp.Rel):
            return f"{self.wrap(e.lhs, _ADD)} {_REL[type(e)]} {self.wrap(e.rhs, _ADD)}", 0
        if isinstance(e, Unordered):  # a NaN on either side (tl.where: a scalar side may be a Python float)
            a, b = (self.wrap(x, _ADD) for x in e.args)
            return f"tl.where({a} != {a}, {a} != {a}, {b} != {b})", _ATOM
        if isinstance(e, InfCompare):
            return f"{self.wrap(e.args[1], _ADD)} {e.op} {self.wrap(e.args[2], _ADD)}", 0
        if isinstance(e, sp.ITE):  # a where() inside a where()'s condition, folded by sympy
            c, a, b = (self.go(x)[0] for x in e.args)
            return f"tl.where({c}, {a}, {b})", _ATOM
        if isinstance(e, sp.And | sp.Or):
            # as tl.where (so is Not): Triton's interpreter cannot `&`, `|` or `~` a scalar condition (on a
            # size) with a block
            *rest, out = (self.go(a)[0] for a in e.args)
            for c in reversed(rest):
                out = f"tl.where({c}, {out}, {c})" if isinstance(e, sp.And) else f"tl.where({c}, {c}, {out})"
            return out, _ATOM
        if isinstance(e, sp.Not):
            return f"tl.where({self.go(e.args[0])[0]}, False, True)", _ATOM
        if e is sp.true or e is sp.false:
            return ("(0.0 == 0.0)" if e is sp.true else "(0.0 != 0.0)"), _ATOM
        raise UnsupportedExpression(f"cannot print {e} for Triton")

    def add(self, e: sp.Expr) -> str:
        """A sum, in the user's grouping where the spec wrote it (:mod:`fuser_core.grouping`): float32
        addition is not associative, and ``(a - ma) - (b - mb)`` keeps digits ``a - b - ma + mb`` loses."""
        split = self.grouping.split(e)
        if split is not None:
            return self.wrap(split.left, _ADD) + self.added(split.sign * split.right, split.right, split.sign)
        parts = self.grouping.arrange(e)
        content, primitive = e.as_content_primitive()
        if content.is_Rational and content > 0 and content != 1 and primitive.is_Add and not any(
                p.grouped for p in parts):
            # a common factor outside: 3 * (t - t_old), not 3 * t - 3 * t_old, which rounds each
            # product first and cancels the difference away (a Taylor shift's 3 delta: 12x the formula's
            # error at offset 1000, fuzz seed 70); and a temperature's 10/7 * (m_old - m), not
            # 10 * m_old / 7 - 10 * m / 7 (a split's merge of a tempered entropy at x + 1000: 10.7x)
            return f"{number(content)} * ({self.go(primitive)[0]})"
        left = Counter(p.expr for p in parts if not p.grouped)
        rest = []
        for t in e.as_ordered_terms() if len(e.args) < 8 else e.args:  # sympy's order for terms in no user sum
            if left[t] > 0:
                left[t] -= 1
                rest.append(t)
        rest.sort(key=lambda t: bool(t.as_coeff_Mul()[0].is_negative))  # `x - mx`, not `-mx + x`
        out = ""
        for p in parts:
            if not p.grouped:
                continue
            c, neg = abs(p.coeff), bool(p.coeff.is_negative)
            inner = self.go(p.expr)[0]
            text = f"{number(c)} * ({inner})" if c != 1 else f"({inner})" if out or neg else inner
            out = out + (" - " if neg else " + ") + text if out else ("-" if neg else "") + text
        for t in rest:
            out = out + self.added(t, t, 1) if out else self.wrap(t, _ADD)
        return out

    def added(self, value: sp.Expr, operand: sp.Expr, sign: int) -> str:
        """`` + operand`` or `` - operand`` for adding ``value`` (= ``sign * operand``) to what is printed:
        a sum operand in parentheses (its own additions first, as written)."""
        if operand.is_Add:
            return f" {'-' if sign < 0 else '+'} ({self.go(operand)[0]})"
        if value.as_coeff_Mul()[0].is_negative:
            return f" - {self.wrap(-value, _MUL)}"
        return f" + {self.wrap(value, _MUL)}"

    def mul(self, e: sp.Expr) -> tuple[str, int]:
        coeff, rest = e.as_coeff_Mul()
        if coeff.is_negative:
            return f"-{self.wrap(-e, _UNARY + 1)}", _UNARY
        num, den = [], []
        for f in sp.Mul.make_args(e):
            if f.is_Pow and f.exp.is_Number and f.exp.is_negative and _sigmoid_arg(f) is None:
                den.append(f.base ** (-f.exp))
            elif f.is_Rational and not f.is_Integer and max(abs(f.p), f.q) > FLOAT32_MAX:
                # p / q as one literal: printed apart, a q past float32's range is inf in the kernel (eps**8 with
                # eps = 1e-5 is 1 / 10**40: x / inf is NaN where x * 1e-40 is the formula's value)
                num.append(sp.Float(float(f)))
            elif f.is_Rational and not f.is_Integer:
                if f.p != 1:
                    num.append(sp.Integer(f.p))
                den.append(sp.Integer(f.q))
            else:
                num.append(f)
        if self.reciprocals and den:
            top, den = self.inverted(e, num, den)
        else:
            top = " * ".join(self.wrap(f, _MUL) for f in num) if num else "1.0"
        if not den:
            return top, _MUL
        if len(den) > 1:
            bottom = "(" + " * ".join(self.wrap(f, _MUL) for f in den) + ")"
        else:  # a lone factor that prints as a product (size(n)**2: `s * s`) needs parentheses too
            bottom = self.wrap(den[0], _MUL + 1)
        return f"{top} / {bottom}", _MUL

    def inverted(self, e: sp.Expr, num: list[sp.Expr], den: list[sp.Expr]) -> tuple[str, list[sp.Expr]]:
        """The product of ``num`` times the reciprocal of the divisors in ``den`` on fewer dims than
        ``e``, inverted once on their own dims with the numbers of ``num`` (``448 * a / amax`` is
        ``a * (448 / amax)[:, None]``: one multiply per element; to_triton's ``reciprocals``), and the
        divisors left to divide by."""
        mine = set(self.dims(e))
        low = [f for f in den if set(self.dims(f)) < mine]
        numbers = [f for f in num if f.is_Number] if low else []
        rest = [f for f in num if f not in numbers]
        top = " * ".join(self.wrap(f, _MUL) for f in rest) if rest else "1.0"
        if not low:
            return top, den
        divisor = sp.Mul(*low)
        own = self.dims(divisor)
        want, self.want = self.want, own
        try:
            inverse = f"({self.wrap(sp.Mul(*numbers), _MUL) if numbers else '1.0'} / {self.wrap(divisor, _MUL + 1)})"
        finally:
            self.want = want
        if own:
            inverse = self.layout.expand(inverse, own, self.want or own)
        return (f"{top} * {inverse}" if rest else inverse), [f for f in den if f not in low]

    def exp2(self, arg: sp.Expr) -> str:
        """exp(arg) as tl.exp2 of each term of ``arg`` times log2(e): ``exp(s - m)`` is
        ``tl.exp2(s * LOG2E - m * LOG2E)``, an FMA per element when m is a row's (the multiply of a
        broadcast row value is one per row). A user's sum inside stays one term, in parentheses
        (:mod:`fuser_core.grouping`); numeric coefficients fold into the constant in float64."""
        if arg.is_integer and not arg.is_Number and any(not is_dim_symbol(s, "size") for s in arg.free_symbols):
            return f"tl.exp2(({self.arg(arg)}) * {LOG2E!r})"  # an integer argument: as a float first
        split = self.grouping.split(arg) if arg.is_Add else None
        if split is not None:
            terms = [(sp.Integer(1), split.left), (sp.Integer(split.sign), split.right)]
        elif arg.is_Add:
            terms = [(p.coeff, p.expr) if p.grouped else p.expr.as_coeff_Mul() for p in self.grouping.arrange(arg)]
        else:
            terms = [arg.as_coeff_Mul()]
        terms.sort(key=lambda t: (bool(t[0].is_negative), t[1] == 1))  # `x - mx`, not `-mx + x`; numbers last
        out = ""
        for coeff, rest in terms:
            c = float(coeff) * LOG2E
            varying, constant = self.program_constants(rest)
            masked = self.scaled_where(rest) if c > 0 else None
            if masked is not None:  # where(c, s * scale, -inf): the scale joins LOG2E inside, an FMA per element
                cond, varying, constant, other = masked
                text = (f"tl.where({self.go(cond)[0]}, {self.wrap(varying, _MUL)} * ({self.wrap(constant, _MUL)} * "
                        f"{number(sp.Float(c))}), {number(other)})")
            elif rest == 1:
                text = number(sp.Float(abs(c)))
            elif constant != 1:  # s * (scale * LOG2E): the product of constants once per program, an FMA per element
                text = f"{self.wrap(varying, _MUL)} * ({self.wrap(constant, _MUL)} * {number(sp.Float(abs(c)))})"
            else:
                operand = f"({self.go(rest)[0]})" if rest.is_Add else self.wrap(rest, _MUL)
                text = f"{operand} * {number(sp.Float(abs(c)))}"
            sign = " - " if c < 0 else " + "
            out = out + sign + text if out else ("-" if c < 0 else "") + text
        return f"tl.exp2({out})"

    def scaled_where(self, e: sp.Expr) -> tuple[sp.Expr, sp.Expr, sp.Expr, sp.Expr] | None:
        """(condition, varying, constant, other) of ``where(condition, varying * constant, other)`` with
        ``other`` +-inf and ``constant`` a positive program constant (:meth:`program_constants`:
        attention's 1 / sqrt(size(d)) on a causal score): its product with a positive c is
        ``where(condition, varying * (constant * c), other)`` (+-inf times a positive c stays itself),
        with one rounding less per element: exp2 is printed only where a 16-bit rounding follows
        (exp_base2). None for any other expression."""
        if not isinstance(e, sp.Piecewise) or len(e.args) != 2 or e.args[1][1] is not sp.true:
            return None
        (branch, cond), (other, _) = e.args
        if other not in (sp.oo, -sp.oo):
            return None
        varying, constant = self.program_constants(branch)
        if constant == 1 or constant.is_positive is not True or constant.is_finite is not True:
            return None
        return cond, varying, constant, other

    def program_constants(self, e: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
        """(the factors of a product ``e`` that vary over the tile, those that do not: sizes, runtime
        scalars, a row's nothing); (e, 1) when either is empty or without a layout."""
        if not e.is_Mul or self.layout is None:
            return e, sp.Integer(1)
        constant = [f for f in e.args if f.free_symbols and not self.dims(f)]
        if not constant or len(constant) == len(e.args):
            return e, sp.Integer(1)
        return sp.Mul(*[f for f in e.args if f not in constant]), sp.Mul(*constant)

    def pow(self, e: sp.Expr) -> tuple[str, int]:
        base, exp = e.base, e.exp
        sigmoid = _sigmoid_arg(e)
        if sigmoid is not None:  # the spec's sigmoid, as sympy holds it: 1 / (1 + exp(-x))
            return self.call("sigmoid_accurate", self.arg(sigmoid))
        if exp == sp.Rational(1, 2):
            return f"tl.sqrt({self.arg(base)})", _ATOM
        if exp == sp.Rational(-1, 2):
            return f"tl.rsqrt({self.arg(base)})", _ATOM
        if exp.is_Integer and 0 < int(exp) <= MAX_SQUARED_POWER:
            return _squarings(self.wrap(base, _ATOM), int(exp)), _MUL
        if exp.is_Integer and -MAX_SQUARED_POWER <= int(exp) < 0:
            return f"1.0 / ({_squarings(self.wrap(base, _ATOM), -int(exp))})", _MUL
        if base == 2:
            return f"tl.exp2({self.arg(exp)})", _ATOM
        if base.is_positive is True:
            return f"tl.exp2(({self.arg(exp)}) * tl.log2({self.arg(base)}))", _ATOM
        if exp.is_Integer:  # any base: |b| ** n, negated for a negative base and odd n
            b = self.arg(base)
            p = self.call("pow_real", f"tl.abs({b}), {self.go(exp)[0]}")[0]
            return (f"tl.where({b} < 0.0, -{p}, {p})" if int(exp) % 2 else p), _ATOM
        return self.call("pow_real", f"{self.arg(base)}, {self.arg(exp)}")

    def piecewise(self, e: sp.Piecewise) -> str:
        *branches, (last, cond) = e.args
        if cond is not sp.true:
            raise UnsupportedExpression(f"Piecewise without a default branch: {e}")
        out = self.go(last)[0]
        for value, cond in reversed(branches):
            out = f"tl.where({self.go(cond)[0]}, {self.go(value)[0]}, {out})"
        return out


def _rounded(x: float, dtype: str) -> float:
    import numpy as np

    from fuser_core.reference import cast_to

    return float(cast_to(np.array(x), dtype))


def _constant_value(e: sp.Expr) -> float | None:
    """The float64 value of a constant expression, evaluated as the reference does (round half
    to even, casts rounding); None when sympy cannot evaluate it to a real number."""
    import numpy as np

    if e.is_Number:
        return float(e)
    args = [_constant_value(a) for a in e.args]
    if not e.args or None in args:
        return None
    if e.func in _CAST_DTYPE:
        return _rounded(args[0], _CAST_DTYPE[e.func])
    if e.func == Round:
        return float(np.round(args[0]))
    try:
        x = complex(e.func(*(sp.Float(a) for a in args)))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return x.real if x.imag == 0 else None
