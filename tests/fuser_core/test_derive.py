"""The derivation: which reductions fuse, how, and why not (docs/THEORY.md 2-5)."""

from __future__ import annotations

import pytest
import sympy as sp

from tests.support.catalog import load_catalog
from fuser_core.certificate import certify
from fuser_core.derive import derive_cascade
from fuser_core.spec import load_spec

CATALOG = load_catalog()

# docs/THEORY.md and the catalog: every catalog cascade fuses; the interesting ones and how.
EXPECTED_KIND = {
    ("attention", "den"): "scaled",
    ("attention", "o"): "scaled",
    ("attention_causal", "o"): "scaled",
    ("cross_entropy", "den"): "scaled",
    ("cross_entropy", "picked"): "first",
    ("fp8_quant_gemm", "acc"): "scaled",
    ("layernorm", "var"): "taylor",
    ("logsumexp", "den"): "scaled",
    ("moe_routing", "gate"): "scaled",
    ("safe_softmax", "den"): "scaled",
}


def spec_of(steps, outputs, inputs=None):
    return load_spec(
        {"foldwise": 1, "name": "t", "inputs": inputs or {"x": {"dims": ["m", "n"]}}, "steps": steps, "outputs": outputs}
    )


MX = {"name": "mx", "reduce": "max", "over": "n", "expr": "x"}
MEAN = {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"}
DEN = {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_spec_fuses_and_certifies(name):
    d = derive_cascade(load_spec(CATALOG[name]))
    assert d.fusible, {f.name: f.reason for f in d.forms.values()}
    cert = certify(d, trials=12, seed=1)
    assert cert.holds
    assert cert.algebra_max_rel_err < 1e-9
    assert cert.exact == (name != "fp8_quant_gemm")
    for (spec_name, step), kind in EXPECTED_KIND.items():
        if spec_name == name:
            assert d.forms[step].kind == kind


def test_softmax_correction_is_the_online_softmax_rescale():
    d = derive_cascade(load_spec(CATALOG["safe_softmax"]))
    den = d.forms["den"]
    mx_old, mx_new = sp.Symbol("mx[old]", real=True), sp.Symbol("mx[new]", real=True)
    assert den.deps == ("mx",)
    assert sp.simplify(den.corrections[0] - sp.exp(mx_old - mx_new)) == 0


def test_attention_defers_the_denominator_like_flash_attention():
    o = derive_cascade(load_spec(CATALOG["attention"])).forms["o"]
    assert o.deps == ("mx", "den")
    assert str(o.deferred[0]) == "1/den"  # applied once at the end
    assert "mx" in str(o.corrections[0]) and "den" not in str(o.corrections[0])
    assert o.contraction  # p.v should be a tl.dot


def test_layernorm_variance_is_centred_with_its_first_order_sum():
    """Taylor, not Welford: the state is sum (x - mean~)^2 / N and sum -2 (x - mean~) / N; the top
    coefficient sum 1 / N is the count (no state). The shifted form's move would take the first-order
    sum as 0, which a rounded running mean makes false (351x the formula's error at mean 1000)."""
    from fuser_core.realisation import ShiftTerm

    var = derive_cascade(load_spec(CATALOG["layernorm"])).forms["var"]
    count = sp.Symbol("count[old]", integer=True, nonnegative=True)
    n = sp.Symbol("size(c)", integer=True, positive=True)
    x, mean = sp.Symbol("x", real=True), sp.Symbol("mean", real=True)
    m_old, m_new = sp.Symbol("mean[old]", real=True), sp.Symbol("mean[new]", real=True)
    acc0, acc1 = sp.Symbol("acc[0]"), sp.Symbol("acc[1]")
    assert var.kind == "taylor" and len(var.contributions) == 2
    assert sp.simplify(var.contributions[0] - (x - mean) ** 2 / n) == 0
    assert sp.simplify(var.contributions[1] + 2 * (x - mean) / n) == 0
    d = m_new - m_old
    assert sp.simplify(var.reanchor[0] - (acc0 + ShiftTerm(acc1, d) + ShiftTerm(count / n, d**2))) == 0
    assert sp.simplify(var.reanchor[1] - (acc1 + ShiftTerm(count / n, 2 * d))) == 0


def test_a_cast_inside_a_multi_term_sum_keeps_the_shifted_form():
    """Taylor does not take casts (the cast values are not a polynomial in the anchor); the shifted
    (Welford/Chan) move still fuses them."""
    mean = {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"}
    d = derive_cascade(spec_of([mean, {"name": "r", "reduce": "sum", "over": "n",
                                       "expr": '(cast(x, "bfloat16") - mean) ** 2 / size(n)'}], ["r"]))
    assert d.forms["r"].kind == "shifted", d.forms["r"].reason


def test_moe_topk_is_monotone_in_the_softmax():
    gate = derive_cascade(load_spec(CATALOG["moe_routing"])).forms["gate"]
    assert gate.effective_op == "topk"
    assert str(gate.deferred[0]) == "1/den"


def test_cross_entropy_gather_fuses_horizontally():
    d = derive_cascade(load_spec(CATALOG["cross_entropy"]))
    (group,) = d.groups
    assert set(group.horizontal) == {"mx", "picked"}
    assert [e.name for e in d.epilogue] == ["loss"] and not d.epilogue[0].second_pass


def test_fp8_gemm_is_inexact_because_of_the_cast():
    d = derive_cascade(load_spec(CATALOG["fp8_quant_gemm"]))
    assert not d.forms["acc"].exact
    assert "cast_float8_e4m3fn" in str(d.forms["acc"].contributions[0])  # quantised with the running amax
    cert = certify(d, trials=6)
    assert cert.max_rel_err > cert.algebra_max_rel_err  # the cast really changes the result
    assert "not bit-identical" in cert.note


@pytest.mark.parametrize(
    "steps, reason_part",
    [
        ([MX, {"name": "r", "reduce": "sum", "over": "n", "expr": "sin(x * mx)"}], "sin(mx*x)"),
        ([MEAN, {"name": "r", "reduce": "sum", "over": "n", "expr": "maximum(x, mean)"}], "Max(mean, x)"),
        ([MEAN, {"name": "r", "reduce": "max", "over": "n", "expr": "(x - mean) ** 2"}], "2 independent terms"),
        ([MEAN, {"name": "r", "reduce": "max", "over": "n", "expr": "x * mean"}], "cannot decide the sign"),
        ([MEAN, {"name": "r", "reduce": "sum", "over": "n", "expr": "(x - mean) ** 40"}], "power above"),
        ([MX, {"name": "r", "reduce": "sum", "over": "n", "expr": "where(x > mx, 1, 0)"}], "mixes"),
        (
            [{"name": "g", "reduce": "topk", "k": 2, "as": "j", "over": "n", "expr": "x"},
             {"name": "r", "reduce": "sum", "over": "n", "expr": "x * g.values"}],
            "topk result",
        ),
        (
            [MEAN, {"name": "c", "reduce": "sum", "over": "m", "expr": "x - mean"},
             {"name": "r", "reduce": "sum", "over": "n", "expr": "x * c"}],
            "reduction over m",
        ),
    ],
)
def test_non_fusible_reductions_name_the_offending_term(steps, reason_part):
    d = derive_cascade(spec_of(steps, ["r"]))
    r = d.forms["r"]
    assert not r.fused and not d.fusible
    assert reason_part in r.reason
    assert r.reason.startswith(f"{r.op} over n:")


def test_a_dependent_of_a_non_fused_reduction_is_not_fused():
    steps = [MX, {"name": "a", "reduce": "sum", "over": "n", "expr": "sin(x * mx)"},
             {"name": "r", "reduce": "sum", "over": "n", "expr": "x * a"}]
    d = derive_cascade(spec_of(steps, ["r"]))
    assert "which is not fused" in d.forms["r"].reason


@pytest.mark.parametrize(
    "steps, kind, op",
    [
        # softmax entropy: two terms, both anchored at the running max
        ([MX, DEN, {"name": "r", "reduce": "sum", "over": "n", "expr": "-(exp(x - mx) / den) * log(exp(x - mx) / den)"}],
         "scaled", "sum"),
        ([MX, {"name": "r", "reduce": "sum", "over": "n", "expr": "exp(x - mx) + 1"}], "scaled", "sum"),
        ([MEAN, {"name": "r", "reduce": "max", "over": "n", "expr": "x - mean"}], "scaled", "max"),  # additive
        ([MX, DEN, {"name": "r", "reduce": "max", "over": "n", "expr": "-exp(x - mx) / den"}], "scaled", "min"),  # a(D) < 0
        ([MEAN, {"name": "r", "reduce": "topk", "k": 3, "as": "j", "over": "n", "expr": "mean - x"}], "scaled", "bottomk"),
        ([MX, DEN, {"name": "r", "reduce": "argmax", "over": "n", "expr": "exp(x - mx) / den"}], "scaled", "argmax"),
        ([MEAN, {"name": "r", "reduce": "sum", "over": "n", "expr": "(x - mean) ** 3"}], "taylor", "sum"),  # rank 4
    ],
)
def test_extended_forms_fuse_and_certify(steps, kind, op):
    d = derive_cascade(spec_of(steps, ["r"]))
    r = d.forms["r"]
    assert r.fused and r.kind == kind and r.effective_op == op
    cert = certify(d, trials=10, seed=3)
    assert cert.holds and cert.max_rel_err < 1e-9


def test_masked_tiles_and_parts_stay_finite():
    # Only the first 3 positions are visible: most tiles and split parts see nothing but -inf.
    steps = [
        {"name": "s", "expr": "where(index(n) <= 2, x, -inf)"},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * x / den"},
    ]
    d = derive_cascade(spec_of(steps, ["o"]))
    cert = certify(d, trials=16, seed=5)
    assert cert.holds and cert.max_rel_err < 1e-9


def test_variance_stays_accurate_with_a_large_offset():
    """The Taylor realisation avoids raw power sums' cancellation (mean 1e6, unit spread)."""
    import numpy as np

    from fuser_core.certificate_loop import AxisLoop
    from fuser_core.certificate_numpy import compile_forms
    from fuser_core.reference import Evaluator

    spec = load_spec(CATALOG["layernorm"])
    d = derive_cascade(spec)
    rng = np.random.default_rng(0)
    shape = {"t": 2, "c": 1000}
    inputs = {
        "x": 1e6 + rng.standard_normal((2, 1000)),
        "gamma": np.ones(1000),
        "beta": np.zeros(1000),
    }
    ev = Evaluator(spec, shape)
    env = ev.run(inputs)
    group = d.groups[0]
    loop = AxisLoop(d, ev, env, group.axis, [d.forms[m] for m in group.members], compile_forms(d, True))
    with np.errstate(all="ignore"):
        err = loop.compare(d.forms["var"], loop.run_split(rng))
    assert err < 1e-6  # raw sums of x^2 ~ 1e12 per element would lose all ~1.0 of the variance


def test_a_huge_product_is_refused_before_sympy_expands_it():
    import time

    names = [f"x{i}" for i in range(10)]  # distinct inputs, so sympy cannot collect them
    inputs = {name: {"dims": ["m", "n"]} for name in ["x", *names]}
    steps = [MEAN, {"name": "r", "reduce": "sum", "over": "n", "expr": f"({' + '.join(names)} + mean) ** 12"}]
    t0 = time.perf_counter()
    r = derive_cascade(spec_of(steps, ["r"], inputs)).forms["r"]
    assert not r.fused and "too many to separate" in r.reason
    assert time.perf_counter() - t0 < 5  # generous: this guards against a hang, not a target


@pytest.mark.parametrize(
    "expr, states",
    [
        ("(x - mx) ** 2 / size(n)", 2),  # variance around the running max: orders 0 and 1; order 2 is the count
        ("exp(x - mx) * (x - mean) ** 2 / size(n)", 3),  # softmax-weighted variance: every order is weighted
        ("(x - mean) ** 3", 3),  # third central moment: orders 0 to 2; order 3 is -count
    ],
)
def test_polynomial_dependence_gets_centred_taylor_accumulators(expr, states):
    deps = [s for s in (MX, MEAN) if s["name"] in expr]
    d = derive_cascade(spec_of([*deps, {"name": "r", "reduce": "sum", "over": "n", "expr": expr}], ["r"]))
    r = d.forms["r"]
    # one accumulator per order, but a top one that reads no value: a constant's sum, the count
    assert r.kind == "taylor" and len(r.contributions) == states
    # centred: the contributions hold (x - anchor), never raw powers of x alone
    assert "x - " in str(r.contributions[0]).replace("-mean + x", "x - mean").replace("-mx + x", "x - mx")
    cert = certify(d, trials=10, seed=2)
    assert cert.holds and cert.max_rel_err < 1e-9


def test_taylor_accumulators_are_stable_with_a_large_offset():
    """The shift keeps (x - anchor) small: raw sums of x^2 at 1e6 would lose everything."""
    import numpy as np

    from fuser_core.certificate_loop import AxisLoop
    from fuser_core.certificate_numpy import compile_forms
    from fuser_core.reference import Evaluator

    spec = spec_of([MX, {"name": "r", "reduce": "sum", "over": "n", "expr": "(x - mx) ** 2 / size(n)"}], ["r"])
    d = derive_cascade(spec)
    rng = np.random.default_rng(0)
    shape = {"m": 2, "n": 500}
    ev = Evaluator(spec, shape)
    env = ev.run({"x": 1e6 + rng.standard_normal((2, 500))})
    group = d.groups[0]
    loop = AxisLoop(d, ev, env, group.axis, [d.forms[m] for m in group.members], compile_forms(d, True))
    with np.errstate(all="ignore"):
        assert loop.compare(d.forms["r"], loop.run_split(rng)) < 1e-6


# -- anchors combined with loop constants through maximum/minimum (issue 23, 6a: attention sinks)
ATTENTION_SINK = {
    "foldwise": 1, "name": "attention_sink",
    "inputs": {"q": {"dims": ["b", "h", "m", "d"]}, "k": {"dims": ["b", "h", "n", "d"]},
               "v": {"dims": ["b", "h", "n", "e"]}, "sink": {"dims": ["h"]}},
    "params": {"scale": "1 / sqrt(size(d))"},
    "steps": [
        {"name": "s", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - maximum(mx, sink))"},
        {"name": "o", "reduce": "sum", "over": "n",
         "expr": "exp(s - maximum(mx, sink)) * v / (den + exp(sink - maximum(mx, sink)))"},
    ],
    "outputs": ["o"],
}
SINK_INPUTS = {"x": {"dims": ["m", "n"]}, "c": {"dims": ["m"]}}
MN = {"name": "mn", "reduce": "min", "over": "n", "expr": "x"}


def sink_form(steps):
    d = derive_cascade(spec_of(steps, [steps[-1]["name"]], SINK_INPUTS))
    return d, d.forms[steps[-1]["name"]]


def test_attention_sink_fuses_with_the_max_of_anchor_and_sink_as_its_anchor():
    """den = sum exp(s - max(mx, sink)): anchored at max(running mx, sink), rescaled by
    exp(max(mx_old, sink) - max(mx_new, sink)) <= 1; o anchored the same way, its denominator
    (den + exp(sink - max(mx, sink))) applied once at the end, in that form (no bare exp(sink))."""
    d = derive_cascade(load_spec(ATTENTION_SINK))
    assert d.fusible, {f.name: f.reason for f in d.forms.values()}
    mx, sink, den = (d.symbols.symbols[n] for n in ("mx", "sink", "den"))
    mx_old, mx_new = sp.Symbol("mx[old]", real=True), sp.Symbol("mx[new]", real=True)
    want = sp.exp(sp.Max(mx_old, sink) - sp.Max(mx_new, sink))
    for name in ("den", "o"):
        form = d.forms[name]
        assert form.kind == "scaled" and form.deps[0] == "mx"
        assert form.scales == (sp.exp(-sp.Max(mx, sink)),)
        assert sp.simplify(form.corrections[0] - want) == 0
        assert form.contributions[0].has(sp.exp(d.symbols.symbols["s"] - sp.Max(mx, sink)))
    assert d.forms["o"].deferred == (1 / (den + sp.exp(sink - sp.Max(mx, sink))),)
    # no where() around F: the reference's own 0 * NaN (a sink of +inf) must not become a guarded 0
    assert d.forms["o"].empty_adds_zero == (False,)
    cert = certify(d, trials=12, seed=3)
    assert cert.holds and cert.max_rel_err < 1e-9


def test_a_running_min_with_a_constant_mirrors_the_max():
    _, form = sink_form([MN, {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(minimum(mn, c) - x)"}])
    mn, c = sp.Symbol("mn", real=True), sp.Symbol("c", real=True)
    assert form.fused and form.scales == (sp.exp(sp.Min(mn, c)),)
    mn_old, mn_new = sp.Symbol("mn[old]", real=True), sp.Symbol("mn[new]", real=True)
    assert sp.simplify(form.corrections[0] - sp.exp(sp.Min(mn_new, c) - sp.Min(mn_old, c))) == 0


@pytest.mark.parametrize("expr,reason", [
    # maximum(-mx, c) falls as mx rises: the term grows with the running max, and x - max(-mx, c) is unbounded
    ("exp(x - maximum(-mx, c))", "not bounded by the running value of mx"),
    ("exp(x - minimum(mx, c))", "not bounded by the running value of mx"),  # capped by c: x - c unbounded
    ("exp(x - minimum(maximum(mx, c), c + 5))", "not bounded by the running value of mx"),
    ("exp(2 * x + maximum(mx, c) - 3 * maximum(mx, c + 1))", "not monotone in mx"),
    ("exp(x - maximum(mx, -mx) + c)", "nor monotone in it"),  # |mx|: not monotone
    ("exp(x - maximum(mx * mx, c))", "nor monotone in it"),
    ("exp(x - maximum(mx, x) + c)", "mixes the streamed values"),  # a "constant" that varies along the axis
])
def test_anchors_through_maximum_that_are_not_monotone_or_unbounded_are_refused(expr, reason):
    _, form = sink_form([MX, {"name": "den", "reduce": "sum", "over": "n", "expr": expr}])
    assert not form.fused and reason in form.reason, form.reason


def test_a_maximum_with_a_same_axis_sum_is_refused():
    """t has no running value the loop could anchor at: max(mx, t) would be applied at the end and the
    loop would sum the bare exp(x)."""
    t = {"name": "t", "reduce": "sum", "over": "n", "expr": "x"}
    _, form = sink_form([MX, t, {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - maximum(mx, t)) * c"}])
    assert not form.fused and "so the loop would sum the unanchored exp(x)" in form.reason, form.reason
