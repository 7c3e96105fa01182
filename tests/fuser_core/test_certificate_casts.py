"""A cast whose operand sits exactly on a rounding midpoint (a tie) in the certificate.

The old fuzz finding "a cast of a dependency inside a sum over another axis gives a certificate
error of 1.7e-8 vs the 1e-9 bound" (benchmarks/results/fuzz_judge_seed43.md): in
``s = sum over n of cast((x - r) / 3, "float32")`` with ``r`` a reduction over another axis, the
fused form has no same-axis dependency, so it is exact and judged with its casts. sympy
distributes the 1/3, and the fused form evaluates ``cast(-1/3*r + (1/3)*x)`` where the reference
evaluates ``cast((x - r) / 3)``. float32 inputs put ``(x - r) / 3`` exactly on a float32 midpoint
about once in 600 elements; the reference then rounds to even, while the fused operand, a float64
ulp away, rounds to the other neighbour: one float32 ulp on one term, 2e-9 to 1e-7 on the sum.
The conditioning allowance now also nudges every cast's operand up and down by CONDITIONING_ULPS
float64 ulps, which moves the reference by exactly such a flip; the random input moves alone
missed it in about 1 set of 12 trials in 8.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from fuser_core import certificate
from fuser_core.certificate import certify
from fuser_core.derive import derive_cascade
from fuser_core.spec import load_spec
from fuser_core.symbolic import CAST_FUNCTIONS


def cast_of_other_axis_reduction(reduce: str = "sum"):
    return load_spec({
        "foldwise": 1, "name": "cast_tie",
        "inputs": {"x": {"dims": ["m", "n"]}, "y": {"dims": ["m", "k"]}},
        "steps": [{"name": "r", "reduce": reduce, "over": "k", "expr": "y"},
                  {"name": "s", "reduce": "sum", "over": "n", "expr": 'cast((x - r) / 3, "float32")'}],
        "outputs": ["s"]})


def tie_inputs(spec, shape, rng, dtype):
    """x, y with (x - r) / 3 exactly halfway between two float32 values in every element."""
    m, n, k = shape["m"], shape["n"], shape["k"]
    y = np.zeros((m, k))
    y[:, 0] = rng.standard_normal(m).astype(np.float32)  # r has float32's bits: x below is exact
    f = rng.standard_normal((m, n)).astype(np.float32)
    mid = f.astype(np.float64) + np.spacing(np.abs(f)).astype(np.float64) / 2  # a float32 tie, exact in float64
    r = y.sum(axis=1, keepdims=True) if spec.step("r").reduce == "sum" else y.max(axis=1, keepdims=True)
    x = 3 * mid + r
    assert np.array_equal((x - r) / 3, mid)  # the reference's operand is the tie itself
    return {"x": x, "y": y}


def test_the_fused_form_rounds_the_cast_operand_differently():
    form = derive_cascade(cast_of_other_axis_reduction()).forms["s"]
    assert form.fused and form.exact  # no same-axis dependency: judged with its casts, not on the algebra
    assert "x/3" in str(form.terms[0].g)  # (x - r) / 3 distributed: other float64 roundings than the reference's


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_a_cast_operand_on_a_float32_tie_is_allowed_its_flip(monkeypatch, reduce):
    """Every term on a tie: the fused sum is off by float32 ulps, and the nudged casts account for it."""
    monkeypatch.setattr(certificate, "random_inputs", tie_inputs)
    d = derive_cascade(cast_of_other_axis_reduction(reduce))
    cert = certify(d, trials=4)
    assert cert.exact and cert.holds, cert
    monkeypatch.setattr(certificate, "CONDITIONING_K", 0)
    raw = certify(d, trials=4)
    assert not raw.holds  # the ties are really hit: without the allowance the flips fail the 1e-9 bound
    # float32 ulps, one per term; relative to a sum that may cancel down to its 1e-4 * sum |terms| floor
    assert 1e-9 < raw.max_rel_err < 1e-3


def test_random_float32_inputs_hit_the_ties_and_the_certificate_holds():
    """The fuzz finding as drawn: plain certify() over 30 seeds. Seeds 9, 12, 22 and 25 failed
    with the random input moves alone (errors 2e-9 to 1.4e-8)."""
    d = derive_cascade(cast_of_other_axis_reduction())
    certs = [certify(d, seed=seed) for seed in range(30)]
    assert all(c.holds for c in certs), [(s, c.max_rel_err) for s, c in enumerate(certs) if not c.holds]


def test_random_float32_inputs_fail_without_the_allowance(monkeypatch):
    monkeypatch.setattr(certificate, "CONDITIONING_K", 0)
    d = derive_cascade(cast_of_other_axis_reduction())
    errors = [certify(d, seed=seed).max_rel_err for seed in range(30)]
    assert sum(e > certificate.TOLERANCE for e in errors) >= 5
    assert max(errors) < 1e-6  # one float32 ulp on a term or two of the sum


def test_a_cast_operand_off_far_from_any_tie_is_still_caught(monkeypatch):
    """The nudges forgive only operands within a few float64 ulps of a tie: a fused form whose
    cast operand is off by 1e-6 relative (a wrong form) still fails."""
    d = derive_cascade(cast_of_other_axis_reduction())
    real = d.forms["s"].realisation
    cast = CAST_FUNCTIONS["float32"]
    wrong = {c: cast(c.args[0] * sp.Float(1 + 1e-6)) for c in d.forms["s"].terms[0].g.atoms(cast)}
    assert wrong
    step = type(real).step
    monkeypatch.setattr(type(real), "step", lambda self: tuple(
        type(rule)(rule.op, rule.left, rule.right.xreplace(wrong)) for rule in step(self)) if self is real else step(self))
    cert = certify(d, trials=4)
    assert not cert.holds and cert.max_rel_err > 1e-7, cert
