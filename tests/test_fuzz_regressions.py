"""Regression tests for the bugs the cascade fuzzer (tests/fuzz_strategies.py) found in
fuser_core, each with the smallest spec that showed it. Kernels run through Triton's
interpreter at small ragged shapes."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import sympy as sp
import torch

from fuser_core.certificate import certify
from fuser_core.codegen.plan import KernelConfig, NotValid, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.reference import evaluate
from fuser_core.runner import FLOOR, TOLERANCE, run, self_check
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values


def spec_of(steps, outputs, inputs=None, params=None, name="reg"):
    raw = {"foldwise": 1, "name": name, "inputs": inputs or {"x": {"dims": ["m", "n"]}}, "steps": steps,
           "outputs": outputs}
    if params:
        raw["params"] = params
    return load_spec(raw)


def red(name, op, expr, over="n", **extra):
    return {"name": name, "reduce": op, "over": over, "expr": expr, **extra}


def every_strategy_passes(spec, shape, block=4):
    """self_check with the default choice and every valid strategy (tiles of `block` on the axis)."""
    d = derive_cascade(spec)
    valid = [s for s, why in valid_strategies(spec, d, shape).items() if why is None]
    assert valid, valid_strategies(spec, d, shape)
    reports = [self_check(spec, shape, derivation=d)]
    axis = next(s.over for s in spec.steps if s.is_reduction)
    for strategy in valid:
        config = None if strategy == "row_resident" else KernelConfig({axis: block}, split=2 if strategy == "split_fused" else 1)
        reports.append(self_check(spec, shape, strategy=strategy, config=config, derivation=d))
    for r in reports:
        assert r["passed"], r
    return reports


# ---------------------------------------------------------------- the certificate


def test_steps_named_like_the_certificate_state_keys():
    """A step named `count` or `run` met the loop state's own keys (TypeError: dict + int)."""
    spec = spec_of([red("count", "max", "x"), red("run", "sum", "exp(x - count)")], ["run"])
    cert = certify(derive_cascade(spec), trials=4)
    assert cert.holds and cert.max_rel_err < 1e-12


def test_argmax_of_values_tied_across_tiles():
    """Exactly tied values (the constant side of a minimum) rescaled by running corrections may
    come out in either order: both positions are the first maximum, not an error."""
    spec = spec_of(
        [red("mx", "max", "q", over="c"), red("den", "sum", "exp(q - mx) + 1", over="c"),
         red("am", "argmax", "exp(minimum(q, -1) - mx) / den", over="c")],
        ["am"], inputs={"q": {"dims": ["c"]}},
    )
    d = derive_cascade(spec)
    assert d.forms["am"].fused
    assert certify(d, trials=12).holds


def test_topk_tied_at_its_kth_place_across_tiles():
    """round(a * 4) makes exact ties; rescaled by running corrections they come out of a tile a
    few ulps apart, and the k-th place may hold either of two tied positions (algebra error 1)."""
    v = "(round(a * 4) * 0.25 + 0.1)"
    spec = spec_of([red("mx", "max", v, over="d"), red("p", "topk", f"exp({v} - mx) / 0.5", over="d", k=4, **{"as": "kd"}),
                    red("u", "argmax", f"exp({v} - mx) / 0.5", over="d")], ["p", "u"], inputs={"a": {"dims": ["e", "d"]}})
    d = derive_cascade(spec)
    assert d.forms["p"].fused and d.forms["u"].fused
    for seed in (2, 5):  # seeds that drew a tie at the 4th place
        assert certify(d, trials=8, seed=seed).holds


def test_a_wrong_argmax_still_fails_the_certificate():
    spec = spec_of([red("mx", "max", "x"), red("am", "argmax", "x - mx")], ["am"])
    d = derive_cascade(spec)
    d.forms["am"].effective_op = "argmin"  # a deliberately wrong realisation
    d.realise("am")
    assert not certify(d, trials=4).holds


def test_sum_that_cancels_to_zero_is_judged_against_its_terms():
    """sum (x - mean) is 0 in real arithmetic: float64 leaves ~1e-16, and relative to that the
    fused and multi-pass rounding differed by 1e12. A wrong algebra still fails."""
    mean = red("mean", "sum", "x / size(n)")
    spec = spec_of([mean, red("r", "sum", "x - mean")], ["r"])
    d = derive_cascade(spec)
    assert certify(d, trials=12).holds
    form = d.forms["r"]
    assert form.kind == "taylor"
    form.reanchor = tuple(2 * r + sp.Integer(1) for r in form.reanchor)  # wrong anchor move: off by a multiple of the terms
    d.realise("r")
    assert not certify(d, trials=4).holds


def test_dependency_that_cancels_does_not_fail_its_dependent():
    """acc, a mean of quantised values, can cancel to ~1e-17; the dependent mx = sum w * acc then
    differed from multi-pass by 3e-7 through acc's own rounding. Dependents are checked against
    multi-pass at the dependencies' fused values."""
    spec = spec_of(
        [red("acc", "sum", "round(w * 4) * 0.25 / size(seq)", over="seq"), red("mx", "sum", "w * acc", over="seq")],
        ["mx"], inputs={"w": {"dims": ["seq", "m"]}},
    )
    cert = certify(derive_cascade(spec), trials=24, seed=3)
    assert cert.holds, cert


def test_a_rule_that_reads_streamed_values_outside_a_tile_fails():
    """The certificate evaluated such a rule on an empty slice and compared empty arrays (error 0)."""
    mean = red("mean", "sum", "x / size(n)")
    spec = spec_of([mean, red("r", "sum", "(x - mean) ** 2")], ["r"])
    d = derive_cascade(spec)
    form = d.forms["r"]
    assert form.kind == "taylor"
    x = next(s for s in form.integrand.free_symbols if s.name == "x")
    form.reanchor = (form.reanchor[0] * x, *form.reanchor[1:])  # reads the streamed x when moving anchors: never valid
    d.realise("r")
    assert not certify(d, trials=4).holds


def test_two_topk_with_different_k_over_one_axis():
    """The certificate's random shapes took the last k, not the largest (ShapeError)."""
    spec = spec_of([red("a", "topk", "x", k=3, **{"as": "i"}), red("b", "topk", "-x", k=1, **{"as": "j"})], ["a", "b"])
    assert certify(derive_cascade(spec), trials=12).holds


def test_nested_where_conditions_in_the_certificate():
    """sympy folds a where() in a where() condition into Or(...): lambdify printed
    logical_or.reduce((a, b)), which cannot stack arrays of different shapes."""
    spec = spec_of(
        [red("y", "sum", "where(where(index(m) == label, eps, 0) != size(e), x, 0)", over="e"),
         red("t", "topk", "x * y", over="e", k=1, **{"as": "kk"})],
        ["t"], inputs={"x": {"dims": ["m", "e"]}, "label": {"dims": [], "kind": "index"}},
        params={"eps": "1 / sqrt(size(m))"},
    )
    assert certify(derive_cascade(spec), trials=4).holds


# ---------------------------------------------------------------- the derivation


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


@pytest.mark.parametrize("steps, inputs", [
    # Piecewise.eval rebuilt itself without end while converting the where()
    ([red("mean", "sum", "kk", over="m"), red("r", "sum", "(kk / (1 + kk * w)) * rsqrt(mean * mean + 1)", over="m"),
     {"name": "p", "expr": "kk ** 2"}, red("mask", "max", "where((kk - p) != (p - r), (kk - kk), -1)", over="m"),
     red("scale2", "sum", "exp(where((kk - p) != (p - r), (kk - kk), -1) - mask)", over="m")], ["kk", "w"]),
])
def test_sympy_recursing_without_end_is_a_limit_naming_the_cause(steps, inputs):
    """RecursionError escaped derive_cascade and certify, unexpected by `foldwise derive` and the API."""
    from fuser_core.errors import DerivationLimitError
    from fuser_core.report import derivation_report

    spec = spec_of(steps, [steps[-1]["name"]], inputs={n: {"dims": ["m"]} for n in inputs})
    with pytest.raises(DerivationLimitError, match="recursed without end"):
        derivation_report(spec)


def test_a_taylor_form_sympy_recursed_on_is_refused_before_it_is_certified():
    """The certificate's lambdify rebuilt this Taylor form without end (RecursionError). The form centres
    where(.., kk, 0) on the running max s, which 0 may exceed: it is refused now (fuzz seed 61), with its reason."""
    from fuser_core.report import derivation_report

    steps = [red("s", "max", "kk", over="m"),
             red("sel", "sum", "(where(minimum(index(m) * 0.25, kk) == (kk - size(m) * 0.5), kk, 0) - s) ** 2", over="m")]
    spec = spec_of(steps, ["sel"], inputs={"kk": {"dims": ["m"]}})
    assert "both sides" in derive_cascade(spec).forms["sel"].reason
    assert derivation_report(spec)


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


