"""From our AST to sympy, for one cascade axis.

A reduction's integrand is converted with every elementwise step substituted (inlined),
so that what remains are *leaves*:

- streamed leaves: values that vary along the cascade axis (inputs with that dim,
  ``index(axis)``, results of reductions over other axes that keep the axis, like
  attention's ``s = q.k``) -- the ``x`` of docs/THEORY.md;
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

import math
import time
from fractions import Fraction
from functools import cached_property

import sympy as sp

from fuser_core import expr as ex
from fuser_core.dim_symbols import dim_symbol, is_dim_symbol
from fuser_core.errors import DerivationLimitError, SpecError
from fuser_core.grouping import Grouping
from fuser_core.spec import Param, Spec, Step

# Limits that keep sympy's own work bounded (each stops a derivation with DerivationLimitError,
# or, for numbers, does what float64 arithmetic -- the reference's -- does):
MAX_EXACT_POWER = 64  # number ** p with |p| above this is evaluated in float64, never as an exact integer
MAX_NUMBER_BITS = 1100  # an exact rational beyond float64's range (or this many bits) becomes a float
MAX_SYMBOLIC_NODES = 50_000  # a step's sympy tree (nodes counted with repetition)
MAX_WHERE_IN_CONDITION = 3  # where() values inside one where() condition: sympy unfolds them exponentially
MAX_FOLDED_CONDITION = 100  # nodes of a where() condition that reads a where() value (folding takes ~1 s at this size)
MAX_FOLDED_NODES = 1000  # arguments of one maximum/minimum/clamp/where: sympy compares them pairwise

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
COMPARE_OPS = tuple(_COMPARE)  # InfCompare's first argument indexes this
_REL_OP = {cls: op for op, cls in _COMPARE.items()}  # a sympy relation's class -> its op


class NanOf(sp.Function):
    """``nan_of(v)``: 0 for a finite v, NaN for an infinite or NaN v (IEEE's v - v). sympy applies
    algebraic identities IEEE arithmetic does not (v - v = 0, x * 0 = 0, (a + b) - b = a): where
    converting an operation drops a symbol one of its operands read, :meth:`SymbolicSpec.convert`
    adds ``nan_of`` of that symbol, so an infinite or NaN value still gives the NaN the formula as
    written gives. Printed in kernels as the helper ``nan_of`` (v - v), in the certificate's NumPy as v - v."""

    nargs = 1

    @classmethod
    def eval(cls, v):  # noqa: ANN001, ANN206 (sympy's protocol)
        if v.is_number and v.is_finite:
            return sp.Integer(0)
        return None


NanOf.__name__ = "nan_of"  # its name in printers and lambdify's namespace


def _cancelled(total: sp.Expr, *operands: sp.Expr) -> sp.Expr:
    """``total`` plus ``nan_of(o)`` for each operand ``o`` that read a symbol sympy's simplification of
    the operation dropped (a size is finite and an index too: those are not kept). Of the operand, not
    the symbol: ``s - s`` with ``s = clamp(where(x > 0, 2, 0), -1, 1)`` is 0 for an infinite x too,
    as s is finite; ``x - x`` is NaN there. Of the lost symbols' part of it: an operand's other symbols are
    taken at a finite value, as their infinities do not cancel."""
    lost = set().union(*(o.free_symbols for o in operands)) - total.free_symbols
    lost = {s for s in lost if not is_dim_symbol(s, "size", "index")}
    if not lost:
        return total
    # each operand's part that reads the lost symbols: its other symbols at a generic finite value (3/7), so that
    # an infinite kept symbol gives no NaN (``(-v) + (v - q)`` at q = -inf is inf, not NaN; fuzz seed 73)
    generic = sp.Rational(3, 7)
    kept = dict.fromkeys(o.xreplace({s: generic for s in o.free_symbols - lost}) for o in operands
                         if o.free_symbols & lost)
    return total + sp.Add(*(NanOf(o) for o in sorted(kept, key=sp.default_sort_key)))


class InfCompare(sp.logic.boolalg.BooleanFunction):
    """``lhs op rhs`` where a side is +-inf, kept as written: ``InfCompare(k, lhs, rhs)``, ``op`` =
    ``COMPARE_OPS[k]``. sympy takes every symbol here as a finite real, so it folds
    ``abs(mx) == inf`` to False and ``x > -inf`` to True; a where() guarding a reduction that is
    infinite on a row (an all -inf row's max) was then dropped, and that row gave NaN where the
    reference and torch give -inf. The comparison is evaluated only between numbers."""

    nargs = 3

    @classmethod
    def eval(cls, k, lhs, rhs):  # noqa: ANN001, ANN206 (sympy's protocol)
        if not lhs.free_symbols and not rhs.free_symbols:
            return _COMPARE[COMPARE_OPS[int(k)]](lhs, rhs)
        return None

    @property
    def op(self) -> str:
        return COMPARE_OPS[int(self.args[0])]

    # printers: sympy's code printers would rewrite a BooleanFunction through to_nnf (as if its
    # arguments were booleans); lambdify calls the namespace's InfCompare (fuser_core.certificate)
    def _numpycode(self, printer) -> str:  # noqa: ANN001
        k, lhs, rhs = self.args
        return f"InfCompare({int(k)}, {printer._print(lhs)}, {printer._print(rhs)})"

    _lambdacode = _pythoncode = _numpycode

    def _sympystr(self, printer) -> str:  # noqa: ANN001
        return f"({printer._print(self.args[1])} {self.op} {printer._print(self.args[2])})"

    def _latex(self, printer) -> str:  # noqa: ANN001
        rel = {"<": "<", "<=": r"\le", ">": ">", ">=": r"\ge", "==": "=", "!=": r"\ne"}[self.op]
        return f"{printer._print(self.args[1])} {rel} {printer._print(self.args[2])}"


class Unordered(sp.logic.boolalg.BooleanFunction):
    """``unordered(a, b)``: a or b is NaN (IEEE's unordered comparison). sympy negates ``not (a < b)`` to
    ``a >= b``, which a NaN makes False where the spec's ``not`` gives True; :func:`negate` writes it
    ``a >= b or unordered(a, b)``. Evaluated only between numbers (sympy's numbers are never NaN here)."""

    nargs = 2

    @classmethod
    def eval(cls, a, b):  # noqa: ANN001, ANN206 (sympy's protocol)
        if not a.free_symbols and not b.free_symbols:
            return sp.true if (a is sp.nan or b is sp.nan) else sp.false
        return None

    def _numpycode(self, printer) -> str:  # noqa: ANN001
        a, b = (printer._print(x) for x in self.args)
        return f"Unordered({a}, {b})"

    _lambdacode = _pythoncode = _numpycode

    def _sympystr(self, printer) -> str:  # noqa: ANN001
        return f"unordered({printer._print(self.args[0])}, {printer._print(self.args[1])})"

    def _eval_as_set(self):  # noqa: ANN202 (sympy's protocol: Piecewise folds conditions as sets where it can)
        raise NotImplementedError("unordered(a, b) is no set of real numbers")

    def _latex(self, printer) -> str:  # noqa: ANN001
        return rf"\operatorname{{isnan}}({printer._print(self.args[0])}) \lor \operatorname{{isnan}}({printer._print(self.args[1])})"


_NEGATED = {sp.Lt: sp.Ge, sp.Le: sp.Gt, sp.Gt: sp.Le, sp.Ge: sp.Lt}


def negate(c: sp.Basic) -> sp.Basic:
    """``not c`` as IEEE evaluates it: an ordered comparison negated is the opposite comparison or an
    unordered pair (``not (x < 1)`` is ``x >= 1 or isnan(x)``), pushed through and/or by De Morgan;
    sympy's own ``Not`` drops the NaN case."""
    if type(c) in _NEGATED:
        return sp.Or(_NEGATED[type(c)](c.lhs, c.rhs), Unordered(c.lhs, c.rhs))
    if isinstance(c, sp.And):
        return sp.Or(*(negate(a) for a in c.args))
    if isinstance(c, sp.Or):
        return sp.And(*(negate(a) for a in c.args))
    return sp.Not(c)  # ==, != (their negations agree with IEEE), InfCompare, Unordered, true/false


def compare(op: str, lhs: sp.Expr, rhs: sp.Expr) -> sp.Basic:
    """The sympy form of ``lhs op rhs``: :class:`InfCompare` when a side holds +-inf, or when sympy
    decides it from its assumptions about values that may be infinite or NaN. sympy takes every symbol
    for a finite real, so ``0 != log2(sigmoid(w) + 1)`` is True to it, and ``exp(x) > 0`` too, while
    at w = -inf the first is false (CI fuzz: a where() then took the wrong branch). Sizes and indices
    are finite integers: comparisons of those are decided. A where() on a side is folded here, each
    branch compared on its own (``where(c, a, 0) != b`` is ``(c and a != b) or (not c and 0 != b)``),
    so that no later fold of it meets sympy's assumptions."""
    k = sp.Integer(COMPARE_OPS.index(op))
    for side, other, first in ((lhs, rhs, True), (rhs, lhs, False)):
        if isinstance(side, sp.Piecewise) and side.args[-1][1] == sp.true:
            out, rest = [], sp.true
            for value, cond in side.args:
                here = compare(op, value, other) if first else compare(op, other, value)
                out.append(sp.And(rest, cond, here))
                rest = sp.And(rest, negate(cond))
            return sp.Or(*out)
    if any(side.has(sp.oo, -sp.oo) for side in (lhs, rhs)):
        return InfCompare(k, lhs, rhs)
    decided = _COMPARE[op](lhs, rhs)
    floats = {s for s in (lhs.free_symbols | rhs.free_symbols) if not is_dim_symbol(s, "size", "index")}
    if decided in (sp.true, sp.false) and floats:
        return InfCompare(k, lhs, rhs)
    return decided


def logic(op: str, args: list[sp.Basic]) -> sp.Basic:
    """``and``/``or`` of conditions. sympy folds ``a <= b or a > b`` to True (complements, for finite reals);
    with a NaN both are false, and so is the formula's ``or`` (fuzz seed 72: a where() on two such
    comparisons of a NaN took the other branch in every kernel). Where sympy decides an ``or`` that way, its
    comparisons of values are kept as written (:class:`InfCompare`), so that nothing folds them."""
    combine = sp.And if op == "and" else sp.Or
    out = combine(*args)
    if out in (sp.true, sp.false) and all(a not in (sp.true, sp.false) for a in args):
        def kept(a: sp.Basic) -> sp.Basic:
            if isinstance(a, sp.Rel) and any(not is_dim_symbol(s, "size", "index") for s in a.free_symbols):
                return InfCompare(sp.Integer(COMPARE_OPS.index(_REL_OP[type(a)])), a.lhs, a.rhs)
            return a
        out = combine(*(kept(a) for a in args))
    return out


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
    return dim_symbol("size", dim)


def axis_size(spec: Spec, axis: str) -> sp.Expr:
    """The number of elements a reduction over ``axis`` sees: size(axis), or for a merged dim the
    product of its parts' sizes, as the user writes it (mean = sum x / (size(c) * size(p)))."""
    return sp.Mul(*(size_symbol(d) for d in spec.merges.get(axis, (axis,))))


def index_symbol(dim: str) -> sp.Symbol:
    return dim_symbol("index", dim)


class IndexData(sp.Symbol):
    """An index input (``kind: "index"``: labels, lengths, starts): integer data, not a value. A
    where() on it and on indices masks elements as one on indices alone does (fuser_core.masks:
    a padding mask ``index(n) >= kv_start`` drops the pad slots, whatever they hold)."""


def strip_casts(e: sp.Expr) -> sp.Expr:
    """The expression in real arithmetic: every cast replaced by its argument."""
    casts = {f for f in e.atoms(sp.Function) if f.func in CAST_FUNCTIONS.values()}
    while casts:
        e = e.xreplace({c: c.args[0] for c in casts})
        casts = {f for f in e.atoms(sp.Function) if f.func in CAST_FUNCTIONS.values()}
    return e


def has_cast(e: sp.Expr) -> bool:
    return any(f.func in CAST_FUNCTIONS.values() for f in e.atoms(sp.Function))


def cast_decides(e: sp.Expr) -> bool:
    """Does a cast feed a discrete decision (a comparison, ``round``)? Then stripping it, as the
    fused realisations do, may flip the decision rather than move a value by a rounding."""
    return any(has_cast(node) for node in e.atoms(sp.Rel, Round))


class Deadline:
    """A wall-clock budget for a derivation, checked between sympy operations.

    Safe in any thread (no signals, nothing killed): work stops at the next check after the
    budget is spent, with :class:`~fuser_core.errors.DerivationLimitError`. The size limits
    above keep each single sympy operation between two checks short.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def check(self, where: str) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise DerivationLimitError(
                f"the derivation took longer than its time limit of {self.seconds:g} s (stopped at {where})"
            )


class SymbolicSpec:
    """sympy views of a spec's steps: every elementwise step inlined, reductions as symbols."""

    def __init__(self, spec: Spec, *, deadline: Deadline | None = None):
        self.deadline = deadline or Deadline(None)
        self.where = "the params"  # the step being converted, for limit errors
        self._sizes: dict[sp.Expr, int] = {}
        self.spec = spec
        self._value: dict[str, sp.Expr] = {}
        self.symbols: dict[str, sp.Symbol] = {}
        self.leaf_dims: dict[sp.Symbol, tuple[str, ...]] = {}  # the named dims each leaf varies over
        self.leaf_step: dict[sp.Symbol, Step] = {}  # leaves that stand for reduction results
        self.grouping = Grouping()  # the user's sums, for printers that keep them (fuser_core.grouping)

    # -- leaves
    def leaf(
        self, name: str, dims: tuple[str, ...], *, integer: bool = False, positive: bool | None = None,
        index_data: bool = False,
    ) -> sp.Symbol:
        sym = self.symbols.get(name)
        if sym is None:
            kwargs: dict[str, bool] = {"integer": True} if integer else {"real": True}
            if positive:
                kwargs["positive"] = True
            elif positive is False:
                kwargs["nonnegative"] = True
            sym = (IndexData if index_data else sp.Symbol)(name, **kwargs)
            self.symbols[name] = sym
            self.leaf_dims[sym] = dims
        return sym

    @cached_property
    def params(self) -> dict[str, sp.Expr]:
        out: dict[str, sp.Expr] = {}
        for p in self.spec.params:
            if p.runtime:  # a symbol of its own (value()), never its default: a kernel argument
                continue
            try:
                out[p.name] = self.convert(p.expr)
            except _Undefined as err:
                raise SpecError(str(err), loc=("params", p.name)) from None
        return out

    # -- steps
    def value(self, name: str, part: str | None = None) -> sp.Expr:
        """The sympy value of a name: inlined for elementwise steps, a symbol for reductions."""
        key = f"{name}.{part}" if part else name
        if key in self._value:
            return self._value[key]
        obj = self.spec.lookup(name)
        if isinstance(obj, Param) and obj.runtime:
            # a real scalar known only at call time, like an input over no dims; declared positive (eps,
            # a scale), sqrt/rsqrt/division by it stay derivable
            out = self.leaf(name, (), positive=True if obj.positive else None)
        elif isinstance(obj, Param):
            out = self.params[name]
        elif isinstance(obj, Step) and not obj.is_reduction:
            out = self.convert_step(obj)
        elif isinstance(obj, Step):
            integer = obj.is_integer or part == "indices"
            sign = None if integer else self.sign_of(obj)
            out = self.leaf(key, obj.dims, integer=integer, positive=sign)
            self.leaf_step[out] = obj
        else:
            assert obj is not None
            out = self.leaf(name, obj.dims, integer=obj.is_index, index_data=obj.is_index)
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
        return self.convert_step(step)

    def convert_step(self, step: Step) -> sp.Expr:
        """A step's expression in sympy, within the size limits; limit errors name the step."""
        outer, self.where = self.where, f"step {step.name!r}"
        try:
            return self.check_size(self.convert(step.expr))
        except _Undefined as err:
            raise SpecError(str(err), loc=("steps", self.spec.steps.index(step), "expr"), step=step.name) from None
        finally:
            self.where = outer

    def size(self, e: sp.Expr) -> int:
        """Nodes of ``e``'s tree counted with repetition (what printing or lambdify walk),
        in time linear in its distinct nodes."""
        n = self._sizes.get(e)
        if n is None:
            n = 1 + sum(self.size(a) for a in e.args)
            self._sizes[e] = n
        return n

    def check_size(self, e: sp.Expr) -> sp.Expr:
        n = self.size(e)
        if n > MAX_SYMBOLIC_NODES:
            raise DerivationLimitError(
                f"{self.where}: its symbolic form has {n} nodes once earlier steps are substituted; "
                f"the limit is {MAX_SYMBOLIC_NODES}"
            )
        return e

    def convert(self, e: ex.Expr) -> sp.Expr:
        self.deadline.check(self.where)
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
            if e.op in "+-":
                sign = 1 if e.op == "+" else -1
                total = tame_numbers(a + sign * b)
                self.grouping.record(total, a, b, sign)
                return _cancelled(total, a, b)
            if e.op == "*":
                return _cancelled(tame_numbers(a * b), a, b)
            if e.op == "/":
                return _cancelled(tame_numbers(a / b), a, b)
            if a.is_number and b.is_number and not _small_exponent(b):
                return float_power(a, b)  # 9 ** 9 ** 9: never an exact 370-million-digit integer
            return tame_numbers(a**b)
        if isinstance(e, ex.Compare):
            return compare(e.op, self.convert(e.left), self.convert(e.right))
        if isinstance(e, ex.Logic):
            args = [self.convert(a) for a in e.args]
            return negate(args[0]) if e.op == "not" else logic(e.op, args)
        if isinstance(e, ex.Cast):
            return CAST_FUNCTIONS[e.dtype](self.convert(e.operand))
        if isinstance(e, ex.Call):
            args = [self.convert(a) for a in e.args]
            if e.func in ("maximum", "minimum", "clamp", "where"):
                n = sum(self.size(a) for a in args)
                if n > MAX_FOLDED_NODES:
                    raise DerivationLimitError(
                        f"{self.where}: the arguments of {e.func}() have {n} nodes once earlier steps are "
                        f"substituted; the limit is {MAX_FOLDED_NODES} (sympy compares them pairwise)"
                    )
            if e.func in _UNARY:
                return tame_numbers(_UNARY[e.func](args[0]))
            if e.func == "maximum":
                return sp.Max(*args)
            if e.func == "minimum":
                return sp.Min(*args)
            if e.func == "clamp":
                return sp.Min(sp.Max(args[0], args[1]), args[2])
            if e.func == "where":
                nested = len(args[0].atoms(sp.Piecewise))
                if nested > MAX_WHERE_IN_CONDITION:
                    raise DerivationLimitError(
                        f"{self.where}: a where() condition reads {nested} where() values once earlier steps are "
                        f"substituted; the limit is {MAX_WHERE_IN_CONDITION} (sympy unfolds them exponentially)"
                    )
                if nested and self.size(args[0]) > MAX_FOLDED_CONDITION:
                    raise DerivationLimitError(
                        f"{self.where}: a where() condition that reads a where() value has {self.size(args[0])} nodes "
                        f"once earlier steps are substituted; the limit is {MAX_FOLDED_CONDITION} (sympy folds it)"
                    )
                try:
                    return sp.Piecewise((args[1], args[0]), (args[2], True))
                except (ValueError, TypeError, KeyError) as err:  # sympy folds a where() inside the condition, and may
                    # fail (KeyError: Piecewise's ITE rewrite pops a free symbol of a condition that has none)
                    raise DerivationLimitError(
                        f"{self.where}: sympy cannot fold the where() inside this where() condition ({err})"
                    ) from None
                except RecursionError:  # Piecewise.eval can rebuild itself without end (Ne(x - x**2, ...))
                    raise DerivationLimitError(
                        f"{self.where}: sympy cannot simplify this where() condition (it recursed without end)"
                    ) from None
        raise TypeError(f"cannot convert {e!r}")


# ---------------------------------------------------------------- numbers


def _small_exponent(b: sp.Expr) -> bool:
    try:
        return abs(float(b)) <= MAX_EXACT_POWER
    except (TypeError, ValueError, OverflowError):  # complex or undefined: leave it to sympy
        return True


def _float(value: float) -> sp.Expr:
    if math.isnan(value):
        return sp.nan
    if math.isinf(value):
        return sp.oo if value > 0 else -sp.oo
    return number(value)


def float_power(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    """``a ** b`` for numbers with a large exponent, in float64 (inf on overflow, 0 on underflow,
    nan for a negative base and a fractional exponent), as the reference computes it."""
    import numpy as np

    try:
        x, y = float(a), float(b)
    except (TypeError, OverflowError):
        return sp.nan
    with np.errstate(all="ignore"):
        return _float(float(np.power(np.float64(x), np.float64(y))))


def _too_big(r: sp.Rational) -> bool:
    p, q = abs(int(r.p)), int(r.q)
    if max(p.bit_length(), q.bit_length()) > MAX_NUMBER_BITS:
        return True
    if p.bit_length() - q.bit_length() < 1020:
        return False
    try:  # within a few bits of float64's largest value
        float(Fraction(p, q))
    except OverflowError:
        return True
    return False


def _round_rational(r: sp.Rational) -> sp.Expr:
    try:
        value = float(Fraction(int(r.p), int(r.q)))
    except OverflowError:
        value = math.inf if r.p > 0 else -math.inf
    return _float(value)


class _Undefined(Exception):
    """An expression that is infinite or undefined for every input (x / (x - x), log(0))."""


def tame_numbers(e: sp.Expr) -> sp.Expr:
    """``e`` with a numeric coefficient that left float64's range (or grew too many digits to
    print) replaced by what float64 makes of it: ``x * 1e300 * 1e300`` is ``oo*x``, not
    ``10**600*x``; ``sin(inf)`` is nan. Numbers combine only in the coefficient of the node
    just built, so this check of one node after each operation is enough.

    sympy's complex infinity (``x / 0`` is ``zoo*x``, ``log(0)`` is ``zoo``) means the spec
    divides by, or takes log/rsqrt of, something that is identically 0 once earlier steps are
    substituted: the converter reports that as a SpecError naming the step."""
    if e.has(NanOf):  # nan_of(v) is 0 for every finite v: x / (x - x) divides by 0 all the same
        plain = e.xreplace({n: sp.Integer(0) for n in e.atoms(NanOf)})
        if plain is sp.zoo or (plain.is_Mul and sp.zoo in plain.args):
            e = plain
    if e is sp.zoo or (e.is_Mul and sp.zoo in e.args):
        raise _Undefined(
            "is infinite or undefined for every input: it divides by, or takes log or rsqrt of, an expression "
            "that is identically 0 once earlier steps are substituted"
        )
    if isinstance(e, sp.AccumBounds):  # sin(inf), cos(inf): nan in float arithmetic
        return sp.nan
    if e.is_Rational:
        return _round_rational(e) if _too_big(e) else e
    if e.is_Mul or e.is_Add:
        c, rest = e.as_coeff_Mul() if e.is_Mul else e.as_coeff_Add()
        if c.is_Rational and _too_big(c):
            return _round_rational(c) * rest if e.is_Mul else _round_rational(c) + rest
    return e
