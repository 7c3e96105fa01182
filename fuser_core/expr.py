"""The expression language of spec v1: tokenizer, parser, AST and printer.

User text is parsed only by this grammar (never ``eval``/``sympify``/``parse_expr``):

    expr    := either
    either  := both (("or" | "|") both)*            conditions: where()'s first argument only
    both    := negated (("and" | "&") negated)*
    negated := ("not" | "!") negated | compare
    compare := sum [("<" | "<=" | ">" | ">=" | "==" | "!=") sum]
    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := "-" unary | power
    power   := atom ["**" unary]                 (right-assoc, binds tighter than unary -)
    atom    := NUMBER | "inf" | NAME ["." ("values" | "indices")]
             | FUNC "(" expr ("," expr)* ")" | "(" expr ")" | STRING (cast's dtype only)

Whether a comparison or string may appear where it does, and whether a name exists, is
checked later by :mod:`fuser_core.spec`, which knows the context; the parser only builds
the tree, within size and depth limits.

Example:
    >>> e = parse_expr_text("exp(x - mx) / den")
    >>> to_text(e)
    'exp(x - mx) / den'
    >>> to_text(e, rename={"mx": "s0"})
    'exp(x - s0) / den'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from fuser_core.errors import SpecError

MAX_EXPR_CHARS = 2000
MAX_EXPR_NODES = 400
# to_text of any expression within MAX_EXPR_NODES is shorter than this (it adds spaces, and
# canonical names and numbers can be longer than the user's): the limit for reloading
# expressions we printed ourselves, e.g. a canonical form.
MAX_PRINTED_CHARS = 40 * MAX_EXPR_NODES
MAX_EXPR_DEPTH = 32

# name -> number of arguments. size/index/cast are parsed into their own nodes.
FUNCTIONS: dict[str, int] = {
    "exp": 1, "exp2": 1, "log": 1, "log2": 1, "log1p": 1, "sqrt": 1, "rsqrt": 1,
    "abs": 1, "tanh": 1, "sigmoid": 1, "erf": 1, "sin": 1, "cos": 1, "round": 1,
    "maximum": 2, "minimum": 2, "where": 3, "clamp": 3,
}
SPECIAL_FUNCTIONS = ("size", "index", "cast")
CAST_DTYPES = ("float8_e4m3fn", "float16", "bfloat16", "float32")
TOPK_PARTS = ("values", "indices")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_WORDS = {"and": "and", "&": "and", "or": "or", "|": "or", "not": "not", "!": "not"}  # spelling -> op
RESERVED = frozenset(FUNCTIONS) | frozenset(SPECIAL_FUNCTIONS) | {"inf", "nan", "and", "or", "not"}


# ---------------------------------------------------------------- AST


@dataclass(frozen=True, slots=True)
class Num:
    value: float


@dataclass(frozen=True, slots=True)
class Ref:
    """A name: an input, a param or an earlier step (``part`` for a topk step's result)."""

    name: str
    part: str | None = None


@dataclass(frozen=True, slots=True)
class Size:
    dim: str


@dataclass(frozen=True, slots=True)
class Index:
    dim: str


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # + - * / **
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Compare:
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Logic:
    """``and``/``or`` of two conditions, or ``not`` of one (``args``: one operand for not)."""

    op: str  # and, or, not
    args: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Cast:
    operand: Expr
    dtype: str


@dataclass(frozen=True, slots=True)
class Str:
    """A string literal; valid only as cast's dtype (the parser folds it into ``Cast``)."""

    value: str


Expr = Num | Ref | Size | Index | Neg | BinOp | Compare | Logic | Call | Cast | Str
CONDITIONS = (Compare, Logic)  # the nodes with a truth value: where()'s first argument only


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Neg):
        return (e.operand,)
    if isinstance(e, BinOp | Compare):
        return (e.left, e.right)
    if isinstance(e, Call | Logic):
        return e.args
    if isinstance(e, Cast):
        return (e.operand,)
    return ()


def walk(e: Expr) -> Iterator[Expr]:
    """Every node, parents before children, left to right."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(children(node)))


def map_expr(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Rebuild ``e`` bottom-up; ``fn`` may return a replacement for a node (or None)."""
    if isinstance(e, Neg):
        e = Neg(map_expr(e.operand, fn))
    elif isinstance(e, BinOp):
        e = BinOp(e.op, map_expr(e.left, fn), map_expr(e.right, fn))
    elif isinstance(e, Compare):
        e = Compare(e.op, map_expr(e.left, fn), map_expr(e.right, fn))
    elif isinstance(e, Call):
        e = Call(e.func, tuple(map_expr(a, fn) for a in e.args))
    elif isinstance(e, Logic):
        e = Logic(e.op, tuple(map_expr(a, fn) for a in e.args))
    elif isinstance(e, Cast):
        e = Cast(map_expr(e.operand, fn), e.dtype)
    out = fn(e)
    return e if out is None else out


