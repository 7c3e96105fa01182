"""Per-lane running states in the streaming loop (structure.per_lane): softmax-like cascades keep
one state per lane of the axis's tile, update it elementwise in the loop (no reduction across the
tile per iteration) and merge the lanes once after it with the realisation's merge rule; attention
(its ``o`` folds by a matrix product, over a state with dims besides the lanes) stays per tile. The merged
results match the float64 reference, edge inputs included (-inf lanes, NaN, all -inf rows,
n < BLOCK, ragged tails)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.module import module_source, output_dtypes
from fuser_core.codegen.plan import KernelConfig, make_plan
from fuser_core.codegen.structure import build_structure, kernel_names, per_lane
from fuser_core.derive import derive_cascade
from fuser_core.reference import bind_shape, evaluate
from fuser_core.runner import bind_dtypes, interpreter_quiet, run

from tests.fuser_core.test_codegen_structure import attention, kernel_sources

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SHAPES = {"safe_softmax": {"m": 5, "n": 300}, "logsumexp": {"m": 5, "n": 300}, "cross_entropy": {"t": 5, "v": 300}}


def source_of(name: str, strategy: str, shape: dict, blocks: dict, split: int = 1):
    spec = load_catalog_spec(name)
    plan = make_plan(spec, derive_cascade(spec), strategy, shape, KernelConfig(blocks, split=split))
    dtypes = bind_dtypes(spec, "float32")
    return plan, kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))


def first_loop(body: str) -> tuple[str, str]:
    """(the first loop's body, the code after it up to the next loop) of a kernel body."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("for start in range("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent), len(lines))
    after = []
    for line in lines[end:]:
        if line.strip().startswith("for "):
            break
        after.append(line)
    return "\n".join(lines[start + 1:end]), "\n".join(after)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
def test_softmax_like_loops_fold_per_lane_and_merge_once(name: str, strategy: str) -> None:
    axis = "v" if name == "cross_entropy" else "n"
    plan, kernels = source_of(name, strategy, SHAPES[name], {axis: 64}, split=2 if strategy == "split_fused" else 1)
    structure = build_structure(plan, bind_dtypes(plan.spec, "float32"))
    streamed = next(loop for loop in structure.kernels[0].loops() if loop.span in ("axis", "chunk"))
    assert streamed.per_lane and per_lane(plan, streamed.body)[0]
    assert streamed.lanes  # the lane merge after the loop
    body = kernels[kernel_names(plan)[0]][1]
    loop, after = first_loop(body)
    assert not re.search(r"tl\.(max|min|sum|reduce)\(", loop), loop  # elementwise per lane: no reduction per tile
    assert "_lane = " in loop
    # after the loop, each reduction once: max of the lanes, sum of the lanes re-anchored to the merged max
    assert "mx_acc = tl.reduce(mx_lane, 0, max_nan)" in after  # NaN propagates, as torch's amax
    assert "den_acc = tl.sum(rescale(den_lane, tl.exp(mx_lane_anchor - mx_anchor)), axis=0)" in after
    # every state the loop carries keeps the lane shape (the compiler needs a loop-carried type to stay)
    for state in structure.kernels[0].states:
        assert axis in state.dims and state.name.endswith(("_lane", *(f"_lane{j}" for j in range(4))))


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
def test_attention_stays_per_tile(strategy: str) -> None:
    spec, d, plan, dtypes = attention(strategy)
    structure = build_structure(plan, dtypes)
    streamed = next(loop for loop in structure.kernels[0].loops() if loop.span in ("axis", "chunk"))
    ok, why = per_lane(plan, streamed.body)
    assert not streamed.per_lane and not ok and why == "o folds by a matrix product", why
    body = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))[structure.kernels[0].name][1]
    loop, _ = first_loop(body)
    assert "tl.dot(" in loop and "tl.reduce(" in loop and "_lane" not in body


