"""Issue 3's matrix: every catalog spec x every strategy valid for it x two shapes x two dtypes,
generated, run (Triton's interpreter on CPU) and compared with the float64 reference.

Tiles are small on purpose: the loop axis is walked in blocks of 8, so streaming kernels
loop over several tiles, split kernels have several chunks (split = 3), and lane dims are
held two at a time. The "ragged" shape has no dim that is a multiple of its block (the loop
axis 37, or 19 for attention; inner axes 5; lanes 3 and 5), so every tile edge is masked;
the "even" shape is all multiples of the blocks (and its third split chunk is empty).
"""

from __future__ import annotations

import functools
import math

import pytest
from tests.support.catalog import load_catalog

from fuser_core.codegen.plan import (
    STRATEGIES,
    KernelConfig,
    NotValid,
    default_config,
    loop_axis,
    make_plan,
    valid_strategies,
)
from fuser_core.codegen.module import output_dtypes
from fuser_core.codegen.strategies.row_resident import MAX_RESIDENT_BLOCK
from fuser_core.derive import derive_cascade
from fuser_core.reference import bind_shape
from fuser_core.runner import TOLERANCE, bind_dtypes, self_check
from fuser_core.spec import load_spec

# masked-off lanes of a tile compute on fill values (0 / 0, inf - inf); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CATALOG = load_catalog()
AXIS_BLOCK = 8
LANE_BLOCK = 2  # ragged shape: lanes of 3 and 5 held two at a time, so lane edges are masked too
SPLIT = 3
INEXACT_FUSED = {("fp8_quant_gemm", "streaming_fused"), ("fp8_quant_gemm", "split_fused")}


@functools.cache
def spec_and_derivation(name: str):
    spec = load_spec(CATALOG[name])
    return spec, derive_cascade(spec)


def shapes_for(name: str) -> dict[str, dict[str, int]]:
    """{"ragged": ..., "even": ...} for a catalog spec: tiny, and never a whole tile on the ragged one."""
    spec, _ = spec_and_derivation(name)
    axis, inner = loop_axis(spec)
    as_dims = {s.as_dim: s.k for s in spec.steps if s.as_dim}
    attention_like = bool(inner)  # attention: one batch and head (group), the loop axis short
    ragged: dict[str, int] = {}
    even: dict[str, int] = {}
    lane_sizes = iter([3, 5] * len(spec.dims))
    for d in spec.dims:
        if d in as_dims:
            ragged[d] = even[d] = as_dims[d]
        elif d == axis:
            ragged[d], even[d] = (19, 16) if attention_like else (37, 32)
        elif d in inner:
            ragged[d], even[d] = 5, 4
        elif attention_like and d in ("b", "h", "g"):  # g: the grouped layout's key-value heads
            ragged[d] = even[d] = 1
        else:
            ragged[d], even[d] = next(lane_sizes), 2
    return {"ragged": ragged, "even": even}


def dtype_for(name: str, float_dtype: str):
    if name == "fp8_quant_gemm":
        return {"a": float_dtype, "w": "float8_e4m3fn", "w_scale": "float32"}
    return float_dtype


def config_for(name: str, strategy: str, shape_kind: str) -> KernelConfig:
    spec, derivation = spec_and_derivation(name)
    axis, _ = loop_axis(spec)
    blocks: dict[str, int] = {}
    if strategy != "row_resident":
        blocks[axis] = AXIS_BLOCK
    if shape_kind == "ragged":
        shape = bind_shape(spec, shapes_for(name)["ragged"])
        plan = make_plan(spec, derivation, strategy, shape, default_config(spec, derivation, strategy, shape))
        blocks.update({lane: LANE_BLOCK for lane in plan.lanes})
    return KernelConfig(blocks, split=SPLIT if strategy == "split_fused" else 1)


