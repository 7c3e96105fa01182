"""Spec loading and validation (fuser_core.spec): the catalog loads, and every kind of invalid
spec raises SpecError naming the field (``.loc``) and the step (``.step``)."""

from __future__ import annotations

import copy
import json
import time

import pytest

from fuser_core.errors import SpecError
from fuser_core.expr import MAX_EXPR_NODES
from fuser_core.spec import (
    MAX_INLINED_NODES,
    MAX_SPEC_BYTES,
    MAX_STEPS,
    MAX_TOPK,
    Spec,
    load_spec,
)

from tests.support.catalog import load_catalog

CATALOG = load_catalog()


def test_catalog_is_there(catalog_dir, catalog_specs):
    assert catalog_dir.is_dir()
    assert {"safe_softmax", "attention", "moe_routing", "cross_entropy"} <= set(catalog_specs)
    assert "suites" not in catalog_specs


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_spec_loads(name, catalog_dir):
    raw = CATALOG[name]
    text = (catalog_dir / f"{name}.json").read_text()
    for source in (raw, text, text.encode("utf-8")):
        spec = load_spec(source)
        assert isinstance(spec, Spec)
        assert spec.name == raw["name"] == name
        assert [s.name for s in spec.steps] == [s["name"] for s in raw["steps"]]
        assert spec.outputs == tuple(raw["outputs"])


def test_load_spec_does_not_modify_its_argument():
    raw = copy.deepcopy(CATALOG["attention"])
    load_spec(raw)
    assert raw == CATALOG["attention"]


# ---------------------------------------------------------------- inferred dims


@pytest.mark.parametrize(
    ("spec", "step", "dims"),
    [
        ("safe_softmax", "mx", ("m",)),
        ("safe_softmax", "den", ("m",)),
        ("safe_softmax", "y", ("m", "n")),
        ("logsumexp", "lse", ("m",)),
        ("attention", "s", ("b", "h", "m", "n")),
        ("attention", "mx", ("b", "h", "m")),
        ("attention", "den", ("b", "h", "m")),
        ("attention", "o", ("b", "h", "m", "e")),
        ("attention_causal", "s0", ("b", "h", "m", "n")),
        ("attention_causal", "s", ("b", "h", "m", "n")),
        ("attention_causal", "o", ("b", "h", "m", "e")),
        ("moe_routing", "mx", ("t",)),
        ("moe_routing", "gate", ("t", "j")),
        ("cross_entropy", "picked", ("t",)),
        ("cross_entropy", "loss", ("t",)),
        ("fp8_quant_gemm", "amax", ("m",)),
        ("fp8_quant_gemm", "acc", ("m", "n")),
        ("fp8_quant_gemm", "out", ("m", "n")),
        ("fp8_quant_per_token", "scale", ("t",)),
        ("fp8_quant_per_token", "q", ("t", "c")),
        ("layernorm", "mean", ("t",)),
        ("layernorm", "var", ("t",)),
        ("layernorm", "y", ("t", "c")),
        ("rmsnorm", "ms", ("t",)),
        ("rmsnorm", "y", ("t", "c")),
    ],
)
def test_inferred_dims(spec, step, dims):
    assert load_spec(CATALOG[spec]).step(step).dims == dims


def test_spec_level_facts():
    attn = load_spec(CATALOG["attention"])
    assert attn.dims == ("b", "h", "m", "d", "n", "e")
    assert attn.output_parts == ("o",)
    assert [p.name for p in attn.params] == ["scale"]
    assert attn.step("s").is_reduction and attn.step("s").over == "d"

    moe = load_spec(CATALOG["moe_routing"])
    gate = moe.step("gate")
    assert (gate.reduce, gate.k, gate.as_dim, gate.over) == ("topk", 8, "j", "x")
    assert moe.dims == ("t", "x", "j")
    assert moe.output_parts == ("gate.values", "gate.indices")

    ce = load_spec(CATALOG["cross_entropy"])
    assert ce.input("target").kind == "index"
    assert ce.input("logits").kind == "float"

    fp8 = load_spec(CATALOG["fp8_quant_per_token"])
    assert fp8.outputs == ("q", "scale")


def test_argmax_step():
    raw = {
        "foldwise": 1, "name": "am", "inputs": {"x": {"dims": ["m", "n"]}},
        "steps": [{"name": "i", "reduce": "argmax", "over": "n", "expr": "x"}], "outputs": ["i"],
    }
    step = load_spec(raw).step("i")
    assert step.is_integer and step.dims == ("m",)


