"""From our AST to sympy, for one cascade axis.

A reduction's integrand is converted with every elementwise step substituted (inlined),
so that what remains are *leaves*:

- streamed leaves: values that vary along the cascade axis (inputs with that dim,
  ``index(axis)``, results of reductions over other axes that keep the axis, like
  attention's ``s = q.k``) -- the ``x`` of THEORY.md;
- dependency symbols: results of earlier reductions over the same axis -- the ``D``;
- neutral leaves: constant along the axis (other inputs, ``size(d)``, ``index(other)``).

Symbols carry sympy assumptions (real, integer, positive) so that sympy can decide signs:
a ``sum`` of something positive is positive, and so on. Casts become opaque functions
(``cast_float8_e4m3fn(...)``): :func:`strip_casts` removes them to reason in real
arithmetic, while the certificate evaluates them for real.

Example:
    >>> from fuser_core.spec import load_spec
    >>> spec = load_spec({"foldwise": 1, "name": "sm", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...               {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
    ...     "outputs": ["den"]})
    >>> conv = SymbolicSpec(spec)
    >>> conv.integrand(spec.step("den"))
    exp(-mx + x)
"""

from __future__ import annotations

from functools import cached_property

import sympy as sp

from fuser_core import expr as ex
from fuser_core.spec import Param, Spec, Step

CAST_FUNCTIONS: dict[str, type[sp.Function]] = {
    dtype: sp.Function(f"cast_{dtype}", real=True) for dtype in ex.CAST_DTYPES  # type: ignore[misc]
}
Round = sp.Function("round", real=True)

_UNARY = {
    "exp": sp.exp,
    "exp2": lambda a: sp.Integer(2) ** a,
    "log": sp.log,
    "log2": lambda a: sp.log(a) / sp.log(2),
    "log1p": lambda a: sp.log(1 + a),
    "sqrt": sp.sqrt,
    "rsqrt": lambda a: 1 / sp.sqrt(a),
    "abs": sp.Abs,
    "tanh": sp.tanh,
    "sigmoid": lambda a: 1 / (1 + sp.exp(-a)),
    "erf": sp.erf,
    "sin": sp.sin,
    "cos": sp.cos,
    "round": Round,
}
_COMPARE = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "==": sp.Eq, "!=": sp.Ne}


def number(value: float) -> sp.Expr:
    """Exact sympy number for a spec literal (1e-5 becomes 1/100000, inf becomes oo)."""
    if value == float("inf"):
        return sp.oo
    if value == float("-inf"):
        return -sp.oo
    if value.is_integer():
        return sp.Integer(int(value))
    return sp.Rational(repr(value))


def size_symbol(dim: str) -> sp.Symbol:
    return sp.Symbol(f"size({dim})", integer=True, positive=True)


def index_symbol(dim: str) -> sp.Symbol:
    return sp.Symbol(f"index({dim})", integer=True, nonnegative=True)


def strip_casts(e: sp.Expr) -> sp.Expr:
    """The expression in real arithmetic: every cast replaced by its argument."""
    casts = {f for f in e.atoms(sp.Function) if f.func in CAST_FUNCTIONS.values()}
    while casts:
        e = e.xreplace({c: c.args[0] for c in casts})
        casts = {f for f in e.atoms(sp.Function) if f.func in CAST_FUNCTIONS.values()}
    return e


def has_cast(e: sp.Expr) -> bool:
    return any(f.func in CAST_FUNCTIONS.values() for f in e.atoms(sp.Function))


class SymbolicSpec:
    """sympy views of a spec's steps: every elementwise step inlined, reductions as symbols."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self._value: dict[str, sp.Expr] = {}
        self.symbols: dict[str, sp.Symbol] = {}
        self.leaf_dims: dict[sp.Symbol, tuple[str, ...]] = {}  # the named dims each leaf varies over
        self.leaf_step: dict[sp.Symbol, Step] = {}  # leaves that stand for reduction results

    # -- leaves
    def leaf(
        self, name: str, dims: tuple[str, ...], *, integer: bool = False, positive: bool | None = None
    ) -> sp.Symbol:
        sym = self.symbols.get(name)
        if sym is None:
            kwargs: dict[str, bool] = {"integer": True} if integer else {"real": True}
            if positive:
                kwargs["positive"] = True
            elif positive is False:
                kwargs["nonnegative"] = True
            sym = sp.Symbol(name, **kwargs)
            self.symbols[name] = sym
            self.leaf_dims[sym] = dims
        return sym

    @cached_property
    def params(self) -> dict[str, sp.Expr]:
        out: dict[str, sp.Expr] = {}
        for p in self.spec.params:
            out[p.name] = self.convert(p.expr)
        return out

    # -- steps
    def value(self, name: str, part: str | None = None) -> sp.Expr:
        """The sympy value of a name: inlined for elementwise steps, a symbol for reductions."""
        key = f"{name}.{part}" if part else name
        if key in self._value:
            return self._value[key]
        obj = self.spec.lookup(name)
        if isinstance(obj, Param):
            out = self.params[name]
        elif isinstance(obj, Step) and not obj.is_reduction:
            out = self.convert(obj.expr)
        elif isinstance(obj, Step):
            integer = obj.is_integer or part == "indices"
            sign = None if integer else self.sign_of(obj)
            out = self.leaf(key, obj.dims, integer=integer, positive=sign)
            self.leaf_step[out] = obj
        else:
            assert obj is not None
            out = self.leaf(name, obj.dims, integer=obj.kind == "index")
        self._value[key] = out
        return out

    def sign_of(self, step: Step) -> bool | None:
        """True: provably positive; False: provably non-negative; None: unknown."""
        integrand = strip_casts(self.integrand(step))
        if integrand.is_positive:
            return True
        if integrand.is_nonnegative:
            return False
        return None

    def integrand(self, step: Step) -> sp.Expr:
        """The expression a reduction reduces, with elementwise steps inlined."""
        return self.convert(step.expr)

    def convert(self, e: ex.Expr) -> sp.Expr:
        if isinstance(e, ex.Num):
            return number(e.value)
        if isinstance(e, ex.Ref):
            return self.value(e.name, e.part)
        if isinstance(e, ex.Size):
            sym = size_symbol(e.dim)
            self.leaf_dims[sym] = ()
            return sym
        if isinstance(e, ex.Index):
            sym = index_symbol(e.dim)
            self.leaf_dims[sym] = (e.dim,)
            return sym
        if isinstance(e, ex.Neg):
            return -self.convert(e.operand)
        if isinstance(e, ex.BinOp):
            a, b = self.convert(e.left), self.convert(e.right)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            if e.op == "/":
                return a / b
            return a**b
        if isinstance(e, ex.Compare):
            return _COMPARE[e.op](self.convert(e.left), self.convert(e.right))
        if isinstance(e, ex.Cast):
            return CAST_FUNCTIONS[e.dtype](self.convert(e.operand))
        if isinstance(e, ex.Call):
            args = [self.convert(a) for a in e.args]
            if e.func in _UNARY:
                return _UNARY[e.func](args[0])
            if e.func == "maximum":
                return sp.Max(*args)
            if e.func == "minimum":
                return sp.Min(*args)
            if e.func == "clamp":
                return sp.Min(sp.Max(args[0], args[1]), args[2])
            if e.func == "where":
                return sp.Piecewise((args[1], args[0]), (args[2], True))
        raise TypeError(f"cannot convert {e!r}")