def matrix():
    sixteen = iter(["float16", "bfloat16"] * len(CATALOG))
    for name in sorted(CATALOG):
        spec, derivation = spec_and_derivation(name)
        half = next(sixteen)
        for shape_kind, shape in shapes_for(name).items():
            valid = valid_strategies(spec, derivation, bind_shape(spec, shape))
            for strategy in STRATEGIES:
                if valid[strategy] is not None:
                    continue
                for dt in ("float32", half):
                    yield pytest.param(name, strategy, shape_kind, dt, id=f"{name}-{strategy}-{shape_kind}-{dt}")


@pytest.mark.parametrize(("name", "strategy", "shape_kind", "dt"), list(matrix()))
def test_catalog_matches_reference(name: str, strategy: str, shape_kind: str, dt: str) -> None:
    spec, derivation = spec_and_derivation(name)
    shape = shapes_for(name)[shape_kind]
    config = config_for(name, strategy, shape_kind)
    report = self_check(spec, shape, dtype_for(name, dt), strategy=strategy, config=config, derivation=derivation)

    assert report["strategy"] == strategy
    assert report["config"] == config.to_dict()
    assert set(report["errors"]) == set(spec.output_parts)
    # fp8_quant_gemm's fused kernels quantise with the running amax: inexact by design,
    # judged normwise; every other (spec, strategy) is elementwise against the storage dtype.
    inexact = (name, strategy) in INEXACT_FUSED
    assert report["exact"] is (not inexact), report
    if not inexact:  # fp32 1e-4, 16-bit 1e-2 (fp8 and int32 outputs by their own storage dtype)
        stores = output_dtypes(spec, bind_dtypes(spec, dtype_for(name, dt)))
        assert report["tolerances"] == {p: TOLERANCE[stores[p]] for p in spec.output_parts}
        assert {stores[p] for p in spec.output_parts} & {dt, "int32", "float8_e4m3fn"}
    assert report["passed"], report
    for part, err in report["errors"].items():
        assert math.isfinite(err) and err <= report["tolerances"][part], (part, err, report)
    if "gate.indices" in report["errors"]:
        assert report["errors"]["gate.indices"] == 0


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_matrix_shapes_really_tile(name: str) -> None:
    """The ragged shape masks every edge; streaming walks >= 3 tiles; split has 3 non-empty chunks."""
    spec, derivation = spec_and_derivation(name)
    axis, inner = loop_axis(spec)
    shape = bind_shape(spec, shapes_for(name)["ragged"])
    assert shape[axis] % AXIS_BLOCK != 0 and -(-shape[axis] // AXIS_BLOCK) >= 3
    plan = make_plan(spec, derivation, "split_fused", shape, config_for(name, "split_fused", "ragged"))
    for lane in plan.lanes:
        assert shape[lane] == 1 or shape[lane] % plan.blocks[lane] != 0, lane
    for d in inner:
        assert shape[d] % 2 == 1, d  # held in one power-of-two block: its tail is masked
    chunk = -(-(-(-shape[axis] // SPLIT)) // AXIS_BLOCK) * AXIS_BLOCK  # the launcher's chunk size
    assert sum(1 for s in range(SPLIT) if s * chunk < shape[axis]) == SPLIT
    assert all(v is None for v in valid_strategies(spec, derivation, shape).values())


# ---------------------------------------------------------------------------------------------
# Strategies the plan refuses: NotValid with a reason, decided before any kernel runs.


def _non_fusible_softmax():
    raw = CATALOG["safe_softmax"] | {"name": "sin_softmax"}
    raw["steps"] = [dict(s) for s in raw["steps"]]
    raw["steps"][1]["expr"] = "sin(x * mx)"
    spec = load_spec(raw)
    return spec, derive_cascade(spec)


def refusal_cases():
    long_row = {"m": 1, "n": MAX_RESIDENT_BLOCK + 1}
    yield pytest.param("safe_softmax", long_row, "row_resident", None, "too long", id="row_resident-long-row")
    yield pytest.param("logsumexp", {"m": 2, "n": 37}, "row_resident", KernelConfig({"n": 8}),
                       "BLOCK_n >= size(n)", id="row_resident-block-shorter-than-row")
    # (attention's d past 1024 runs: a K loop sums the scores a tile at a time; cross_entropy_ignore's v is
    # read by three sums, so it is held whole)
    yield pytest.param("cross_entropy_ignore", {"t": 3, "v": 3000}, "streaming_fused", None,
                       "inner axis v", id="streaming_fused-inner-axis-too-long")
    yield pytest.param("cross_entropy_ignore", {"t": 3, "v": 3000}, "multi_pass", None,
                       "inner axis v", id="multi_pass-inner-axis-too-long")
    yield pytest.param("layernorm", {"t": 3, "c": 37}, "split_fused", KernelConfig({"c": 8}, split=1),
                       "split >= 2", id="split_fused-split-1")
    yield pytest.param("layernorm", {"t": 3, "c": 37}, "streaming_fused", KernelConfig({"c": 8}, split=3),
                       "only for split_fused", id="streaming_fused-with-split")
    yield pytest.param("rmsnorm", {"t": 3, "c": 37}, "multi_pass", KernelConfig({"nope": 8}),
                       "unknown dim 'nope'", id="config-names-unknown-dim")
    yield pytest.param("rmsnorm", {"t": 3, "c": 37}, "vectorised", None, "unknown strategy", id="unknown-strategy")
    yield pytest.param("safe_softmax", {"m": 4, "n": 64}, "row_resident", KernelConfig({"m": 2048}),
                       "too large", id="row_resident-tile-too-large")
    for strategy in ("streaming_fused", "split_fused"):
        yield pytest.param("sin_softmax", {"m": 3, "n": 37}, strategy, None, "sin(", id=f"{strategy}-non-fusible")


@pytest.mark.parametrize(("name", "shape", "strategy", "config", "reason"), list(refusal_cases()))
def test_invalid_strategy_raises_not_valid(name, shape, strategy, config, reason) -> None:
    spec, derivation = _non_fusible_softmax() if name == "sin_softmax" else spec_and_derivation(name)
    bound = bind_shape(spec, shape)
    if config is None:
        if strategy in STRATEGIES:
            why = valid_strategies(spec, derivation, bound)[strategy]
            assert why is not None and reason in why, why
            config = default_config(spec, derivation, strategy, bound)
        else:
            config = KernelConfig()
    with pytest.raises(NotValid) as plan_err:
        make_plan(spec, derivation, strategy, bound, config)
    assert reason in str(plan_err.value)
    # the runner refuses before generating or running anything
    with pytest.raises(NotValid) as run_err:
        self_check(spec, shape, "float32", strategy=strategy, config=config, derivation=derivation)
    assert str(run_err.value) == str(plan_err.value)


def test_every_refusal_in_valid_strategies_is_a_not_valid() -> None:
    """For every catalog spec and a few awkward shapes, each strategy the plan calls invalid
    raises NotValid from make_plan with the same, non-empty reason."""
    seen = 0
    for name in sorted(CATALOG):
        spec, derivation = spec_and_derivation(name)
        axis, inner = loop_axis(spec)
        for shape in (shapes_for(name)["ragged"], {**shapes_for(name)["ragged"], axis: MAX_RESIDENT_BLOCK + 1}):
            bound = bind_shape(spec, shape)
            for strategy, why in valid_strategies(spec, derivation, bound).items():
                config = default_config(spec, derivation, strategy, bound)
                if why is None:
                    make_plan(spec, derivation, strategy, bound, config)
                    continue
                seen += 1
                assert why.strip()
                with pytest.raises(NotValid) as err:
                    make_plan(spec, derivation, strategy, bound, config)
                assert str(err.value) == why
    assert seen >= len(CATALOG)  # at least row_resident on every long row