# ---------------------------------------------------------------- invalid specs


def _step(raw: dict, name: str) -> dict:
    return next(s for s in raw["steps"] if s["name"] == name)


def _set(path, value):
    """Mutation: set raw[path...] = value."""

    def mutate(raw):
        obj = raw
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return mutate


def _del(path):
    def mutate(raw):
        obj = raw
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]

    return mutate


def _expr(step, text):
    def mutate(raw):
        _step(raw, step)["expr"] = text

    return mutate


def _step_key(step, key, value):
    def mutate(raw):
        _step(raw, step)[key] = value

    return mutate


def _drop_step_key(step, key):
    def mutate(raw):
        del _step(raw, step)[key]

    return mutate


def _add_step(entry, at=None):
    def mutate(raw):
        raw["steps"].insert(len(raw["steps"]) if at is None else at, entry)

    return mutate


def _all(*mutations):
    def mutate(raw):
        for m in mutations:
            m(raw)

    return mutate


# (id, catalog spec, mutation, loc, step, words in the message)
INVALID = [
    # -- expressions: unknown names, arity, python
    ("unknown-name", "safe_softmax", _expr("den", "exp(x - mz)"), ("steps", 1, "expr"), "den", "unknown name 'mz'"),
    ("unknown-func", "safe_softmax", _expr("den", "expo(x - mx)"), ("steps", 1, "expr"), "den",
     "unknown function 'expo'"),
    ("arity", "safe_softmax", _expr("y", "exp(x, mx) / den"), ("steps", 2, "expr"), "y",
     "exp() takes 1 argument, got 2"),
    ("arity-where", "attention_causal", _expr("s", "where(index(n) <= index(m), s0)"), ("steps", 1, "expr"), "s",
     "where() takes 3 arguments"),
    ("attribute", "safe_softmax", _expr("y", "x.__class__"), ("steps", 2, "expr"), "y", "attribute access"),
    ("dunder-import", "safe_softmax", _expr("y", "__import__('os')"), ("steps", 2, "expr"), "y",
     "unknown function '__import__'"),
    ("dunder-name", "safe_softmax", _expr("y", "__builtins__"), ("steps", 2, "expr"), "y",
     "unknown name '__builtins__'"),
    ("parse-error", "safe_softmax", _expr("den", "exp(x - mx"), ("steps", 1, "expr"), "den", "expected ')'"),
    ("expr-not-text", "safe_softmax", _expr("den", 3), ("steps", 1, "expr"), "den", "expected an expression string"),
    ("expr-missing", "safe_softmax", _drop_step_key("den", "expr"), ("steps", 1, "expr"), "den", "required"),
    ("values-of-non-topk", "safe_softmax", _expr("den", "exp(x - mx.values)"), ("steps", 1, "expr"), "den",
     ".values is only for topk"),
    ("topk-without-part", "moe_routing",
     _all(_add_step({"name": "g2", "expr": "gate * 2"}), _set(("outputs",), ["g2"])),
     ("steps", 3, "expr"), "g2", "gate.values"),
    ("dim-as-name", "safe_softmax", _expr("den", "exp(x - mx) * n"), ("steps", 1, "expr"), "den", "'n' is a dim"),
    ("string-outside-cast", "safe_softmax", _expr("y", "exp(x - mx) / den * 'float16'"), ("steps", 2, "expr"), "y",
     "a string may only be the dtype of cast()"),
    ("bad-cast-dtype", "fp8_quant_per_token", _expr("q", "cast(clamp(x / scale, -448, 448), 'float64')"),
     ("steps", 2, "expr"), "q", "cast() takes a dtype string"),
    ("size-unknown-dim", "layernorm", _expr("mean", "x / size(z)"), ("steps", 0, "expr"), "mean", "unknown dim 'z'"),
    ("index-unknown-dim", "cross_entropy", _expr("picked", "where(index(w) == target, logits, 0)"),
     ("steps", 2, "expr"), "picked", "unknown dim 'w'"),
    # -- comparisons
    ("compare-outside-where", "safe_softmax", _expr("y", "x < mx"), ("steps", 2, "expr"), "y",
     "a comparison may only be the condition of where()"),
    ("compare-in-arith", "safe_softmax", _expr("y", "(x < mx) * den"), ("steps", 2, "expr"), "y",
     "a comparison may only be the condition of where()"),
    ("compare-as-where-value", "attention_causal", _expr("s", "where(index(n) <= index(m), s0 < 1, -inf)"),
     ("steps", 1, "expr"), "s", "a comparison may only be the condition of where()"),
    ("compare-nested-in-cond", "attention_causal", _expr("s", "where((index(n) <= index(m)) < 1, s0, -inf)"),
     ("steps", 1, "expr"), "s", "a comparison may only be the condition of where()"),
    ("where-non-comparison", "attention_causal", _expr("s", "where(index(n) - index(m), s0, -inf)"),
     ("steps", 1, "expr"), "s", "where() needs a comparison"),
    # -- and, or, not
    ("logic-outside-where", "attention_causal", _expr("s", "index(n) <= index(m) and index(n) < 3"), ("steps", 1, "expr"),
     "s", "and may only combine the conditions of where()"),
    ("logic-of-a-number", "attention_causal", _expr("s", "where(index(n) <= index(m) and s0, s0, -inf)"),
     ("steps", 1, "expr"), "s", "and combines comparisons"),
    ("not-of-a-number", "attention_causal", _expr("s", "where(not s0, s0, -inf)"),
     ("steps", 1, "expr"), "s", "not combines comparisons"),
    # -- cycles and order
    ("self-reference", "safe_softmax", _expr("den", "exp(x - mx) + den"), ("steps", 1, "expr"), "den", "uses itself"),
    ("forward-reference", "safe_softmax", _expr("mx", "x + den"), ("steps", 0, "expr"), "mx", "comes later"),
    ("cycle", "logsumexp", _all(_expr("mx", "lse"), _step_key("mx", "over", "n")), ("steps", 0, "expr"), "mx",
     "comes later"),
    ("duplicate-step", "safe_softmax", _step_key("den", "name", "mx"), ("steps", 1, "name"), "mx", "already used"),
    ("step-named-like-input", "safe_softmax", _all(_step_key("y", "name", "x"), _set(("outputs",), ["x"])),
     ("steps", 2, "name"), "x", "already used"),
    ("step-named-like-dim", "safe_softmax", _all(_step_key("y", "name", "n"), _set(("outputs",), ["n"])),
     ("steps", 2, "name"), "n", "already a dim name"),
    ("step-name-reserved", "safe_softmax", _all(_step_key("y", "name", "exp"), _set(("outputs",), ["exp"])),
     ("steps", 2, "name"), None, "reserved word"),
    ("step-name-bad", "safe_softmax", _step_key("y", "name", "y-1"), ("steps", 2, "name"), None, "identifier"),
    ("step-name-missing", "safe_softmax", _drop_step_key("y", "name"), ("steps", 2, "name"), None, "identifier"),
    ("step-not-object", "safe_softmax", _set(("steps", 1), "den"), ("steps", 1), None, "expected an object"),
    # -- reductions
    ("reduce-of-constant", "safe_softmax", _expr("mx", "1"), ("steps", 0, "over"), "mx",
     "reduces over 'n', but its expression has dims ()"),
    ("reduce-dim-not-in-expr", "logsumexp", _expr("den", "exp(mx)"), ("steps", 1, "over"), "den",
     "reduces over 'n', but its expression has dims (m)"),
    ("reduce-unknown-dim", "safe_softmax", _step_key("mx", "over", "w"), ("steps", 0, "over"), "mx", "unknown dim 'w'"),
    ("reduce-over-not-ident", "safe_softmax", _step_key("mx", "over", 3), ("steps", 0, "over"), "mx", "identifier"),
    ("reduce-over-one-in-a-list", "safe_softmax", _step_key("mx", "over", ["n"]), ("steps", 0, "over"), "mx",
     "names 2 to 4 dims"),
    ("reduce-without-over", "safe_softmax", _drop_step_key("mx", "over"), ("steps", 0, "over"), "mx", "needs 'over'"),
    ("unknown-reduce", "safe_softmax", _step_key("den", "reduce", "mean"), ("steps", 1, "reduce"), "den",
     "unknown reduction 'mean'"),
    ("reduce-not-text", "safe_softmax", _step_key("den", "reduce", ["sum"]), ("steps", 1, "reduce"), "den",
     "unknown reduction"),
    ("over-without-reduce", "safe_softmax", _step_key("y", "over", "n"), ("steps", 2, "over"), "y", "needs 'reduce'"),
    ("k-without-reduce", "safe_softmax", _step_key("y", "k", 2), ("steps", 2, "k"), "y", "needs 'reduce'"),
    ("k-on-sum", "safe_softmax", _step_key("den", "k", 2), ("steps", 1, "k"), "den", "only for topk"),
    ("as-on-max", "safe_softmax", _step_key("mx", "as", "j"), ("steps", 0, "as"), "mx", "only for topk"),
    # -- topk
    ("topk-without-k", "moe_routing", _drop_step_key("gate", "k"), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-zero", "moe_routing", _step_key("gate", "k", 0), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-negative", "moe_routing", _step_key("gate", "k", -1), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-bool", "moe_routing", _step_key("gate", "k", True), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-float", "moe_routing", _step_key("gate", "k", 8.0), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-text", "moe_routing", _step_key("gate", "k", "8"), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-k-huge", "moe_routing", _step_key("gate", "k", MAX_TOPK + 1), ("steps", 2, "k"), "gate", "topk needs 'k'"),
    ("topk-without-as", "moe_routing", _drop_step_key("gate", "as"), ("steps", 2, "as"), "gate", "identifier"),
    ("topk-as-existing-dim", "moe_routing", _step_key("gate", "as", "t"), ("steps", 2, "as"), "gate",
     "'t' already exists"),
    ("topk-as-over-dim", "moe_routing", _step_key("gate", "as", "x"), ("steps", 2, "as"), "gate", "already exists"),
    ("topk-as-step-name", "moe_routing", _step_key("gate", "as", "den"), ("steps", 2, "as"), "gate",
     "clashes with a name"),
    ("topk-as-input-name", "moe_routing", _step_key("gate", "as", "logits"), ("steps", 2, "as"), "gate",
     "clashes with a name"),
    ("topk-as-own-name", "moe_routing", _step_key("gate", "as", "gate"), ("steps", 2, "as"), "gate",
     "clashes with a name"),
    ("topk-as-reserved", "moe_routing", _step_key("gate", "as", "inf"), ("steps", 2, "as"), "gate", "reserved word"),
    # -- inputs and dims
    ("input-dim-twice", "safe_softmax", _set(("inputs", "x", "dims"), ["m", "m"]), ("inputs", "x", "dims"), None,
     "'m' appears twice"),
    ("dim-named-like-input", "layernorm", _set(("inputs", "x", "dims"), ["t", "gamma"]),
     ("inputs", "x", "dims", 1), None, "clashes with the input"),
    ("dim-named-like-own-input", "safe_softmax", _set(("inputs", "x", "dims"), ["m", "x"]),
     ("inputs", "x", "dims", 1), None, "clashes with the input"),
    ("dim-not-ident", "safe_softmax", _set(("inputs", "x", "dims"), ["m", "n 1"]), ("inputs", "x", "dims", 1), None,
     "identifier"),
    ("dim-not-text", "safe_softmax", _set(("inputs", "x", "dims"), ["m", 3]), ("inputs", "x", "dims", 1), None,
     "identifier"),
    ("dims-not-list", "safe_softmax", _set(("inputs", "x", "dims"), "m n"), ("inputs", "x", "dims"), None,
     "list of dim names"),
    ("dims-missing", "safe_softmax", _set(("inputs", "x"), {}), ("inputs", "x", "dims"), None, "list of dim names"),
    ("too-many-dims", "safe_softmax", _set(("inputs", "x", "dims"), [f"a{i}" for i in range(9)]),
     ("inputs", "x", "dims"), None, "the limit is 8"),
    ("input-kind", "cross_entropy", _set(("inputs", "target", "kind"), "int"), ("inputs", "target", "kind"), None,
     "must be 'index' or 'float'"),
    ("input-unknown-key", "safe_softmax", _set(("inputs", "x", "dtype"), "float16"), ("inputs", "x"), None,
     "unknown field 'dtype'"),
    ("input-not-object", "safe_softmax", _set(("inputs", "x"), ["m", "n"]), ("inputs", "x"), None,
     "expected an object"),
    ("input-name-bad", "safe_softmax", _set(("inputs",), {"1x": {"dims": ["m"]}}), ("inputs", "1x"), None,
     "identifier"),
    ("input-name-reserved", "safe_softmax", _set(("inputs",), {"exp": {"dims": ["m"]}}), ("inputs", "exp"), None,
     "reserved word"),
    ("inputs-empty", "safe_softmax", _set(("inputs",), {}), ("inputs",), None, "non-empty"),
    ("unused-input", "layernorm", _expr("y", "(x - mean) * rsqrt(var + eps) * gamma"), ("inputs", "beta"), None,
     "not used"),
    # -- params
    ("param-uses-name", "layernorm", _set(("params", "eps"), "x * 2"), ("params", "eps"), None, "unknown name 'x'"),
    ("param-uses-param", "attention", _set(("params", "s2"), "scale * 2"), ("params", "s2"), None,
     "unknown name 'scale'"),
    ("param-uses-index", "attention", _set(("params", "scale"), "index(d)"), ("params", "scale"), None, "index()"),
    ("param-size-unknown-dim", "attention", _set(("params", "scale"), "size(w)"), ("params", "scale"), None,
     "unknown dim 'w'"),
    ("param-compare", "attention", _set(("params", "scale"), "size(d) < 2"), ("params", "scale"), None,
     "comparisons"),
    ("param-where", "attention", _set(("params", "scale"), "where(size(d) < 2, 1, 2)"), ("params", "scale"), None,
     "not allowed in a param"),
    ("param-bool", "layernorm", _set(("params", "eps"), True), ("params", "eps"), None, "a number or an expression"),
    ("param-null", "layernorm", _set(("params", "eps"), None), ("params", "eps"), None, "a number or an expression"),
    ("param-list", "layernorm", _set(("params", "eps"), [1]), ("params", "eps"), None, "a number or an expression"),
    ("param-huge-int", "layernorm", _set(("params", "eps"), 10**400), ("params", "eps"), None, "finite"),
    ("param-inf-float", "layernorm", _set(("params", "eps"), float("inf")), ("params", "eps"), None, "finite"),
    ("param-parse-error", "attention", _set(("params", "scale"), "1 / sqrt(size(d)"), ("params", "scale"), None,
     "expected ')'"),
    ("param-name-clash", "layernorm", _set(("params", "x"), 1), ("params", "x"), None, "already used"),
    ("param-named-like-dim", "layernorm", _set(("params", "c"), 1), ("params", "c"), None, "already a dim"),
    ("params-not-object", "layernorm", _set(("params",), [1]), ("params",), None, "expected an object"),
    # -- top level
    ("unknown-top-key", "safe_softmax", _set(("version",), 1), (), None, "unknown field 'version'"),
    ("unknown-step-key", "safe_softmax", _step_key("den", "keepdims", True), ("steps", 1), None,
     "unknown field 'keepdims'"),
    ("foldwise-2", "safe_softmax", _set(("foldwise",), 2), ("foldwise",), None, "unsupported format version 2"),
    ("foldwise-text", "safe_softmax", _set(("foldwise",), "1"), ("foldwise",), None, "unsupported format version"),
    ("foldwise-true", "safe_softmax", _set(("foldwise",), True), ("foldwise",), None, "unsupported format version"),
    ("foldwise-float", "safe_softmax", _set(("foldwise",), 1.0), ("foldwise",), None, "unsupported format version"),
    ("foldwise-missing", "safe_softmax", _del(("foldwise",)), ("foldwise",), None, "required"),
    ("name-missing", "safe_softmax", _del(("name",)), ("name",), None, "required"),
    ("name-upper", "safe_softmax", _set(("name",), "Softmax"), ("name",), None, "[a-z][a-z0-9_]*"),
    ("name-dash", "safe_softmax", _set(("name",), "safe-softmax"), ("name",), None, "[a-z][a-z0-9_]*"),
    ("name-too-long", "safe_softmax", _set(("name",), "a" * 65), ("name",), None, "at most 64"),
    ("name-empty", "safe_softmax", _set(("name",), ""), ("name",), None, "[a-z][a-z0-9_]*"),
    ("name-not-text", "safe_softmax", _set(("name",), 7), ("name",), None, "[a-z][a-z0-9_]*"),
    ("doc-not-text", "safe_softmax", _set(("doc",), ["x"]), ("doc",), None, "text"),
    ("doc-too-long", "safe_softmax", _set(("doc",), "x" * 5000), ("doc",), None, "at most"),
    ("steps-empty", "safe_softmax", _set(("steps",), []), ("steps",), None, "non-empty list"),
    ("steps-not-list", "safe_softmax", _set(("steps",), {"y": "x"}), ("steps",), None, "non-empty list"),
    ("too-many-steps", "safe_softmax",
     _set(("steps",), [{"name": f"a{i}", "expr": "x" if i == 0 else f"a{i - 1} + 1"} for i in range(MAX_STEPS + 1)]),
     ("steps",), None, f"the limit is {MAX_STEPS}"),
    # -- outputs
    ("output-is-input", "safe_softmax", _set(("outputs",), ["y", "x"]), ("outputs", 1), None, "is an input"),
    ("output-is-param", "layernorm", _set(("outputs",), ["y", "eps"]), ("outputs", 1), None, "is a param"),
    ("output-unknown", "safe_softmax", _set(("outputs",), ["z"]), ("outputs", 0), None, "not a step"),
    ("output-topk-part", "moe_routing", _set(("outputs",), ["gate.values"]), ("outputs", 0), None, "not a step"),
    ("output-twice", "safe_softmax", _set(("outputs",), ["y", "y"]), ("outputs", 1), None, "listed twice"),
    ("output-not-text", "safe_softmax", _set(("outputs",), [["y"]]), ("outputs", 0), None, "not a step"),
    ("outputs-empty", "safe_softmax", _set(("outputs",), []), ("outputs",), None, "non-empty list"),
    ("outputs-not-list", "safe_softmax", _set(("outputs",), "y"), ("outputs",), None, "non-empty list"),
    ("step-unreached", "safe_softmax", _set(("outputs",), ["den"]), ("steps", 2, "name"), "y",
     "does not reach any output"),
    ("dead-step-in-middle", "safe_softmax", _add_step({"name": "junk", "expr": "x * 2"}, at=1), ("steps", 1, "name"),
     "junk", "does not reach any output"),
    # -- output_dtypes
    ("output-dtype-not-output", "safe_softmax", _set(("output_dtypes",), {"den": "float32"}), ("output_dtypes", "den"),
     None, "is not an output"),
    ("output-dtype-unknown", "safe_softmax", _set(("output_dtypes",), {"y": "float64"}), ("output_dtypes", "y"), None,
     "one of float32, float16, bfloat16"),
    ("output-dtypes-not-object", "safe_softmax", _set(("output_dtypes",), ["y"]), ("output_dtypes",), None,
     "expected an object"),
]


