"""Partial derivatives of spec expressions, on the expression language's own tree.

``partial(e, name)`` is the derivative of ``e`` with respect to the name ``name`` with every other
name held fixed (an earlier step is a variable of its own here: the chain rule through the steps
is :mod:`fuser_core.backward.derive`'s job). The result is an expression of the same language, so
a backward cascade is a spec like any other and prints with :func:`fuser_core.expr.to_text`.

Why not sympy: its ``diff`` would need the tree converted and printed back, and its
simplification distributes and reorders freely (the forward's printer had to undo exactly that
to keep a split's error small); the rules below keep the forward's own subexpressions, which
:func:`fuser_core.backward.derive` then names as the forward's steps.

Conventions, each chosen to agree with torch's autograd (the certificate's reference):
- ``maximum``/``minimum``: the gradient goes to the larger (smaller) argument, half to each on a tie;
- ``clamp(x, lo, hi)``: to ``x`` where ``lo <= x <= hi``, else to the bound it was clamped to;
- ``abs``: sign(x), 0 at 0; ``round``: 0;
- ``cast``: passes the gradient through unchanged (the straight-through rule of fake quantisation:
  torch's ``x.to(torch.float8_e4m3fn).float()`` has the same);
- ``where(c, a, b)``: ``where(c, da, db)``; a condition is never differentiated.
"""

from __future__ import annotations

import math

from fuser_core import expr as ex

ZERO = ex.Num(0.0)
ONE = ex.Num(1.0)
LN2 = math.log(2.0)


class NotDifferentiable(ValueError):
    """A node the backward does not differentiate (a topk's values, a string)."""


# ---------------------------------------------------------------- constructors that fold 0 and 1


def is_zero(e: ex.Expr) -> bool:
    return isinstance(e, ex.Num) and e.value == 0.0


def is_one(e: ex.Expr) -> bool:
    return isinstance(e, ex.Num) and e.value == 1.0


def add(a: ex.Expr, b: ex.Expr) -> ex.Expr:
    if is_zero(a):
        return b
    if is_zero(b):
        return a
    if isinstance(b, ex.Neg):
        return ex.BinOp("-", a, b.operand)
    return ex.BinOp("+", a, b)


def sub(a: ex.Expr, b: ex.Expr) -> ex.Expr:
    if is_zero(b):
        return a
    if is_zero(a):
        return neg(b)
    return ex.BinOp("-", a, b)


def neg(a: ex.Expr) -> ex.Expr:
    if isinstance(a, ex.Neg):
        return a.operand
    if isinstance(a, ex.Num):
        return ex.Num(-a.value)
    return ex.Neg(a)


def mul(a: ex.Expr, b: ex.Expr) -> ex.Expr:
    """``a * b``; a zero factor gives zero (a derivative that is structurally 0 carries no
    gradient, as torch's graph has no edge there)."""
    if is_zero(a) or is_zero(b):
        return ZERO
    if is_one(a):
        return b
    if is_one(b):
        return a
    if isinstance(a, ex.Num) and a.value == -1.0:
        return neg(b)
    if isinstance(b, ex.Num) and b.value == -1.0:
        return neg(a)
    if isinstance(a, ex.Neg):
        return neg(mul(a.operand, b))
    if isinstance(b, ex.Neg):
        return neg(mul(a, b.operand))
    return ex.BinOp("*", a, b)


def div(a: ex.Expr, b: ex.Expr) -> ex.Expr:
    if is_zero(a):
        return ZERO
    if is_one(b):
        return a
    if isinstance(a, ex.Neg):
        return neg(div(a.operand, b))
    return ex.BinOp("/", a, b)


def call(func: str, *args: ex.Expr) -> ex.Expr:
    return ex.Call(func, tuple(args))


def where(cond: ex.Expr, a: ex.Expr, b: ex.Expr) -> ex.Expr:
    if a == b:
        return a
    return call("where", cond, a, b)


# ---------------------------------------------------------------- the rules


def depends_on(e: ex.Expr, name: str) -> bool:
    return any(isinstance(n, ex.Ref) and n.name == name for n in ex.walk(e))


