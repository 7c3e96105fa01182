"""Resource limits of the core: specs crafted to make sympy or the code generator blow up
(deep nesting, huge exponents, pow towers, hundreds of terms, products that expand to huge
polynomials, many steps, where()/maximum() chains) are refused by the loader, stopped by
derive_cascade's size and time limits with DerivationLimitError, or reported as not fused
with the limit as the reason -- each quickly."""

from __future__ import annotations

import re
import threading
import time

import pytest
import sympy as sp

from fuser_core import symbolic
from fuser_core.certificate import certify
from fuser_core.codegen.plan import MAX_KERNEL_NODES, NotValid, valid_strategies
from fuser_core.derive import DERIVE_TIME_LIMIT_S, derive_cascade
from fuser_core.errors import DerivationLimitError, SpecError
from fuser_core.expr import MAX_EXPR_DEPTH
from fuser_core.report import derivation_report
from fuser_core.runner import self_check
from fuser_core.spec import MAX_STEPS, load_spec
from tests.support import cascades

QUICK_S = 2.0  # every crafted spec is answered within this (load + derive)
MX = {"name": "mx", "reduce": "max", "over": "n", "expr": "x"}
MEAN = {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"}


def raw_spec(steps, outputs=None, inputs=None):
    return {"foldwise": 1, "name": "crafted", "inputs": inputs or {"x": {"dims": ["m", "n"]}}, "steps": steps,
            "outputs": outputs or [steps[-1]["name"]]}


def red(expr, op="sum", name="r"):
    return {"name": name, "reduce": op, "over": "n", "expr": expr}


def chain(template: str, n: int, start: str = "x", first=(MX, MEAN)) -> list[dict]:
    """Elementwise steps e0..e{n-1}, each `template` of the previous one, then r = sum of the last."""
    steps, prev = list(first), start
    for i in range(n):
        steps.append({"name": f"e{i}", "expr": template.format(p=prev, i=i)})
        prev = f"e{i}"
    return [*steps, red(prev)]


def outcome(raw, *, time_limit_s: float | None = DERIVE_TIME_LIMIT_S):
    """('refused' | 'stopped' | 'derived', detail, seconds): what the core does with `raw`."""
    start = time.perf_counter()
    try:
        spec = load_spec(raw)
    except SpecError as err:
        return "refused", str(err), time.perf_counter() - start
    try:
        d = derive_cascade(spec, time_limit_s=time_limit_s)
    except DerivationLimitError as err:
        return "stopped", str(err), time.perf_counter() - start
    seconds = time.perf_counter() - start
    cert = certify(d, trials=4)  # and what was derived is right
    assert cert.holds, cert
    return "derived", d, seconds


# ---------------------------------------------------------------- crafted specs

CRAFTED = {
    # nesting exactly at the parser's depth limit loads and derives; one more level is refused
    "depth_at_limit": (raw_spec([MX, red("(" * (MAX_EXPR_DEPTH - 1) + "exp(x - mx)" + ")" * (MAX_EXPR_DEPTH - 1))]),
                       "derived", "scaled"),
    "depth_beyond_limit": (raw_spec([MX, red("(" * (MAX_EXPR_DEPTH + 1) + "x - mx" + ")" * (MAX_EXPR_DEPTH + 1))]),
                           "refused", "nests deeper"),
    "exp_tower_at_limit": (raw_spec([MX, red("exp(" * 30 + "x - mx" + ")" * 30)]), "derived", "mixes"),
    # huge exponents: separation gives up, with the limit as the reason
    "x_pow_1e6": (raw_spec([red("x ** 1000000")]), "derived", "first"),
    "centred_pow_1e6": (raw_spec([MEAN, red("(x - mean) ** 1000000")]), "derived", "power above 12"),
    "product_pow_1e300": (raw_spec([MEAN, red("(x * mean) ** 1e300")]), "derived", "exponent beyond 64"),
    # pow towers of numbers: float64 arithmetic, never a 370-million-digit integer
    "tower_9_9_9": (raw_spec([MEAN, red("9 ** 9 ** 9 * x * mean")]), "derived", None),
    "tower_2_1e300": (raw_spec([MEAN, red("x * 2 ** 1e300 + mean")]), "derived", None),
    "tower_of_twos": (raw_spec([MEAN, red("2 ** 2 ** 2 ** 2 ** 2 * x * mean")]), "derived", None),
    "sqrt2_pow_1e9": (raw_spec([MEAN, red("sqrt(2) ** 1e9 * x * mean")]), "derived", None),
    "coefficient_overflow": (raw_spec([MEAN, red("x * 1e300 * 1e300 * mean")]), "derived", None),
    "tower_of_sizes": (raw_spec([MEAN, red("size(n) ** size(n) ** size(n) * x * mean")]), "derived", None),
    # many terms
    "300_terms": (raw_spec([MX, red(" + ".join(f"x*{i % 10}" for i in range(300)))]), "refused", "400 nodes"),
    "300_terms_text": (raw_spec([MX, red(" + ".join(f"exp({i} * x - mx)" for i in range(300)))]), "refused", "characters"),
    "45_separable_terms": (raw_spec([MX, red(" + ".join(f"exp(x * {i} - mx)" for i in range(1, 46)))]),
                           "derived", "the limit is 32"),
    # products that expand to huge polynomials
    "binomial_product": (raw_spec([MEAN, red(" * ".join(f"(x + {i} * mean)" for i in range(1, 40)))]),
                         "derived", "more than 128 terms"),
    "multinomial_pow": (raw_spec([MEAN, red("(x + mean + 1) ** 12 * (x - mean + 2) ** 12")]), "derived", "more than 128 terms"),
    "nested_squares": (raw_spec([MEAN, red("((((((((((x - mean) ** 2 + mean) ** 2 + mean) ** 2 + mean) ** 2 + mean) "
                                           "** 2 + mean) ** 2 + mean) ** 2 + mean) ** 2 + mean) ** 2 + mean) ** 2")]),
                       "derived", "more than 128 terms"),
    # many steps: a chain of 63 dependent reductions derives; 65 steps are refused
    "63_dependent_steps": (raw_spec([MX] + [red(f"exp(x - {'mx' if i == 0 else f'q{i - 1}'}) + {i}",
                                                op="max" if i % 2 else "sum", name=f"q{i}") for i in range(MAX_STEPS - 1)]),
                           "derived", None),
    "65_steps": (raw_spec([MX] + [red("x", name=f"q{i}") for i in range(MAX_STEPS)], outputs=["mx"]), "refused", "steps"),
    # elementwise chains: the inlined size limit of the loader, then derive's own limits
    "doubling_chain": (raw_spec(chain("exp({p} - mx) + sin({p} * 2) + {p} * {p}", 8)), "refused", "20000"),
    "maximum_chain": (raw_spec(chain("maximum({p}, mean) + minimum({p}, mx)", 11)), "stopped", "maximum() have"),
    "where_in_where_chain": (raw_spec(chain("where({p} > mean * {i}, {p} - mx, mean)", 10)), "stopped", "where() condition"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_spec_is_refused_stopped_or_reported_quickly(name):
    raw, expected, detail = CRAFTED[name]
    kind, result, seconds = outcome(raw)
    assert kind == expected, (kind, result if isinstance(result, str) else {k: f.reason for k, f in result.forms.items()})
    assert seconds < QUICK_S, f"{name} took {seconds:.2f} s"
    if kind == "derived":
        r = result.forms["r"] if "r" in result.forms else list(result.forms.values())[-1]
        if detail == "first":
            assert r.kind == "first"
        elif detail == "scaled":
            assert r.kind == "scaled"
        elif detail is not None:
            assert not r.fused and detail in r.reason, r.reason
            assert len(r.reason) < 400  # a readable reason, not the expanded expression
    elif detail is not None:
        assert detail in result, result


def test_number_towers_are_float64_values():
    """What the reference computes: 9 ** 9 ** 9 is inf in float64, not an exact integer."""
    conv = symbolic.SymbolicSpec(load_spec(CRAFTED["tower_9_9_9"][0]))
    r = conv.integrand(conv.spec.step("r"))
    assert sp.oo in r.atoms(sp.Number) | {r.as_coeff_Mul()[0]}
    conv = symbolic.SymbolicSpec(load_spec(CRAFTED["coefficient_overflow"][0]))
    assert conv.integrand(conv.spec.step("r")).as_coeff_Mul()[0] == sp.oo


# ---------------------------------------------------------------- the time limit


def test_time_limit_stops_a_derivation_and_names_where():
    spec = load_spec(raw_spec([MX, MEAN, red("(x - mean) ** 2 * exp(x - mx)")]))
    with pytest.raises(DerivationLimitError, match=r"time limit of 0 s \(stopped at step"):
        derive_cascade(spec, time_limit_s=0.0)
    assert derive_cascade(spec, time_limit_s=None).forms["r"].fused  # None: no limit


def test_a_slow_chain_is_stopped_by_the_time_limit_too():
    """Below the size limits, a maximum() chain still costs sympy time that doubles per step;
    a 0.1 s budget stops it soon after, wherever it is."""
    raw = raw_spec(chain("maximum({p}, mean) + minimum({p}, mx)", 8))
    kind, result, seconds = outcome(raw, time_limit_s=0.1)
    assert kind == "stopped" and "time limit of 0.1 s" in result, result
    assert seconds < QUICK_S


def test_time_limit_works_off_the_main_thread():
    """No signals: the service derives in worker threads."""
    out: dict[str, BaseException | None] = {}
    spec = load_spec(raw_spec([MX, MEAN, red("(x - mean) ** 2 * exp(x - mx)")]))

    def work():
        try:
            derive_cascade(spec, time_limit_s=0.0)
            out["err"] = None
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            out["err"] = err

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert isinstance(out.get("err"), DerivationLimitError)


def test_the_budget_ends_with_the_derivation():
    """The code generator converts more of the spec later, long after derive returned."""
    spec = load_spec(raw_spec([MX, red("exp(x - mx)", name="den"), {"name": "y", "expr": "exp(x - mx) / den"}]))
    d = derive_cascade(spec, time_limit_s=0.05)
    time.sleep(0.1)
    d.symbols.value("y")  # no DerivationLimitError
    assert self_check(spec, {"m": 2, "n": 7}, derivation=d)["passed"]


def test_derivation_report_surfaces_the_limit_in_the_callers_names():
    """What `foldwise derive` and POST /v1/derivations call: the error names the user's step
    (the derivation runs on the canonical spec, whose steps are s0, s1, ...)."""
    spec = load_spec(CRAFTED["maximum_chain"][0])
    with pytest.raises(DerivationLimitError, match=r"step 'e\d+': the arguments of maximum\(\) have \d+ nodes") as err:
        derivation_report(spec)
    assert "'s" not in str(err.value)


# ---------------------------------------------------------------- the code generator


def test_kernels_are_not_generated_for_huge_expressions():
    """An 8-step chain inlines to ~2000 nodes: printing it took seconds per kernel and ~25 KB of
    source; every strategy is refused instead, naming the step and the limit."""
    raw = raw_spec(chain("sin({p} - mx) * ({p} + mean)", 8) + [{"name": "y", "expr": "e7 * r"}], outputs=["y"])
    spec = load_spec(raw)
    start = time.perf_counter()
    d = derive_cascade(spec)
    reasons = valid_strategies(spec, d, {"m": 2, "n": 37})
    assert all(r is not None and f"at most {MAX_KERNEL_NODES}" in r for r in reasons.values()), reasons
    with pytest.raises(NotValid, match="no strategy can run"):
        self_check(spec, {"m": 2, "n": 37}, derivation=d)
    assert time.perf_counter() - start < QUICK_S


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
@pytest.mark.parametrize("steps, inputs", [
    # Piecewise.eval rebuilt itself without end while converting the where()
    ([cascades.red("mean", "sum", "kk", over="m"),
      cascades.red("r", "sum", "(kk / (1 + kk * w)) * rsqrt(mean * mean + 1)", over="m"),
      {"name": "p", "expr": "kk ** 2"},
      cascades.red("mask", "max", "where((kk - p) != (p - r), (kk - kk), -1)", over="m"),
      cascades.red("scale2", "sum", "exp(where((kk - p) != (p - r), (kk - kk), -1) - mask)", over="m")], ["kk", "w"]),
])
def test_sympy_recursing_without_end_is_a_limit_naming_the_cause(steps, inputs):
    """RecursionError escaped derive_cascade and certify, unexpected by `foldwise derive` and the API."""
    from fuser_core.errors import DerivationLimitError
    from fuser_core.report import derivation_report

    spec = cascades.spec_of(steps, [steps[-1]["name"]], inputs={n: {"dims": ["m"]} for n in inputs})
    with pytest.raises(DerivationLimitError, match="recursed without end"):
        derivation_report(spec)


CERTIFICATE_CANNOT_EVALUATE = [
    # numpy.select got a scalar condition from lambdify's Piecewise (TypeError)
    {"foldwise": 1, "name": "dhho51vppwc", "inputs": {"x": {"dims": ["d"]}, "kk": {"dims": ["d"]}, "v": {"dims": ["d"]}}, "steps": [{"name": "vals", "expr": "(-where((kk * v) >= where(where(x < log(2 + v * v), x, -1) >= where(x != (kk * v), v, -1), alpha, -1), clamp(x, -1, 1), -1))"}, {"name": "s", "expr": "(clamp((alpha + alpha), -1, 2) + where(vals == cast(alpha, \"float8_e4m3fn\"), (v) ** 4, 0))"}, {"name": "acc", "reduce": "max", "over": "d", "expr": "x"}, {"name": "var", "reduce": "sum", "over": "d", "expr": "((exp2(sin(alpha)) / size(d)) * exp(sigmoid(where(where((vals + eps) == (v) ** 2, kk, kk) > (vals + vals), kk, 0))))"}], "outputs": ["s", "acc", "var"], "params": {"eps": "size(d) * 0.5", "alpha": "log(size(d) + 1)"}},
    # sympy rebuilt max(zoo, ...) while substituting (ValueError: not comparable)
    {"foldwise": 1, "name": "oc7y9z_", "inputs": {"kk": {"dims": ["c"]}, "x": {"dims": ["c"]}, "bias": {"dims": []}}, "steps": [{"name": "tmp", "reduce": "min", "over": "c", "expr": "sin((-x))"}, {"name": "r", "reduce": "min", "over": "c", "expr": "where((round(kk * 4) * 0.25 + 0.1) > (bias) ** 3, x, beta0) - tmp"}, {"name": "BLOCK", "reduce": "argmax", "over": "c", "expr": "where((bias) ** 3 > where((kk * 0.5) != maximum(beta0, bias), kk, -1), kk, -1)"}, {"name": "z", "reduce": "max", "over": "c", "expr": "(log(2 + (kk / (1 + x * bias)) * (kk / (1 + x * bias))) + where(bias < where(index(c) == BLOCK, bias, 0), (beta0 * 4), 0))"}], "outputs": ["r", "z"], "params": {"beta0": "1 / sqrt(size(c))"}},
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_where_condition_sympy_cannot_fold_is_reported():
    """sympy's Piecewise raised ValueError ('-I' is not comparable) out of derive_cascade, then a limit error. A
    comparison with a where() on a side is now folded branch by branch as it is converted: it derives, and
    every strategy matches the reference."""
    spec = cascades.spec_of(
        [cascades.red("r", "sum", "where(x + x < where(sqrt(abs(eps) + 1) < clamp(eps, -1, 1), x, 0), x, x)")],
        ["r"], params={"eps": "1 / sqrt(size(n))"})
    cascades.every_strategy_passes(spec, {"m": 3, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
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
