"""A selection carries other values (issue 37, 15): ``sum over x of where(index(x) == sel.indices,
X, 0)`` is X at the positions a top-k (or argmax) over x chose, gathered after its loop in every
fused strategy (fuser_core.derive.gathers). DeepSeek-V3's aux-loss-free router selects its experts
by biased scores and weights them by the unbiased ones."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fuser_core.certificate import certify
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig, default_config, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import bind_dtypes, run, self_check
from fuser_core.spec import load_spec
from tests.support.cascades import red

ROUTER = load_spec({
    "foldwise": 1, "name": "dsv3_router",
    "inputs": {"logits": {"dims": ["t", "x"]}, "bias": {"dims": ["x"]}},
    "steps": [
        red("sel", "topk", "sigmoid(logits) + bias", over="x", k=8, **{"as": "j"}),
        red("score", "sum", "where(index(x) == sel.indices, sigmoid(logits), 0)", over="x"),
        red("norm", "sum", "score", over="j"),
        {"name": "w", "expr": "score / norm"},
    ],
    "outputs": ["sel", "w"],
})
SHAPE = {"t": 4, "x": 150}
CONFIGS = {  # several tiles of x (three parts for split_fused); row_resident holds x whole
    "row_resident": None,
    "streaming_fused": KernelConfig({"x": 32}, num_warps=4),
    "split_fused": KernelConfig({"x": 16}, num_warps=4, split=3),
    "multi_pass": KernelConfig({"x": 32}, num_warps=4),
    "unfused_chain": None,
}


def test_the_values_at_a_top_k_s_positions_are_gathered_not_refused():
    derivation = derive_cascade(ROUTER)
    form = derivation.forms["score"]
    assert form.fused and form.gathered and form.deps == ("sel",)
    assert derivation.fusible
    cert = certify(derivation, trials=6)
    assert cert.holds and cert.max_rel_err < 1e-12
    shape = bind_shape(ROUTER, SHAPE)
    assert all(why is None for why in valid_strategies(ROUTER, derivation, shape).values())


def test_the_certificate_checks_the_gather(monkeypatch):
    """A gather at the wrong positions fails the certificate (it compares, not assumes)."""
    derivation = derive_cascade(ROUTER)
    form = derivation.forms["score"]
    x, at = form.gather
    monkeypatch.setattr(form, "gather", (x, at + 1))
    assert not certify(derivation, trials=3).holds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", list(CONFIGS))
def test_every_strategy_gives_the_unbiased_weights_of_the_selected_experts(strategy, dtype):
    derivation = derive_cascade(ROUTER)
    report = self_check(ROUTER, SHAPE, dtype, strategy=strategy, config=CONFIGS[strategy], derivation=derivation)
    assert report["passed"], report
    assert report["errors"]["sel.indices"] == 0.0
    # the weights are the unbiased scores at the selected experts, renormalised
    shape = bind_shape(ROUTER, SHAPE)
    inputs = random_inputs(ROUTER, shape, np.random.default_rng(3), bind_dtypes(ROUTER, "float32"))
    out = run(ROUTER, shape, "float32", inputs, strategy=strategy, config=CONFIGS[strategy], derivation=derivation).outputs
    idx = out["sel.indices"].numpy().astype(np.int64)
    score = 1 / (1 + np.exp(-np.take_along_axis(np.asarray(inputs["logits"], np.float64), idx, axis=1)))
    np.testing.assert_allclose(out["w"].numpy(), score / score.sum(axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused", "row_resident"])
def test_the_fused_kernels_load_k_values_after_the_selection_instead_of_a_second_pass(strategy):
    derivation = derive_cascade(ROUTER)
    shape = bind_shape(ROUTER, SHAPE)
    cfg = CONFIGS[strategy] or default_config(ROUTER, derivation, strategy, shape)
    source = generate(ROUTER, derivation, strategy, shape, cfg, bind_dtypes(ROUTER, "float32")).source
    assert len(re.findall(r"^\s+for start in range\(", source, re.M)) == (1 if strategy != "row_resident" else 0)
    gathers = re.findall(r"^(\s+)score_logits = tl\.load\(logits_ptr .*score_at \* stride_logits_x", source, re.M)
    assert gathers, source
    assert all(indent == "    " for indent in gathers)  # at a kernel's top level: after the loop, once


def test_an_argmax_carries_a_value_too_and_a_running_value_is_still_refused_by_name():
    base = {"foldwise": 1, "name": "carry", "inputs": {"x": {"dims": ["m", "n"]}, "y": {"dims": ["m", "n"]}}}
    spec = load_spec({**base, "steps": [red("am", "argmax", "x"), red("at_am", "sum", "where(index(n) == am, y * 2, 0)")],
                      "outputs": ["am", "at_am"]})
    derivation = derive_cascade(spec)
    assert derivation.forms["at_am"].gathered
    for strategy in ("streaming_fused", "split_fused"):
        cfg = KernelConfig({"n": 16}, split=3 if strategy == "split_fused" else 1)
        report = self_check(spec, {"m": 5, "n": 70}, strategy=strategy, config=cfg, derivation=derivation)
        assert report["passed"], report
    # X reading a reduction over the same axis (its final value) is not one load: still refused, with the reason
    spec = load_spec({**base, "steps": [red("mx", "max", "x"), red("am", "argmax", "x"),
                                        red("p", "sum", "where(index(n) == am, exp(y - mx), 0)")],
                      "outputs": ["am", "p"]})
    form = derive_cascade(spec).forms["p"]
    assert not form.fused and "a argmax result" in form.reason


def test_the_reference_and_the_gather_agree_on_nan_and_ties():
    """NaN ranks last in the selection, ties take the lower index: the gathered value is the one at the
    position the selection reports, whatever it holds (NaN, inf)."""
    shape = bind_shape(ROUTER, {"t": 3, "x": 40})
    logits = np.zeros((3, 40), np.float32)
    logits[0, 5] = np.nan
    logits[1, :] = 1.0  # every score tied
    logits[2, 7] = np.inf
    inputs = {"logits": logits, "bias": np.zeros(40, np.float32)}
    ref = evaluate(ROUTER, shape, inputs)
    derivation = derive_cascade(ROUTER)
    for strategy in ("streaming_fused", "split_fused"):
        out = run(ROUTER, shape, "float32", inputs, strategy=strategy, config=CONFIGS[strategy], derivation=derivation).outputs
        np.testing.assert_array_equal(out["sel.indices"].numpy(), ref["sel.indices"])
        np.testing.assert_allclose(out["w"].numpy(), ref["w"], rtol=1e-6, equal_nan=True)
