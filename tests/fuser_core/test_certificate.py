"""The certificate must fail on a wrong form: a check that cannot fail proves nothing."""

from __future__ import annotations

import dataclasses

import sympy as sp

from tests.support.catalog import load_catalog
from fuser_core.certificate import certify
from fuser_core.derive import derive_cascade
from fuser_core.spec import load_spec

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
