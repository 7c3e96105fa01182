"""Streamed reductions the way Liger-Kernel writes them (issue 22, 3): states per tile or per lane
as a configuration choice, no tail mask where the loads' fills already give the identity, and a
reduction that is one term (cross-entropy's target logit) loaded, not folded. Kernels run through
Triton's interpreter and are checked against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig, make_plan
from fuser_core.derive import derive_cascade
from fuser_core.problem import ShapeError
from fuser_core.reference import evaluate, random_inputs
from fuser_core.runner import bind_dtypes, compare, run, self_check
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

STRATEGIES = ("row_resident", "streaming_fused", "split_fused", "multi_pass")


def cfg(strategy: str, per_lane: bool = True, block: int = 16) -> KernelConfig:
    blocks = {"v": 128} if strategy == "row_resident" else {"v": block}
    return KernelConfig(blocks, split=3 if strategy == "split_fused" else 1, per_lane=per_lane)


def test_cross_entropy_loads_the_target_logit() -> None:
    spec = load_catalog_spec("cross_entropy")
    derivation = derive_cascade(spec)
    plan = make_plan(spec, derivation, "streaming_fused", {"t": 5, "v": 100}, cfg("streaming_fused"))
    assert set(plan.gathers) == {"picked"} and [s.name for s in plan.axis_reductions()] == ["mx", "den"]
    source = generate(spec, derivation, "streaming_fused", {"t": 5, "v": 100}, cfg("streaming_fused"),
                      bind_dtypes(spec, "float32")).source
    loop = source[source.index("for start in range"):source.index("# output loss")]
    assert "target" not in loop  # no compare with the target per element
    assert "picked_logits = tl.load(logits_ptr" in source and "picked_at * stride_logits_v" in source


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cross_entropy_targets_in_and_out_of_range(strategy: str) -> None:
    """Targets at both ends of [0, v) select their logit; one outside it (Hugging Face's ignore
    index -100, or v itself) selects nothing and is refused before a launch with the input, the
    position and the value (issue 24: the formula would silently give the row's logsumexp;
    cross_entropy_ignore is the spec that ignores -100)."""
    spec = load_catalog_spec("cross_entropy")
    shape = {"t": 6, "v": 100}
    inputs = random_inputs(spec, shape, np.random.default_rng(3))
    inputs["target"] = np.array([0, 99, 42, 1, 98, 7], dtype=np.int64)
    result = run(spec, shape, "float32", inputs, strategy=strategy, config=cfg(strategy))
    ref = evaluate(spec, shape, inputs)
    errors = compare(spec, result.outputs, ref, {"loss": "float32"})
    assert errors["loss"] <= 1e-4, errors
    logits = inputs["logits"].astype(np.float64)
    want = np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(6), inputs["target"]]
    np.testing.assert_allclose(result.outputs["loss"].numpy(), want, rtol=1e-5)
    for position, bad in ((3, -100), (4, 100)):
        target = inputs["target"].copy()
        target[position] = bad
        with pytest.raises(ShapeError, match=rf"inputs.target: holds {bad} at position \[{position}\]"):
            run(spec, shape, "float32", {**inputs, "target": target}, strategy=strategy, config=cfg(strategy))


@pytest.mark.parametrize("name,shape", [("safe_softmax", {"m": 5, "n": 300}), ("logsumexp", {"m": 5, "n": 300}),
                                        ("cross_entropy", {"t": 5, "v": 300}), ("layernorm", {"t": 4, "c": 300})])
@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
def test_states_per_tile_or_per_lane_match_float64(name: str, shape: dict, strategy: str) -> None:
    spec = load_catalog_spec(name)
    derivation = derive_cascade(spec)
    axis = "v" if name == "cross_entropy" else ("c" if name == "layernorm" else "n")
    sources = []
    for per_lane in (True, False):
        config = KernelConfig({axis: 32}, split=3 if strategy == "split_fused" else 1, per_lane=per_lane)
        report = self_check(spec, shape, "float32", strategy=strategy, config=config, derivation=derivation)
        assert report["passed"], report
        sources.append(generate(spec, derivation, strategy, shape, config, bind_dtypes(spec, "float32")).source)
    lanes, tile = sources
    assert "_lane = " not in tile  # per tile: no per-lane state
    if name != "layernorm":  # layernorm's Taylor states stay per tile either way
        assert "_lane = " in lanes


def test_a_fold_drops_its_tail_mask_only_where_the_fill_is_the_identity() -> None:
    """Per tile, cross-entropy's den sums exp(logits - mx) over logits loaded with -inf in the tail:
    0 there, no tl.where. A sum that divides by a running anchor keeps its mask (0 / 0 at an empty
    lane); a max whose expression is 0 at the fill keeps it too (0 is not the max's identity)."""
    spec = load_catalog_spec("cross_entropy")
    derivation = derive_cascade(spec)
    source = generate(spec, derivation, "streaming_fused", {"t": 5, "v": 100}, cfg("streaming_fused", per_lane=False),
                      bind_dtypes(spec, "float32")).source
    assert "tl.sum(tl.exp(logits - mx_anchor), axis=0)" in source
    peak = load_spec({"foldwise": 1, "name": "peaked", "inputs": {"x": {"dims": ["m", "n"]}}, "steps": [
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
        {"name": "peak", "reduce": "max", "over": "n", "expr": "exp(x - mx) / den"},
        {"name": "r", "reduce": "sum", "over": "n", "expr": "exp(x - mx) / den / peak"}], "outputs": ["r", "peak"]})
    d = derive_cascade(peak)
    text = generate(peak, d, "streaming_fused", {"m": 3, "n": 45}, KernelConfig({"n": 8}), bind_dtypes(peak, "float32")).source
    r_line = next(line for line in text.splitlines() if line.strip().startswith("r_lane = rescale("))
    peak_line = next(line for line in text.splitlines() if line.strip().startswith("peak_lane = max_nan("))
    assert "tl.where(mask_n" in r_line and "tl.where(mask_n" in peak_line
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({"n": 8}, split=6 if strategy == "split_fused" else 1)
        assert self_check(peak, {"m": 3, "n": 45}, "float32", strategy=strategy, config=config, derivation=d)["passed"]


def test_per_lane_is_a_config_field_that_old_configs_lack() -> None:
    assert KernelConfig({"n": 64}).to_dict() == {"blocks": {"n": 64}, "num_warps": 4, "num_stages": 2, "split": 1}
    tile = KernelConfig.from_dict({"blocks": {"n": 64}, "per_lane": False})
    assert tile.per_lane is False and tile.to_dict()["per_lane"] is False
    with pytest.raises(ValueError, match="per_lane"):
        KernelConfig.from_dict({"blocks": {"n": 64}, "per_lane": "no"})
