"""Property-based fuzzing of load_spec: whatever comes in, the only exception is SpecError,
and no input makes it slow. Raise FOLDWISE_FUZZ_EXAMPLES (e.g. 5000) for a longer run."""

from __future__ import annotations

import copy
import json
import math
import os
import time

from tests.support.catalog import load_catalog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser_core.canonical import canonical_form, spec_hash
from fuser_core.errors import SpecError
from fuser_core.expr import COMPARE_OPS, FUNCTIONS, SPECIAL_FUNCTIONS
from fuser_core.reduce_ops import SPEC_REDUCE_KINDS
from fuser_core.spec import load_spec

CATALOG = load_catalog()
NAMES = sorted(CATALOG)

EXAMPLES = int(os.environ.get("FOLDWISE_FUZZ_EXAMPLES", "0")) or None
# CPU seconds, not wall-clock: a loaded CI machine (other processes on the cores) must not fail the
# check, which guards against work that grows with the input (a pathological expression)
SLOW_LOAD_S = 0.5


def fuzz_settings(default: int):
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def check_load(source):
    """load_spec either accepts ``source`` or raises SpecError; never anything else, never slowly."""
    start = time.thread_time()
    try:
        spec = load_spec(source)
    except SpecError as err:
        assert isinstance(err.loc, tuple)
        assert all(isinstance(p, str | int) for p in err.loc)
        str(err)  # printable
        spec = None
    elapsed = time.thread_time() - start
    assert elapsed < SLOW_LOAD_S, f"load_spec took {elapsed:.2f} s"
    if spec is not None:
        # an accepted spec has a canonical form that is itself accepted, with the same hash
        form = canonical_form(spec)
        assert spec_hash(load_spec(form)) == spec_hash(spec)
        assert canonical_form(load_spec(json.dumps(form))) == form
    return spec


# ---------------------------------------------------------------- (a) arbitrary JSON values

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**400), 10**400),
    st.floats(),
    st.text(max_size=20),
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=10), inner, max_size=5),
    ),
    max_leaves=30,
)

# values shaped like specs, so that the fuzz gets past the first checks
IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,3}", fullmatch=True)
EXPR_PIECES = st.sampled_from(
    [*FUNCTIONS, *SPECIAL_FUNCTIONS, "(", ")", ",", "+", "-", "*", "/", "**", *COMPARE_OPS, ".values", ".indices",
     "1", "0", "-1", "inf", "1e-5", "'float16'", '"float8_e4m3fn"', "x", "y", "m", "n", "s", "mx", " "]
)
EXPR_SOUP = st.lists(st.one_of(EXPR_PIECES, IDENT), max_size=12).map("".join)
STEP = st.fixed_dictionaries(
    {"name": st.one_of(IDENT, JSON), "expr": st.one_of(EXPR_SOUP, JSON)},
    optional={
        "reduce": st.one_of(st.sampled_from(SPEC_REDUCE_KINDS), JSON),
        "over": st.one_of(IDENT, JSON),
        "k": st.one_of(st.integers(-2, 10), JSON),
        "as": st.one_of(IDENT, JSON),
    },
)
SPEC_SHAPED = st.fixed_dictionaries(
    {
        "foldwise": st.one_of(st.just(1), JSON),
        "name": st.one_of(IDENT, JSON),
        "inputs": st.one_of(
            st.dictionaries(IDENT, st.fixed_dictionaries({"dims": st.lists(IDENT, max_size=3)}), max_size=3), JSON
        ),
        "steps": st.one_of(st.lists(STEP, max_size=4), JSON),
        "outputs": st.one_of(st.lists(IDENT, max_size=3), JSON),
    },
    optional={"params": st.dictionaries(IDENT, st.one_of(EXPR_SOUP, JSON), max_size=2), "doc": JSON},
)


@fuzz_settings(300)
@given(st.one_of(JSON, SPEC_SHAPED))
def test_arbitrary_json_as_value(value):
    check_load(value)


@fuzz_settings(300)
@given(st.one_of(JSON, SPEC_SHAPED))
def test_arbitrary_json_as_text(value):
    try:
        text = json.dumps(value)
    except ValueError:  # an int too long to print
        return
    check_load(text)
    check_load(text.encode("utf-8"))


@fuzz_settings(200)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_arbitrary_text(source):
    check_load(source)


# ---------------------------------------------------------------- (b) mutated catalog specs

