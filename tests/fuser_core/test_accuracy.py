"""The accuracy bar (fuser_core.accuracy, issue 23): a strategy's error on each input family at most
2x the spec's formula evaluated in the run's dtype (and 2x torch's op where it has one), special
values equal to the reference's; in ``foldwise run`` and the tuner's correctness gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from fuser_core.accuracy import (
    FAMILIES, FormulaEvaluator, accuracy_check, bar_verdict, family_inputs, formula_outputs, parse_families,
)
from fuser_core.catalog import load_catalog_spec
from fuser_core.reference import evaluate
from fuser_core.spec import load_spec
from tests.support.cascades import red, spec_of

REPO = Path(__file__).resolve().parents[2]
# A variance weighted by exp(x - mx) (2 + sin(x)): positive weights, but sympy cannot prove 2 + sin(x) >= 0,
# so the weighted mean is no anchor and the fused strategies accumulate raw moments sum w v^2, sum w v, sum w
# (docs/THEORY.md 5, "Centred accumulators"): with v near 100 they cancel digits the formula keeps.
WEIGHT = "exp(x - mx) * (2 + sin(x))"
VARIANCE = {"foldwise": 1, "name": "weighted_variance",
            "inputs": {"x": {"dims": ["m", "n"]}, "v": {"dims": ["m", "n"]}}, "steps": [
                {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                {"name": "den", "reduce": "sum", "over": "n", "expr": WEIGHT},
                {"name": "mu", "reduce": "sum", "over": "n", "expr": f"{WEIGHT} * v / den"},
                {"name": "var", "reduce": "sum", "over": "n", "expr": f"{WEIGHT} * (v - mu) ** 2 / den"}],
            "outputs": ["var"]}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_an_output_that_loses_digits_is_refused_and_the_formula_passes():
    spec = load_catalog_spec("safe_softmax")
    shape = {"m": 4, "n": 40}
    inputs = family_inputs(spec, shape, "offset100", {"x": "float32"})
    reference = evaluate(spec, shape, inputs)
    formula = formula_outputs(spec, shape, inputs, "float32")
    stores = {"y": "float32"}
    assert bar_verdict(spec, formula[0], reference, formula, stores)["passed"]
    lossy = {"y": reference["y"] * (1 + 1e-5)}  # ~170 float32 ulps: what a cancelling fused form gives
    verdict = bar_verdict(spec, lossy, reference, formula, stores)
    assert not verdict["passed"] and verdict["ratio"] > 2, verdict


def test_a_wrong_special_value_is_refused():
    spec = load_catalog_spec("logsumexp")
    shape = {"m": 4, "n": 40}
    inputs = family_inputs(spec, shape, "nan", {"x": "float32"})
    reference = evaluate(spec, shape, inputs)
    assert np.isnan(reference["lse"][:2]).all() and np.isfinite(reference["lse"][2:]).all()
    hidden = {"lse": np.nan_to_num(reference["lse"], nan=0.0)}  # a kernel that drops the NaN
    verdict = bar_verdict(spec, hidden, reference, formula_outputs(spec, shape, inputs, "float32"), {"lse": "float32"},
                          special=True)
    assert not verdict["passed"] and verdict["specials"] == ["NaN at [[0], [1]]"], verdict


def test_the_formula_rounds_to_the_runs_dtype():
    spec = load_catalog_spec("rmsnorm")
    shape = {"t": 3, "c": 40}
    inputs = family_inputs(spec, shape, "normal", {"x": "bfloat16", "w": "bfloat16"})
    got = FormulaEvaluator(spec, shape, "bfloat16").outputs(inputs)["y"]
    import ml_dtypes

    assert np.array_equal(got, got.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert not np.array_equal(got, evaluate(spec, shape, inputs)["y"])


def test_families_are_parsed_by_name_and_group():
    assert parse_families("offset100,peaked") == ("offset100", "peaked")
    assert parse_families("specials") == ("masked", "nan", "axis1", "empty")
    assert parse_families("none") == ()
    assert set(parse_families("all")) == set(FAMILIES)
    with pytest.raises(ValueError, match="unknown input family 'offset7'"):
        parse_families("offset7")


@pytest.mark.parametrize("name", ["safe_softmax", "layernorm", "cross_entropy", "moe_routing"])
def test_a_catalog_spec_passes_every_family(name):
    spec = load_catalog_spec(name)
    dims = {d: 40 for d in spec.dims}
    dims.update({s.as_dim: s.k for s in spec.steps if s.as_dim})
    verdict = accuracy_check(spec, dims, "float32", families=tuple(FAMILIES))
    assert verdict["passed"], [r for r in verdict["families"] if not r["passed"]]
    assert [r["family"] for r in verdict["families"]] == list(FAMILIES)


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm"])
def test_torchs_op_is_compared_on_the_services_canonical_copy(name):
    """The service tunes the canonical copy (dims d0, d1 in another order, steps s0.., params p0..):
    torch's op is still found, called in the catalog's names and laid out in the copy's dim order
    (a job on rmsnorm failed with KeyError 'c' in the dashboard test)."""
    from fuser_core.canonical import canonical_form

    catalog = load_catalog_spec(name)
    copy = load_spec(canonical_form(catalog))
    renamed = {"c": "d0", "t": "d1"}
    assert catalog.dims == ("t", "c") and copy.dims == ("d0", "d1")  # the copy lays outputs out (c, t)
    verdict = accuracy_check(copy, {renamed[d]: n for d, n in {"c": 40, "t": 3}.items()}, "float32",
                             families=("normal", "offset100"))
    assert verdict["torch_op"] == name
    for row in verdict["families"]:
        assert row["passed"] and row["torch_error"] is not None and row["torch_error"] < 1e-3, row  # not transposed


def test_an_argmax_over_an_empty_axis_is_refused_as_the_reference_refuses():
    spec = load_spec({"foldwise": 1, "name": "am", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "i", "reduce": "argmax", "over": "n", "expr": "x"}], "outputs": ["i"]})
    row = accuracy_check(spec, {"m": 3, "n": 20}, families=("empty",))["families"][0]
    assert row["passed"] and "refused as the reference is" in row["note"], row


def test_the_tuner_gate_refuses_a_strategy_that_loses_digits_naming_the_family():
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.measure import ModelMeasurer, clear_verification_cache
    from tuner.profiles import get_profile

    clear_verification_cache()
    spec = load_spec(VARIANCE)
    derivation = derive_cascade(spec)
    m = ModelMeasurer(make_problem(spec, {"m": 64, "n": 4096}, "float32"), derivation, get_profile("h100"))
    fused = m.verification("streaming_fused")
    assert not fused["passed"]
    assert "fails the accuracy bar on the offset100 family" in fused["error"] and "x the formula's" in fused["error"]
    assert m.verification("multi_pass")["passed"]  # the unfused arithmetic keeps the digits
    sm = load_catalog_spec("safe_softmax")
    m = ModelMeasurer(make_problem(sm, {"m": 64, "n": 4096}, "float32"), derive_cascade(sm), get_profile("h100"))
    check = m.verification("streaming_fused")
    assert check["passed"] and set(check["accuracy"]) == {"offset100", "offset1000", "peaked"}
    clear_verification_cache()


def foldwise_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "service.cli", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_foldwise_run_prints_a_line_per_family_and_reports_them_in_json():
    proc = foldwise_run("safe_softmax", "--shape", "m=3,n=37", "--families", "offset100,peaked,masked")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and report["accuracy"]["passed"]
    assert [r["family"] for r in report["accuracy"]["families"]] == ["offset100", "peaked", "masked"]
    lines = [ln.split() for ln in proc.stderr.splitlines()]
    assert any(ln[:1] == ["offset100"] and ln[-1] == "pass" for ln in lines), proc.stderr
    assert "accuracy: passed" in proc.stderr


def test_foldwise_run_exits_1_when_a_family_fails():
    path = Path(__file__).parent / "data" / "_variance.json"
    proc = None
    try:
        path.write_text(json.dumps(VARIANCE))
        proc = foldwise_run(str(path), "--shape", "m=3,n=40", "--strategy", "streaming_fused", "--families", "offset100")
    finally:
        path.unlink(missing_ok=True)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and not report["accuracy"]["passed"] and report["accuracy"]["failed"] == ["offset100"]
    assert "FAILED on offset100" in proc.stderr


def test_foldwise_run_refuses_an_unknown_family():
    proc = foldwise_run("safe_softmax", "--shape", "m=3,n=37", "--families", "offset7")
    assert proc.returncode == 2 and "--families" in proc.stderr


# ---------------------------------------------------------------- fuzz seed 53: scalar inputs (dims [])

SCALAR_BIAS = {"foldwise": 1, "name": "scalar_bias", "inputs": {"x": {"dims": ["m", "n"]}, "b": {"dims": []}},
               "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x + b"},
                         {"name": "s", "reduce": "sum", "over": "n", "expr": "exp(x + b - mx)"}],
               "outputs": ["s"]}


def test_family_inputs_move_a_scalar_input_too():
    """A 0-dim input has no axis to move: family_inputs moved axis -1 of it (AxisError, fuzz seed 53)."""
    spec = load_spec(SCALAR_BIAS)
    dtypes = {"x": "float32", "b": "float32"}
    plain = family_inputs(spec, {"m": 2, "n": 5}, "normal", dtypes)
    shifted = family_inputs(spec, {"m": 2, "n": 5}, "offset100", dtypes)
    assert shifted["b"].shape == () and shifted["b"] == pytest.approx(plain["b"] + 100, rel=1e-6)
    assert accuracy_check(spec, {"m": 2, "n": 7}, families=("offset100", "peaked", "masked", "nan"),
                          strategy="row_resident")["passed"]


@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused"])
def test_the_empty_family_with_a_scalar_input(strategy):
    """A 0-dim input reached the empty-shape path as (1,) (np.ascontiguousarray makes a 0-dim array 1-dim, in
    fuser_core.tensors.to_torch), which the reference's shape check refused: a crash on the empty family."""
    spec = load_spec(SCALAR_BIAS)
    verdict = accuracy_check(spec, {"m": 2, "n": 7}, families=("empty",), strategy=strategy)
    assert verdict["passed"], verdict["families"]
    from fuser_core.tensors import to_torch

    assert to_torch({"b": np.float32(1.5).reshape(())}, {"b": "float32"}, "cpu")["b"].shape == ()