def test_shifted_and_taylor_stay_per_tile() -> None:
    """layernorm's variance (Taylor) anchors at a running estimate of the mean and reads the count: per tile."""
    spec = load_catalog_spec("layernorm")
    plan = make_plan(spec, derive_cascade(spec), "streaming_fused", {"t": 3, "c": 100}, KernelConfig({"c": 32}))
    streamed = next(loop for loop in build_structure(plan, bind_dtypes(spec, "float32")).kernels[0].loops()
                    if loop.span == "axis")
    assert not streamed.per_lane


def edge_inputs(name: str, rows: int, n: int) -> dict[str, np.ndarray]:
    """Row 0 all -inf, row 1 with -inf lanes among finite values (and one at the end), row 2 a NaN,
    row 3 large values (a lane anchored far from the merged max), the rest random."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, n)) * 3.0
    x[0] = -np.inf
    x[1, ::3] = -np.inf
    x[1, -1] = -np.inf
    x[2, n // 2] = np.nan
    x[3] = rng.normal(size=n) - 80.0
    x[3, 0] = 60.0  # one lane far above the others: the other lanes rescale by exp(-140) (underflows to 0)
    if name == "cross_entropy":
        return {"logits": x, "target": rng.integers(0, n, size=rows)}
    return {"x": x}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("n,block,split", [(300, 64, 1), (37, 64, 1), (64, 64, 1), (300, 32, 3), (5, 16, 2)])
def test_per_lane_results_match_float64_on_edge_inputs(name: str, n: int, block: int, split: int) -> None:
    spec = load_catalog_spec(name)
    axis = "v" if name == "cross_entropy" else "n"
    lane = "t" if name == "cross_entropy" else "m"
    shape = bind_shape(spec, {lane: 6, axis: n})
    strategy = "split_fused" if split > 1 else "streaming_fused"
    inputs = edge_inputs(name, 6, n)
    config = KernelConfig({axis: block, lane: 2}, split=split)  # two rows per program: lanes of a 2-d tile
    with interpreter_quiet():
        result = run(spec, shape, "float32", inputs, strategy=strategy, config=config)
    assert "_lane" in result.source
    reference = evaluate(spec, shape, inputs)
    for part, want in reference.items():
        got = result.outputs[part].cpu().numpy().astype(np.float64)
        want = np.asarray(want, dtype=np.float64)
        np.testing.assert_allclose(got[1:], want[1:], rtol=2e-5, atol=1e-6, equal_nan=True, err_msg=f"{name} {part}")
        # the all -inf row: the reference's exp(-inf - (-inf)) is NaN everywhere; the fused kernels (per tile
        # as before, and per lane) anchor an infinite max at 0, so logsumexp gives -inf there (torch's too)
        assert not np.isfinite(got[0]).any(), (name, got[0])
        if name == "safe_softmax":
            assert np.isnan(got[0]).all()


@pytest.mark.parametrize("name,shape,blocks", [
    ("attention", {"b": 1, "h": 2, "m": 1, "n": 300, "d": 16, "e": 16}, {"n": 64}),  # decode: no tl.dot at m = 1
    ("attention_causal", {"b": 1, "h": 2, "m": 20, "n": 300, "d": 16, "e": 16}, {"n": 64, "m": 16, "e": 16}),
    ("fp8_quant_gemm", {"m": 3, "k": 300, "n": 5}, {"k": 64}),
])
def test_a_matrix_product_stays_per_tile_at_any_blocks(name: str, shape: dict, blocks: dict) -> None:
    """A sum that is a matrix product (a tl.dot at blocks >= 16) would hold an outer product per lane."""
    spec = load_catalog_spec(name)
    plan = make_plan(spec, derive_cascade(spec), "streaming_fused", shape, KernelConfig(blocks))
    streamed = next(loop for loop in build_structure(plan, bind_dtypes(spec, "float32")).kernels[0].loops()
                    if loop.span == "axis")
    ok, why = per_lane(plan, streamed.body)
    # at these blocks causal attention's masked product is a tl.dot (decide_dot); else it is refused as a product
    assert not streamed.per_lane and not ok and "matrix product" in why, why