# ---------------------------------------------------------------- tokenizer

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<str>"[^"\\\n]*"|'[^'\\\n]*')
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\*\*|<=|>=|==|!=|[-+*/()<>,.&|!])
    """,
    re.VERBOSE | re.ASCII,  # ASCII digits and spaces only: float() would accept e.g. Arabic-Indic digits
)


@dataclass(frozen=True, slots=True)
class Token:
    type: str  # num, str, name, op, end
    text: str
    pos: int


def tokenize(
    text: str, loc: tuple[str | int, ...] = (), step: str | None = None, max_chars: int = MAX_EXPR_CHARS
) -> list[Token]:
    if len(text) > max_chars:
        raise SpecError(f"expression is {len(text)} characters; the limit is {max_chars}", loc=loc, step=step)
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos] in "\"'":
                raise SpecError(
                    f"unterminated string starting at column {pos + 1} (strings end on their line, no backslashes)",
                    loc=loc, step=step,
                )
            raise SpecError(f"unexpected character {text[pos]!r} at column {pos + 1}", loc=loc, step=step)
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append(Token(kind, m.group(), pos))
        pos = m.end()
    tokens.append(Token("end", "", len(text)))
    return tokens


# ---------------------------------------------------------------- parser


class _Parser:
    def __init__(self, text: str, loc: tuple[str | int, ...], step: str | None, max_chars: int):
        self.text = text
        self.loc = loc
        self.step = step
        self.tokens = tokenize(text, loc, step, max_chars)
        self.i = 0
        self.depth = 0
        self.nodes = 0

    # -- helpers
    def error(self, message: str, tok: Token | None = None) -> SpecError:
        tok = tok or self.peek()
        where = "at the end" if tok.type == "end" else f"at column {tok.pos + 1} ({tok.text!r})"
        return SpecError(f"{message} {where} in {self.text!r}", loc=self.loc, step=self.step)

    def peek(self) -> Token:
        return self.tokens[self.i]

    def next(self) -> Token:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        if self.peek().type == "op" and self.peek().text == text:
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            raise self.error(f"expected {text!r}")

    def node(self, n: Expr) -> Expr:
        self.nodes += 1
        if self.nodes > MAX_EXPR_NODES:
            raise SpecError(f"expression has more than {MAX_EXPR_NODES} nodes", loc=self.loc, step=self.step)
        return n

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_EXPR_DEPTH:
            raise SpecError(f"expression nests deeper than {MAX_EXPR_DEPTH} levels", loc=self.loc, step=self.step)

    # -- grammar
    def parse(self) -> Expr:
        e = self.either()
        if self.peek().type != "end":
            raise self.error("unexpected token")
        return e

    def logic_word(self, op: str) -> bool:
        """Is the next token ``op`` (and, or, not) in either spelling? Consumes it if so."""
        tok = self.peek()
        if tok.type in ("op", "name") and LOGIC_WORDS.get(tok.text) == op:
            self.i += 1
            return True
        return False

    def either(self) -> Expr:
        left = self.both()
        while self.logic_word("or"):
            left = self.node(Logic("or", (left, self.both())))
        return left

    def both(self) -> Expr:
        left = self.negated()
        while self.logic_word("and"):
            left = self.node(Logic("and", (left, self.negated())))
        return left

    def negated(self) -> Expr:
        if self.logic_word("not"):
            self.enter()
            operand = self.negated()
            self.depth -= 1
            return self.node(Logic("not", (operand,)))
        return self.compare()

    def compare(self) -> Expr:
        left = self.sum()
        tok = self.peek()
        if tok.type == "op" and tok.text in COMPARE_OPS:
            self.next()
            right = self.sum()
            if self.peek().type == "op" and self.peek().text in COMPARE_OPS:
                raise self.error("chained comparisons are not supported")
            return self.node(Compare(tok.text, left, right))
        return left

    def sum(self) -> Expr:
        left = self.product()
        while self.peek().type == "op" and self.peek().text in ("+", "-"):
            op = self.next().text
            left = self.node(BinOp(op, left, self.product()))
        return left

    def product(self) -> Expr:
        left = self.unary()
        while self.peek().type == "op" and self.peek().text in ("*", "/"):
            op = self.next().text
            left = self.node(BinOp(op, left, self.unary()))
        return left

    def unary(self) -> Expr:
        if self.accept("-"):
            self.enter()
            operand = self.unary()
            self.depth -= 1
            if isinstance(operand, Num):
                return Num(-operand.value)
            return self.node(Neg(operand))
        return self.power()

    def power(self) -> Expr:
        base = self.atom()
        if self.accept("**"):
            self.enter()
            exponent = self.unary()
            self.depth -= 1
            return self.node(BinOp("**", base, exponent))
        return base

    def atom(self) -> Expr:
        tok = self.next()
        if tok.type == "num":
            value = float(tok.text)
            if not math.isfinite(value):
                raise self.error("number out of range", tok)
            return self.node(Num(value))
        if tok.type == "str":
            return self.node(Str(tok.text[1:-1]))
        if tok.type == "op" and tok.text == "(":
            self.enter()
            e = self.either()
            self.expect(")")
            self.depth -= 1
            return e
        if tok.type == "name":
            if tok.text == "inf":
                return self.node(Num(math.inf))
            if self.peek().type == "op" and self.peek().text == "(":
                return self.call(tok)
            if self.accept("."):
                attr = self.next()
                if attr.type != "name" or attr.text not in TOPK_PARTS:
                    raise self.error(
                        "attribute access is not allowed; only .values and .indices of a topk step", attr
                    )
                return self.node(Ref(tok.text, attr.text))
            return self.node(Ref(tok.text))
        raise self.error("expected a number, a name or '('", tok)

    def call(self, name: Token) -> Expr:
        func = name.text
        if func not in FUNCTIONS and func not in SPECIAL_FUNCTIONS:
            raise self.error(f"unknown function {func!r}", name)
        self.expect("(")
        self.enter()
        args: list[Expr] = []
        if not self.accept(")"):
            args.append(self.either())
            while self.accept(","):
                args.append(self.either())
            self.expect(")")
        self.depth -= 1
        arity = FUNCTIONS.get(func, 2 if func == "cast" else 1)
        if len(args) != arity:
            raise self.error(f"{func}() takes {arity} argument{'s' if arity > 1 else ''}, got {len(args)}", name)
        if func in ("size", "index"):
            (arg,) = args
            if not isinstance(arg, Ref) or arg.part is not None:
                raise self.error(f"{func}() takes a dim name", name)
            return self.node(Size(arg.name) if func == "size" else Index(arg.name))
        if func == "cast":
            operand, dtype = args
            if not isinstance(dtype, Str) or dtype.value not in CAST_DTYPES:
                raise self.error(f"cast() takes a dtype string, one of {', '.join(CAST_DTYPES)}", name)
            return self.node(Cast(operand, dtype.value))
        return self.node(Call(func, tuple(args)))


def parse_expr_text(
    text: str, loc: tuple[str | int, ...] = (), step: str | None = None, max_chars: int = MAX_EXPR_CHARS
) -> Expr:
    """Parse one expression of the spec language into our AST (raises :class:`SpecError`)."""
    if not isinstance(text, str):
        raise SpecError(f"expected an expression string, got {type(text).__name__}", loc=loc, step=step)
    return _Parser(text, loc, step, max_chars).parse()


# ---------------------------------------------------------------- printer

_PREC = {"or": -2, "and": -1, "not": 0, "compare": 1, "+": 2, "-": 2, "*": 3, "/": 3, "neg": 4, "**": 5, "atom": 6}


def format_number(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0 and math.copysign(1, value) < 0:
        return "-0.0"  # not "0": x / -0 is -inf, x / 0 is inf
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _prec(e: Expr) -> int:
    if isinstance(e, Logic):
        return _PREC[e.op]
    if isinstance(e, Compare):
        return _PREC["compare"]
    if isinstance(e, BinOp):
        return _PREC[e.op]
    if isinstance(e, Neg) or (isinstance(e, Num) and (e.value < 0 or math.copysign(1, e.value) < 0)):
        return _PREC["neg"]
    return _PREC["atom"]


def to_text(e: Expr, rename: Mapping[str, str] | None = None) -> str:
    """Print ``e`` in the spec language with minimal parentheses; ``rename`` maps names and dims."""
    r = rename or {}

    def name(n: str) -> str:
        return r.get(n, n)

    def wrap(child: Expr, need: bool) -> str:
        s = go(child)
        return f"({s})" if need else s

    def go(e: Expr) -> str:
        if isinstance(e, Num):
            return format_number(e.value)
        if isinstance(e, Ref):
            return name(e.name) + (f".{e.part}" if e.part else "")
        if isinstance(e, Size):
            return f"size({name(e.dim)})"
        if isinstance(e, Index):
            return f"index({name(e.dim)})"
        if isinstance(e, Str):
            return f"'{e.value}'" if '"' in e.value else f'"{e.value}"'
        if isinstance(e, Cast):
            return f'cast({go(e.operand)}, "{e.dtype}")'
        if isinstance(e, Call):
            return f"{e.func}({', '.join(go(a) for a in e.args)})"
        if isinstance(e, Neg):
            return "-" + wrap(e.operand, _prec(e.operand) < _PREC["neg"])
        if isinstance(e, Logic):
            p = _PREC[e.op]
            if e.op == "not":
                return "not " + wrap(e.args[0], _prec(e.args[0]) < p)
            left, right = e.args
            return f"{wrap(left, _prec(left) < p)} {e.op} {wrap(right, _prec(right) <= p)}"
        if isinstance(e, Compare):
            p = _PREC["compare"]
            return f"{wrap(e.left, _prec(e.left) <= p)} {e.op} {wrap(e.right, _prec(e.right) <= p)}"
        assert isinstance(e, BinOp)
        p = _PREC[e.op]
        if e.op == "**":  # right-associative
            return f"{wrap(e.left, _prec(e.left) <= p)} ** {wrap(e.right, _prec(e.right) < _PREC['neg'])}"
        return f"{wrap(e.left, _prec(e.left) < p)} {e.op} {wrap(e.right, _prec(e.right) <= p)}"

    return go(e)
