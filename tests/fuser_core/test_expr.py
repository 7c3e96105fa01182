"""The expression language: tokenizer, parser, printer (fuser_core.expr)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser_core.errors import SpecError
from fuser_core.expr import (
    CAST_DTYPES,
    COMPARE_OPS,
    FUNCTIONS,
    MAX_EXPR_CHARS,
    MAX_EXPR_DEPTH,
    MAX_EXPR_NODES,
    RESERVED,
    BinOp,
    Call,
    Cast,
    Compare,
    Index,
    Logic,
    Neg,
    Num,
    Ref,
    Size,
    Str,
    children,
    format_number,
    map_expr,
    parse_expr_text,
    to_text,
    walk,
)

P = parse_expr_text
x, y, z = Ref("x"), Ref("y"), Ref("z")


# ---------------------------------------------------------------- precedence and associativity


@pytest.mark.parametrize(
    ("text", "tree"),
    [
        ("-x ** 2", Neg(BinOp("**", x, Num(2)))),
        ("-(x ** 2)", Neg(BinOp("**", x, Num(2)))),
        ("(-x) ** 2", BinOp("**", Neg(x), Num(2))),
        ("-2 ** 2", Neg(BinOp("**", Num(2), Num(2)))),
        ("x - y - z", BinOp("-", BinOp("-", x, y), z)),
        ("x - (y - z)", BinOp("-", x, BinOp("-", y, z))),
        ("x / y / z", BinOp("/", BinOp("/", x, y), z)),
        ("x / y * z", BinOp("*", BinOp("/", x, y), z)),
        ("2 ** 3 ** 2", BinOp("**", Num(2), BinOp("**", Num(3), Num(2)))),
        ("(2 ** 3) ** 2", BinOp("**", BinOp("**", Num(2), Num(3)), Num(2))),
        ("x ** -y", BinOp("**", x, Neg(y))),
        ("x ** -1", BinOp("**", x, Num(-1))),
        ("x + y * z", BinOp("+", x, BinOp("*", y, z))),
        ("(x + y) * z", BinOp("*", BinOp("+", x, y), z)),
        ("x * -y", BinOp("*", x, Neg(y))),
        ("x - -y", BinOp("-", x, Neg(y))),
        ("--x", Neg(Neg(x))),
        ("-x * y", BinOp("*", Neg(x), y)),
        ("x + y < z * 2", Compare("<", BinOp("+", x, y), BinOp("*", z, Num(2)))),
        ("x <= y", Compare("<=", x, y)),
        ("x >= y", Compare(">=", x, y)),
        ("x > y", Compare(">", x, y)),
        ("x == y", Compare("==", x, y)),
        ("x != y", Compare("!=", x, y)),
        ("index(n) <= index(m)", Compare("<=", Index("n"), Index("m"))),
        ("where(x < 0, -x, x)", Call("where", (Compare("<", x, Num(0)), Neg(x), x))),
        ("1 / sqrt(size(d))", BinOp("/", Num(1), Call("sqrt", (Size("d"),)))),
        ("g.values * g.indices", BinOp("*", Ref("g", "values"), Ref("g", "indices"))),
        ("cast(x, 'float16')", Cast(x, "float16")),
        ('cast(x * 2, "float8_e4m3fn")', Cast(BinOp("*", x, Num(2)), "float8_e4m3fn")),
        ("maximum(x, minimum(y, z))", Call("maximum", (x, Call("minimum", (y, z))))),
        ("clamp(x, -448, 448)", Call("clamp", (x, Num(-448), Num(448)))),
        ("  x\t+\ny  ", BinOp("+", x, y)),
        ("((x))", x),
    ],
)
def test_parse_tree(text, tree):
    assert P(text) == tree


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", 1.0),
        ("0.5", 0.5),
        (".5", 0.5),
        ("5.", 5.0),
        ("1e-5", 1e-5),
        ("1E-5", 1e-5),
        ("0.00001", 1e-5),
        ("1e+3", 1000.0),
        ("2.5e3", 2500.0),
        ("448", 448.0),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("-(inf)", -math.inf),
        ("-1e-12", -1e-12),
        ("--3", 3.0),
    ],
)
def test_numbers(text, value):
    assert P(text) == Num(value)


def test_unary_minus_of_a_number_is_folded():
    assert P("-3") == Num(-3.0)
    assert P("x - -3") == BinOp("-", x, Num(-3.0))


def test_number_out_of_range():
    with pytest.raises(SpecError, match="number out of range"):
        P("1e999")
    with pytest.raises(SpecError, match="number out of range"):
        P("9" * 400)


def test_non_ascii_digits_are_not_numbers():
    # float() accepts Arabic-Indic digits; the grammar does not.
    with pytest.raises(SpecError, match="unexpected character"):
        P("\u0661\u0662")


# ---------------------------------------------------------------- printer


@pytest.mark.parametrize(
    ("text", "printed"),
    [
        ("exp(x - mx) / den", "exp(x - mx) / den"),
        ("((x))+(y)", "x + y"),
        ("x-(y-z)", "x - (y - z)"),
        ("(x-y)-z", "x - y - z"),
        ("-x**2", "-x ** 2"),
        ("(-x)**2", "(-x) ** 2"),
        ("(-2)**x", "(-2) ** x"),
        ("2**3**2", "2 ** 3 ** 2"),
        ("(2**3)**2", "(2 ** 3) ** 2"),
        ("x ** -y", "x ** -y"),
        ("x**(-1)", "x ** -1"),
        ("x ** (y * z)", "x ** (y * z)"),
        ("-(x*y)", "-(x * y)"),
        ("0.00001", "1e-05"),
        ("1e-5", "1e-05"),
        ("1.0", "1"),
        ("1e3", "1000"),
        ("1e16", "1e+16"),
        ("-inf", "-inf"),
        ("x / -0", "x / -0.0"),
        ("where((x < y), x, y)", "where(x < y, x, y)"),
        ("cast(x,'float16')", 'cast(x, "float16")'),
        ("(x < y) + 1", "(x < y) + 1"),
        ("g.values", "g.values"),
    ],
)
def test_printer(text, printed):
    assert to_text(P(text)) == printed
    assert P(printed) == P(text)


def test_printer_rename():
    e = P("where(index(n) <= index(m), s0 + size(n), g.values)")
    assert to_text(e, {"n": "d1", "m": "d0", "s0": "s", "g": "s2"}) == (
        "where(index(d1) <= index(d0), s + size(d1), s2.values)"
    )


def test_negative_zero_keeps_its_sign():
    e = P("-0")
    assert math.copysign(1, e.value) < 0
    again = P(to_text(e))
    assert math.copysign(1, again.value) < 0
    assert format_number(0.0) == "0"


def test_string_printing_picks_a_quote():
    assert P(to_text(Str('a"b'))) == Str('a"b')
    assert P(to_text(Str("a'b"))) == Str("a'b")


# ---------------------------------------------------------------- round trip property

NAMES = st.sampled_from(["x", "y", "mx", "den", "s0", "q_1", "Kv"])
DIMS = st.sampled_from(["m", "n", "d0"])
NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True),
    st.integers(-10**6, 10**6).map(float),
    st.sampled_from([0.0, -0.0, 1e-5, 0.5, 448.0, 1e16, -1e300, 5e-324]),
)
LEAVES = st.one_of(
    NUMBERS.map(Num),
    NAMES.map(Ref),
    st.tuples(NAMES, st.sampled_from(["values", "indices"])).map(lambda t: Ref(*t)),
    DIMS.map(Size),
    DIMS.map(Index),
)


def _neg(e):
    # the parser folds unary minus of a number into the number
    return Num(-e.value) if isinstance(e, Num) else Neg(e)


def _extend(inner):
    return st.one_of(
        inner.map(_neg),
        st.tuples(st.sampled_from(["+", "-", "*", "/", "**"]), inner, inner).map(lambda t: BinOp(*t)),
        st.tuples(st.sampled_from(COMPARE_OPS), inner, inner).map(lambda t: Compare(*t)),
        st.tuples(st.sampled_from(["and", "or"]), inner, inner).map(lambda t: Logic(t[0], (t[1], t[2]))),
        inner.map(lambda a: Logic("not", (a,))),
        st.tuples(inner, st.sampled_from(CAST_DTYPES)).map(lambda t: Cast(*t)),
        *[
            st.tuples(*[inner] * arity).map(lambda args, f=f: Call(f, args))
            for f, arity in sorted(FUNCTIONS.items())
        ],
    )


ASTS = st.recursive(LEAVES, _extend, max_leaves=12)


def _same(a, b) -> bool:
    """AST equality that also tells -0.0 from 0.0."""
    if isinstance(a, Num) and isinstance(b, Num):
        return a.value == b.value and math.copysign(1, a.value) == math.copysign(1, b.value)
    if type(a) is not type(b):
        return False
    ca, cb = children(a), children(b)
    if not ca:
        return a == b
    return (
        len(ca) == len(cb)
        and all(_same(p, q) for p, q in zip(ca, cb))
        and getattr(a, "op", None) == getattr(b, "op", None)
        and getattr(a, "func", None) == getattr(b, "func", None)
        and getattr(a, "dtype", None) == getattr(b, "dtype", None)
    )


@settings(max_examples=300, deadline=None)
@given(ASTS)
def test_print_parse_round_trip(tree):
    text = to_text(tree)
    again = P(text)
    assert _same(again, tree), (text, again, tree)
    assert to_text(again) == text  # printing is a fixed point


@settings(max_examples=100, deadline=None)
@given(ASTS)
def test_walk_visits_every_node(tree):
    def count(e):
        return 1 + sum(count(c) for c in children(e))

    assert len(list(walk(tree))) == count(tree)
    assert map_expr(tree, lambda n: None) == tree


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("foo(x)", "unknown function 'foo'"),
        ("softmax(x)", "unknown function 'softmax'"),
        ("eval(x)", "unknown function 'eval'"),
        ("__import__('os')", "unknown function '__import__'"),
        ("exp(x, y)", "exp() takes 1 argument, got 2"),
        ("exp()", "exp() takes 1 argument, got 0"),
        ("maximum(x)", "maximum() takes 2 arguments, got 1"),
        ("where(x < y, x)", "where() takes 3 arguments, got 2"),
        ("clamp(x, 1, 2, 3)", "clamp() takes 3 arguments, got 4"),
        ("size(m, n)", "size() takes 1 argument, got 2"),
        ("cast(x)", "cast() takes 2 arguments, got 1"),
        ("size(2)", "size() takes a dim name"),
        ("index(x + 1)", "index() takes a dim name"),
        ("size(g.values)", "size() takes a dim name"),
        ("x.__class__", "attribute access is not allowed"),
        ("x.__class__.__bases__", "attribute access is not allowed"),
        ("x.real", "attribute access is not allowed"),
        ("x.values.indices", "unexpected token"),
        ("cast(x, 'float64')", "cast() takes a dtype string"),
        ("cast(x, 'int8')", "cast() takes a dtype string"),
        ("cast(x, y)", "cast() takes a dtype string"),
        ("cast(x, 16)", "cast() takes a dtype string"),
        ("exp(x", "expected ')' at the end"),
        ("(x + y", "expected ')' at the end"),
        ("x + y)", "unexpected token"),
        ("x +", "expected a number, a name or '(' at the end"),
        ("", "expected a number, a name or '(' at the end"),
        ("   ", "expected a number, a name or '(' at the end"),
        ("exp(x,)", "expected a number, a name or '('"),
        ("'float16", "unterminated string"),
        ('"abc', "unterminated string"),
        ("cast(x, 'float16)", "unterminated string"),
        ("cast(x, 'flo\\at16')", "unterminated string"),
        ("x @ y", "unexpected character '@'"),
        ("x; y", "unexpected character ';'"),
        ("`x`", "unexpected character '`'"),
        ("x % y", "unexpected character '%'"),
        ("x[0]", "unexpected character '['"),
        ("{x}", "unexpected character '{'"),
        ("x if y else z", "unexpected token"),
        ("lambda: x", "unexpected character ':'"),
        ("lambda x: x", "unexpected character ':'"),
        ("x y", "unexpected token"),
        ("x < y < z", "chained comparisons are not supported"),
        ("x = y", "unexpected character '='"),
        ("x // y", "expected a number, a name or '('"),
        ("x ** ** y", "expected a number, a name or '('"),
        ("1.5.5", "unexpected token"),
        ("x.5", "unexpected token"),
        ("+x", "expected a number, a name or '('"),
        ("exp", None),  # parses (as a name; the spec rejects it)
    ],
)
def test_errors(text, message):
    if message is None:
        P(text)
        return
    with pytest.raises(SpecError) as info:
        P(text)
    assert message in str(info.value)


def test_error_carries_location():
    with pytest.raises(SpecError) as info:
        P("exp(x", loc=("steps", 2, "expr"), step="den")
    err = info.value
    assert err.loc == ("steps", 2, "expr")
    assert err.step == "den"
    assert str(err).startswith("steps[2] (den).expr: ")


def test_non_string_expression():
    for value in (1, 1.5, None, ["x"], {"x": 1}, True):
        with pytest.raises(SpecError, match="expected an expression string"):
            P(value)


def test_strings_outside_cast_parse_as_str():
    # the parser keeps a lone string (spec validation rejects it, knowing the context)
    assert P("'float16'") == Str("float16")
    assert P("x * 'a'") == BinOp("*", x, Str("a"))


# ---------------------------------------------------------------- limits


def test_too_long():
    text = "x + " * (MAX_EXPR_CHARS // 4) + "x"
    assert len(text) > MAX_EXPR_CHARS
    with pytest.raises(SpecError, match=f"the limit is {MAX_EXPR_CHARS}"):
        P(text)
    # whitespace counts too: the limit bounds the work done on any text
    with pytest.raises(SpecError, match="characters"):
        P(" " * (MAX_EXPR_CHARS + 1) + "x")


def test_at_the_length_limit():
    text = "x" + " " * (MAX_EXPR_CHARS - 1)
    assert P(text) == x


def test_depth_limit_parentheses():
    ok = "(" * MAX_EXPR_DEPTH + "x" + ")" * MAX_EXPR_DEPTH
    assert P(ok) == x
    deep = "(" * (MAX_EXPR_DEPTH + 1) + "x" + ")" * (MAX_EXPR_DEPTH + 1)
    with pytest.raises(SpecError, match=f"nests deeper than {MAX_EXPR_DEPTH} levels"):
        P(deep)


@pytest.mark.parametrize(
    "text",
    [
        "(" * 999 + "x" + ")" * 999,
        "(" * (MAX_EXPR_CHARS - 1) + "x",
        "-" * (MAX_EXPR_CHARS - 1) + "x",
        "- " * 999 + "x",
        "exp(" * 390 + "x" + ")" * 390,
        "x ** " * 399 + "x",
        "x**" * 666 + "x",
        "where(" * 300 + "x",
        "-(" * 600 + "x" + ")" * 600,
    ],
    ids=["parens", "open-parens", "minus", "spaced-minus", "exp", "power", "power-tight", "where", "neg-parens"],
)
def test_deep_nesting_is_a_spec_error_not_recursion(text):
    """Found by the depth counter, long before Python's recursion limit."""
    assert len(text) <= MAX_EXPR_CHARS
    with pytest.raises(SpecError, match="nests deeper"):
        P(text)


