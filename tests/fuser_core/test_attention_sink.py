"""Attention sinks (issue 23, 6a): a running max combined with a per-head constant, exp(s - max(mx, sink)),
fuses in every strategy. Kernels run through Triton's interpreter on sizes that are no multiple of their
tiles, against the float64 reference: random inputs in fp32/fp16/bf16, the real-model families (a sink
far above every score: o = 0; a sink of -inf: plain attention; scores near 100) and special values
(rows of -inf, +inf and NaN under sinks of -inf, +inf, NaN and a number)."""

from __future__ import annotations

import numpy as np
import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import BASELINE, STRATEGIES, KernelConfig
from fuser_core.derive import derive_cascade
from fuser_core.edge_rows import special_mismatches
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import interpreter_quiet, run, self_check
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ALL = (*STRATEGIES, BASELINE)
SHAPE = {"b": 1, "h": 3, "m": 5, "n": 37, "d": 7, "e": 6}  # n = 37: four tiles of 8 and a partial one


def config(strategy: str) -> KernelConfig | None:
    if strategy in ("row_resident", BASELINE):
        return None
    return KernelConfig({"n": 8, "e": 4}, split=3 if strategy == "split_fused" else 1)


@pytest.fixture(scope="module")
def sink():
    spec = load_catalog_spec("attention_sink")
    return spec, derive_cascade(spec)


def test_every_strategy_is_valid_and_fused(sink):
    spec, d = sink
    assert d.fusible and tuple(STRATEGIES) == ("row_resident", "streaming_fused", "split_fused", "multi_pass")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("strategy", ALL)
def test_kernels_match_float64(sink, strategy, dtype):
    spec, d = sink
    report = self_check(spec, SHAPE, dtype, strategy=strategy, config=config(strategy), derivation=d, seed=2)
    assert report["strategy"] == strategy and report["passed"], report
    assert report["max_rel_err"] <= (2e-5 if dtype == "float32" else report["tolerances"]["o"]), report


def families(spec):
    shape = bind_shape(spec, SHAPE)
    rng = np.random.default_rng(5)
    base = random_inputs(spec, shape, rng, "float32")
    hot = dict(base)  # scores near 100: exp(s) alone overflows float32 past 88
    hot["q"] = np.ones_like(base["q"])
    hot["k"] = (100 / 7 + 0.3 * rng.standard_normal(base["k"].shape)).astype(np.float32)
    hot["sink"] = np.array([99.0, 100.0, 120.0], np.float32)
    return shape, {
        "sink far above every score": {**base, "sink": np.full(3, 1e4, np.float32)},
        "sink -inf": {**base, "sink": np.full(3, -np.inf, np.float32)},
        "scores near 100": hot,
        "mixed sinks": {**base, "sink": np.array([-np.inf, 0.5, 3.0], np.float32)},
    }


@pytest.mark.parametrize("strategy", ALL)
def test_real_model_families(sink, strategy):
    spec, d = sink
    shape, cases = families(spec)
    plain = load_catalog_spec("attention")
    for name, inputs in cases.items():
        with np.errstate(all="ignore"):
            want = evaluate(spec, shape, inputs)["o"]
        if name == "sink far above every score":
            assert np.all(want == 0)
        if name == "sink -inf":  # the sink drops out: plain attention
            ref = evaluate(plain, shape, {k: v for k, v in inputs.items() if k != "sink"})["o"]
            np.testing.assert_allclose(want, ref, rtol=1e-12, atol=0)
        with interpreter_quiet():
            got = run(spec, shape, "float32", inputs, strategy=strategy, config=config(strategy), derivation=d)
        got = got.outputs["o"].numpy().astype(np.float64)
        assert np.isfinite(got).all(), name
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
        assert err <= 1e-4 if want.any() else np.all(got == 0), (name, err)


SCORES = {  # the scores as an input: rows of special values exactly where the test puts them
    "foldwise": 1, "name": "sink_scores",
    "inputs": {"x": {"dims": ["h", "m", "n"]}, "v": {"dims": ["h", "n", "e"]}, "sink": {"dims": ["h"]}},
    "steps": [
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - maximum(mx, sink))"},
        {"name": "o", "reduce": "sum", "over": "n",
         "expr": "exp(x - maximum(mx, sink)) * v / (den + exp(sink - maximum(mx, sink)))"},
    ],
    "outputs": ["mx", "den", "o"],
}


@pytest.mark.parametrize("strategy", ALL)
def test_special_values_under_every_sink(strategy):
    """Every head has a row of -inf (a fully masked row: the running max starts, and stays, at -inf),
    one +inf, one NaN, a row of +inf, one -inf; the heads' sinks are -inf, +inf, NaN and 0.7. The
    running anchor max(mx, sink) with mx = -inf (safe anchor 0 in the fused loop) must give the
    formula's value: 0 for a finite sink, NaN where the sink is -inf too (exp(-inf + inf))."""
    spec = load_spec(SCORES)
    d = derive_cascade(spec)
    assert d.fusible
    shape = {"h": 4, "m": 7, "n": 37, "e": 3}
    inputs = random_inputs(spec, shape, np.random.default_rng(1), "float32")
    x = inputs["x"]
    x[:, 0, :] = -np.inf
    x[:, 1, 3] = np.inf
    x[:, 2, 5] = np.nan
    x[:, 3, :] = np.inf
    x[:, 4, 7] = -np.inf
    inputs["sink"] = np.array([-np.inf, np.inf, np.nan, 0.7], np.float32)
    with np.errstate(all="ignore"):
        want = evaluate(spec, shape, inputs)
    assert want["o"][3, 0].tolist() == [0.0] * 3 and np.isnan(want["o"][0, 0]).all()  # finite sink; -inf sink
    with interpreter_quiet():
        result = run(spec, shape, "float32", inputs, strategy=strategy, config=config(strategy), derivation=d)
    for part in ("mx", "den", "o"):
        got = np.broadcast_to(result.outputs[part].numpy().astype(np.float64), np.shape(want[part]))
        assert not special_mismatches(got, want[part]), (part, special_mismatches(got, want[part]))
        both = np.isfinite(got) & np.isfinite(want[part])
        err = np.abs(got[both] - want[part][both]) / (1.0 + np.abs(want[part][both]))
        assert err.max(initial=0.0) <= 1e-5, (part, err.max())