CERTIFICATE_CANNOT_EVALUATE = [
    # numpy.select got a scalar condition from lambdify's Piecewise (TypeError)
    {"foldwise": 1, "name": "dhho51vppwc", "inputs": {"x": {"dims": ["d"]}, "kk": {"dims": ["d"]}, "v": {"dims": ["d"]}}, "steps": [{"name": "vals", "expr": "(-where((kk * v) >= where(where(x < log(2 + v * v), x, -1) >= where(x != (kk * v), v, -1), alpha, -1), clamp(x, -1, 1), -1))"}, {"name": "s", "expr": "(clamp((alpha + alpha), -1, 2) + where(vals == cast(alpha, \"float8_e4m3fn\"), (v) ** 4, 0))"}, {"name": "acc", "reduce": "max", "over": "d", "expr": "x"}, {"name": "var", "reduce": "sum", "over": "d", "expr": "((exp2(sin(alpha)) / size(d)) * exp(sigmoid(where(where((vals + eps) == (v) ** 2, kk, kk) > (vals + vals), kk, 0))))"}], "outputs": ["s", "acc", "var"], "params": {"eps": "size(d) * 0.5", "alpha": "log(size(d) + 1)"}},
    # sympy rebuilt max(zoo, ...) while substituting (ValueError: not comparable)
    {"foldwise": 1, "name": "oc7y9z_", "inputs": {"kk": {"dims": ["c"]}, "x": {"dims": ["c"]}, "bias": {"dims": []}}, "steps": [{"name": "tmp", "reduce": "min", "over": "c", "expr": "sin((-x))"}, {"name": "r", "reduce": "min", "over": "c", "expr": "where((round(kk * 4) * 0.25 + 0.1) > (bias) ** 3, x, beta0) - tmp"}, {"name": "BLOCK", "reduce": "argmax", "over": "c", "expr": "where((bias) ** 3 > where((kk * 0.5) != maximum(beta0, bias), kk, -1), kk, -1)"}, {"name": "z", "reduce": "max", "over": "c", "expr": "(log(2 + (kk / (1 + x * bias)) * (kk / (1 + x * bias))) + where(bias < where(index(c) == BLOCK, bias, 0), (beta0 * 4), 0))"}], "outputs": ["r", "z"], "params": {"beta0": "1 / sqrt(size(c))"}},
]


@pytest.mark.parametrize("raw", CERTIFICATE_CANNOT_EVALUATE, ids=["condlist", "zoo"])
def test_a_certificate_that_cannot_evaluate_is_a_limit(raw):
    """sympy/numpy errors escaped certify (a crash of `foldwise derive`); now a DerivationLimitError (since
    comparisons of where() values are folded branch by branch, the first one stops at the size limit of such a
    condition, before the certificate)."""
    from fuser_core.errors import DerivationLimitError
    from fuser_core.report import derivation_report

    try:
        report = derivation_report(load_spec(raw))
    except DerivationLimitError as err:
        assert re.search(r"the certificate cannot evaluate|where\(\) condition that reads", str(err)), err
    else:  # the zoo spec: its where()s folded branch by branch, sympy no longer meets max(zoo, ...)
        assert report["certificate"]["holds"], report["certificate"]


# ---------------------------------------------------------------- the code generator


def test_split_fused_with_scalar_results():
    """A split kernel stored a size-1 block through a scalar workspace pointer (InterpreterError)."""
    spec = spec_of(
        [red("mx", "max", "x", over="m"), red("den", "sum", "exp(x - mx)", over="m"),
         red("v", "sum", "(x - mx) ** 2", over="m"), red("am", "argmax", "x - mx", over="m"),
         red("g", "topk", "exp(x - mx) / den", over="m", k=3, **{"as": "j"})],
        ["mx", "den", "v", "am", "g"], inputs={"x": {"dims": ["m"]}},
    )
    report = self_check(spec, {"m": 11}, strategy="split_fused", config=KernelConfig({"m": 4}, split=2))
    assert report["passed"], report


