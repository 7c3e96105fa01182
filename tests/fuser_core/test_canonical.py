"""Canonical form and spec_hash (fuser_core.canonical): docs/SPEC.md "Canonical form and identity"."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
from tests.support.catalog import load_catalog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser_core.canonical import canonical_form, canonical_json, canonical_names, spec_hash
from fuser_core.report import derivation_report
from fuser_core.expr import RESERVED
from fuser_core.spec import load_spec

CATALOG = load_catalog()
NAMES = sorted(CATALOG)


def h(raw) -> str:
    return spec_hash(load_spec(raw))


# ---------------------------------------------------------------- helpers: renaming and shuffling raw specs

_TOKEN = re.compile(r"\"[^\"]*\"|'[^']*'|(?<![.\w])[A-Za-z_]\w*")


def rename_expr(text: str, mapping: dict[str, str]) -> str:
    """Rename identifiers of an expression text (not strings, not .values/.indices)."""
    return _TOKEN.sub(lambda m: mapping.get(m.group(), m.group()), text)


def spec_names(raw: dict) -> tuple[list[str], list[str], list[str]]:
    """(dims, steps, params) named by a raw spec."""
    dims: list[str] = []
    for decl in raw["inputs"].values():
        dims += [d for d in decl["dims"] if d not in dims]
    dims += [s["as"] for s in raw["steps"] if "as" in s]
    # a runtime param keeps its name (the call's keyword; docs/SPEC.md): only constant params are renamings
    return dims, [s["name"] for s in raw["steps"]], [p for p, v in raw.get("params", {}).items() if not isinstance(v, dict)]


def _renamed_param(value, mapping: dict[str, str]):
    """A param's value with names renamed: an expression, or a runtime param's default expression."""
    if isinstance(value, str):
        return rename_expr(value, mapping)
    if isinstance(value, dict) and isinstance(value.get("default"), str):
        return {**value, "default": rename_expr(value["default"], mapping)}
    return value


def rename(raw: dict, mapping: dict[str, str]) -> dict:
    """Consistently rename dims, steps and params (inputs keep their names) in a raw spec."""
    out = copy.deepcopy(raw)
    out["inputs"] = {
        name: {**decl, "dims": [mapping.get(d, d) for d in decl["dims"]]} for name, decl in raw["inputs"].items()
    }
    for decl in out["inputs"].values():  # a paged input's layout names its dims (its table keeps its name)
        if "paged" in decl:
            paged = decl["paged"]
            decl["paged"] = {**paged, "dim": mapping.get(paged["dim"], paged["dim"]),
                             "by": [mapping.get(d, d) for d in paged["by"]]}
    out["params"] = {mapping.get(p, p): _renamed_param(v, mapping) for p, v in raw.get("params", {}).items()}
    steps = []
    for s in raw["steps"]:
        s = dict(s)
        s["name"] = mapping.get(s["name"], s["name"])
        s["expr"] = rename_expr(s["expr"], mapping)
        for key in ("over", "as"):
            if isinstance(s.get(key), list):  # dims reduced together
                s[key] = [mapping.get(d, d) for d in s[key]]
            elif key in s:
                s[key] = mapping.get(s[key], s[key])
        steps.append(s)
    out["steps"] = steps
    out["outputs"] = [mapping.get(o, o) for o in raw["outputs"]]
    if "constraints" in raw:  # "m <= n": dims
        out["constraints"] = [rename_expr(c, mapping) for c in raw["constraints"]]
    if "example" in raw:  # dim -> size
        out["example"] = {mapping.get(d, d): n for d, n in raw["example"].items()}
    return out


def shuffle_keys(value, rng: random.Random):
    """The same JSON value with every object's keys in a random order (lists keep theirs)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffle_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffle_keys(v, rng) for v in value]
    return value


# ---------------------------------------------------------------- invariance


