"""The derivation: which reductions fuse, how, and why not (docs/THEORY.md 2-5)."""

from __future__ import annotations

import pytest
import sympy as sp

from tests.support.catalog import NOT_FUSED, load_catalog
from fuser_core.certificate import certify
from fuser_core.codegen.plan import valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.spec import load_spec
from tests.support.cascades import every_strategy_passes, red, spec_of

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


MX = {"name": "mx", "reduce": "max", "over": "n", "expr": "x"}
MEAN = {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"}
DEN = {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_spec_fuses_and_certifies(name):
    d = derive_cascade(load_spec(CATALOG[name]))
    if name in NOT_FUSED:
        step, reason = NOT_FUSED[name]
        assert not d.fusible and reason in d.forms[step].reason
        assert all(f.reason is None for f in d.forms.values() if f.name != step)
    else:
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
        # softmax entropy written -p log p: the log's exp taken out (algebra.exp_logs_split), a polynomial
        # in mx it centres (Taylor), not the raw sum exp(x - mx) x cancelled at the end (issue 37, 13)
        ([MX, DEN, {"name": "r", "reduce": "sum", "over": "n", "expr": "-(exp(x - mx) / den) * log(exp(x - mx) / den)"}],
         "taylor", "sum"),
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


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_shifted_form_never_reads_streamed_values_the_integrand_lacks():
    """h = sum (w - y)**2 with y = sum logits * w: the shifted realisation expressed sum(w) as
    (1/logits) * partial(y) -- a streamed value in the anchor move (kernels off by 100x)."""
    spec = spec_of(
        [red("y", "sum", "logits * w", over="e"), red("h", "sum", "(w - y) ** 2", over="e")], ["h"],
        inputs={"logits": {"dims": ["e"]}, "w": {"dims": ["e"]}},
    )
    d = derive_cascade(spec)
    h = d.forms["h"]
    streamed = {"logits", "w"}
    if h.kind == "shifted":
        assert not {s.name for s in h.delta.free_symbols} & streamed
    assert certify(d, trials=8).holds
    every_strategy_passes(spec, {"e": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_cubic_around_a_raw_sum_is_not_fused():
    """sum ((|w| + 1) ** 0.5 - u) ** 3 around u = sum clamp(w): the Taylor accumulators sat on the
    running estimate partial * N / count, which strays far from the final u early on; split
    kernels lost float32 accuracy (1.6e-4 here, up to 5e-3 at other seeds). Refused instead;
    the same cubic around a mean keeps the Taylor form and passes every strategy."""
    raw = [red("u", "sum", "clamp(w, -1, 2)", over="c"), red("vals", "sum", "((abs(w) + 1) ** 0.5 - u) ** 3 / size(c)", over="c")]
    spec = spec_of(raw, ["vals"], inputs={"w": {"dims": ["seq", "c"]}})
    vals = derive_cascade(spec).forms["vals"]
    assert not vals.fused and "raw sum" in vals.reason
    assert valid_strategies(spec, derive_cascade(spec), {"seq": 2, "c": 13})["streaming_fused"] is not None
    every_strategy_passes(spec, {"seq": 2, "c": 13})

    raw[0] = red("u", "sum", "clamp(w, -1, 2) / size(c)", over="c")
    spec = spec_of(raw, ["vals"], inputs={"w": {"dims": ["seq", "c"]}})
    d = derive_cascade(spec)
    assert d.forms["vals"].kind == "taylor"
    assert certify(d, trials=8).holds
    every_strategy_passes(spec, {"seq": 2, "c": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_exponent_the_running_max_does_not_bound_is_not_fused():
    """exp(x - idx) with idx = max(4 x (x + size(m)/2)^2): early running maxima sit far below the
    final one, so the anchored state reached inf and the certificate reported NaN. Refused,
    naming the exponent; bounded forms (softmax, a minimum of the max's own values) still fuse."""
    spec = spec_of([red("idx", "max", "4 * x * (x + size(m) / 2) ** 2"), red("total", "max", "exp(x - idx)"),
                    red("s", "sum", "exp(x - idx) + 1")], ["total", "s"])
    d = derive_cascade(spec)
    for name in ("total", "s"):
        assert not d.forms[name].fused and "not bounded by the running value of idx" in d.forms[name].reason
    every_strategy_passes(spec, {"m": 3, "n": 13})

    spec = spec_of([red("mx", "max", "2 * x"), red("s", "sum", "exp(2 * x - mx) * x"),
                    red("t", "sum", "exp(minimum(2 * x, 1) - mx)"), red("r", "sum", "x * exp(mx - 3)")],
                   ["s", "t", "r"])
    d = derive_cascade(spec)
    assert d.forms["s"].kind == d.forms["t"].kind == "scaled"
    assert d.forms["r"].fused  # the running exp(mx) stays below its final value
    assert certify(d, trials=8).holds
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_shifted_form_does_not_take_a_cast_sum_for_the_plain_one():
    """o = sum (a - tl)^2 with tl = sum cast(a, float16): the shifted form took partial(tl) for the
    sum of a seen so far, off by the float16 rounding (certificate error 5.8e-4). It is not shifted now; and
    as a square centred on a raw sum's running estimate (fuzz seeds 60, 61) it is computed after tl is final."""
    spec = spec_of([red("tl", "sum", 'cast(a, "float16")', over="c"), red("o", "sum", "(a - tl) ** 2", over="c")],
                   ["o"], inputs={"a": {"dims": ["e", "c"]}})
    d = derive_cascade(spec)
    assert d.forms["o"].kind == "not_fused" and "raw sum" in d.forms["o"].reason
    assert certify(d, trials=8).holds
    every_strategy_passes(spec, {"e": 2, "c": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_taylor_form_sympy_recursed_on_is_refused_before_it_is_certified():
    """The certificate's lambdify rebuilt this Taylor form without end (RecursionError). The form centres
    where(.., kk, 0) on the running max s, which 0 may exceed: it is refused now (fuzz seed 61), with its reason."""
    from fuser_core.report import derivation_report

    steps = [red("s", "max", "kk", over="m"),
             red("sel", "sum", "(where(minimum(index(m) * 0.25, kk) == (kk - size(m) * 0.5), kk, 0) - s) ** 2", over="m")]
    spec = spec_of(steps, ["sel"], inputs={"kk": {"dims": ["m"]}})
    assert "both sides" in derive_cascade(spec).forms["sel"].reason
    assert derivation_report(spec)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_cast_deciding_a_where_is_not_stripped_by_a_fused_form():
    """where(beta0 >= cast(beta0, bfloat16), q, 0): the fused forms strip casts, which made the
    condition always true (normwise error 2.07 in a streaming kernel). Such a step is not fused."""
    spec = spec_of([red("idx", "max", "q", over="c"),
                    red("sz", "sum", '(where(beta0 >= cast(beta0, "bfloat16"), q, 0) - idx) ** 2', over="c"),
                    red("y", "sum", "(clamp(q, -1, 0.5) - sz) ** 2 / size(c)", over="c")], ["y"],
                   inputs={"q": {"dims": ["c"]}}, params={"beta0": "log(size(c) + 1)"})
    d = derive_cascade(spec)
    assert not d.forms["sz"].fused and "cast inside a comparison" in d.forms["sz"].reason
    every_strategy_passes(spec, {"c": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
@pytest.mark.parametrize("expr", ["x / (x - x)", "-x / 0 + 1", "log(x - x) + x", "rsqrt(x - x) * x", "exp(x - mx) / (mx - mx)"])
def test_division_by_zero_is_a_spec_error_naming_the_step(expr):
    """sympy makes x / 0 and log(0) complex infinity (zoo): lambdify cannot print it (KeyError
    'ComplexInfinity' in the certificate, so `foldwise derive` crashed), and fused forms of an
    expression that is infinite everywhere mean nothing. It is an invalid spec, found once
    earlier steps are substituted, and reported in the caller's names."""
    from fuser_core.errors import SpecError
    from fuser_core.report import derivation_report

    raw = {"foldwise": 1, "name": "reg", "inputs": {"x": {"dims": ["m", "n"]}},
           "steps": [red("mx", "max", "x"), red("myred", "sum", expr), {"name": "y", "expr": "myred + mx"}],
           "outputs": ["y"]}
    spec = load_spec(raw)
    for derive in (derive_cascade, derivation_report):
        with pytest.raises(SpecError, match="identically 0") as err:
            derive(spec)
        assert err.value.loc == ("steps", 1, "expr") and err.value.step == "myred", (err.value.loc, err.value.step)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_an_undefined_output_step_is_found_by_derive():
    """An elementwise output no reduction reads was converted only when a kernel was planned."""
    from fuser_core.errors import SpecError

    spec = spec_of([red("mx", "max", "x"), {"name": "sel", "expr": "x / (x - x)"}], ["mx", "sel"])
    with pytest.raises(SpecError, match="identically 0") as err:
        derive_cascade(spec)
    assert err.value.loc == ("steps", 1, "expr")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_large_sentinel_constant_in_a_where():
    """-1e30 is an exact sympy Integer beyond int64: lambdify printed it as a Python int, NumPy's
    select made an object array, and the certificate crashed (reported as a derivation limit)."""
    spec = spec_of(
        [{"name": "xm", "expr": "where(index(n) < len, x, -1e30)"}, red("mx", "max", "xm"),
         red("den", "sum", "exp(xm - mx)"), {"name": "y", "expr": "exp(xm - mx) / den"}],
        ["y"], inputs={"x": {"dims": ["m", "n"]}, "len": {"dims": ["m"], "kind": "index"}},
    )
    d = derive_cascade(spec)
    assert d.fusible
    cert = certify(d, trials=12)
    assert cert.holds and cert.max_rel_err < 1e-12, cert
    every_strategy_passes(spec, {"m": 3, "n": 13})


LENGTHS = {"x": {"dims": ["m", "n"]}, "len": {"dims": ["m"], "kind": "index"}}  # a per-row length (0 included)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_masked_softmax_with_a_per_row_length():
    """where(index(n) < len, exp(x - mx), 0) around the dependent term was 'not fused': the where()
    mixed x and mx. Its condition reads no dependency, so it masks G: G = where(c, exp(x), 0)."""
    spec = spec_of(
        [red("mx", "max", "where(index(n) < len, x, -inf)"), red("den", "sum", "where(index(n) < len, exp(x - mx), 0)"),
         {"name": "y", "expr": "where(index(n) < len, exp(x - mx) / den, 0)"}],
        ["y"], inputs=LENGTHS,
    )
    d = derive_cascade(spec)
    assert d.forms["den"].kind == "scaled"
    assert certify(d, trials=12).holds
    every_strategy_passes(spec, {"m": 5, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_masked_attention_keeps_the_anchor_inside_the_mask():
    """o = sum where(c, exp(s - mx) * v / den, 0): the anchor exp(-mx) is moved into the where()
    (exp(s - mx), bounded), and 1/den of a fully masked row (den = 0) times an empty accumulator
    is 0, as the reference's where() gives, not 0 * inf."""
    spec = spec_of(
        [red("mx", "max", "where(index(n) < len, s, -inf)"), red("den", "sum", "where(index(n) < len, exp(s - mx), 0)"),
         red("o", "sum", "where(index(n) < len, exp(s - mx) * v / den, 0)"),
         red("ent", "sum", "where(index(n) < len, exp(s - mx) * (s - mx), 0.5)")],
        ["o", "ent"], inputs={"s": {"dims": ["m", "n"]}, "v": {"dims": ["n", "e"]}, "len": {"dims": ["m"], "kind": "index"}},
    )
    d = derive_cascade(spec)
    assert d.fusible and d.forms["o"].empty_adds_zero == (True,)
    assert certify(d, trials=12).holds
    every_strategy_passes(spec, {"m": 4, "n": 13, "e": 3})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_masked_variance_stays_centred():
    """A masked variance around a masked mean separates into masked power sums; the Taylor form
    (per branch of the mask) keeps the accumulators centred instead of raw power sums."""
    spec = spec_of(
        [red("mean", "sum", "where(index(n) < len, x, 0) / size(n)"),
         red("var", "sum", "where(index(n) < len, (x - mean) ** 2, 0) / size(n)")],
        ["var"], inputs=LENGTHS,
    )
    d = derive_cascade(spec)
    assert d.forms["var"].kind == "taylor"
    assert certify(d, trials=12).holds
    every_strategy_passes(spec, {"m": 3, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_masked_order_reductions_with_infinite_sentinels():
    """where(c, a(D) G(x) + b(D), -inf) is -inf on masked elements under any a(D) > 0: the order
    form is the live branch's. argmin with +inf, and a negative factor (max and min swap)."""
    spec = spec_of(
        [red("mx", "max", "x"), red("den", "sum", "exp(x - mx)"),
         red("g", "topk", "where(index(n) < len, exp(x - mx) / den, -inf)", k=3, **{"as": "j"}),
         red("am", "argmin", "where(index(n) < len, x - mx, inf)"),
         red("an", "argmax", "where(index(n) >= len, -exp(x - mx), inf)")],
        ["g", "am", "an"], inputs=LENGTHS,
    )
    d = derive_cascade(spec)
    assert d.fusible, {f.name: f.reason for f in d.forms.values()}
    assert certify(d, trials=12).holds
    every_strategy_passes(spec, {"m": 3, "n": 13, "j": 3})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_where_whose_condition_reads_a_dependency_still_does_not_fuse():
    """Only a condition free of D is a mask: where(x > mx / 2, ...) decides with the running value."""
    spec = spec_of([red("mx", "max", "x"), red("den", "sum", "where(x > mx / 2, exp(x - mx), 0)")], ["den"])
    assert not derive_cascade(spec).forms["den"].fused


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_polynomial_centred_on_a_max_that_a_mask_can_make_infinite_is_not_fused():
    """Fuzz seed 44: ``g = max over e of where(index(e) > index(n), logits, -inf)`` is -inf on the
    row where every element is masked; ``sum ((bias^2 - g)^3)`` centred on g (Taylor form) gave
    NaN there (inf - inf) where the unfused value is inf, and the certificate failed. Polynomial
    (Taylor and shifted) forms are refused around such anchors; the certificate then holds."""
    spec = load_spec({
        "foldwise": 1, "name": "f", "inputs": {"logits": {"dims": ["n", "e"]}, "bias": {"dims": ["e"]}},
        "steps": [{"name": "g", "reduce": "max", "over": "e", "expr": "where(index(e) > index(n), logits, -inf)"},
                  {"name": "c", "reduce": "sum", "over": "e", "expr": "((bias) ** 2 - g) ** 3 / size(e)"},
                  {"name": "v", "reduce": "sum", "over": "e", "expr": "(bias - where(index(e) > index(n), logits, -1e30)) ** 2"},
                  {"name": "s", "reduce": "sum", "over": "e", "expr": "where(index(e) > index(n), exp(logits - g), 0)"},
                  {"name": "t", "reduce": "sum", "over": "e", "expr": "where(index(e) > index(n), (logits - g) ** 2, 0)"}],
        "outputs": ["c", "v", "s", "t"]})
    d = derive_cascade(spec)
    assert not d.forms["c"].fused and "cancel inf against inf" in d.forms["c"].reason
    assert d.forms["s"].fused  # a scaled form keeps its guards: the masked softmax still fuses
    assert d.forms["t"].fused  # masked like g: no element reaches the polynomial where g is -inf
    assert certify(d).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_where_fill_that_is_a_symbolic_constant_is_compared_as_a_number():
    """fuzz seed 50: ``sigmoid(where(c, lse, -1))`` summed over d has the fill sigmoid(-1) =
    1/(1 + E); the mask check built sp.Float from it (TypeError: cannot create mpf) and every
    strategy crashed while generating. The fill is not the sum's identity, so no mask window."""
    spec = spec_of(
        [{"name": "lse", "expr": 'cast(where(index(e) <= index(d), logits, v), "float8_e4m3fn")'},
         red("h", "sum", "sigmoid(where(not index(e) <= index(d), lse, -1))", over="d")],
        ["h"], inputs={"logits": {"dims": ["n", "d", "e"]}, "v": {"dims": ["d"]}})
    every_strategy_passes(spec, {"n": 2, "d": 9, "e": 3})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_square_centred_on_a_value_that_exceeds_the_running_max_is_not_fused():
    """Fuzz seed 61, peaked rows: ``sum((maximum(w, x) - mx)^2)``, Taylor-centred on the running max of x.
    With w near the final max but far above the early running max, each move cancels the squares away (392x the
    formula's error). ``sum((x - mx)^2)`` keeps its Taylor form: x never exceeds the running max, so every term of
    a move has one sign."""
    inputs = {"x": {"dims": ["n"]}, "w": {"dims": ["m"]}}
    spec = spec_of([red("mx", "max", "x"), red("total", "sum", "(maximum(w, x) - mx) ** 2"),
                    red("s", "sum", "(x - mx) ** 2")], ["total", "s"], inputs=inputs)
    d = derive_cascade(spec)
    assert d.forms["total"].kind == "not_fused" and "both sides" in d.forms["total"].reason
    assert d.forms["s"].kind == "taylor"
    from fuser_core.accuracy import accuracy_check

    verdict = accuracy_check(spec, {"m": 2, "n": 13}, families=("peaked", "offset100"), derivation=d)
    assert verdict["passed"], verdict["families"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_raw_power_sums_of_a_dependent_sum_are_not_fused():
    """Fuzz seeds 60 and 61: ``sum((q - acc)^2)`` with acc a dependent sum (no running anchor) was kept as
    sum(q^2) - 2 acc sum(q) + n acc^2, 17.6x and 25x the formula's error; a square centred on a raw sum's
    running estimate is refused too. A mean written as ``s / size(n)`` still fuses."""
    inputs = {"x": {"dims": ["m", "n"]}}
    dependent = spec_of([red("mx", "max", "x"), red("acc", "sum", "exp(x - mx) * x"), red("y", "sum", "(x - acc) ** 2")],
                        ["y"], inputs=inputs)
    raw = spec_of([red("s", "sum", "x ** 2"), red("y", "sum", "(x - s) ** 2")], ["y"], inputs=inputs)
    mean = spec_of([red("s", "sum", "x"), {"name": "mean", "expr": "s / size(n)"}, red("y", "sum", "(x - mean) ** 2")],
                   ["y"], inputs=inputs)
    assert "raw power sums" in derive_cascade(dependent).forms["y"].reason
    assert "raw sum" in derive_cascade(raw).forms["y"].reason
    assert derive_cascade(mean).forms["y"].kind in ("shifted", "taylor")
