"""Long contexts (issue 36, 1): a size limit applies to what a strategy stores or addresses, so a
131072-token attention binds and its fused kernels are generated (the unfused chain, which stores
the score matrix, refuses it naming the step); and the kernels' 32-bit offsets are never reached
wrapped: a launcher refuses, naming it, a tensor whose furthest element lies 2**31 elements or more
past its first (a view into a larger buffer), checked here on meta tensors, which have strides but
no memory."""

from __future__ import annotations

import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.chain import chain_modules
from fuser_core.codegen.helpers import int32_offsets
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import NotValid, default_config, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.problem import bind_shape

LONG = {"b": 1, "h": 32, "m": 131072, "n": 131072, "d": 128, "e": 128}
BF16 = {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16"}


def test_a_131072_token_causal_attention_binds_and_its_fused_kernels_are_generated():
    spec = load_catalog_spec("attention_causal")
    derivation = derive_cascade(spec)
    bound = bind_shape(spec, LONG)  # s0 would have 2**39 elements: no fused strategy stores it
    valid = valid_strategies(spec, derivation, bound)
    assert [s for s, why in valid.items() if why is None] == ["streaming_fused", "split_fused", "multi_pass"]
    assert "too long to keep resident" in valid["row_resident"]
    with pytest.raises(NotValid, match="the unfused chain stores step 's0'"):
        chain_modules(spec, bound, BF16)
    module = generate(spec, derivation, "streaming_fused", bound,
                      default_config(spec, derivation, "streaming_fused", bound), BF16)
    # sizes are kernel arguments, never baked in: the kernel is the one compiled at every length
    assert "131072" not in module.source and "int32_offsets(q=q, k=k, v=v, o=o)" in module.source


def test_a_view_whose_offsets_pass_2_31_is_refused_naming_it():
    spec = load_catalog_spec("safe_softmax")
    shape = bind_shape(spec, {"m": 4096, "n": 300})
    derivation = derive_cascade(spec)
    launch = generate(spec, derivation, "row_resident", shape, default_config(spec, derivation, "row_resident", shape),
                      {"x": "float16"}).load().launch
    rows = torch.empty(4096, 2**20, dtype=torch.float16, device="meta")  # a wide buffer: rows 2**20 apart
    with pytest.raises(ValueError, match=r"x: its furthest element is 4293919019 elements past its first "
                                         r"\(strides \(1048576, 1\)\); the kernels index with 32-bit offsets"):
        launch({"x": rows[:, :300]}, shape)
    out = torch.empty(300, 4096, dtype=torch.float16, device="meta").t()  # an output the caller lays out
    int32_offsets(x=rows[:2047, :300], y=out)  # within reach: 2046 * 2**20 + 299 < 2**31; a transpose
    with pytest.raises(ValueError, match="^y: "):
        int32_offsets(x=rows[:2047, :300], y=torch.empty(2**31 + 1, dtype=torch.float16, device="meta"))
    chain = [k for k in chain_modules(spec, shape, "float16") if k.kind == "elementwise"]
    assert chain and "int32_offsets(" in chain[0].source  # the unfused chain's own launcher checks too