@pytest.mark.parametrize("name", NAMES)
def test_hash_is_stable_and_hex(name):
    a, b = h(CATALOG[name]), h(copy.deepcopy(CATALOG[name]))
    assert a == b
    assert re.fullmatch(r"[0-9a-f]{64}", a)


def test_catalog_hashes_are_distinct():
    hashes = {h(raw) for raw in CATALOG.values()}
    assert len(hashes) == len(CATALOG)


@pytest.mark.parametrize("name", NAMES)
def test_key_order_at_every_level(name):
    raw = CATALOG[name]
    for seed in range(5):
        assert h(shuffle_keys(raw, random.Random(seed))) == h(raw)
    # also as JSON text with sorted keys and different whitespace
    assert h(json.dumps(raw, sort_keys=True)) == h(raw)
    assert h(json.dumps(raw, indent=7)) == h(json.dumps(raw, separators=(",", ":")))


def test_input_declaration_order():
    raw = CATALOG["attention"]
    reordered = dict(raw, inputs={k: raw["inputs"][k] for k in ("v", "q", "k")})
    assert load_spec(reordered).dims != load_spec(raw).dims  # the spec's own dim order changes...
    assert h(reordered) == h(raw)  # ...but not its identity


@pytest.mark.parametrize("name", NAMES)
def test_name_and_doc_do_not_count(name):
    raw = copy.deepcopy(CATALOG[name])
    other = dict(raw, name="something_else", doc="other words")
    assert h(other) == h(raw)
    other.pop("doc")
    assert h(other) == h(raw)


@pytest.mark.parametrize(
    ("spec", "step", "variant"),
    [
        ("safe_softmax", "den", "exp( x-mx )"),
        ("safe_softmax", "den", "(exp((x - (mx))))"),
        ("safe_softmax", "y", "(exp(x - mx)) / (den)"),
        ("layernorm", "var", "((x - mean) ** 2) / size(c)"),
        ("layernorm", "var", "(x - mean)**2/size( c )"),
        ("attention", "s", "(q * k) * scale"),
        ("attention_causal", "s", "where((index(n) <= (index(m) + size(n)) - size(m)), s0, -(inf))"),
        ("attention_causal", "s", "where(index(n) <= index(m) + size(n) - size(m), s0, -inf)\n"),
        ("fp8_quant_gemm", "amax", "maximum(abs(a), 0.000000000001)"),
        ("fp8_quant_gemm", "amax", "maximum(abs(a), 1E-12)"),
        ("fp8_quant_gemm", "amax", "maximum(abs(a), 1.0e-12)"),
        ("fp8_quant_gemm", "out", "acc * amax / 448.0 * w_scale"),
        ("fp8_quant_gemm", "out", "acc * amax / 4.48e2 * w_scale"),
        ("fp8_quant_gemm", "acc", "cast(a * 448 / amax, 'float8_e4m3fn') * w"),
        ("fp8_quant_per_token", "q", "cast(clamp(x / scale, -(448), 448.), \"float8_e4m3fn\")"),
        ("cross_entropy", "picked", "where(index(v) == target, logits, 0.0)"),
    ],
)
def test_expression_spelling_does_not_count(spec, step, variant):
    raw = copy.deepcopy(CATALOG[spec])
    next(s for s in raw["steps"] if s["name"] == step)["expr"] = variant
    assert h(raw) == h(CATALOG[spec])


def test_param_spelling_does_not_count():
    baked = copy.deepcopy(CATALOG["layernorm"])  # the catalog's eps is a runtime scalar: a constant here
    baked["params"]["eps"] = 1e-05
    base = h(baked)
    assert base != h(CATALOG["layernorm"])
    for eps in (0.00001, "1e-5", "0.00001", "(1e-05)", " 1.0E-5 "):
        raw = copy.deepcopy(CATALOG["layernorm"])
        raw["params"]["eps"] = eps
        assert h(raw) == base, eps
    raw = copy.deepcopy(CATALOG["attention"])
    raw["params"]["scale"] = "1/sqrt( size(d) )"
    assert h(raw) == h(CATALOG["attention"])