# ---------------------------------------------------------------- fuzz seed 53: the formula overflows

OVERFLOW = {"foldwise": 1, "name": "exp_of_max", "inputs": {"x": {"dims": ["m", "n"]}},
            "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                      {"name": "e", "expr": "exp(mx)"}], "outputs": ["e"]}


def test_an_overflow_the_formula_shares_is_not_the_strategys():
    """exp(100) overflows float32, so the formula's error is inf; a kernel that gives the same inf was refused with
    ratio inf/inf = NaN ("error inf is nanx the formula's"). A kernel that is wrong where the formula overflows still fails."""
    spec = load_spec(OVERFLOW)
    verdict = accuracy_check(spec, {"m": 3, "n": 9}, families=("offset100",), strategy="row_resident")
    row = verdict["families"][0]
    assert verdict["passed"] and row["formula_error"] < 1e-6, row
    ref = {"e": np.array([1e43, 2.0])}
    formula = {"e": np.array([np.inf, 2.0])}
    stores = {"e": "float32"}
    assert bar_verdict(spec, {"e": np.array([np.inf, 2.0])}, ref, formula, stores)["passed"]
    assert not bar_verdict(spec, {"e": np.array([np.nan, 2.0])}, ref, formula, stores)["passed"]
    ref, formula = {"e": np.array([1e39, 1e38])}, {"e": np.array([np.inf, 1e38])}  # the rest still held to the ratio
    assert bar_verdict(spec, {"e": np.array([np.inf, 1e38])}, ref, formula, stores)["passed"]
    assert not bar_verdict(spec, {"e": np.array([np.inf, 1.1e38])}, ref, formula, stores)["passed"]


def test_a_finite_value_where_one_rounding_of_the_formula_gives_nan_is_held_to_the_others():
    """A softmax entropy -p log p at scale 30: the formula's plain rounding gives 0 log 0 = NaN where its
    nudged roundings (the knife-edge evaluations) stay finite, 1% off the tiny reference; the centred
    fused kernels give the finite value 5e-4 off and were refused (error inf), as only 2 ulps were
    allowed there. Now within 2x the worst finite evaluation passes, further fails, and where every
    evaluation is NaN the floor is still 2 ulps."""
    spec = load_spec(OVERFLOW)
    stores = {"e": "float32"}
    ref = {"e": np.array([2.405e-5, 0.77])}
    formulas = [{"e": np.array([np.nan, 0.77])}, {"e": np.array([2.39e-5, 0.77])}]  # 0.6% off at the first
    assert bar_verdict(spec, {"e": np.array([2.4038e-5, 0.77])}, ref, formulas, stores)["passed"]
    assert bar_verdict(spec, {"e": np.array([np.nan, 0.77])}, ref, formulas, stores)["passed"]  # the formula's NaN
    assert not bar_verdict(spec, {"e": np.array([2.2e-5, 0.77])}, ref, formulas, stores)["passed"]  # 9% off
    only_nan = [{"e": np.array([np.nan, 0.77])}]
    assert not bar_verdict(spec, {"e": np.array([2.4038e-5, 0.77])}, ref, only_nan, stores)["passed"]
    from tests.fuser_core.test_centred_accuracy import ENTROPY_PLOGP

    entropy = load_spec(ENTROPY_PLOGP)
    for strategy in ("streaming_fused", "split_fused"):
        verdict = accuracy_check(entropy, {"m": 4, "n": 300}, families=("scale30",), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


def test_a_value_the_outputs_dtype_cannot_hold_is_judged_as_stored():
    """A float16 GEMM output whose float64 value passes 65504: the formula (evaluated in float32) is
    finite there, but stored it is inf, as the kernel's is. The fp8 GEMM's multi_pass failed the
    offset and scale families on exactly this (error inf, ratio inf); a kernel that stores a finite
    number there instead is still wrong."""
    spec = load_catalog_spec("fp8_quant_gemm")
    dtypes = {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}
    verdict = accuracy_check(spec, {"m": 6, "n": 16, "k": 37}, dtypes, families=("offset100", "scale30"),
                             strategy="multi_pass")
    assert verdict["passed"], verdict["families"]
    ref = {"o": np.array([1e6, 2.0])}
    formula = {"o": np.array([1e6, 2.0])}  # float32 holds it
    stores = {"o": "float16"}
    assert bar_verdict(spec, {"o": np.array([np.inf, 2.0])}, ref, formula, stores)["passed"]
    assert not bar_verdict(spec, {"o": np.array([65504.0, 2.0])}, ref, formula, stores)["passed"]
    ref, formula = {"o": np.array([1e6, 3e4])}, {"o": np.array([1e6, 3e4])}  # the rest still held to the ratio
    assert bar_verdict(spec, {"o": np.array([np.inf, 3e4])}, ref, formula, stores)["passed"]
    assert not bar_verdict(spec, {"o": np.array([np.inf, 3.3e4])}, ref, formula, stores)["passed"]


def test_a_sum_that_cancels_is_judged_on_its_terms_magnitude():
    """Fuzz seed 61: a 5-term sum of a row that cancels 22-fold (|sum| 0.14, sum |x| 3.05) erred 11 units of its
    result's roundoff in a kernel's order of additions and at most 4 in the formula's: 2.7x, refused, although
    both are within one unit of its largest partial sum. Both errors are now measured in units of the terms'
    magnitude (fuser_core.accuracy.cancellation); a sum whose terms share a sign keeps the plain bar. (A loop's
    order of additions is now among the formula's own evaluations: test_a_loops_order_of_additions_is_the_formulas.)"""
    from fuser_core.accuracy import cancellation

    spec = load_spec({"foldwise": 1, "name": "plain_sum", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "u", "reduce": "sum", "over": "n", "expr": "x"},
                                {"name": "q", "reduce": "sum", "over": "n", "expr": "x * x"}], "outputs": ["u", "q"]})
    x = np.array([[-0.73226738, -0.54425901, -0.31630015, 0.41163054, 1.04251337]])
    shape = {"m": 1, "n": 5}
    reference = evaluate(spec, shape, {"x": x})
    cancel = cancellation(spec, shape, {"x": x}, reference)
    assert cancel["u"][0] == pytest.approx(np.abs(x).sum() / abs(x.sum()))
    assert cancel["q"][0] == 1.0
    formula = formula_outputs(spec, shape, {"x": x}, "float32")
    stores = {"u": "float32", "q": "float32"}
    # 3 ulps of sum |x| off: 66 units of the result's roundoff, refused by the plain bar, within it in the terms' units
    off = 3 * 2.0**-24 * np.abs(x).sum()
    got = {"u": reference["u"] + off, "q": formula[0]["q"]}
    assert not bar_verdict(spec, got, reference, formula, stores)["passed"]
    assert bar_verdict(spec, got, reference, formula, stores, cancel=cancel)["passed"]
    lossy = {"u": got["u"], "q": formula[0]["q"] * (1 + 2e-6)}  # a square sum 34 ulps off fails either way
    assert not bar_verdict(spec, lossy, reference, formula, stores, cancel=cancel)["passed"]


