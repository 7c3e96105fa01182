"""The certificate must fail on a wrong form: a check that cannot fail proves nothing."""

from __future__ import annotations

import dataclasses

import pytest
import sympy as sp

from tests.support.catalog import load_catalog
from fuser_core.certificate import certify
from fuser_core.derive import derive_cascade
from fuser_core.spec import load_spec
from tests.support.cascades import red, spec_of

CATALOG = load_catalog()


def corrupted(name: str, step: str, **changes):
    d = derive_cascade(load_spec(CATALOG[name]))
    d.forms[step] = dataclasses.replace(d.forms[step], **changes)
    d.realise(step)  # the certificate reads the realisation: rebuild it from the corrupted form
    return d


def test_a_missing_softmax_correction_is_caught():
    d = corrupted("safe_softmax", "den", corrections=(sp.Integer(1),))
    cert = certify(d, trials=8)
    assert not cert.holds
    assert cert.per_reduction["den"] > 1e-3
    assert "float64 rounding" not in cert.note.replace("beyond float64 rounding", "")  # never "the error is rounding"


def test_a_wrong_taylor_shift_is_caught():
    # layernorm's variance moved as if its first-order sum were 0 (the shifted, Welford move's assumption)
    # and its count term dropped: no move at all in real arithmetic
    form = derive_cascade(load_spec(CATALOG["layernorm"])).forms["var"]
    d = corrupted("layernorm", "var", reanchor=tuple(sp.Symbol(f"acc[{k}]") for k in range(len(form.reanchor))))
    cert = certify(d, trials=8)
    assert not cert.holds and cert.per_reduction["var"] > 1e-3


def test_a_wrong_final_factor_is_caught():
    d = corrupted("attention", "o", deferred=(sp.Integer(1),))
    assert not certify(d, trials=4).holds


def test_a_wrong_topk_order_is_caught():
    d = corrupted("moe_routing", "gate", effective_op="bottomk")
    assert not certify(d, trials=4).holds


def test_certificate_reports_trials_and_is_reproducible():
    d = derive_cascade(load_spec(CATALOG["logsumexp"]))
    a, b = certify(d, trials=5, seed=7), certify(d, trials=5, seed=7)
    assert a.trials == 5 and a.max_rel_err == b.max_rel_err
    assert a.to_dict()["exact"] is True


ENTROPY_WITH_TEMPERATURE = {
    "foldwise": 1, "name": "entropy_t", "inputs": {"x": {"dims": ["m", "n"]}}, "params": {"t": "0.7"},
    "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x / t"},
              {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x / t - mx)"},
              {"name": "h", "reduce": "sum", "over": "n", "expr": "-(exp(x / t - mx) / den) * (x / t - mx - log(den))"}],
    "outputs": ["h"]}


def test_a_result_that_is_zero_in_real_arithmetic_is_judged_against_the_inputs_size():
    """The entropy of one value is 0; float64 gives +-1e-16 in the reference and the fused form
    alike. Judged relative to itself that failed the certificate (seeds 7, 22, 29, 38: error 1.0,
    and 2e284 against an exact 0); against the inputs' size it is rounding. A wrong form still fails."""
    from fuser_core.certificate_loop import rel_err

    d = derive_cascade(load_spec(ENTROPY_WITH_TEMPERATURE))
    for seed in (7, 22, 29, 38):
        cert = certify(d, seed=seed)
        assert cert.holds and cert.max_rel_err < 1e-9, (seed, cert.per_reduction)
    assert rel_err([2.2e-16], [0.0], input_scale=3.0) < 1e-9
    assert rel_err([1e-9], [0.0], input_scale=3.0) > 1e-9  # an absolute error of 1e-9 is not rounding
    form = d.forms["h"]
    assert form.kind == "taylor"  # centred: sum exp(x/t - mx) (x/t - mx), log(den) applied at the end
    wrong = dataclasses.replace(form, reanchor=tuple(sp.Symbol(f"acc[{k}]") for k in range(len(form.reanchor))))
    d.forms["h"] = wrong
    d.realise("h")
    assert not certify(d, trials=8).holds


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_steps_named_like_the_certificate_state_keys():
    """A step named `count` or `run` met the loop state's own keys (TypeError: dict + int)."""
    spec = spec_of([red("count", "max", "x"), red("run", "sum", "exp(x - count)")], ["run"])
    cert = certify(derive_cascade(spec), trials=4)
    assert cert.holds and cert.max_rel_err < 1e-12


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_wrong_argmax_still_fails_the_certificate():
    spec = spec_of([red("mx", "max", "x"), red("am", "argmax", "x - mx")], ["am"])
    d = derive_cascade(spec)
    d.forms["am"].effective_op = "argmin"  # a deliberately wrong realisation
    d.realise("am")
    assert not certify(d, trials=4).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_two_topk_with_different_k_over_one_axis():
    """The certificate's random shapes took the last k, not the largest (ShapeError)."""
    spec = spec_of([red("a", "topk", "x", k=3, **{"as": "i"}), red("b", "topk", "-x", k=1, **{"as": "j"})], ["a", "b"])
    assert certify(derive_cascade(spec), trials=12).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


SIN_NEAR_A_POLE = {  # fuzz seed 43 (benchmarks/results/fuzz_judge_seed43.md, certificate failure 4)
    "foldwise": 1, "name": "qv8brgtu",
    "inputs": {"v": {"dims": ["j2", "c", "e"]}, "tgt": {"dims": ["j2"], "kind": "index"}},
    "steps": [{"name": "triton", "expr": "(((alpha / (1 + v * alpha)) / size(j2))) ** 4"},
              {"name": "idx", "reduce": "sum", "over": "e", "expr": "sin(triton)"},
              {"name": "mx", "expr": "minimum(cast(triton, \"float16\"), where(index(e) >= index(c), alpha, -1))"},
              {"name": "p", "expr": "cast(alpha, \"float32\") * mx"},
              {"name": "offs", "expr": "where(tgt >= 1, p, 0)"}],
    "outputs": ["idx", "offs"], "params": {"alpha": 2}}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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