def test_float_kind_spelled_out_does_not_count():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw["inputs"]["x"]["kind"] = "float"
    assert h(raw) == h(CATALOG["safe_softmax"])


def test_unused_param_does_not_count():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw["params"] = {"unused": 3}
    assert h(raw) == h(CATALOG["safe_softmax"])


def test_missing_params_equals_empty_params():
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw.pop("params", None)
    assert h(raw) == h(CATALOG["safe_softmax"])


@pytest.mark.parametrize("name", NAMES)
def test_renaming_dims_steps_params(name):
    raw = CATALOG[name]
    dims, steps, params = spec_names(raw)
    mapping = {d: f"dim_{i}" for i, d in enumerate(reversed(dims))}
    mapping |= {s: f"stp{i}_" for i, s in enumerate(reversed(steps))}
    mapping |= {p: f"P{i}" for i, p in enumerate(params)}
    renamed = rename(raw, mapping)
    assert renamed != raw
    assert h(renamed) == h(raw)
    # each kind alone too
    for only in (dims, steps, params):
        assert h(rename(raw, {k: v for k, v in mapping.items() if k in only})) == h(raw)


def test_swapping_step_names_is_a_renaming():
    raw = CATALOG["safe_softmax"]
    assert h(rename(raw, {"mx": "den", "den": "mx"})) == h(raw)
    assert h(rename(raw, {"m": "n", "n": "m"})) == h(raw)


def test_renaming_an_input_changes_the_hash():
    # inputs keep their names: they are the kernel's interface
    raw = copy.deepcopy(CATALOG["safe_softmax"])
    raw["inputs"] = {"xx": raw["inputs"].pop("x")}
    for s in raw["steps"]:
        s["expr"] = rename_expr(s["expr"], {"x": "xx"})
    assert "xx" in raw["steps"][0]["expr"]
    assert h(raw) != h(CATALOG["safe_softmax"])


# ---------------------------------------------------------------- different computations


def _changed(spec, mutate):
    raw = copy.deepcopy(CATALOG[spec])
    mutate(raw)
    return raw


def _step_of(raw, name):
    return next(s for s in raw["steps"] if s["name"] == name)


DIFFERENT = [
    ("sum-vs-max", "logsumexp", lambda r: _step_of(r, "mx").update(reduce="min")),
    ("max-vs-sum", "safe_softmax", lambda r: _step_of(r, "mx").update(reduce="sum")),
    ("argmax", "safe_softmax",
     lambda r: (_step_of(r, "mx").update(reduce="argmax"))),
    ("other-over", "attention", lambda r: _step_of(r, "s").update(over="h")),
    ("constant", "fp8_quant_per_token", lambda r: _step_of(r, "scale").update(expr="maximum(amax, 1e-12) / 447")),
    ("constant-tiny", "fp8_quant_gemm", lambda r: _step_of(r, "amax").update(expr="maximum(abs(a), 1e-13)")),
    ("param-value", "layernorm", lambda r: r["params"].update(eps=1e-6)),
    ("param-size-dim", "attention", lambda r: r["params"].update(scale="1 / sqrt(size(e))")),
    ("k", "moe_routing", lambda r: _step_of(r, "gate").update(k=4)),
    ("swap-minus", "safe_softmax", lambda r: _step_of(r, "den").update(expr="exp(mx - x)")),
    ("swap-divide", "safe_softmax", lambda r: _step_of(r, "y").update(expr="den / exp(x - mx)")),
    ("swap-compare", "attention_causal",
     lambda r: _step_of(r, "s").update(expr="where(index(m) <= index(n), s0, -inf)")),
    ("compare-op", "attention_causal", lambda r: _step_of(r, "s").update(expr="where(index(n) < index(m), s0, -inf)")),
    ("neg-inf", "attention_causal", lambda r: _step_of(r, "s").update(expr="where(index(n) <= index(m), s0, inf)")),
    ("input-kind", "cross_entropy", lambda r: r["inputs"]["target"].pop("kind")),
    ("input-dim-order", "safe_softmax", lambda r: r["inputs"]["x"].update(dims=["n", "m"])),
    ("cast-dtype", "fp8_quant_per_token",
     lambda r: _step_of(r, "q").update(expr='cast(clamp(x / scale, -448, 448), "bfloat16")')),
    ("outputs-order", "fp8_quant_per_token", lambda r: r.update(outputs=["scale", "q"])),
    ("extra-output", "safe_softmax", lambda r: r.update(outputs=["y", "den"])),
    ("power", "layernorm", lambda r: _step_of(r, "var").update(expr="(x - mean) ** 3 / size(c)")),
    ("minus-precedence", "layernorm", lambda r: _step_of(r, "var").update(expr="-(x - mean) ** 2 / size(c)")),
    ("neg-zero", "safe_softmax", lambda r: _step_of(r, "y").update(expr="exp(x - mx) / den + 1 / -0")),
]