@pytest.mark.parametrize(
    ("base", "mutate", "loc", "step", "words"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_spec(base, mutate, loc, step, words):
    raw = copy.deepcopy(CATALOG[base])
    mutate(raw)
    with pytest.raises(SpecError) as info:
        load_spec(raw)
    err = info.value
    assert words in err.message, err
    assert err.loc == loc, err
    if step is not None:
        assert err.step == step, err
    if loc and loc[0] == "steps" and len(loc) > 2 and loc[2] != "name":
        assert err.step is not None, "a step's field error names the step (unless the name itself is bad)"
    # the same through JSON text (where the value survives JSON)
    try:
        text = json.dumps(raw)
    except (TypeError, ValueError):
        return
    if "Infinity" in text or "NaN" in text or len(text) > MAX_SPEC_BYTES:
        return
    with pytest.raises(SpecError) as info2:
        load_spec(text)
    assert info2.value.loc == loc


def test_error_text_names_step_and_field():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw["steps"][1]["expr"] = "exp(x - mz)"
    with pytest.raises(SpecError) as info:
        load_spec(raw)
    assert str(info.value) == "steps[1] (den).expr: unknown name 'mz'"


def test_mutations_start_from_valid_specs():
    # guard: every base spec of the table is valid as is
    for name in {case[1] for case in INVALID}:
        load_spec(copy.deepcopy(CATALOG[name]))


# ---------------------------------------------------------------- decoding and size limits


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{", "not valid JSON"),
        ("", "not valid JSON"),
        ("{'foldwise': 1}", "not valid JSON"),
        ('{"foldwise": 1,}', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ("[]", "expected an object"),
        ("1", "expected an object"),
        ("null", "expected an object"),
        ('"spec"', "expected an object"),
        ('{"foldwise": NaN}', "JSON constant NaN"),
        ('{"foldwise": Infinity}', "JSON constant Infinity"),
        ('{"foldwise": -Infinity}', "JSON constant -Infinity"),
        ("[" * 100000, "larger than"),
        ("[" * 30000 + "]" * 30000, "nests too deeply"),
        ('{"a":' * 10000 + "1" + "}" * 10000, "nests too deeply"),
        ('{"foldwise": ' + "1" * 5000 + "}", "not valid JSON"),
        ("\ud800", "not valid JSON"),
    ],
    ids=lambda v: v[:20] if isinstance(v, str) else None,
)
def test_bad_source(source, words):
    with pytest.raises(SpecError) as info:
        load_spec(source)
    assert words in info.value.message


@pytest.mark.parametrize("source", [None, 1, 1.5, ["a"], object(), bytearray(b"{}")])
def test_source_of_wrong_type(source):
    with pytest.raises(SpecError):
        load_spec(source)


def test_nan_in_params_from_json_text():
    text = json.dumps(CATALOG["layernorm"]).replace("1e-05", "NaN")
    with pytest.raises(SpecError) as info:
        load_spec(text)
    assert "NaN" in info.value.message


def test_spec_text_too_large():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    text = json.dumps(raw)
    padded = text[:-1] + "," + " " * (MAX_SPEC_BYTES - len(text)) + "}"
    assert len(padded.encode()) > MAX_SPEC_BYTES
    with pytest.raises(SpecError) as info:
        load_spec(padded)
    assert str(MAX_SPEC_BYTES) in info.value.message
    with pytest.raises(SpecError) as info:
        load_spec(padded.encode())
    assert str(MAX_SPEC_BYTES) in info.value.message
    # multi-byte characters count as bytes, not characters
    raw["doc"] = "\u00e9" * (MAX_SPEC_BYTES // 2 + 10)
    with pytest.raises(SpecError) as info:
        load_spec(json.dumps(raw, ensure_ascii=False))
    assert str(MAX_SPEC_BYTES) in info.value.message


def test_deeply_nested_value_given_as_dict():
    # a dict handed over directly (the HTTP layer decodes JSON itself): no RecursionError
    deep: list = []
    cur = deep
    for _ in range(100_000):
        cur.append([])
        cur = cur[0]
    for field in ("name", "foldwise", "inputs", "steps", "outputs", "doc"):
        raw = copy.deepcopy(CATALOG["safe_softmax"])
        raw[field] = deep
        with pytest.raises(SpecError) as info:
            load_spec(raw)
        assert info.value.loc[0] == field


def test_huge_int_values_given_as_dict():
    big = 10**5000
    for mutate in (
        _set(("foldwise",), big),
        _set(("params", "eps"), big),
        _set(("name",), big),
        _step_key("ms", "reduce", big),
        _step_key("ms", "over", big),
        _set(("outputs",), [big]),
    ):
        raw = copy.deepcopy(CATALOG["rmsnorm"])
        mutate(raw)
        with pytest.raises(SpecError) as info:
            load_spec(raw)
        assert len(str(info.value)) < 400


def test_non_string_keys_given_as_dict():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw[1] = 2
    with pytest.raises(SpecError) as info:
        load_spec(raw)
    assert "unknown field" in info.value.message
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw["inputs"][3] = {"dims": ["m"]}
    with pytest.raises(SpecError) as info:
        load_spec(raw)
    assert info.value.loc == ("inputs", 3)


# ---------------------------------------------------------------- blow-up limits


def _chain(n: int, expr) -> dict:
    steps = [{"name": "a0", "expr": "x"}]
    for i in range(1, n):
        steps.append({"name": f"a{i}", "expr": expr(f"a{i - 1}")})
    return {
        "foldwise": 1, "name": "chain", "inputs": {"x": {"dims": ["m"]}},
        "steps": steps, "outputs": [steps[-1]["name"]],
    }


def test_inlining_blow_up_is_caught():
    raw = _chain(MAX_STEPS, lambda prev: f"{prev} * {prev} + {prev}")
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        load_spec(raw)
    assert time.perf_counter() - start < 0.5
    err = info.value
    assert f"the limit is {MAX_INLINED_NODES}" in err.message
    assert err.loc[0] == "steps" and err.loc[2] == "expr"
    assert err.step == f"a{err.loc[1]}"


def test_inlining_stops_at_reductions():
    # the same doubling through reductions is fine: a reduction's result is one value
    steps = [{"name": "a0", "expr": "x"}]
    for i in range(1, 40):
        prev = f"a{i - 1}"
        if i % 2:
            steps.append({"name": f"a{i}", "expr": f"{prev} * {prev} + x"})
        else:
            steps.append({"name": f"a{i}", "reduce": "max", "over": "m", "expr": f"{prev} * x"})
    raw = {"foldwise": 1, "name": "chain", "inputs": {"x": {"dims": ["m"]}}, "steps": steps, "outputs": ["a39"]}
    load_spec(raw)


def test_long_linear_chain_is_fine():
    load_spec(_chain(MAX_STEPS, lambda prev: f"{prev} + 1"))


def test_one_big_expression_at_the_node_limit():
    raw = _chain(2, lambda prev: " + ".join([prev] * ((MAX_EXPR_NODES + 1) // 2)))
    load_spec(raw)


def test_shape_constraints():
    """``"constraints"`` (issue 36, 2): pairs of dims and a relation, read by a pattern (never
    evaluated), refused naming the entry when malformed; one spelling per meaning (``n >= m`` is
    ``m <= n``: the same spec_hash); a shape that breaks one is refused naming both dims."""
    from fuser_core.canonical import spec_hash
    from fuser_core.problem import ShapeError, bind_shape

    raw = {"foldwise": 1, "name": "c", "inputs": {"q": {"dims": ["m", "d"]}, "k": {"dims": ["n", "d"]}},
           "steps": [{"name": "s", "reduce": "sum", "over": "d", "expr": "q * k"},
                     {"name": "mx", "reduce": "max", "over": "n", "expr": "s"}], "outputs": ["mx"]}
    plain = load_spec(raw)
    spec = load_spec({**raw, "constraints": ["m <= n"]})
    assert plain.constraints == () and spec.constraints == (("m", "<=", "n"),)
    assert spec_hash(spec) != spec_hash(plain)
    assert spec_hash(load_spec({**raw, "constraints": [" n>=m ", "m <= n"]})) == spec_hash(spec)
    assert load_spec({**raw, "constraints": ["n == m"]}).constraints == (("m", "==", "n"),)
    for bad, words in ((["m <= x"], "'x' is not a dim of this spec"), (["m <= m"], "compares 'm' with itself"),
                       (["m => n"], 'expected "<dim> <relation> <dim>"'), (["__import__('os') < n"], "expected"),
                       ("m <= n", "expected a list"), ([7], "expected"), (["m <= n"] * 17, "the limit is 16")):
        with pytest.raises(SpecError, match="^constraints") as err:
            load_spec({**raw, "constraints": bad})
        assert words in str(err.value), (bad, str(err.value))
    assert bind_shape(spec, {"m": 4, "n": 4, "d": 2}) == {"m": 4, "n": 4, "d": 2}
    with pytest.raises(ShapeError, match=r"^shape\.m: m = 5 and n = 4: the spec takes only m <= n$"):
        bind_shape(spec, {"m": 5, "n": 4, "d": 2})


def test_output_dtypes_store_values_not_indices():
    """``output_dtypes`` stores a value output in its dtype (a top-k's values, not its indices), refuses an
    arg-reduction's indices by name, and is part of the spec's identity."""
    from fuser_core.canonical import spec_hash
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.problem import make_problem
    from fuser_core.catalog import PACKAGED_DIR
    from fuser_core.spec import load_spec

    moe = load_catalog_spec("moe_routing")
    stored = json.loads((PACKAGED_DIR / "moe_routing.json").read_text()) | {"output_dtypes": {"gate": "float32"}}
    dtypes = make_problem(load_spec(stored), {"t": 3, "x": 8}, "bfloat16").output_dtypes
    assert dtypes == {"gate.values": "float32", "gate.indices": "int32"}
    assert spec_hash(load_spec(stored)) != spec_hash(moe)
    arg = {"foldwise": 1, "name": "a", "inputs": {"x": {"dims": ["m", "n"]}},
           "steps": [{"name": "i", "reduce": "argmax", "over": "n", "expr": "x"}], "outputs": ["i"],
           "output_dtypes": {"i": "float32"}}
    with pytest.raises(SpecError) as err:
        load_spec(arg)
    assert err.value.loc == ("output_dtypes", "i") and "writes indices" in str(err.value)
