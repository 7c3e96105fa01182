"""The unfused kernel chain (fuser_core/codegen/chain.py): one kernel per reduction, results
through memory, checked against the float64 reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np
import pytest
import torch
from tests.support.catalog import load_catalog

from fuser_core.codegen.chain import (
    ChainElementwise,
    chain_modules,
    elementwise_blocks,
    elementwise_kernel,
    run_chain,
    run_chain_detailed,
)
from fuser_core.codegen.module import output_dtypes
from fuser_core.reference import Evaluator, bind_shape, evaluate, random_inputs
from fuser_core.runner import TOLERANCE, bind_dtypes, compare, run
from fuser_core.spec import load_spec

# masked-off lanes of a tile compute on fill values (0 / 0, inf - inf); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CATALOG = load_catalog()
ATTENTION_SHAPE = {"b": 1, "h": 2, "m": 3, "n": 19, "d": 8, "e": 5}


def shape_for(spec) -> dict[str, int]:
    """Small sizes: reduction axes 37 (19 for attention), other dims 3; topk `as` dims from k."""
    if spec.name.startswith("attention"):  # the grouped layout's g, r as well as h
        return {d: ATTENTION_SHAPE.get(d, 2) for d in spec.dims}
    axes = {s.over for s in spec.steps if s.is_reduction}
    as_dims = {s.as_dim for s in spec.steps if s.as_dim}
    return {d: 37 if d in axes else 3 for d in spec.dims if d not in as_dims}


def dtype_for(spec, dtype: str):
    if spec.name == "fp8_quant_gemm":
        return {"a": dtype, "w": "float8_e4m3fn", "w_scale": "float32"}
    return dtype


def check(spec, shape, dtype, seed: int = 0, **kwargs):
    bound = bind_shape(spec, shape)
    dtypes = bind_dtypes(spec, dtype)
    inputs = random_inputs(spec, bound, np.random.default_rng(seed), dtypes)
    result = run_chain_detailed(spec, bound, dtypes, inputs, **kwargs)
    reference = evaluate(spec, bound, inputs)
    stores = output_dtypes(spec, dtypes)
    assert list(result.outputs) == list(spec.output_parts)
    for part, t in result.outputs.items():
        assert tuple(t.shape) == reference[part].shape, part
        assert t.dtype == getattr(torch, stores[part]), part
        assert t.is_contiguous()
    errors = compare(spec, result.outputs, reference, stores)
    bad = {p: e for p, e in errors.items() if not e <= TOLERANCE[stores[p]]}
    assert not bad, f"{spec.name} {dtype}: {bad}"
    return result, bound, inputs


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_chain_matches_reference(name, dtype):
    spec = load_spec(CATALOG[name])
    result, _, _ = check(spec, shape_for(spec), dtype_for(spec, dtype))
    reductions = [s.name for s in spec.steps if s.is_reduction]
    elementwise = [o for o in spec.outputs if not spec.step(o).is_reduction]
    assert [k.name for k in result.kernels] == reductions + (["elementwise"] if elementwise else [])


def test_one_kernel_per_reduction_and_intermediates_in_memory():
    """Attention: s = q.k is its own kernel and is materialised (b, h, m, n) in float32, like an
    unfused QK^T -> softmax -> PV chain; every later kernel reads the earlier results from memory."""
    spec = load_spec(CATALOG["attention"])
    result, bound, inputs = check(spec, ATTENTION_SHAPE, "float16")
    names = [k.name for k in result.kernels]
    assert names == ["s", "mx", "den", "o"]
    for k in result.kernels:
        assert k.kind == "reduction"
        assert [s.name for s in k.spec.steps if s.is_reduction] == [k.name]  # one reduction per kernel
        assert k.source.count("_kernel[(") == 1  # the launcher launches one kernel
        assert k.path.exists()
    reads = {k.name: sorted(what for where, what in k.reads.values() if where == "step") for k in result.kernels}
    assert reads == {"s": [], "mx": ["s"], "den": ["mx", "s"], "o": ["den", "mx", "s"]}
    env = Evaluator(spec, bound).run(inputs)
    ev = Evaluator(spec, bound)
    for name in ("s", "mx", "den"):
        t = result.intermediates[name]
        assert t.dtype == torch.float32
        want = ev.unaligned(env[name], spec.step(name).dims)
        assert tuple(t.shape) == want.shape
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-6)
    # the final output is written in its storage dtype directly
    assert result.intermediates["o"].dtype == torch.float16


def test_elementwise_kernel_and_cache():
    spec = load_spec(CATALOG["fp8_quant_per_token"])  # outputs over (t, c) and over (t)
    shape = {"t": 5, "c": 37}
    kernels = chain_modules(spec, shape, "float16", config_blocks={"t": 2, "c": 16})
    assert [k.name for k in kernels] == ["amax", "elementwise"]
    amax, ew = kernels
    assert amax.strategy == "multi_pass" and amax.blocks["c"] == 16  # a block < size: loop over the axis
    assert ew.writes == ("q", "scale") and ew.stores == {"q": "float8_e4m3fn", "scale": "float16"}
    assert ew.blocks == {"t": 2, "c": 16}
    assert "if pid_c == 0:" in ew.source  # scale (t) is stored once, by the programs at block 0 of c
    again = chain_modules(spec, shape, "float16", config_blocks={"t": 2, "c": 16})
    assert [(k.key, k.path) for k in again] == [(k.key, k.path) for k in kernels]
    assert all(k.source == k.path.read_text() for k in again)
    check(spec, shape, "float16", config_blocks={"t": 2, "c": 16})
    # same outputs as the fused kernel
    inputs = random_inputs(spec, shape, np.random.default_rng(1), "float32")
    fused = run(spec, shape, "float32", inputs).outputs
    chained = run_chain(spec, shape, "float32", inputs)
    for part in spec.output_parts:
        assert torch.equal(fused[part].float(), chained[part].float()), part


MIXED = {
    "foldwise": 1,
    "name": "mixed",
    "inputs": {"y": {"dims": ["c"]}, "x": {"dims": ["m", "n"]}, "w": {"dims": ["c", "n"]}},
    "steps": [
        {"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
        {"name": "am", "reduce": "argmax", "over": "n", "expr": "x"},
        {"name": "g", "reduce": "topk", "k": 2, "as": "j", "over": "n", "expr": "x - mx"},
        {"name": "gs", "reduce": "sum", "over": "j", "expr": "g.values / size(n)"},
        {"name": "p", "expr": "where(index(n) == am, 2, 1) * exp(x - mx)"},
        {"name": "r", "reduce": "sum", "over": "n", "expr": "p * w"},
        {"name": "z", "expr": "r + y + gs"},
    ],
    "outputs": ["z", "am", "g"],
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_topk_parts_index_results_and_permuted_dims(dtype):
    """g.values becomes input g_values; argmax feeds a later kernel as an index input; size(n)
    of a dim gs's kernel lacks is a constant; r's kernel orders dims (m, c), the spec (c, m)."""
    spec = load_spec(MIXED)
    result, _, _ = check(spec, {"c": 3, "m": 4, "n": 13}, dtype)
    by_name = {k.name: k for k in result.kernels}
    assert by_name["gs"].reads == {"g_values": ("step", "g.values")}
    assert by_name["gs"].spec.input("g_values").dims == ("m", "j")
    assert by_name["r"].spec.input("am").kind == "index"
    assert by_name["r"].permute == {"r": (1, 0)}
    assert result.intermediates["am"].dtype == torch.int32
    assert tuple(result.intermediates["r"].shape) == (3, 4)


@pytest.mark.parametrize("name", ["attention_causal", "layernorm", "moe_routing"])
def test_multi_pass_chain(name):
    """Axis blocks smaller than the axis: every reduction kernel loops over it (multi_pass);
    lane blocks that do not divide the sizes exercise the masks."""
    spec = load_spec(CATALOG[name])
    axes = {s.over for s in spec.steps if s.is_reduction}
    blocks = {d: (4 if d in axes else 2) for d in spec.dims if not any(s.as_dim == d for s in spec.steps)}
    result, _, _ = check(spec, shape_for(spec), "float32", seed=1, config_blocks=blocks)
    assert {k.strategy for k in result.kernels if k.kind == "reduction"} == {"multi_pass"}


def test_elementwise_kernel_scalar_outputs():
    """Outputs over fewer dims than the tile, down to scalars (a pointer block of size 1)."""
    spec = load_spec({
        "foldwise": 1, "name": "scalars", "inputs": {"x": {"dims": ["m", "n"]}},
        "steps": [{"name": "s", "reduce": "sum", "over": "n", "expr": "x"},
                  {"name": "t", "reduce": "sum", "over": "m", "expr": "s"},
                  {"name": "y", "expr": "t * 2 + size(n)"}, {"name": "z", "expr": "s - t"},
                  {"name": "w", "expr": "x + t"}],
        "outputs": ["y", "z", "w"],
    })
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    s, t = x.sum(1), x.sum()
    want = {"y": t * 2 + 5, "z": s - t, "w": x + t}
    for outs in (["y"], ["y", "z"], ["y", "z", "w"]):
        dims = spec.order_dims({d for o in outs for d in spec.step(o).dims})
        plan = ChainElementwise(tuple(outs), dims, elementwise_blocks(dims, {"m": 3, "n": 5}, {}),
                                {o: "float32" for o in outs})
        k = elementwise_kernel(spec, plan, {"x": "float32"})
        got = k.launch({"x": x}, {"s": s, "t": t.reshape(())}, {"m": 3, "n": 5})
        for o in outs:
            torch.testing.assert_close(got[o], want[o], rtol=1e-5, atol=1e-5)


# DeepSeek-V3's router (issue 37, 14): experts picked by the biased scores, weighted by the unbiased
# ones, gathered at the picked positions. Its gather runs on a [t, j] tile whose blocks differ (t in
# a block of 8, j of 2): the input's own tail mask must be on that tile, not on [t] alone.
DS_ROUTER = {
    "foldwise": 1, "name": "ds_router",
    "inputs": {"logits": {"dims": ["t", "x"]}, "bias": {"dims": ["x"]}},
    "steps": [
        {"name": "s", "expr": "sigmoid(logits)"},
        {"name": "sel", "reduce": "topk", "over": "x", "k": 2, "as": "j", "expr": "s + bias"},
        {"name": "w", "reduce": "sum", "over": "x", "expr": "where(index(x) == sel.indices, s, 0)"},
    ],
    "outputs": ["w", "sel"],
}


@pytest.mark.parametrize("t", [3, 6, 8])
def test_the_chains_gather_masks_its_whole_tile(t):
    spec = load_spec(DS_ROUTER)
    check(spec, {"t": t, "x": 16}, "float32")
    # a NaN row keeps its NaN weights (the reference's), the other rows theirs
    bound = bind_shape(spec, {"t": t, "x": 16})
    inputs = random_inputs(spec, bound, np.random.default_rng(1), bind_dtypes(spec, "float32"))
    inputs["logits"][1, 5] = np.nan
    reference = evaluate(spec, bound, inputs)
    got = run_chain(spec, bound, "float32", inputs)
    for row in range(t):
        ref = np.asarray(reference["w"][row], dtype=np.float64)
        out = got["w"][row].double().numpy()
        assert np.array_equal(np.isnan(ref), np.isnan(out)), row
        assert np.allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=1e-6, atol=1e-7), row


def test_a_dim_read_only_through_index_is_refused_by_the_chain_naming_it():
    """A masked count over valid tokens reads t only through index(t): no input of the step has t,
    so its spec of one reduction has no t. The chain says so (the fused strategies run it)."""
    from fuser_core.codegen.config import NotValid

    spec = load_spec({
        "foldwise": 1, "name": "masked_mean",
        "inputs": {"x": {"dims": ["t", "c"]}, "length": {"dims": ["c"], "kind": "index"}},
        "steps": [{"name": "cnt", "reduce": "sum", "over": "t", "expr": "where(index(t) < length, 1, 0)"},
                  {"name": "s", "reduce": "sum", "over": "t", "expr": "where(index(t) < length, x, 0)"},
                  {"name": "mean", "expr": "s / cnt"}],
        "outputs": ["mean"]})
    with pytest.raises(NotValid, match="step 'cnt'.*dim t only through index"):
        chain_modules(spec, {"t": 6, "c": 5}, "float32")