@pytest.mark.parametrize(("spec", "mutate"), [c[1:] for c in DIFFERENT], ids=[c[0] for c in DIFFERENT])
def test_different_computations_hash_differently(spec, mutate):
    raw = _changed(spec, mutate)
    assert h(raw) != h(CATALOG[spec])


def test_negative_zero_is_not_zero():
    def with_expr(e):
        return _changed("safe_softmax", lambda r: _step_of(r, "y").update(expr=e))

    assert h(with_expr("exp(x - mx) / den + 1 / -0")) != h(with_expr("exp(x - mx) / den + 1 / 0"))
    assert h(with_expr("exp(x - mx) / den + 1 / -0")) == h(with_expr("exp(x - mx) / den + 1 / -0.0"))


def test_input_named_like_a_canonical_name():
    """Inputs keep their names, so canonical step/dim/param names must avoid them: with an
    input called s0, ``s0 + a`` and ``a + a`` (step 0 named a) must not print alike."""

    def spec(second):
        return {
            "foldwise": 1, "name": "t", "inputs": {"s0": {"dims": ["m"]}, "d0": {"dims": ["m"]}},
            "params": {"p0": 2},
            "steps": [{"name": "a", "expr": "exp(s0) * d0 * p0"}, {"name": "b", "expr": second}],
            "outputs": ["b"],
        }

    assert h(spec("a + s0")) != h(spec("a + a"))
    form = canonical_form(load_spec(spec("a + s0")))
    assert load_spec(form) is not None
    names = canonical_names(load_spec(spec("a + s0")))
    assert not set(names.values()) & {"s0", "d0"}
    assert names["p0"] == "p0" or names["p0"] == "p1"
    assert h(form) == h(spec("a + s0"))


# ---------------------------------------------------------------- the canonical form itself


@pytest.mark.parametrize("name", NAMES)
def test_canonical_form_is_a_valid_spec_with_the_same_hash(name):
    spec = load_spec(CATALOG[name])
    form = canonical_form(spec)
    json.dumps(form)  # JSON-able
    again = load_spec(form)
    assert spec_hash(again) == spec_hash(spec)
    assert canonical_form(again) == form  # a fixed point
    assert load_spec(canonical_json(spec)).name == "canonical"
    # same structure
    assert [(s.reduce, s.k) for s in again.steps] == [(s.reduce, s.k) for s in spec.steps]
    assert {i.name for i in again.inputs} == {i.name for i in spec.inputs}


def test_canonical_form_of_attention():
    form = canonical_form(load_spec(CATALOG["attention"]))
    assert form["inputs"] == {
        "k": {"dims": ["d0", "d1", "d2", "d3"]},
        "q": {"dims": ["d0", "d1", "d4", "d3"]},
        "v": {"dims": ["d0", "d1", "d2", "d5"]},
    }
    assert form["params"] == {"p0": "1 / sqrt(size(d3))"}
    assert [s["name"] for s in form["steps"]] == ["s0", "s1", "s2", "s3"]
    assert form["steps"][0] == {"name": "s0", "expr": "q * k * p0", "reduce": "sum", "over": "d3"}
    assert form["steps"][3]["expr"] == "exp(s0 - s1) * v / s2"
    assert form["outputs"] == ["s3"]
    assert "doc" not in form