def test_powers_above_eight_of_negative_values():
    """x ** 9 and x ** 10 printed as exp2(e * log2(x)): NaN for every negative x."""
    spec = spec_of([red("a", "sum", "x ** 9"), red("b", "max", "x ** 10"), {"name": "y", "expr": "(x - a) ** 11"}],
                   ["a", "b", "y"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


def test_a_lone_product_in_a_denominator():
    """(x / size(n)) ** 2 printed as `x * x / s * s` (= x * x)."""
    spec = spec_of([red("r", "min", "(x / size(n)) ** 2")], ["r"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


def test_integer_values_in_float_functions():
    """exp(cos(argmin)) and sqrt(index(n)) gave tl.cos(int32): Triton takes floats only."""
    spec = spec_of([red("am", "argmin", "x"), {"name": "y", "expr": "exp(cos(am)) * x + sqrt(index(n)) * log(index(m) + 1)"}],
                   ["y"])
    every_strategy_passes(spec, {"m": 3, "n": 13})


def test_cast_of_a_constant_and_a_constant_output():
    """cast(alpha, ...) printed as (2.0).to(...), and a constant step as tl.broadcast_to(1e-10, ...)."""
    spec = spec_of([red("mx", "max", "x"), {"name": "y", "expr": 'cast(alpha, "float32") * x + cast(1.7, "bfloat16")'},
                    {"name": "c", "expr": "alpha * alpha"}], ["mx", "y", "c"], params={"alpha": 1e-5})
    every_strategy_passes(spec, {"m": 2, "n": 13})


def test_nested_casts_of_constants():
    """cast(cast(alpha, "float16"), "float16") printed as fp16 rounding of a Python float
    (AttributeError: 'float' object has no attribute 'to'): constants are evaluated and rounded
    when generated, as the reference does."""
    spec = spec_of([red("mx", "max", 'x + cast(cast(alpha, "float16"), "float16")'),
                    {"name": "y", "expr": 'x * cast(cast(1 / 3, "bfloat16") + 1, "bfloat16")'},
                    # round() of a constant inside a cast was printed without the cast (29.791, not 29.75)
                    {"name": "z", "expr": 'sin(cast((round(3 * 4) * 0.25 + 0.1) ** 3, "bfloat16") * x)'}], ["mx", "y", "z"],
                   params={"alpha": 0.1})
    every_strategy_passes(spec, {"m": 2, "n": 13})


def test_folded_conditions_on_a_size_and_a_block():
    """sympy folds where() conditions into And/Or/Not of a comparison on size(e) (a scalar in the
    kernel) and one on the values (a block); Triton's interpreter cannot `|`, `&` or `~` those
    (TypeError: ufunc 'bitwise_or' not supported)."""
    spec = spec_of([red("r", "max", "where(where(bias >= 0, 1, 0) != where(size(e) > 20, 0, 1), bias, -bias)", over="e"),
                    red("s", "sum", "where(where(bias >= 0, 1, 0) == where(size(e) > 3, 1, 0), bias, 0)", over="e")],
                   ["r", "s"], inputs={"bias": {"dims": ["e"]}})
    every_strategy_passes(spec, {"e": 13})


def test_constant_functions_are_evaluated_in_float64():
    """log1p(abs(1e-5)) printed as tl.log(1.00001): in float32 that is 1.0014e-5, so a constant
    comparison with 1e-5 went the other way (error 72) and tanh(log1p(eps)) * x was off by 1.4e-3."""
    spec = spec_of([red("mean", "max", "where(minimum(eps, scale) < log1p(abs(scale)), x, -1)"),
                    {"name": "y", "expr": "x * tanh(log1p(abs(scale))) + mean"},
                    # a whole step of constants folded to one number still stores as a block
                    {"name": "c", "expr": "log2(sigmoid(clamp(2, -1, 0.5)) + 1) + round(0.3 * 4)"}], ["y", "c"],
                   params={"eps": "1 / sqrt(size(m))", "scale": 1e-05})
    every_strategy_passes(spec, {"m": 1, "n": 13})


def test_bfloat16_casts_round_to_nearest_even_under_the_interpreter():
    """The interpreter's float32 -> bfloat16 conversion truncates (1.01171875 -> 1.0078125)."""
    spec = spec_of([red("mx", "max", "x"), {"name": "y", "expr": 'cast(x, "bfloat16") * 1'}], ["mx", "y"],
                   inputs={"x": {"dims": ["n"]}})
    values = np.array([1.00390625, 1.01171875, 1 + 2**-8 + 2**-20, -1.00390625, 3.3, 0.1, 1e38, -0.0], np.float32)
    shape = {"n": values.size}
    out = run(spec, shape, "float32", {"x": values.astype(np.float64)})
    ref = evaluate(spec, shape, {"x": values.astype(np.float64)})
    np.testing.assert_array_equal(out.outputs["y"].float().numpy(), ref["y"])


def test_where_inside_a_where_condition():
    """sympy folds it into ITE(...), which the printer refused (UnsupportedExpression)."""
    spec = spec_of(
        [red("h", "argmax", "x", over="m"), red("r", "min", "maximum(x, where(alpha >= where(index(m) == h, size(m), -1), w, -1))", over="m")],
        ["r"], inputs={"x": {"dims": ["n", "m"]}, "w": {"dims": ["n"]}}, params={"alpha": "log(size(m) + 1)"},
    )
    every_strategy_passes(spec, {"n": 2, "m": 13})


def test_a_step_named_count_as_an_anchor():
    """A dependency named `count` printed its own count[old] as the tile counter."""
    spec = spec_of([red("count", "max", "v", over="t"), red("idx", "sum", "(v - count) ** 2", over="t")],
                   ["count", "idx"], inputs={"v": {"dims": ["t", "d"]}})
    every_strategy_passes(spec, {"t": 13, "d": 2})


def test_log1p_of_small_values_keeps_float32_accuracy():
    """log1p(a) was printed tl.log(a + 1.0): for |a| ~ 1e-5 that loses ~1e-3 of the result."""
    spec = spec_of([red("out", "sum", "x * 1e-5"), {"name": "y", "expr": "log1p(abs(out)) + 0 * x"}], ["y"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


def test_inner_argmax_or_topk_is_not_valid_rather_than_a_crash():
    """An argmax over an inner axis raised NotImplementedError while writing the kernel."""
    spec = spec_of(
        [red("s", "sum", "v * q", over="j"), red("am", "argmax", "z", over="s2")],
        ["s", "am"], inputs={"v": {"dims": ["d", "j", "s2"]}, "q": {"dims": ["d", "j", "s2"]}, "z": {"dims": ["s2", "j"]}},
    )
    d = derive_cascade(spec)
    shape = {"d": 2, "j": 5, "s2": 3}
    reasons = valid_strategies(spec, d, shape)
    assert all(r is not None for r in reasons.values()), reasons
    with pytest.raises(NotValid):
        self_check(spec, shape, derivation=d)


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


def test_inf_literals_and_overflowing_constants_stay_ieee():
    """`inf` in a where() branch (causal masks) and constants that overflow float64 are fine."""
    spec = spec_of([red("mx", "max", "where(index(n) <= index(m), x, -inf)"),
                    red("den", "sum", "exp(where(index(n) <= index(m), x, -inf) - mx) + sin(inf) * 0 + x * 1e300 * 1e300 * 0")],
                   ["den"])
    d = derive_cascade(spec)
    assert certify(d, trials=4).holds


def test_an_undefined_output_step_is_found_by_derive():
    """An elementwise output no reduction reads was converted only when a kernel was planned."""
    from fuser_core.errors import SpecError

    spec = spec_of([red("mx", "max", "x"), {"name": "sel", "expr": "x / (x - x)"}], ["mx", "sel"])
    with pytest.raises(SpecError, match="identically 0") as err:
        derive_cascade(spec)
    assert err.value.loc == ("steps", 1, "expr")


def test_a_where_condition_sympy_cannot_fold_is_reported():
    """sympy's Piecewise raised ValueError ('-I' is not comparable) out of derive_cascade, then a limit error. A
    comparison with a where() on a side is now folded branch by branch as it is converted: it derives, and
    every strategy matches the reference."""
    spec = spec_of([red("r", "sum", "where(x + x < where(sqrt(abs(eps) + 1) < clamp(eps, -1, 1), x, 0), x, x)")],
                   ["r"], params={"eps": "1 / sqrt(size(n))"})
    every_strategy_passes(spec, {"m": 3, "n": 13})


def test_split_topk_of_negative_values():
    """The combine kernel loaded the padding slots of each part's top-k list (BLOCK_as > k) as 0,
    which beat every negative value: the top 3 of -|x| - 1 came out as [0, 0, -1.04]."""
    spec = spec_of([red("g", "topk", "-abs(x) - 1", k=3, **{"as": "j"})], ["g"])
    report = self_check(spec, {"m": 2, "n": 13}, strategy="split_fused", config=KernelConfig({"n": 4}, split=2))
    assert report["passed"], report


def test_split_bottomk_of_positive_values():
    """The same padding for the smallest-k list: +inf, never 0 (nor -inf, which would win every merge)."""
    spec = spec_of([red("mx", "max", "x"), red("g", "topk", "-(abs(x) + 1) * exp(mx)", k=3, **{"as": "j"})], ["g"])
    assert derive_cascade(spec).forms["g"].effective_op == "bottomk"  # the negative factor -exp(mx) swaps the order
    report = self_check(spec, {"m": 2, "n": 13}, strategy="split_fused", config=KernelConfig({"n": 4}, split=2))
    assert report["passed"], report


# ---------------------------------------------------------------- the error measure


def test_an_output_that_is_zero_everywhere_is_judged_absolutely():
    """x - x reordered by sympy came out as ~5e-8 in float32, relative to a reference of 0."""
    from fuser_core.runner import rel_err

    ref = np.zeros(5)
    assert rel_err(np.full(5, 5e-8), ref, FLOOR["float32"]) <= TOLERANCE["float32"]
    assert rel_err(np.full(5, 1e-5), ref, FLOOR["float32"]) > TOLERANCE["float32"]


def test_a_cancelling_output_is_allowed_its_float32_rounding_noise():
    """max(where(...) + acc0) with acc0 nearly cancelling the max: float32 numpy, the unfused
    chain and every kernel erred by 7e-4 relative to the float64 value (2e-4). The reference moves
    by about as much when the inputs move by one ulp, so that error is allowed; a wrong value is not."""
    from fuser_core.reference import bind_shape, evaluate, random_inputs
    from fuser_core.runner import judge, rounding_noise

    spec = spec_of(
        [red("total", "sum", "q"), red("acc0", "sum", "logits * rsqrt(total * total + 1)"),
         {"name": "den", "expr": "((kk * total)) ** 2"}, red("out", "sum", "kk"),
         red("amax", "max", "where((den * q) > clamp(den, -1, 2), logits, q) + acc0")],
        ["out", "amax"], inputs={"q": {"dims": ["n"]}, "kk": {"dims": ["n"]}, "logits": {"dims": ["n"]}},
    )
    reports = every_strategy_passes(spec, {"n": 13})
    assert any(r["errors"]["amax"] > 1e-6 for r in reports)  # the allowance was needed
    shape = bind_shape(spec, {"n": 13})
    inputs = random_inputs(spec, shape, np.random.default_rng(0))
    reference = evaluate(spec, shape, inputs)
    noise = rounding_noise(lambda arrays: evaluate(spec, shape, arrays), inputs, reference)
    stores = {"out": "float32", "amax": "float32"}
    q, kk, logits = (inputs[k].astype(np.float32) for k in ("q", "kk", "logits"))
    total = q.sum(dtype=np.float32)
    acc0 = (logits / np.sqrt(total * total + 1)).sum(dtype=np.float32)
    den = (kk * total) ** 2
    amax32 = np.max(np.where(den * q > np.clip(den, -1, 2), logits, q) + acc0)
    got = {"out": torch.tensor(kk.sum(dtype=np.float32)).reshape(1), "amax": torch.tensor(amax32).reshape(1)}
    assert not judge(spec, got, reference, stores, exact=True)["passed"]  # without the allowance
    assert judge(spec, got, reference, stores, exact=True, noise=noise)["passed"]
    got["amax"] = got["amax"] + 1e-4  # wrong by 5e-5 of the terms' size (acc0 is about -0.95)
    assert judge(spec, got, reference, stores, exact=True, noise=noise)["bad"] == ["amax"]


def test_argmin_over_values_equal_in_float32():
    """exp(sin(erf(x) ** 12)) is 1.0 in float32 for most x, distinct in float64: the kernel's argmin
    (and what reads it) is one of the float32-tied positions, not the float64 one. The judge also
    accepts the reference re-evaluated with each of the first tied positions; any other fails."""
    from fuser_core.reference import bind_shape, evaluate, random_inputs
    from fuser_core.runner import judge, tie_alternatives

    spec = spec_of([red("am", "argmin", "exp(sin(erf(x) ** 12))", over="d"),
                    red("v", "max", "where(index(d) == am, x, -10)", over="d")], ["am", "v"],
                   inputs={"x": {"dims": ["d"]}})
    reports = every_strategy_passes(spec, {"d": 13})
    shape = bind_shape(spec, {"d": 13})
    inputs = random_inputs(spec, shape, np.random.default_rng(0))
    reference = evaluate(spec, shape, inputs)
    ties = tie_alternatives(lambda k: evaluate(spec, shape, inputs, tie_choice=k), spec, reference)
    assert ties and any(int(t["am"]) != int(reference["am"]) for t in ties)
    assert any(r["passed"] for r in reports)
    x = inputs["x"]
    far = int(np.argmax(np.exp(np.sin(np.vectorize(math.erf)(x) ** 12))))  # the largest value: not tied
    got = {"am": torch.tensor([far], dtype=torch.int32), "v": torch.tensor([x[far]], dtype=torch.float32)}
    stores = {"am": "int32", "v": "float32"}
    assert judge(spec, got, reference, stores, exact=True, alternatives=ties)["bad"] == ["am", "v"]


def test_tanh_of_tiny_values_keeps_float32_accuracy():
    """tanh printed as 2 sigmoid(2x) - 1 cancelled to 0 for tiny x (max of tanh(erf(a v)^10):
    relative error 1.0); the kernel helper uses a series near 0."""
    spec = spec_of([red("s", "min", "erf(x) ** 10", over="n"), red("t", "max", "tanh(s)", over="m")], ["t"],
                   inputs={"x": {"dims": ["m", "n"]}})
    rng = np.random.default_rng(0)
    x = (rng.random((13, 13)) * 0.2 + 0.01).astype(np.float32)  # erf(x)^10 ~ 1e-20 .. 1e-8
    result = run(spec, {"m": 13, "n": 13}, "float32", {"x": x})
    got = result.outputs["t"].double().numpy()
    ref = evaluate(spec, {"m": 13, "n": 13}, {"x": x.astype(np.float64)})["t"]
    assert 0 < ref.max() < 1e-6
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_tanh_is_within_a_few_float32_ulps_everywhere():
    """tanh printed as 2 sigmoid(2x) - 1 above |x| = 1/16 erred by up to 20 ulps (x ~ 0.064: the
    subtraction cancels); the accuracy bar's fuzz failed every strategy on it (9 ulps at a peaked
    row). The helper is Cephes' tanhf now: a polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above."""
    spec = spec_of([red("y", "max", "tanh(x)", over="n")], ["y"], inputs={"x": {"dims": ["m", "n"]}})
    x = np.concatenate([np.linspace(-3, 3, 2001), [0.0, -0.0, 0.0625, 0.064, 0.62, 0.63, 40.0, -40.0, np.nan]])
    x = x.astype(np.float32)[:, None]  # one value per row: y = tanh(x)
    got = run(spec, {"m": x.shape[0], "n": 1}, "float32", {"x": x}).outputs["y"].double().numpy()
    ref = np.tanh(x[:, 0].astype(np.float64))
    assert np.isnan(got[-1]) and np.isnan(ref[-1])
    ulps = np.abs(got[:-1] - ref[:-1]) / np.spacing(np.abs(ref[:-1]).astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 3, (ulps.max(), x[np.argmax(ulps), 0])


def test_not_of_a_comparison_keeps_ieee_nan():
    """sympy turns not (g < 0.5) into g >= 0.5, which a NaN g makes False where the spec's `not` gives True
    (CI fuzz, nan family: the max of where(not g < 0.5, x, -inf) was -inf, the reference NaN); `not` of an
    ordered comparison is now the opposite comparison or an unordered pair, in every strategy."""
    spec = spec_of([red("y", "max", "where(not x < 0.5 and not (x > 3 or x < -3), x * 2, -inf)", over="n")], ["y"],
                   inputs={"x": {"dims": ["m", "n"]}})
    x = np.random.default_rng(0).standard_normal((3, 13)).astype(np.float32)
    x[0, 4] = np.nan
    ref = evaluate(spec, {"m": 3, "n": 13}, {"x": x.astype(np.float64)})["y"]
    assert np.isnan(ref[0]) and np.isfinite(ref[1:]).all()
    for strategy in ("row_resident", "streaming_fused", "multi_pass", "unfused_chain"):
        got = run(spec, {"m": 3, "n": 13}, "float32", {"x": x}, strategy=strategy).outputs["y"].double().numpy()
        assert np.isnan(got[0]) and np.allclose(got[1:], ref[1:]), (strategy, got, ref)
    assert certify(derive_cascade(spec), trials=4).holds


# ---------------------------------------------------------------- cascades a new user writes (issue 14)


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


def test_argmax_and_argmin_take_the_first_nan_as_numpy_does():
    """log(x) is NaN for x < 0. NumPy's argmax/argmin (the reference) return the first NaN; the
    certificate's tiled run sorted NaN last (algebra error 1.0), and the kernels' tl.max skipped it."""
    spec = spec_of([red("mx", "max", "x"), red("am", "argmin", "exp(x - mx) * log(x)"), red("ax", "argmax", "log(x)")],
                   ["am", "ax"])
    d = derive_cascade(spec)
    assert d.forms["am"].fused
    cert = certify(d, trials=12)
    assert cert.holds and cert.per_reduction["am"] == 0.0 and cert.per_reduction["ax"] == 0.0, cert
    every_strategy_passes(spec, {"m": 3, "n": 13})


LENGTHS = {"x": {"dims": ["m", "n"]}, "len": {"dims": ["m"], "kind": "index"}}  # a per-row length (0 included)


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


def test_a_where_whose_condition_reads_a_dependency_still_does_not_fuse():
    """Only a condition free of D is a mask: where(x > mx / 2, ...) decides with the running value."""
    spec = spec_of([red("mx", "max", "x"), red("den", "sum", "where(x > mx / 2, exp(x - mx), 0)")], ["den"])
    assert not derive_cascade(spec).forms["den"].fused


# ---------------------------------------------------------------- knife edges of the judge (fuzz seed 42)


def judged(spec, shape, got, stores, seed=0):
    """runner.judge as self_check calls it, on hand-made outputs ``got`` (numpy arrays)."""
    from fuser_core.reference import Evaluator, bind_shape, random_inputs
    from fuser_core.runner import judge, knife_edges, rounding_noise, tie_alternatives

    shape = bind_shape(spec, shape)
    inputs = random_inputs(spec, shape, np.random.default_rng(seed))
    reference = evaluate(spec, shape, inputs)
    return judge(
        spec, {p: torch.from_numpy(np.asarray(v)) for p, v in got(reference, inputs).items()}, reference, stores,
        exact=True, noise=rounding_noise(lambda a: evaluate(spec, shape, a), inputs, reference, seed),
        alternatives=tie_alternatives(lambda k: evaluate(spec, shape, inputs, tie_choice=k), spec, reference),
        knife=lambda: knife_edges(lambda a, r: evaluate(spec, shape, a, rounding=r), inputs, seed),
        selected=lambda part, idx: Evaluator(spec, shape).selected(inputs, part, idx),
    )


TOPK_OF_TIES = spec_of(  # seed 42, 4 specs: acc0 is constant along e, the exp term ~1e-10 of it
    [red("pid", "max", "(x) ** 4", over="e"), red("acc0", "max", "where(index(n) >= index(e), x, x) * pid", over="e"),
     red("den", "sum", "exp(((x) ** 4) - pid)", over="e"), {"name": "den_anchor", "expr": "exp(((x) ** 4) - pid) / den"},
     red("mx_old", "topk", "(den_anchor / size(n)) + acc0", over="e", k=3, **{"as": "slot"})],
    ["mx_old"], inputs={"x": {"dims": ["n", "e", "j2"]}},
)


def test_topk_over_values_tied_in_float32():
    """The 13 values acc0 + tiny are equal in float32: which k indices a kernel returns is rounding's
    choice. The judge accepts indices whose selected values match the reference's values."""
    every_strategy_passes(TOPK_OF_TIES, {"n": 2, "e": 13, "j2": 1, "slot": 3})


def test_a_topk_index_selecting_a_clearly_smaller_value_is_wrong():
    spec = spec_of([red("g", "topk", "x", k=3, **{"as": "j"})], ["g"])
    stores = {"g.values": "float32", "g.indices": "int32"}
    shape = {"m": 2, "n": 13, "j": 3}

    def swapped(order):  # the reference's values and indices, the slots of row 0 in another order
        def got(reference, inputs):
            idx = reference["g.indices"].astype(np.int32).copy()
            idx[0] = idx[0][list(order)]
            return {"g.values": reference["g.values"].astype(np.float32), "g.indices": idx}
        return got

    assert judged(spec, shape, swapped([0, 1, 2]), stores)["passed"]
    assert judged(spec, shape, swapped([1, 0, 2]), stores)["bad"] == ["g.indices"]  # distinct values, wrong slots

    def smallest(reference, inputs):  # slot 2 of row 0 selects the row's smallest value
        idx = reference["g.indices"].astype(np.int32).copy()
        idx[0, 2] = int(np.argmin(inputs["x"][0]))
        return {"g.values": reference["g.values"].astype(np.float32), "g.indices": idx}

    def repeated(reference, inputs):  # one position twice
        idx = reference["g.indices"].astype(np.int32).copy()
        idx[0, 1] = idx[0, 0]
        return {"g.values": reference["g.values"].astype(np.float32), "g.indices": idx}

    assert judged(spec, shape, smallest, stores)["bad"] == ["g.indices"]
    assert judged(spec, shape, repeated, stores)["bad"] == ["g.indices"]


ROUND_ON_A_CANCELLATION = {  # seed 42, 2 specs: 1 + logits tanh(h) = -7.7e-4 at one element
    "foldwise": 1, "name": "uwwwui", "inputs": {"x": {"dims": ["c", "seq"]}, "logits": {"dims": ["j2", "c"]}},
    "steps": [
        {"name": "h", "reduce": "min", "over": "c",
         "expr": "(where(where(index(c) < index(seq), logits, logits) <= sqrt(abs(logits) + 1), index(seq) * 0.25, x)"
                 " + where(index(j2) <= index(c), x, x))"},
        {"name": "T", "reduce": "max", "over": "seq", "expr": "minimum(h, h)"},
        {"name": "o", "reduce": "sum", "over": "c",
         "expr": "(round((log1p(abs(logits)) / (1 + cast(logits, \"float32\") * tanh(h))) * 4) * 0.25 + 0.1)"}],
    "outputs": ["T", "o"],
}


def test_round_of_a_value_float32_cancellation_moves():
    """round(log1p|l| / (1 + l tanh h) * 4): the denominator cancels to -7.7e-4, float32 moves the
    argument (-4696.5) by 0.4 and round() lands one step over: 2.1e-4 of the output. Some float64
    evaluation with float32-sized roundings lands there too, so it is right."""
    every_strategy_passes(load_spec(ROUND_ON_A_CANCELLATION), {"c": 13, "seq": 13, "j2": 1})


def test_a_round_off_by_one_step_away_from_any_boundary_is_wrong():
    spec = spec_of([red("o", "sum", "round(x * 4) * 0.25", over="n")], ["o"])
    shape = {"m": 3, "n": 13}

    def off(reference, inputs):  # row 0 one step of round() too high, its arguments far from half steps
        arg = inputs["x"][0] * 4
        assert np.min(np.abs(arg - np.floor(arg) - 0.5)) > 1e-3
        o = reference["o"].astype(np.float32).copy()
        o[0] += 0.25
        return {"o": o}

    assert judged(spec, shape, lambda r, i: {"o": r["o"].astype(np.float32)}, {"o": "float32"})["passed"]
    assert judged(spec, shape, off, {"o": "float32"})["bad"] == ["o"]


def test_a_where_deciding_at_equality_in_float32():
    """where(log2(sigmoid(y) + 1) >= -x, ...): both sides equal in float32 at one element."""
    spec = load_spec({
        "foldwise": 1, "name": "ru", "inputs": {"x": {"dims": ["seq"]}}, "params": {"eps": 1e-05}, "outputs": ["g"],
        "steps": [
            {"name": "BLOCK", "reduce": "max", "over": "seq", "expr": "x"},
            {"name": "sel", "reduce": "min", "over": "seq", "expr": "exp((x) - BLOCK) / eps"},
            {"name": "y", "expr": "minimum(where(cast(eps, \"float32\") < minimum(BLOCK, eps), eps, -1), (BLOCK + BLOCK))"},
            {"name": "pid", "reduce": "max", "over": "seq",
             "expr": "where(minimum(4, x) <= cast(x, \"float32\"), log2(sigmoid(x) + 1), (x + y))"},
            {"name": "g", "reduce": "min", "over": "seq",
             "expr": "where(log2(sigmoid(y) + 1) >= (-x), (x * (BLOCK * BLOCK)), sqrt(abs(where((sel + sel) <= (-pid), sel, 0)) + 1))"}],
    })
    every_strategy_passes(spec, {"seq": 13})


def test_rounded_evaluations_keep_exact_operations_exact():
    """The knife-edge evaluations move rounding results only: index arithmetic, comparisons and
    round() stay exact, so a mask never flips for them."""
    from fuser_core.reference import Evaluator

    spec = spec_of([red("s", "sum", "where(index(n) + 1 == size(n), round(x * 4), 0)")], ["s"])
    x = np.random.default_rng(0).standard_normal((2, 5))
    exact = evaluate(spec, {"m": 2, "n": 5}, {"x": x})["s"]
    ev = Evaluator(spec, {"m": 2, "n": 5}, rounding=(np.random.default_rng(1), 2.0**-21))
    np.testing.assert_array_equal(ev.outputs({"x": x})["s"], exact)
    moved = evaluate(spec, {"m": 2, "n": 5}, {"x": x}, rounding=(np.random.default_rng(1), 2.0**-21))
    np.testing.assert_array_equal(moved["s"], exact)
    s = spec_of([red("s", "sum", "exp(x)")], ["s"])
    ref = evaluate(s, {"m": 2, "n": 5}, {"x": x})["s"]
    got = evaluate(s, {"m": 2, "n": 5}, {"x": x}, rounding=(np.random.default_rng(1), 2.0**-21))["s"]
    assert 0 < np.max(np.abs(got / ref - 1)) < 4 * 2.0**-21


def test_a_cast_of_a_size_compiles_where_the_size_is_1(compile_pool):
    """cast(size(n) / 2, "float8_e4m3fn"): Triton passes a size of 1 as a constant, so the cast's
    operand was a Python float, and the GPU compiler refused `x.to(...)` in fp8e4m3_round (the
    interpreter accepted it; fuzz seed 43). It is rounded as a 0-d tensor now."""
    from fuser_core.codegen.gpu_compile import CompileRequest

    spec = spec_of([red("nblk", "argmin", "x", over="m"), red("u", "sum", "x * x", over="j"),
                    {"name": "total", "expr": "-where(-u >= where(index(m) != nblk, scale, -1), cast(scale, \"float8_e4m3fn\"), -1)"},
                    red("t", "argmax", "total", over="m"), red("acc", "sum", "-u", over="m")],
                   ["t", "acc"], inputs={"x": {"dims": ["m", "j", "n"]}}, params={"scale": "size(n) * 0.5"})
    shape = {"m": 13, "j": 1, "n": 1}
    for r in every_strategy_passes(spec, shape):
        [build] = compile_pool.compile([CompileRequest(spec, shape, {"x": "float32"}, r["strategy"], r["config"])])
        assert build.ok and build.kernels, build.first_error()


def test_a_where_condition_sympy_cannot_fold_is_a_reported_limit_not_a_crash():
    """Fuzz seed 44: a where() whose condition compares two where() values of constants made
    sympy's Piecewise rewrite pop from an empty set (KeyError); derive_cascade reported it as a
    DerivationLimitError naming the step. Folded branch by branch as it is converted, it derives now (or stops
    at a reported limit), and never crashes."""
    from fuser_core.errors import DerivationLimitError

    spec = load_spec({
        "foldwise": 1, "name": "a", "inputs": {"q": {"dims": ["m"]}, "bias": {"dims": ["m"]}, "w": {"dims": ["m"]}},
        "steps": [{"name": "acc0", "reduce": "max", "over": "m", "expr":
                   "where(where(where((q + bias) < (bias / size(m)), beta0, q) > where((eps) ** 3 <= "
                   "cast(beta0, \"bfloat16\"), beta0, -1), q, q) != (bias + 0.25), (q + w), (q + bias))"},
                  {"name": "g", "reduce": "sum", "over": "m", "expr": "(q - acc0) ** 2"}],
        "outputs": ["g"], "params": {"eps": 0.5, "beta0": 0.5}})
    try:
        d = derive_cascade(spec)
    except DerivationLimitError as err:
        assert "acc0" in str(err)
    else:
        assert certify(d, trials=4).holds


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


SIN_NEAR_A_POLE = {  # fuzz seed 43 (benchmarks/results/fuzz_judge_seed43.md, certificate failure 4)
    "foldwise": 1, "name": "qv8brgtu",
    "inputs": {"v": {"dims": ["j2", "c", "e"]}, "tgt": {"dims": ["j2"], "kind": "index"}},
    "steps": [{"name": "triton", "expr": "(((alpha / (1 + v * alpha)) / size(j2))) ** 4"},
              {"name": "idx", "reduce": "sum", "over": "e", "expr": "sin(triton)"},
              {"name": "mx", "expr": "minimum(cast(triton, \"float16\"), where(index(e) >= index(c), alpha, -1))"},
              {"name": "p", "expr": "cast(alpha, \"float32\") * mx"},
              {"name": "offs", "expr": "where(tgt >= 1, p, 0)"}],
    "outputs": ["idx", "offs"], "params": {"alpha": 2}}


def test_an_ill_conditioned_reference_is_judged_by_its_own_movement():
    """Fuzz seed 43: near v = -1/2 the argument of sin reaches ~5e15, and algebraically equal forms
    differ by O(1) in float64 (0.145 relative). The certificate now allows a failing reduction
    CONDITIONING_K times the reference's own movement at inputs moved by a few float64 ulps; a
    wrong form, which is wrong where the reference is well-conditioned too, is still caught."""
    from fuser_core import certificate

    d = derive_cascade(load_spec(SIN_NEAR_A_POLE))
    assert all(certify(d, seed=seed).holds for seed in range(4))
    # without the allowance the same trials fail: the test exercises it
    original = certificate.CONDITIONING_K
    certificate.CONDITIONING_K = 0
    try:
        assert not all(certify(d, seed=seed).holds for seed in range(4))
    finally:
        certificate.CONDITIONING_K = original


def test_a_combine_kernel_recomputes_a_dependency_a_per_lane_part_kernel_merged(compile_pool):
    """Fuzz seed 45: split_fused's part kernel merged its lanes (per-lane states) and recorded r's
    final value as printed; the combine kernel inherited that record and skipped recomputing r
    after its split loop, then read the loop-scoped r (NameError on sm_90). Each kernel now starts
    with nothing in scope (KernelWriter.begin_kernel)."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from fuser_core.targets import Target

    spec = load_spec({
        "foldwise": 1, "name": "riyc", "inputs": {"kk": {"dims": ["seq"]}, "x": {"dims": ["seq"]}},
        "steps": [{"name": "h", "expr": "(eps) ** 2 * x"},
                  {"name": "sel", "reduce": "sum", "over": "seq", "expr": "maximum(clamp(0.5, -1, 0.5), (x) ** 2)"},
                  {"name": "r", "reduce": "sum", "over": "seq", "expr": "kk * sel"},
                  {"name": "tmp", "reduce": "sum", "over": "seq", "expr": "kk + r"},
                  {"name": "acc0", "reduce": "sum", "over": "seq", "expr": "where(x > 0, x * rsqrt(r * r + 1), 0)"}],
        "outputs": ["h", "tmp", "acc0"], "params": {"eps": "log(size(seq) + 1)"}})
    config = KernelConfig({"seq": 4}, split=2)
    report = self_check(spec, {"seq": 13}, "float32", strategy="split_fused", config=config)
    assert report["passed"], report
    builds = compile_pool.compile([CompileRequest(spec, {"seq": 13}, {"kk": "float32", "x": "float32"}, "split_fused",
                                                  config.to_dict(), Target.parse(arch)) for arch in ("sm_90", "sm_80")])
    assert all(b.ok and len(b.kernels) == 2 for b in builds), [b.first_error() for b in builds]


@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused", "split_fused", "multi_pass"])
def test_a_top_k_of_a_row_masked_to_minus_inf_gives_k_distinct_indices(strategy):
    """Fuzz seed 46: where(index(seq) < target, ..., -inf) with target = 0 masks the whole row; the
    top-4 of thirteen -inf values is indices 0..3 (lower index first on ties, as the reference),
    but the kernels' lists marked taken and empty slots with -inf and returned [0, 0, 0, 0]. Empty
    and taken slots now carry index 2147483647; argmax of a -inf row is index 0 the same way."""
    spec = load_spec({
        "foldwise": 1, "name": "f", "inputs": {"a": {"dims": ["seq", "m"]}, "target": {"dims": [], "kind": "index"}},
        "steps": [{"name": "tl", "reduce": "topk", "over": "seq", "k": 4, "as": "kdim",
                   "expr": "where(index(seq) < target, a, -inf)"},
                  {"name": "am", "reduce": "argmax", "over": "seq", "expr": "where(index(seq) < target, a, -inf)"}],
        "outputs": ["tl", "am"]})
    shape = {"seq": 13, "m": 2, "kdim": 4}
    config = KernelConfig({"seq": 16} if strategy == "row_resident" else {"seq": 4},
                          split=2 if strategy == "split_fused" else 1)
    rng = np.random.default_rng(0)
    for target in (0, 2, 13):
        inputs = {"a": rng.standard_normal((13, 2)).astype(np.float32), "target": np.array(target, np.int32)}
        out = run(spec, shape, "float32", inputs, strategy=strategy, config=config).outputs
        ref = evaluate(spec, shape, inputs)
        got = out["tl.indices"].numpy()
        np.testing.assert_array_equal(got, ref["tl.indices"])
        np.testing.assert_array_equal(out["am"].numpy(), ref["am"])
        assert all(len(set(row)) == 4 for row in got.tolist())


def test_a_mask_window_over_an_inner_dim_starts_at_zero():
    """fuzz seed 48: ``where(index(t) > index(e), ...)`` summed over t, where e is an inner axis
    (another step sums over it), so every program holds e whole. The loop's window read
    ``pid_e * BLOCK_e`` (NameError: no program id of e); a whole dim's first index is 0."""
    spec = spec_of(
        [red("sel", "min", "sqrt(x ** 4 + 1)", over="t"), red("p", "sum", "a / (2 + sin(q))", over="e"),
         red("den", "sum", "where(index(t) > index(e), exp(sel - sqrt(x ** 4 + 1)) * x, 0)", over="t")],
        ["sel", "p", "den"], inputs={"a": {"dims": ["e", "t"]}, "x": {"dims": ["t"]}, "q": {"dims": ["e"]}})
    every_strategy_passes(spec, {"e": 5, "t": 37})


def test_a_where_fill_that_is_a_symbolic_constant_is_compared_as_a_number():
    """fuzz seed 50: ``sigmoid(where(c, lse, -1))`` summed over d has the fill sigmoid(-1) =
    1/(1 + E); the mask check built sp.Float from it (TypeError: cannot create mpf) and every
    strategy crashed while generating. The fill is not the sum's identity, so no mask window."""
    spec = spec_of(
        [{"name": "lse", "expr": 'cast(where(index(e) <= index(d), logits, v), "float8_e4m3fn")'},
         red("h", "sum", "sigmoid(where(not index(e) <= index(d), lse, -1))", over="d")],
        ["h"], inputs={"logits": {"dims": ["n", "d", "e"]}, "v": {"dims": ["d"]}})
    every_strategy_passes(spec, {"n": 2, "d": 9, "e": 3})


# ---------------------------------------------------------------- sympy's cancellations and IEEE (fuzz seed 53)


@pytest.mark.parametrize("expr", ["(x - x) - mx", "(x + 1) - (x - x) + mx * 0", "x * 0 + (mx + x) - x"])
def test_cancelled_symbols_keep_their_nan(expr):
    """sympy simplifies x - x to 0, x * 0 to 0 and (a + b) - b to a, so an infinite x gave a finite kernel value
    where the formula as written (IEEE) gives NaN, in every strategy (the masked and NaN families refused
    row_resident too). The conversion keeps nan_of(x) (0 for finite x, NaN otherwise) for a symbol it dropped."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import NanOf

    spec = spec_of([red("mx", "max", "x"), red("s", "sum", f"({expr}) ** 2")], ["s"])
    d = derive_cascade(spec)
    assert d.forms["s"].integrand.atoms(NanOf), d.forms["s"].integrand
    # (nan_of(x) - mx)^2 centres 0 on the running max, which 0 may exceed: not fused (a Taylor form could cancel)
    fused = ("streaming_fused",) if d.forms["s"].fused else ()
    assert fused or "both sides" in d.forms["s"].reason
    for strategy in ("row_resident", *fused, "multi_pass"):
        verdict = accuracy_check(spec, {"m": 3, "n": 9}, families=("masked", "nan"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])
    assert certify(d, trials=4).holds


def test_a_cancelled_elementwise_output_is_nan_where_its_input_is_infinite():
    """p = -(kk - kk) printed as 0.0: the reference's p is NaN where kk is -inf."""
    spec = spec_of([{"name": "p", "expr": "(-(kk - kk))"}, red("z", "max", "where(kk > 0, kk, -inf)", over="j2")],
                   ["p", "z"], inputs={"kk": {"dims": ["j2"]}})
    x = np.array([1.0, -np.inf, np.nan, 2.0])
    out = run(spec, {"j2": 4}, "float32", {"kk": x}, strategy="row_resident").outputs
    got = out["p"].numpy()
    assert got[0] == 0 and got[3] == 0 and np.isnan(got[1]) and np.isnan(got[2])


def test_a_welford_move_between_one_infinity_is_no_move():
    """CI fuzz after the list ``over`` draws: ``sum(x + T)`` with ``T = sum x`` adds count[old] (T[new] - T[old])
    per tile (then a shifted form, now Taylor's, its first-order coefficient being the count). On a row holding
    -inf the running estimate of T is -inf before and after a tile, and the move was inf - inf = NaN where the
    reference has -inf. ``shift_term`` (``nan_to_zero`` in the shifted form) takes that move as none (a NaN of
    the data is in the accumulator already: its contributions read the running estimate)."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.realisation import ShiftTerm

    spec = spec_of([red("T", "sum", "x"), red("tl", "sum", "x + T")], ["tl"])
    d = derive_cascade(spec)
    assert d.forms["tl"].kind == "taylor" and d.forms["tl"].realisation.accumulators[0].moved.atoms(ShiftTerm)
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({"n": 4}, split=2 if strategy == "split_fused" else 1)
        verdict = accuracy_check(spec, {"m": 3, "n": 13}, families=("masked", "nan", "normal"), strategy=strategy,
                                 config=config)
        assert verdict["passed"], (strategy, verdict["families"])
    assert certify(d, trials=4).holds


def test_a_masked_lane_whose_term_overflows_float32_is_masked():
    """CI fuzz: T = sum exp(mx - bias) * bias with mx = min(bias), its tail lanes loaded as 0: the term there is
    0 * exp(mx - 0), which float64 gives as 0 for any anchor the old check tried, but float32 as 0 * inf = NaN once
    the running min passes 88.7 (inputs near 100). The check now evaluates in float32 at anchors up to 1e30. (The
    argmin keeps bias from being loaded with the min's fill, which would mask the lanes anyway.)"""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("nblk", "argmin", "bias ** 3"), red("mx", "min", "bias"), red("T", "sum", "exp(mx - bias) * bias"),
                    red("top", "topk", "where(bias < 0, bias + T, -inf)", k=3, **{"as": "kdim"})], ["nblk", "top"],
                   inputs={"bias": {"dims": ["n"]}})
    verdict = accuracy_check(spec, {"n": 13}, families=("offset100", "normal"), strategy="streaming_fused",
                             config=KernelConfig({"n": 16}))
    assert verdict["passed"], verdict["families"]


# ---------------------------------------------------------------- fuzz seeds 60 and 61: the fallback passes


def fused_pass_specials(spec, shape, block, families=("masked", "nan", "normal")):
    """The fused strategies (split in two) pass the accuracy bar, special values included."""
    from fuser_core.accuracy import accuracy_check

    axis = next(s.over for s in spec.steps if s.is_reduction)
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({axis: block}, split=2 if strategy == "split_fused" else 1)
        verdict = accuracy_check(spec, shape, families=families, strategy=strategy, config=config)
        assert verdict["passed"], (strategy, verdict["families"])


def test_a_factored_dependency_that_ends_infinite_takes_the_fallback_pass():
    """Fuzz seed 60: ``sum(a * mask)`` with ``mask = sum(a)`` is kept as ``mask * sum(a)``. On a row half masked
    to -inf, mask = -inf and the formula's terms are +inf (a = -inf) and -inf (a finite, positive) or +inf: NaN,
    where the factored form gives +inf. The fused kernels now recompute such a row with a pass of the formula
    (its trip count is 0 where the dependency is finite)."""
    from fuser_core.codegen.module import generate
    from fuser_core.problem import bind_dtypes

    spec = spec_of([red("mask", "sum", "x"), red("acc", "sum", "x * mask")], ["acc"])
    d = derive_cascade(spec)
    assert d.forms["acc"].kind == "scaled"
    source = generate(spec, d, "streaming_fused", {"m": 3, "n": 13}, KernelConfig({"n": 4}), bind_dtypes(spec, "float32")).source
    assert "fallback = tl.where(tl.abs(mask_acc) == float('inf'), 1, 0)" in source
    assert "range(0, (size_n) * fallback, BLOCK_n)" in source
    fused_pass_specials(spec, {"m": 3, "n": 13}, 4)


def test_a_max_offset_that_ends_infinite_takes_the_fallback_pass():
    """Fuzz seed 61: ``max(k + v)`` with ``v = max(w - k)`` is kept as ``max(k) + v`` (v anchored at its running
    value). Where k is half -inf, v = +inf and the formula's max over k + inf holds -inf + inf = NaN, which max
    propagates; the offset form gives +inf."""
    spec = spec_of([red("v", "max", "w - x"), red("acc", "max", "x + v")], ["acc"],
                   inputs={"x": {"dims": ["n", "m"]}, "w": {"dims": ["n"]}})
    fused_pass_specials(spec, {"m": 2, "n": 13}, 4)


def test_a_taylor_sum_of_infinite_data_with_a_centre_crossing_zero_takes_the_fallback_pass():
    """Fuzz seed 61: ``sum(k - (c + mn * v))`` with ``mn = min(x)`` streams ``-mn~ * v`` at the running min,
    whose sign may change between tiles: at v = -inf the tiles add +inf and -inf (NaN), where the formula
    has one sign. A non-finite Taylor or shifted result is computed again."""
    spec = spec_of([red("mn", "min", "x"), red("s", "sum", "k - (0.4 + mn * v)"), red("out", "min", "v")], ["s", "out"],
                   inputs={"v": {"dims": ["m", "n"]}, "k": {"dims": ["n"]}, "x": {"dims": ["n"]}})
    fused_pass_specials(spec, {"m": 2, "n": 13}, 4, families=("masked", "normal"))


def test_a_topk_offset_by_a_nan_sum_ranks_as_the_formula():
    """Fuzz seed 61: ``topk(erf(a) * c + offs)`` with ``offs = sum(a)`` ranks erf(a) and adds offs at the end.
    Where offs is NaN every value is NaN and the formula's top-k is the first k indices."""
    spec = spec_of([red("offs", "sum", "x"), red("best", "topk", "erf(x) * 0.7 + offs", k=2, **{"as": "slot"})],
                   ["best"], inputs={"x": {"dims": ["m", "n"]}})
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({"n": 4}, split=2 if strategy == "split_fused" else 1)
        x = np.random.default_rng(0).normal(size=(2, 13))
        x[1, 5] = np.nan
        got = run(spec, {"m": 2, "n": 13}, "float32", {"x": x}, strategy=strategy, config=config).outputs
        assert got["best.indices"][1].tolist() == [0, 1], strategy
        assert torch.isnan(got["best.values"][1]).all()


def test_an_elementwise_output_of_a_recomputed_top_k_is_written_again():
    """Fuzz seed 60: ``acc = sel.indices * tanh(a)`` with ``sel = topk(v - h)``, ``h = max(v)``: on a NaN row the
    fallback pass ranked again, but acc (an elementwise output reading ``sel.indices``) kept the fused value."""
    spec = spec_of([red("h", "max", "v", over="d"), red("sel", "topk", "v - h", over="d", k=1, **{"as": "jj"}),
                    {"name": "acc", "expr": "sel.indices * tanh(a)"}], ["acc"],
                   inputs={"v": {"dims": ["n", "d"]}, "a": {"dims": ["d"]}})
    fused_pass_specials(spec, {"n": 2, "d": 13, "jj": 1}, 4, families=("nan", "masked"))


def test_the_fallback_passes_are_not_counted_by_the_tuner():
    """The tuner's analysis skips the fallback loops: on finite rows they run 0 times."""
    from tuner.analysis import Anatomy

    spec = spec_of([red("mask", "sum", "x"), red("acc", "sum", "x * mask")], ["acc"])
    an = Anatomy(spec, derive_cascade(spec), {"x": "float32"})
    (kernel,) = an.kernels("streaming_fused", {"m": 1, "n": 1024})
    assert [p.loop for p in kernel.passes if p.loop != "once"] == ["axis"]


# ---------------------------------------------------------------- fuzz seeds 60 and 61: forms that lose accuracy


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


def test_a_comparison_sympy_decides_for_finite_values_is_kept_as_written():
    """CI fuzz: ``where(c, acc, 0) != log2(sigmoid(w) + 1)`` was folded to ``where(c, acc != L, 0 != L)``, and sympy
    took ``0 != L`` for True (sigmoid(w) > 0 for a finite w). At w = -inf, L is 0: the formula's condition is false,
    the kernels took the other branch (0.1 expected, -1.4 given, every strategy). Comparisons of values that may be
    infinite or NaN are kept as written, and a where() inside one is folded branch by branch."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import InfCompare, compare

    w = sp.Symbol("w", real=True)
    assert isinstance(compare("!=", sp.Integer(0), sp.log(1 / (1 + sp.exp(-w)) + 1)), InfCompare)
    assert compare("<", sp.Symbol("index(n)", integer=True), sp.Symbol("index(n)", integer=True) + 1) == sp.true
    spec = spec_of([red("stride", "sum", "w", over="j2"), red("acc", "sum", "where(w > 0, maximum(w, stride), 0)", over="j2"),
                    {"name": "count", "expr": "round(where(where(-1.5 / (1 - 1.5 * acc) <= w, acc, 0) != log2(sigmoid(w) + 1), "
                                              "-1.5, 0) * 4) * 0.25 + 0.1"}],
                   ["stride", "count"], inputs={"w": {"dims": ["j2"]}})
    for strategy in ("row_resident", "multi_pass"):
        verdict = accuracy_check(spec, {"j2": 13}, families=("masked", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


def test_a_step_named_like_an_anchor_is_no_anchor():
    """Fuzz seed 70: ``sum(bias * den_anchor)`` with ``den_anchor = max(bias)``: the tail lanes' fold was left
    unmasked because the value's name ended in ``_anchor`` (a safe anchor is finite); on a row masked to -inf the
    tail's 0 * -inf was NaN where the formula has +inf, in the row-resident kernel."""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("den_anchor", "max", "bias", over="seq"), red("mx_old", "sum", "bias * den_anchor", over="seq")],
                   ["mx_old"], inputs={"bias": {"dims": ["seq"]}})
    for strategy in ("row_resident", "multi_pass", "streaming_fused"):
        verdict = accuracy_check(spec, {"seq": 13}, families=("masked", "nan", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


def test_an_element_masked_on_indices_is_not_read_in_any_strategy():
    """Fuzz seed 70: ``sum exp(mn - where(index(t) <= index(j2), -a q, inf)) (q - mn)`` is 0 * (q - mn) past the
    mask. multi_pass skipped those tiles (as FlashAttention skips masked keys) and gave a number; the formula read
    literally, row_resident and the unfused chain gave 0 * NaN = NaN for a NaN q there. An element a where() on
    indices masks to the identity is now not part of the reduction (fuser_core.masks): the reference drops it and
    every kernel's fold takes the identity there, whether or not its loop skips the tile."""
    from fuser_core.masks import step_exclusions

    steps = [red("mx", "max", "where(index(n) <= index(m), s, -inf)"),
             red("den", "sum", "exp(where(index(n) <= index(m), s, -inf) - mx)"),
             red("o", "sum", "exp(where(index(n) <= index(m), s, -inf) - mx) * v / den")]
    spec = spec_of(steps, ["o", "den"], inputs={"s": {"dims": ["m", "n"]}, "v": {"dims": ["n"]}})
    assert set(step_exclusions(spec)) == {"mx", "den", "o"}
    rng = np.random.default_rng(3)
    shape = {"m": 13, "n": 13}
    s, v = rng.standard_normal((13, 13)), rng.standard_normal(13)
    v[9] = np.nan  # key 9: seen by queries 9..12 only
    s[2, 11] = np.inf  # masked for query 2: exp(inf - mx) * v would be inf or NaN
    ref = evaluate(spec, shape, {"s": s, "v": v})
    assert np.isfinite(ref["o"][:9]).all() and np.isnan(ref["o"][9:]).all()
    d = derive_cascade(spec)
    valid = [st for st, why in valid_strategies(spec, d, shape).items() if why is None]
    assert {"row_resident", "multi_pass", "streaming_fused", "split_fused"} <= set(valid)
    for strategy in [*valid, "unfused_chain"]:
        config = None if strategy in ("row_resident", "unfused_chain") else KernelConfig(
            {"n": 4, "m": 1}, split=2 if strategy == "split_fused" else 1)
        got = run(spec, shape, "float32", {"s": s, "v": v}, strategy=strategy, config=config, derivation=d).outputs
        o = got["o"].double().numpy()
        assert np.array_equal(np.isnan(o), np.isnan(ref["o"])), (strategy, o)
        assert np.allclose(o[:9], ref["o"][:9], rtol=1e-5), (strategy, o, ref["o"])


def test_a_row_an_index_mask_empties_sums_to_zero_in_every_strategy():
    """Fuzz seed 49, once masked elements were dropped: ``sum exp(where(index(d) > index(t), kk x, -inf) - lse)``
    drops every d of the rows t >= size(d) - 1, so their sum is 0 and their max -inf; the fused strategies' settle
    gave 0 * exp(0 - -inf) = NaN. Such rows now take the fallback pass (fuser_core.masks.may_exclude_every), and
    the certificate compares them with the reference there. A row whose kept elements hold -inf is still NaN."""
    from fuser_core.masks import may_exclude_every

    spec = spec_of([red("lse", "max", "where(index(d) > index(t), kk * x, -inf)", over="d"),
                    red("nblk", "sum", "exp(where(index(d) > index(t), kk * x, -inf) - lse)", over="d")],
                   ["nblk"], inputs={"x": {"dims": ["d"]}, "kk": {"dims": ["t"]}})
    d = derive_cascade(spec)
    assert may_exclude_every(d.forms["nblk"].realisation.accumulators[0].contribution, "sum", "d")
    assert certify(d, trials=12).holds
    shape = {"d": 5, "t": 7}
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(5), "kk": rng.standard_normal(7)}
    inputs["x"][4] = -np.inf  # rows t < 4 keep d = 4: kk * x = +-inf there
    ref = evaluate(spec, shape, inputs)["nblk"]
    assert np.isnan(ref[3]) and (ref[4:] == 0).all()
    for strategy in ("row_resident", "multi_pass", "streaming_fused", "split_fused", "unfused_chain"):
        config = None if strategy in ("row_resident", "unfused_chain") else KernelConfig(
            {"d": 2}, split=2 if strategy == "split_fused" else 1)
        got = run(spec, shape, "float32", inputs, strategy=strategy, config=config, derivation=d).outputs["nblk"]
        got = got.double().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.allclose(got[4:], 0.0), (strategy, got)
        assert np.allclose(got[:3], ref[:3], rtol=1e-5), (strategy, got)


def test_causal_attention_keeps_a_key_for_every_query():
    """Causal attention's mask keeps key 0 for every query: no row is empty, so its fused kernels take no
    fallback pass for it (their SASS is unchanged by the exclusion rule)."""
    from fuser_core.masks import may_exclude_every

    from fuser_core.catalog import load_catalog_spec

    d = derive_cascade(load_catalog_spec("attention_causal"))
    for name in ("den", "o"):
        for acc in d.forms[name].realisation.accumulators:
            assert not may_exclude_every(acc.contribution, acc.op, "n")


def test_an_or_of_complementary_comparisons_is_false_for_nan():
    """Fuzz seed 72: ``where(l * q <= l or l < q * l, q * a, 0)``: sympy folds the ``or`` of two complementary
    comparisons to True, but for a NaN ``l`` both are false and the formula takes 0; every kernel added ``q * a``
    there (28.5 against 19.1). Where sympy decides an ``or`` so, its comparisons of values are kept as written."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import InfCompare, SymbolicSpec

    spec = spec_of([red("amax", "sum", "where((logits * q) <= logits or logits < (q * logits), q * a, 0)"),
                    red("tl", "sum", "(q - amax) ** 2")], ["tl"],
                   inputs={"logits": {"dims": ["n"]}, "q": {"dims": ["n"]}, "a": {"dims": ["n"]}})
    assert SymbolicSpec(spec).integrand(spec.step("amax")).atoms(InfCompare)
    for strategy in ("row_resident", "multi_pass"):
        verdict = accuracy_check(spec, {"n": 13}, families=("nan", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


def test_sigmoid_of_a_large_negative_value_is_not_zero():
    """Fuzz seed 54: ``sigmoid(-v)`` at v near 100 printed as ``1 / (1 + exp(v))`` is 1 / inf = 0 in float32, where
    the formula has exp(-100) (a denormal); an argmax over such values then picked another index. The printer
    calls ``sigmoid_accurate`` (exp(x) / (1 + exp(x)) for x < 0)."""
    spec = spec_of([red("out", "argmax", "sigmoid(-v)"), {"name": "s", "expr": "sigmoid(-v)"}], ["out", "s"],
                   inputs={"v": {"dims": ["n"]}})
    v = np.array([100.0, 99.5, 101.0, 100.2, 99.0, 100.7, 98.9, 100.1, 102.0, 99.9, 100.3, 99.8, 100.4])
    ref = evaluate(spec, {"n": 13}, {"v": v})
    for strategy in ("row_resident", "multi_pass"):
        got = run(spec, {"n": 13}, "float32", {"v": v}, strategy=strategy).outputs
        assert int(got["out"]) == int(ref["out"]) == 6, strategy
        s = got["s"].double().numpy()
        assert (s > 0).all() and np.allclose(s, ref["s"], rtol=1e-2, atol=2e-45), (strategy, s)  # denormals: steps of 1.4e-45


def test_a_cancelled_symbol_adds_nan_only_for_its_own_infinity():
    """Fuzz seed 73: ``(-v) + (v - q)`` is ``-q`` to sympy, and IEEE's NaN for an infinite v was kept as
    ``nan_of(v - q)``, NaN at q = -inf too, where the formula gives inf (a min over such values then NaN instead
    of a number). The kept NaN now reads the lost symbol's part of the operand: ``nan_of(v)``."""
    spec = spec_of([red("amax", "min", "(-v) + (v - q)", over="e")], ["amax"],
                   inputs={"q": {"dims": ["e", "j2"]}, "v": {"dims": ["c"]}})
    q = np.array([[-np.inf, -0.1], [-np.inf, 0.3], [-np.inf, -np.inf], [-np.inf, 0.9]])
    v = np.array([-0.7])
    shape = {"e": 4, "j2": 2, "c": 1}
    ref = evaluate(spec, shape, {"q": q, "v": v})["amax"].ravel()
    assert np.isposinf(ref[0]) and np.isfinite(ref[1])
    for strategy in ("row_resident", "multi_pass"):
        got = run(spec, shape, "float32", {"q": q, "v": v}, strategy=strategy).outputs["amax"].double().numpy().ravel()
        assert np.isposinf(got[0]) and np.isclose(got[1], ref[1]), (strategy, got)
    v_inf = np.array([np.inf])  # an infinite v still gives the formula's NaN
    assert np.isnan(run(spec, shape, "float32", {"q": q, "v": v_inf}, strategy="row_resident").outputs["amax"]).all()


def test_integer_powers_are_squarings():
    """Fuzz seed 73: ``sin(c) ** 12`` printed as exp2(12 log2 |b|) erred 2.3x the formula's error; integer powers up
    to 32 are printed as squarings (at most 2 log2(n) roundings)."""
    from fuser_core.codegen.tritonize import _squarings

    assert _squarings("b", 12).count("*") == 11 and _squarings("b", 4) == "(b * b) * (b * b)"
    x = np.array([6.5, 0.3, -2.0, 1.1, -0.9, 3.0, 0.05])
    spec = spec_of([{"name": "p", "expr": "sin(x) ** 12"}, red("s", "sum", "sin(x) ** 12")], ["p", "s"],
                   inputs={"x": {"dims": ["n"]}})
    got = run(spec, {"n": 7}, "float32", {"x": x}, strategy="row_resident").outputs
    assert np.allclose(got["p"].double().numpy(), np.sin(x) ** 12, rtol=2e-6, atol=0)


def test_an_output_float32_cannot_hold_is_held_to_infinity():
    """Fuzz seed 73: ``sum(v * nblk)`` at 1.3e59 is +inf in float32, in the formula and every kernel; the special-
    value check compared with the float64 value and called the infinity wrong. It now compares with the
    reference as the output's dtype holds it."""
    from fuser_core.accuracy import bar_verdict

    spec = spec_of([red("s", "sum", "x")], ["s"], inputs={"x": {"dims": ["n"]}})
    ref = {"s": np.array([1.26e59, -1.3e59, 2.0])}
    got = {"s": np.array([np.inf, -np.inf, 2.0])}
    assert bar_verdict(spec, got, ref, [got], {"s": "float32"}, special=True)["specials"] == []
    wrong = {"s": np.array([np.inf, np.inf, 2.0])}
    assert bar_verdict(spec, wrong, ref, [got], {"s": "float32"}, special=True)["specials"]


def test_an_output_reduced_over_another_axis_is_written_again_after_a_fallback():
    """Fuzz seed 73: ``h = max over t of where(index(e) == g, q, 0)`` with ``g`` an argmax over e whose offset
    ``best`` is NaN: the fallback pass redid g, but h, an output reduced over another axis from it, kept the fused
    g's value (NaN at a position the reference has 0). Outputs reduced over other axes that read a redone step
    are computed and written again."""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("best", "sum", "q", over="e"), red("g", "argmax", "(-q) * 2 + best", over="e"),
                    red("h", "max", "where(index(e) == g, q, 0)", over="t")], ["h"],
                   inputs={"q": {"dims": ["m", "e", "t"]}})
    verdict = accuracy_check(spec, {"m": 2, "e": 13, "t": 5}, families=("nan", "normal"), strategy="streaming_fused",
                             config=KernelConfig({"e": 16}, per_lane=False))
    assert verdict["passed"], verdict["families"]


def test_a_negated_index_mask_is_evaluated_by_the_reference():
    """CI fuzz: ``where(not index(m) <= index(n), x, -inf)`` is ``index(m) > index(n) or unordered(...)`` (NaN makes
    a comparison false, and `not` true); the reference's masked-element rule could not evaluate the unordered
    part and the certificate raised. It is never true for indices."""
    spec = spec_of([red("sel", "max", "where(not index(m) <= index(n), x, -inf)", over="m"),
                    red("vals", "sum", "(x - sel) ** 2", over="m")], ["vals", "sel"], inputs={"x": {"dims": ["n", "m"]}})
    assert certify(derive_cascade(spec), trials=6).holds
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    sel = evaluate(spec, {"n": 3, "m": 4}, {"x": x})["sel"].ravel()
    assert sel.tolist() == [3.0, 7.0, 11.0]
