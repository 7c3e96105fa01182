"""fp8 on the hardware (issue 35, 3): where the target multiplies e4m3 (NVIDIA sm_89+), the fp8
GEMM's operands reach the tensor cores as fp8 (Hopper's QGMMA ... E4M3) and conversions are the
hardware's; elsewhere (sm_80, AMD) and in the interpreter, the exact software path, which
tests/fuser_core/test_fp8_bits.py checks code by code. The hardware's own values are checked on a
GPU (benchmarks/gpu/fp8_native.py), not here."""

from __future__ import annotations

import pytest

from fuser_core.catalog import spec_source
from fuser_core.codegen import helpers
from fuser_core.codegen.gpu_compile import CompileRequest
from fuser_core.codegen.launches import target_driver
from fuser_core.spec import load_spec
from fuser_core.targets import Target
from tuner.profiles import FLEET, get_profile

FP8_GEMM_DTYPES = {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}


def test_the_launcher_asks_the_device_what_the_target_says(monkeypatch):
    """helpers.fp8_native (copied into self-contained modules) and Target.fp8_native are one rule."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seen = set()
    for profile in map(get_profile, FLEET):
        with target_driver(profile.target):
            assert helpers.fp8_native() == profile.target.fp8_native, profile.name
        seen.add(profile.target.fp8_native)
    assert seen == {True, False}  # the fleet has both kinds
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter converts inexactly: always the exact path
    with target_driver(Target.parse("sm_90")):
        assert helpers.fp8_native() is False


@pytest.mark.parametrize("strategy", ["streaming_fused", "multi_pass"])
def test_the_fp8_gemm_multiplies_e4m3_on_hopper_and_fp16_on_ampere(compile_pool, strategy):
    spec = load_spec(spec_source("fp8_quant_gemm"))
    shape = {"m": 512, "n": 512, "k": 512}
    hopper, ampere = compile_pool.compile([
        CompileRequest(spec, shape, FP8_GEMM_DTYPES, strategy, None, Target.parse(arch), sass=True)
        for arch in ("sm_90", "sm_80")])
    assert hopper.ok and ampere.ok, (hopper.first_error(), ampere.first_error())
    [h] = [k.sass["total"]["tensor"] for k in hopper.kernels if k.sass and k.sass["total"]["tensor"]]
    [a] = [k.sass["total"]["tensor"] for k in ampere.kernels if k.sass and k.sass["total"]["tensor"]]
    assert set(h) == {"qgmma.e4m3"}, h  # fp8 operands, nothing in 16 bits
    assert a and not any("e4m3" in kind for kind in a), a  # sm_80 has no fp8 units: fp16's, exact


def test_amd_keeps_the_exact_path_and_compiles(compile_pool):
    spec = load_spec(spec_source("fp8_quant_gemm"))
    [build] = compile_pool.compile([CompileRequest(spec, {"m": 64, "n": 64, "k": 96}, FP8_GEMM_DTYPES,
                                                   "streaming_fused", None, Target.parse("gfx942"))])
    assert build.ok, build.first_error()


def test_the_gemm_quantises_with_one_reciprocal_per_row_and_keeps_the_loaded_weight_bits():
    """The fp8 dot's operands as printed: the activations' 448 a / amax with 1 / amax once per row
    (a division per element was an SFU reciprocal and a multiply in the GEMM's loop), the weights
    as the bits their load gave (shared memory straight to the tensor cores)."""
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import KernelConfig
    from fuser_core.derive import derive_cascade

    spec = load_spec(spec_source("fp8_quant_gemm"))
    config = KernelConfig.from_dict({"blocks": {"m": 64, "n": 64, "k": 32}, "num_warps": 4, "num_stages": 2})
    source = generate(spec, derive_cascade(spec), "multi_pass", {"m": 100, "n": 70, "k": 96}, config,
                      FP8_GEMM_DTYPES).source
    dots = [line for line in source.splitlines() if "tl.dot(" in line and "=" in line]
    assert len(dots) == 2  # the whole tiles of k without the tail mask, then the last partial one
    for dot in dots:
        assert "fp8_operand(" in dot and "(448.0 / amax_acc))[:, None]" in dot and "/ amax_acc[:, None]" not in dot
        assert "fp8_bits_operand(w_bits, FP8_NATIVE)" in dot