def test_canonical_form_of_topk():
    form = canonical_form(load_spec(CATALOG["moe_routing"]))
    gate = form["steps"][2]
    assert (gate["reduce"], gate["k"], gate["as"], gate["over"]) == ("topk", 8, "d2", "d1")


def test_canonical_json_is_compact_and_sorted():
    text = canonical_json(load_spec(CATALOG["safe_softmax"]))
    assert json.loads(text) == canonical_form(load_spec(CATALOG["safe_softmax"]))
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------- property: random renamings and shuffles

FRESH = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,7}", fullmatch=True).filter(lambda n: n not in RESERVED)


@st.composite
def renamed_catalog_spec(draw):
    name = draw(st.sampled_from(NAMES))
    raw = CATALOG[name]
    dims, steps, params = spec_names(raw)
    old = dims + steps + params
    taken = set(raw["inputs"])
    new = draw(
        st.lists(FRESH.filter(lambda n: n not in taken), min_size=len(old), max_size=len(old), unique=True)
    )
    mapping = dict(zip(old, new))
    seed = draw(st.integers(0, 2**32 - 1))
    out = shuffle_keys(rename(raw, mapping), random.Random(seed))
    out["name"] = draw(st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True))
    if draw(st.booleans()):
        out["doc"] = draw(st.text(max_size=30))
    else:
        out.pop("doc", None)
    return name, mapping, out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(renamed_catalog_spec())
def test_random_renaming_and_shuffle_keeps_the_hash(case):
    name, mapping, raw = case
    spec = load_spec(raw)
    assert spec_hash(spec) == h(CATALOG[name]), mapping
    assert canonical_form(spec) == canonical_form(load_spec(CATALOG[name]))
    # through JSON text with arbitrary whitespace too
    assert h(json.dumps(raw, indent=3)) == h(CATALOG[name])


def test_canonical_form_of_an_expression_at_the_length_limit_reloads():
    expr = "+".join(["abcdefghi"] * 200)  # 1999 characters, 399 nodes
    raw = {"foldwise": 1, "name": "a", "inputs": {"abcdefghi": {"dims": ["m"]}},
           "steps": [{"name": "y", "expr": expr}], "outputs": ["y"]}
    spec = load_spec(raw)
    assert spec_hash(load_spec(canonical_form(spec), printed=True)) == spec_hash(spec)
    assert derivation_report(spec)["spec_hash"] == spec_hash(spec)  # derive reloads the canonical form


def test_a_report_made_from_a_given_derivation_of_the_canonical_spec():
    """derivation_report(spec, derivation) reports the caller's derivation of the canonical spec
    (the worker's one derivation) without deriving, in the caller's names; another spec's, or one
    in non-canonical names, is refused."""
    import fuser_core.derive
    from fuser_core.derive import derive_cascade
    from fuser_core.report import clear_cache

    spec = load_spec(load_catalog()["safe_softmax"])
    canon = load_spec(canonical_form(spec))
    derivation = derive_cascade(canon)
    clear_cache()
    expected = derivation_report(spec)  # derived here
    clear_cache()
    real, fuser_core.derive.derive_cascade = fuser_core.derive.derive_cascade, None  # any derive here fails
    try:
        assert derivation_report(spec, derivation) == expected
    finally:
        fuser_core.derive.derive_cascade = real
    with pytest.raises(ValueError, match="canonical spec"):
        derivation_report(spec, derive_cascade(spec))
    with pytest.raises(ValueError, match="another spec"):
        derivation_report(spec, derive_cascade(load_spec(canonical_form(load_spec(load_catalog()["rmsnorm"])))))
