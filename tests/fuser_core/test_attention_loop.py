"""Attention's inner loop at tutorial 06's cost (issue 35, 1): the scale folded into the exp's FMA and
out of the running max, the rescale guard decided on the row's correction, K and V by TMA on sm_90.

Each change is checked where it can fail: the printed source (what the generator decided), the
interpreter (the descriptor path against the pointer path, bit for bit, and both against float64
at sizes that are not multiples of the tiles) and the compiled SASS (UTMALDG in the hot loop on
sm_90, pointer loads on sm_80)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen import helpers
from fuser_core.codegen.gpu_compile import CompileRequest
from fuser_core.codegen.launches import target_driver
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig, make_plan
from fuser_core.codegen.structure import build_structure
from fuser_core.derive import derive_cascade
from fuser_core.problem import bind_scalars, output_dtypes
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import bind_dtypes, interpreter_quiet
from fuser_core.targets import Target

CASES = [  # (spec, shape, blocks, dtype): ragged n, d and e under their blocks; GQA; both causal alignments
    ("attention", {"b": 1, "h": 2, "m": 20, "n": 45, "d": 24, "e": 40}, {"m": 16, "n": 16, "e": 64}, "float16"),
    ("attention_gqa", {"b": 2, "g": 2, "r": 2, "m": 7, "n": 45, "d": 16, "e": 16}, {"m": 16, "n": 16, "e": 16},
     "bfloat16"),
    ("attention_causal", {"b": 1, "h": 2, "m": 45, "n": 45, "d": 16, "e": 16}, {"m": 16, "n": 16, "e": 16},
     "bfloat16"),
]


def module(name: str, shape: dict, blocks: dict, dtype: str, strategy: str = "streaming_fused"):
    spec = load_catalog_spec(name)
    bound = bind_shape(spec, shape)
    config = KernelConfig(blocks, num_warps=4, num_stages=2, split=2 if strategy == "split_fused" else 1)
    return spec, bound, generate(spec, derive_cascade(spec), strategy, bound, config, bind_dtypes(spec, dtype))


def launch(spec, bound, mod, dtype: str, tma: bool) -> dict[str, np.ndarray]:
    loaded = mod.load()
    loaded.tma_loads = lambda *tensors: tma  # the launcher's choice, made here as on a sm_90 device
    dtypes = bind_dtypes(spec, dtype)
    inputs = random_inputs(spec, bound, np.random.default_rng(3))
    tensors = {k: torch.tensor(v).to(getattr(torch, dtypes.get(k, "float32"))) for k, v in inputs.items()}
    with interpreter_quiet():
        out = loaded.launch(tensors, bound, scalars=bind_scalars(spec, bound, {}))
    ref = evaluate(spec, bound, {k: t.double().numpy() for k, t in tensors.items()})
    return {p: out[p].double().numpy() for p in ref}, ref


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
@pytest.mark.parametrize("name,shape,blocks,dtype", CASES)
def test_tiles_by_descriptor_are_the_pointer_loads_tiles(name, shape, blocks, dtype, strategy):
    """Under the interpreter (which runs tensor descriptors as Triton defines them: zero outside the
    tensor), the TMA path gives the pointer path's bits, and both the float64 reference's values."""
    spec, bound, mod = module(name, shape, blocks, dtype, strategy)
    assert "k_desc = tl.make_tensor_descriptor(" in mod.source and "v_desc.load(" in mod.source
    by_tma, ref = launch(spec, bound, mod, dtype, True)
    by_pointers, _ = launch(spec, bound, mod, dtype, False)
    for part, want in ref.items():
        np.testing.assert_array_equal(by_tma[part], by_pointers[part])
        scale = np.abs(want).max()
        assert np.abs(by_tma[part] - want).max() <= 2e-2 * scale, (name, part)


def test_the_scale_multiplies_the_rows_max_and_joins_log2e_in_the_exp():
    """s = tl.dot(q, k) stays unscaled: the running max is the raw scores' max times the scale (one
    multiply per row, bit for bit the max of the scaled scores), and exp(s * scale - mx) prints as
    one FMA per score, the scale times LOG2E a constant of the program."""
    _, _, mod = module(*CASES[0])
    lines = mod.source.splitlines()
    [dot] = {line.strip() for line in lines if line.strip().startswith("s = tl.dot(")}
    assert dot.split("#")[0].rstrip().endswith(")"), dot  # nothing multiplies the product
    assert any("max_nan) * (tl.rsqrt((size_d * 1.0)))" in line for line in lines)
    assert any("tl.exp2(s * (tl.rsqrt((size_d * 1.0)) * 1.4426950408889634)" in line for line in lines)


def test_a_runtime_scale_moves_only_because_it_is_declared_positive():
    spec = load_catalog_spec("attention_gqa")
    shape = bind_shape(spec, CASES[1][1])
    plan = make_plan(spec, derive_cascade(spec), "streaming_fused", shape, KernelConfig(CASES[1][2]))
    dtypes = bind_dtypes(spec, "bfloat16")
    kernel = build_structure(plan, dtypes, output_dtypes(spec, dtypes)).kernels[0]
    dots = [op.dot for op in kernel.walk() if getattr(op, "dot", None) is not None and op.name == "s0"]
    assert dots and all(d.scale is None for d in dots)  # moved into its readers: scalar_scale is > 0 and finite


def test_the_rescale_guard_is_per_row():
    """The correction is guarded once per row (nonzero_correction on attention's [BLOCK_m, 1]); the
    accumulator is multiplied, with no test of its own per element."""
    _, _, mod = module(*CASES[0])
    rescale = next(line for line in mod.source.split("def rescale(")[1].splitlines() if "return" in line)
    assert rescale.strip() == "return acc * nonzero_correction(c)"
    assert "rescale(o_acc, tl.exp2(mx_anchor_old * 1.4426950408889634 - mx_anchor * 1.4426950408889634)[:, None])" \
        in mod.source


def test_a_correction_that_underflows_keeps_an_infinite_accumulator_and_zeroes_nothing_else():
    """Row 0's scores jump by 200 after its first tile (the float32 correction exp(-200) underflows
    to 0) while its first tile's values hold +inf: the float64 formula keeps inf (exp(-200) > 0
    times inf), and so does the kernel; everything else matches float64."""
    spec = load_catalog_spec("attention")
    bound = bind_shape(spec, {"b": 1, "h": 1, "m": 4, "n": 40, "d": 16, "e": 16})
    config = KernelConfig({"m": 16, "n": 16, "e": 16}, num_warps=4, num_stages=2)
    mod = generate(spec, derive_cascade(spec), "streaming_fused", bound, config, bind_dtypes(spec, "float32"))
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 1, 4, 16))
    k = rng.normal(size=(1, 1, 40, 16))
    v = rng.normal(size=(1, 1, 40, 16))
    q[0, 0, 0] = 0.0
    q[0, 0, 0, 0] = 1.0
    k[0, 0, :, 0] = 0.0
    k[0, 0, 20:, 0] = 800.0  # row 0: scores 0 on the first tile, 200 (800 / sqrt(16)) from key 20 on
    v[0, 0, 3, 5] = np.inf
    tensors = {"q": torch.tensor(q, dtype=torch.float32), "k": torch.tensor(k, dtype=torch.float32),
               "v": torch.tensor(v, dtype=torch.float32)}
    with interpreter_quiet():
        got = mod.load().launch(tensors, bound, scalars={})["o"].double().numpy()
    want = evaluate(spec, bound, {n: t.double().numpy() for n, t in tensors.items()})["o"]
    assert want[0, 0, 0, 5] == np.inf and got[0, 0, 0, 5] == np.inf
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all()
    # as accurate as the formula in float32 (scores near +-200 cost digits in any float32 evaluation)
    s32 = tensors["q"] @ tensors["k"].transpose(-1, -2) / 4.0
    formula = (torch.softmax(s32, -1) @ tensors["v"]).double().numpy()
    assert np.abs(got - want)[finite].max() <= 2 * np.abs(formula - want)[finite].max() + 1e-7


def test_the_launcher_loads_by_tma_only_where_a_descriptor_can_hold_the_tensor(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    aligned = torch.empty(2, 3, 64, 128, dtype=torch.float16)
    with target_driver(Target.parse("sm_90")):
        assert helpers.tma_loads(aligned, aligned)
        assert not helpers.tma_loads(aligned, aligned.transpose(2, 3))  # the last dim not contiguous
        shifted = torch.empty(aligned.numel() + 8, dtype=torch.float16)[1:1 + aligned.numel()].view(aligned.shape)
        assert not helpers.tma_loads(aligned, shifted)  # 2 bytes off a 16-byte boundary
        assert not helpers.tma_loads(torch.empty(2, 3, 64, 4, dtype=torch.float16))  # rows of 8 bytes
    for arch in ("sm_80", "gfx942"):
        with target_driver(Target.parse(arch)):
            assert not helpers.tma_loads(aligned)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with target_driver(Target.parse("sm_90")):
        assert not helpers.tma_loads(aligned)


@pytest.mark.parametrize("name,dtype", [("attention", "float16"), ("attention_causal", "bfloat16")])
def test_hopper_loads_k_and_v_by_tma_and_ampere_by_pointers(compile_pool, name, dtype):
    spec = load_catalog_spec(name)
    shape = {"b": 1, "h": 2, "m": 256, "n": 256, "d": 128, "e": 128}
    config = {"blocks": {"m": 128, "n": 128, "e": 128}, "num_warps": 8, "num_stages": 2}
    dtypes = bind_dtypes(spec, dtype)
    hopper, ampere = compile_pool.compile([
        CompileRequest(spec, shape, dtypes, "streaming_fused", config, Target.parse(arch), sass=True)
        for arch in ("sm_90", "sm_80")])
    assert hopper.ok and ampere.ok, (hopper.first_error(), ampere.first_error())
    [h], [a] = hopper.kernels, ampere.kernels
    hot = max(h.sass["loops"], key=lambda lp: lp["instructions"])
    assert hot["classes"].get("tma") == 2 and "ldgsts" not in hot["classes"]  # one UTMALDG each for K and V
    assert not h.spill_bytes
    assert "tma" not in a.sass["total"]["classes"]