def partial(e: ex.Expr, name: str) -> ex.Expr:
    """d e / d name, other names fixed (module doc). Structurally zero where ``e`` does not
    reference ``name``."""
    if not depends_on(e, name):
        return ZERO
    if isinstance(e, ex.Ref):
        if e.part is not None:
            raise NotDifferentiable(f"{e.name}.{e.part}: a topk's parts are not differentiated")
        return ONE
    if isinstance(e, ex.Neg):
        return neg(partial(e.operand, name))
    if isinstance(e, ex.Cast):
        return partial(e.operand, name)
    if isinstance(e, ex.BinOp):
        return _binop(e, name)
    if isinstance(e, ex.Call):
        return _call(e, name)
    if isinstance(e, ex.Compare | ex.Logic):  # only ever where()'s condition, handled there
        raise NotDifferentiable("a condition has no derivative")
    raise NotDifferentiable(f"cannot differentiate {ex.to_text(e)}")


def _binop(e: ex.BinOp, name: str) -> ex.Expr:
    a, b = e.left, e.right
    da, db = partial(a, name), partial(b, name)
    if e.op == "+":
        return add(da, db)
    if e.op == "-":
        return sub(da, db)
    if e.op == "*":
        if a == b:  # a square: 2 a da, not a da + a da
            return mul(mul(ex.Num(2.0), a), da)
        return add(mul(da, b), mul(a, db))
    if e.op == "/":
        # d(a/b) = da/b - (a/b)/b db: (a/b) is the forward's own subexpression, named by the caller
        return sub(div(da, b), mul(div(e, b), db))
    assert e.op == "**"
    if not depends_on(b, name):  # a ** c: c a ** (c - 1) da
        if isinstance(b, ex.Num):
            lowered = ex.Num(b.value - 1.0)
            power = a if b.value == 2.0 else ex.BinOp("**", a, lowered)
            return mul(mul(b, power), da)
        return mul(mul(b, ex.BinOp("**", a, sub(b, ONE))), da)
    # a ** b = exp(b log a)
    return mul(e, add(mul(db, call("log", a)), div(mul(b, da), a)))


def _call(e: ex.Call, name: str) -> ex.Expr:
    f, args = e.func, e.args
    if f == "where":
        cond, a, b = args
        return where(cond, partial(a, name), partial(b, name))
    if f in ("maximum", "minimum"):
        a, b = args
        da, db = partial(a, name), partial(b, name)
        wins = ">" if f == "maximum" else "<"
        loses = "<" if f == "maximum" else ">"
        return where(ex.Compare(wins, a, b), da, where(ex.Compare(loses, a, b), db, mul(ex.Num(0.5), add(da, db))))
    if f == "clamp":
        x, lo, hi = args
        dx, dlo, dhi = (partial(a, name) for a in args)
        return where(ex.Compare("<", x, lo), dlo, where(ex.Compare(">", x, hi), dhi, dx))
    (u,) = args
    du = partial(u, name)
    if f == "round":
        return ZERO
    return mul(_outer(f, u, e), du)


def _outer(f: str, u: ex.Expr, e: ex.Expr) -> ex.Expr:
    """f'(u) for a one-argument function ``e = f(u)``, in terms of ``e`` where that is cheaper."""
    if f == "exp":
        return e
    if f == "exp2":
        return mul(e, ex.Num(LN2))
    if f == "log":
        return div(ONE, u)
    if f == "log2":
        return div(ONE, mul(u, ex.Num(LN2)))
    if f == "log1p":
        return div(ONE, add(ONE, u))
    if f == "sqrt":
        return div(ex.Num(0.5), e)
    if f == "rsqrt":  # -1/2 u^(-3/2) = -1/2 rsqrt(u) / u
        return neg(div(mul(ex.Num(0.5), e), u))
    if f == "abs":
        return where(ex.Compare(">", u, ZERO), ONE, where(ex.Compare("<", u, ZERO), ex.Num(-1.0), ZERO))
    if f == "tanh":
        return sub(ONE, mul(e, e))
    if f == "sigmoid":
        return mul(e, sub(ONE, e))
    if f == "erf":
        return mul(ex.Num(2.0 / math.sqrt(math.pi)), call("exp", neg(mul(u, u))))
    if f == "sin":
        return call("cos", u)
    if f == "cos":
        return neg(call("sin", u))
    raise NotDifferentiable(f"{f}() has no derivative rule")


def folded(e: ex.Expr) -> ex.Expr:
    """``e`` rebuilt through the constructors above (after a name became a number: ``1 * a`` is ``a``)."""
    build = {"+": add, "-": sub, "*": mul, "/": div}

    def fold(node: ex.Expr) -> ex.Expr | None:
        if isinstance(node, ex.BinOp) and node.op in build:
            return build[node.op](node.left, node.right)
        if isinstance(node, ex.Neg):
            return neg(node.operand)
        return None

    return ex.map_expr(e, fold)
