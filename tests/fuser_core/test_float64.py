"""float64 kernels (issue 39 item 6, what ``torch.autograd.gradcheck`` runs in): a float64 input makes
the kernel compute in float64 (loads, states, the split's workspace, sizes), store float64 outputs
and keep the statistics a backward reads in float64; its sums are elementwise (no tl.dot). Every
strategy meets the runner's float64 bar, and the module compiles for sm_90."""

from __future__ import annotations

import re

import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import STRATEGIES, KernelConfig, default_config, loop_axis
from fuser_core.derive import derive_cascade
from fuser_core.problem import output_dtypes
from fuser_core.runner import TOLERANCE, self_check
from fuser_core import generate


@pytest.mark.parametrize("name,shape", [
    ("safe_softmax", {"m": 3, "n": 40}),
    ("layernorm", {"t": 3, "c": 37}),
    ("cross_entropy_ignore", {"t": 5, "v": 30}),  # a count of tokens: float64 too
    ("attention_causal", {"b": 1, "h": 2, "m": 5, "n": 9, "d": 16, "e": 16}),  # the scores: not a tl.dot here
])
def test_every_strategy_meets_the_float64_bar(name, shape):
    spec = load_catalog_spec(name)
    derivation = derive_cascade(spec)
    axis, _ = loop_axis(spec)
    for strategy in STRATEGIES:  # tiles of 4 along the loop axis: several, and a tail
        config = None if strategy == "row_resident" else KernelConfig(
            {axis: 4}, split=2 if strategy == "split_fused" else 1)
        report = self_check(spec, shape, "float64", strategy=strategy, config=config, derivation=derivation)
        assert report["passed"] and report["max_rel_err"] <= TOLERANCE["float64"], (strategy, report)


def test_a_float64_module_computes_and_stores_in_float64():
    spec = load_catalog_spec("cross_entropy_ignore")
    derivation = derive_cascade(spec)
    shape = {"t": 5, "v": 300}
    dtypes = {"logits": "float64", "target": "int64"}
    assert set(output_dtypes(spec, dtypes).values()) == {"float64"}
    source = generate(spec, derivation, "split_fused", shape, default_config(spec, derivation, "split_fused", shape),
                      dtypes).source
    kernels = source[source.index("@triton.jit\ndef cross_entropy_ignore"):source.index("def launch(")]
    assert ".to(tl.float64)" in kernels and "tl.dot" not in kernels
    # no float32 value: every load, state and conversion is float64 (an index stays int32)
    assert not re.search(r"tl\.float32", kernels), [ln for ln in kernels.splitlines() if "tl.float32" in ln]
    assert "dtype=torch.float64" in source[source.index("def launch("):]  # outputs and the split's workspace


def test_a_saving_forward_keeps_float64_statistics():
    """RMSNorm's saved mean square is float32 for 16-bit data (output_dtypes) and float64 for float64 data."""
    from fuser_core.backward.derive import derive_backward

    forward = derive_backward(load_catalog_spec("rmsnorm")).forward
    assert output_dtypes(forward, {"x": "bfloat16", "w": "bfloat16"}) == {"y": "bfloat16", "ms": "float32"}
    assert output_dtypes(forward, {"x": "float64", "w": "float64"}) == {"y": "float64", "ms": "float64"}


def test_a_float64_kernel_compiles_for_sm90(compile_pool):
    """A norm at a model's hidden size. (Attention in float64 holds its scores' products as a
    [m, n, d] broadcast, no tl.dot: at 64 x 64 x 64 tiles ptxas runs for minutes. float64 is for
    gradcheck-sized checks.)"""
    from fuser_core.codegen.gpu_compile import CompileRequest

    spec = load_catalog_spec("layernorm")
    dtypes = {"x": "float64", "gamma": "float64", "beta": "float64"}
    (build,) = compile_pool.compile([CompileRequest(spec, {"t": 64, "c": 4096}, dtypes, "streaming_fused", None)])
    assert build.ok, build.first_error()