FRAGMENTS = [
    "exp(", "x.y", "x.__class__", "__import__('os')", "x ** 99999", "((((((x))))))" * 50, "(" * 40 + "x" + ")" * 40,
    "-" * 40 + "x", "exp(" * 40 + "x" + ")" * 40, "1e999", "nan", "inf", "-inf", "'float16'", "cast(x, 'float64')",
    "x < y < z", "where(x, y, z)", "where(1 < 2, 3 < 4, 5)", "size(size)", "index(1)", "", " ", "\x00", "\u0661",
    "x" * 3000, "a" * 64, "a" * 65, "values", "indices", "gate.values", "gate.indices", "lambda: 0", "x if y else z",
    "x; y", "`x`", "x @ y", "'", '"', "\\", "\n", "+".join(["x"] * 300), "float8_e4m3fn", "topk", "argmax",
]
OPERATORS = ["+", "-", "*", "/", "**", "(", ")", ",", ".", " ", *COMPARE_OPS]


def spec_vocabulary(raw) -> list[str]:
    """Every identifier-like key or string in a raw spec (names, dims, reduce ops...)."""
    words: set[str] = set()
    stack = [raw]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            words.update(k for k in value if isinstance(k, str))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and value.isidentifier():
            words.add(value)
    return sorted(words)


def soup(raw: dict):
    vocab = spec_vocabulary(raw) + list(FUNCTIONS) + list(SPECIAL_FUNCTIONS) + OPERATORS
    return st.lists(st.sampled_from(vocab), min_size=1, max_size=15).map(lambda ws: "".join(ws))


NUMBERS = st.one_of(
    st.integers(-3, 10),
    st.integers(),
    st.just(10**400),
    st.floats(),
    st.sampled_from([0, 1, 1.0, -1, 8, 1024, 1025, True, False, math.inf, -math.inf, math.nan, 1e308, 5e-324]),
)


def paths(value, prefix=()):
    """Every (path to a container, key) in a JSON value, leaves and containers alike."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((prefix, k))
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((prefix, i))
            out += paths(v, (*prefix, i))
    return out


def at(value, path):
    for key in path:
        value = value[key]
    return value


@st.composite
def mutated_spec(draw):
    raw = copy.deepcopy(CATALOG[draw(st.sampled_from(NAMES))])
    vocabulary = spec_vocabulary(raw)
    replacement_text = st.one_of(st.sampled_from(FRAGMENTS), soup(raw), st.text(max_size=12))
    for _ in range(draw(st.integers(1, 3))):
        candidates = paths(raw)
        if not candidates:
            break
        parent_path, key = draw(st.sampled_from(candidates))
        parent = at(raw, parent_path)
        old = parent[key]
        action = draw(st.sampled_from(["drop", "duplicate", "replace", "leaf", "leaf", "leaf"]))
        if action == "drop":
            del parent[key]
        elif action == "duplicate":
            if isinstance(parent, list):
                parent.insert(key, copy.deepcopy(old))
            else:
                new_key = draw(st.one_of(st.sampled_from(vocabulary), st.text(max_size=6)))
                parent[new_key] = copy.deepcopy(old)
        elif action == "replace":
            parent[key] = draw(st.one_of(JSON, replacement_text, NUMBERS))
        elif isinstance(old, str):
            parent[key] = draw(replacement_text)
        elif isinstance(old, int | float):
            parent[key] = draw(NUMBERS)
        else:
            parent[key] = draw(st.one_of(replacement_text, NUMBERS, JSON))
    return raw


@fuzz_settings(500)
@given(mutated_spec())
def test_mutated_catalog_specs(raw):
    check_load(raw)
    try:
        text = json.dumps(raw)
    except ValueError:
        return
    check_load(text)


@fuzz_settings(300)
@given(st.sampled_from(NAMES), st.data())
def test_expression_soup_in_catalog_specs(name, data):
    """Replace one expression (step or param) by a soup of the spec's own names, functions
    and operators: loads, or a SpecError naming that expression."""
    raw = copy.deepcopy(CATALOG[name])
    targets = [("steps", i, "expr") for i in range(len(raw["steps"]))]
    targets += [("params", p) for p in raw.get("params", {})]
    loc = data.draw(st.sampled_from(targets))
    text = data.draw(st.one_of(soup(raw), st.sampled_from(FRAGMENTS)))
    at(raw, loc[:-1])[loc[-1]] = text
    start = time.thread_time()
    try:
        load_spec(raw)
    except SpecError as err:
        assert err.loc, err
    assert time.thread_time() - start < SLOW_LOAD_S