def test_a_loops_order_of_additions_is_the_formulas():
    """Half the formula's random evaluations add in a loop's order (tiles near sqrt(n), then a running sum):
    fuzz seed 70's sin(q * s) at s ~ 1000 and size * s erred 2.2x and 2.7x the pairwise formula's error through
    the order s was summed in alone. A sequential float32 sum of a cancelling row is within the formula's spread;
    a sum 40 units of its result off is not."""
    spec = load_spec({"foldwise": 1, "name": "plain_sum", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "u", "reduce": "sum", "over": "n", "expr": "x"}], "outputs": ["u"]})
    x = np.array([[-0.73226738, -0.54425901, -0.31630015, 0.41163054, 1.04251337]])
    shape = {"m": 1, "n": 5}
    reference = evaluate(spec, shape, {"x": x})
    formula = formula_outputs(spec, shape, {"x": x}, "float32")
    sequential = np.float32(0.0)
    for v in x[0].astype(np.float32):
        sequential = np.float32(sequential + v)
    stores = {"u": "float32"}
    assert bar_verdict(spec, {"u": np.array([sequential], np.float64)}, reference, formula, stores)["passed"]
    far = {"u": reference["u"] * (1 + 40 * 2.0**-24)}
    assert not bar_verdict(spec, far, reference, formula, stores)["passed"]


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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