def test_depth_limit_unary_minus():
    ok = P("-" * MAX_EXPR_DEPTH + "x")
    for _ in range(MAX_EXPR_DEPTH):
        assert isinstance(ok, Neg)
        ok = ok.operand
    assert ok == x
    with pytest.raises(SpecError, match=f"nests deeper than {MAX_EXPR_DEPTH} levels"):
        P("-" * (MAX_EXPR_DEPTH + 1) + "x")


def test_node_limit():
    ok = " + ".join(["x"] * ((MAX_EXPR_NODES + 1) // 2))  # n refs + n-1 ops <= limit
    assert sum(1 for _ in walk(P(ok))) <= MAX_EXPR_NODES
    text = "+".join(["x"] * (MAX_EXPR_NODES // 2 + 2))
    assert len(text) <= MAX_EXPR_CHARS
    with pytest.raises(SpecError, match=f"more than {MAX_EXPR_NODES} nodes"):
        P(text)


def test_left_deep_chain_prints_without_recursion_error():
    # a long left-associative chain is within the node limit but deep as a tree
    text = "-".join(["x"] * ((MAX_EXPR_NODES + 1) // 2))
    assert to_text(P(text)) == " - ".join(["x"] * ((MAX_EXPR_NODES + 1) // 2))


def test_reserved_words():
    assert {"inf", "nan", "exp", "where", "size", "index", "cast"} <= RESERVED


# ---------------------------------------------------------------------------- and, or, not


@pytest.mark.parametrize("text, tree", [
    ("a < b and c < d", Logic("and", (Compare("<", Ref("a"), Ref("b")), Compare("<", Ref("c"), Ref("d"))))),
    ("a < b & c < d", Logic("and", (Compare("<", Ref("a"), Ref("b")), Compare("<", Ref("c"), Ref("d"))))),
    ("a < b or c < d and e < f", Logic("or", (Compare("<", Ref("a"), Ref("b")), Logic("and", (
        Compare("<", Ref("c"), Ref("d")), Compare("<", Ref("e"), Ref("f"))))))),
    ("!(a < b) | c != d", Logic("or", (Logic("not", (Compare("<", Ref("a"), Ref("b")),)), Compare("!=", Ref("c"), Ref("d"))))),
    ("not a < b", Logic("not", (Compare("<", Ref("a"), Ref("b")),))),
])
def test_and_or_not_parse_with_pythons_precedence(text, tree):
    """or binds loosest, then and, then not, then the comparison; & | ! are and, or, not."""
    assert P(text) == tree
    assert P(to_text(tree)) == tree and "&" not in to_text(tree)  # printed as words


def test_and_or_not_are_reserved():
    assert {"and", "or", "not"} <= RESERVED
