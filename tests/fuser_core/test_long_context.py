"""Long contexts (issue 36, 1): a size limit applies to what a strategy stores or addresses, so a
131072-token attention binds and its fused kernels are generated (the unfused chain, which stores
the score matrix, refuses it naming the step); and no offset is reached wrapped: for a tensor whose
furthest element lies 2**31 elements or more past its first (a view into a larger buffer) the fused
kernels index in 64 bits, and the unfused chain refuses it naming it."""

from __future__ import annotations

import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core import interpreter_quiet
from fuser_core.codegen.chain import chain_modules
from fuser_core.codegen.helpers import int32_offsets, wide_offsets
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
    assert "131072" not in module.source and "WIDE_OFFSETS = wide_offsets(q=q, k=k, v=v, o=o)" in module.source


def test_a_view_whose_offsets_pass_2_31_widens_the_fused_kernels_and_the_chain_refuses_it():
    """A view into a larger buffer (rows 2**20 apart: q of a packed qkv, a slice of a preallocated
    cache) whose furthest element lies 2**31 or more past its first: the fused launchers set
    WIDE_OFFSETS (positions times strides in 64 bits; a constexpr, so ordinary calls compile to the
    same code as before); the unfused chain, which keeps 32-bit offsets, refuses it naming it."""
    spec = load_catalog_spec("safe_softmax")
    shape = bind_shape(spec, {"m": 4096, "n": 300})
    derivation = derive_cascade(spec)
    module = generate(spec, derivation, "row_resident", shape, default_config(spec, derivation, "row_resident", shape),
                      {"x": "float16"})
    assert "WIDE_OFFSETS = wide_offsets(x=x, y=y)" in module.source
    rows = torch.empty(4096, 2**20, dtype=torch.float16, device="meta")  # a wide buffer: rows 2**20 apart
    assert wide_offsets(x=rows[:, :300])
    out = torch.empty(300, 4096, dtype=torch.float16, device="meta").t()  # an output the caller lays out
    assert not wide_offsets(x=rows[:2047, :300], y=out)  # within reach: 2046 * 2**20 + 299 < 2**31; a transpose
    assert wide_offsets(x=rows[:2047, :300], y=torch.empty(2**31 + 1, dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match=r"x: its furthest element is 4293919019 elements past its first "
                                         r"\(strides \(1048576, 1\)\); the unfused chain indexes with 32-bit offsets"):
        int32_offsets(x=rows[:, :300])
    chain = [k for k in chain_modules(spec, shape, "float16") if k.kind == "elementwise"]
    assert chain and "int32_offsets(" in chain[0].source  # the unfused chain's own launcher checks


@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused", "split_fused", "multi_pass"])
def test_rows_2_31_elements_apart_are_read_and_written_right(strategy):
    """Rows 2**30 elements apart in one buffer of 2**31 + 1024 float16 (reserved by torch.empty, 4 GB
    of address space, only the rows touched): the third row's offset, 2**31, wraps in 32 bits (the
    interpreter then reads outside the buffer); widened, every strategy gives torch's softmax."""
    spec = load_catalog_spec("safe_softmax")
    shape = bind_shape(spec, {"m": 3, "n": 300})
    derivation = derive_cascade(spec)
    buffer = torch.empty(2**31 + 1024, dtype=torch.float16)
    rows = buffer.as_strided((3, 300), (2**30, 1))
    values = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).to(torch.float16) * 3
    rows.copy_(values)
    out = buffer.as_strided((3, 300), (2**30, 1), storage_offset=300)  # the output in the same wide buffer
    module = generate(spec, derivation, strategy, shape, default_config(spec, derivation, strategy, shape),
                      {"x": "float16"})
    with interpreter_quiet():
        module.load().launch({"x": rows}, shape, out={"y": out})
    expected = torch.softmax(values.double(), -1)
    assert (out.double() - expected).abs().max() < 2e-3
    assert torch.equal(rows, values)  # the input untouched


WIDE_COMPILE = """
import json, torch
from fuser_core.catalog import load_catalog_spec
from fuser_core import derive_cascade, generate, default_config
from fuser_core.problem import bind_shape
from fuser_core.codegen.launches import intercepted_launches, meta_inputs, target_driver
from fuser_core.codegen.gpu_compile import compile_launch
from fuser_core.targets import Target
out = []
for name, shp, dtype, strategy in (("safe_softmax", {"m": 64, "n": 4096}, "float16", "split_fused"),
                                   ("cross_entropy", {"t": 64, "v": 4096}, "bfloat16", "streaming_fused")):
    spec = load_catalog_spec(name); d = derive_cascade(spec); shape = bind_shape(spec, shp)
    dtypes = {i.name: dtype if not i.is_index else "int64" for i in spec.inputs}
    module = generate(spec, d, strategy, shape, default_config(spec, d, strategy, shape), dtypes)
    for wide in (False, True):
        inputs = meta_inputs(spec, shape, dtypes)
        first = spec.inputs[0].name
        t = inputs[first]
        if wide:  # rows 2**26 apart in a larger buffer: the last row lies past 2**31
            inputs[first] = torch.empty(2**33, dtype=t.dtype, device="meta").as_strided(t.shape, (2**26, 1))
        target = Target("cuda", 90, 32)
        with target_driver(target), intercepted_launches() as launches:
            module.load().launch(inputs, shape)
        for launch in launches:
            build = compile_launch(launch, target, sass=True)
            out.append([name, launch.fn.__name__, launch.kwargs["WIDE_OFFSETS"], build.ok,
                        build.sass["total"]["instructions"] if build.ok else build.error])
print(json.dumps(out))
"""


def test_wide_kernels_compile_for_sm_90():
    """WIDE_OFFSETS is a constexpr: with it the kernels compile for sm_90 with 64-bit positions
    (more instructions); without it, none of that is compiled."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # Triton's GPU compiler, in a process of its own
    done = subprocess.run([sys.executable, "-c", WIDE_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert rows and all(ok for *_, ok, _ in rows), rows
    by = {(name, kernel, wide): n for name, kernel, wide, _, n in rows}
    for (name, kernel, wide), n in by.items():
        if wide:
            assert n > by[(name, kernel, False)], (name, kernel, n)
