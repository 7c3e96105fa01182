"""The fleet's GPU profiles (tuner/profiles.py): each of the seven targets loads with its
public figures, names the right compile target and warp size, and is found by device name."""

from __future__ import annotations

import json

import pytest

from fuser_core import Target
from tuner import FLEET, get_profile, profile_for_device_name

ARCHS = {"a100": "sm_80", "l40s": "sm_89", "h100": "sm_90", "h200": "sm_90", "b200": "sm_100",
         "mi300x": "gfx942", "mi355x": "gfx950"}


def test_fleet_is_the_seven_targets_in_order() -> None:
    assert FLEET == ("a100", "l40s", "h100", "h200", "b200", "mi300x", "mi355x")


@pytest.mark.parametrize("name", FLEET)
def test_each_profile_loads_with_its_target(name: str) -> None:
    p = get_profile(name)
    assert p.name == name and p.arch == ARCHS[name]
    assert p.target == Target.parse(ARCHS[name])
    amd = name.startswith("mi")
    assert p.target.backend == ("hip" if amd else "cuda")
    assert p.warp_size == (64 if amd else 32)
    # a block of at most 1,024 threads: 32 warps on NVIDIA, 16 wavefronts on AMD
    assert p.threads_per_block_max == 1024
    assert json.loads(json.dumps(p.to_dict()))["target"] == {
        "backend": p.target.backend, "arch": ARCHS[name], "warp_size": p.warp_size}


def test_datasheet_figures() -> None:
    l40s, b200 = get_profile("l40s"), get_profile("b200")
    assert (l40s.sm_count, l40s.hbm_bytes_per_s, l40s.max_warps_per_sm) == (142, 864e9, 48)
    assert (l40s.smem_per_sm, l40s.smem_per_block_max) == (100 * 1024, 99 * 1024)
    assert l40s.peak_flops["fp16"] == 362.05e12 and l40s.peak_flops["fp8"] == 733e12
    assert (b200.hbm_bytes_per_s, b200.peak_flops["fp16"], b200.peak_flops["fp8"]) == (7.7e12, 2250e12, 4500e12)
    mi300x, mi355x = get_profile("mi300x"), get_profile("mi355x")
    assert (mi300x.sm_count, mi300x.hbm_bytes_per_s, mi300x.clock_hz) == (304, 5.3e12, 2.1e9)
    assert (mi300x.smem_per_sm, mi300x.regs_per_sm, mi300x.max_warps_per_sm) == (64 * 1024, 131072, 32)
    assert mi300x.peak_flops["fp16"] == pytest.approx(1307.4e12)
    assert mi300x.peak_flops["fp8"] == pytest.approx(2614.9e12)
    assert (mi355x.sm_count, mi355x.hbm_bytes_per_s, mi355x.clock_hz) == (256, 8e12, 2.4e9)
    assert mi355x.smem_per_sm == 160 * 1024
    assert "tf32" not in mi355x.peak_flops  # CDNA 4 has no TF32 unit
    assert mi355x.peak_flops["fp8"] == pytest.approx(5033.2e12)


def test_registers_per_program_count_the_warp_width() -> None:
    # 26 registers per thread take 32 (units of 8); a warp holds 32 lanes, a wavefront 64
    assert get_profile("h100").registers_per_program(26, 4) == 32 * 32 * 4
    assert get_profile("mi300x").registers_per_program(26, 4) == 32 * 64 * 4


def test_device_names() -> None:
    assert profile_for_device_name("NVIDIA L40S") == "l40s"
    assert profile_for_device_name("NVIDIA B200") == "b200"
    assert profile_for_device_name("AMD Instinct MI300X") == "mi300x"
    assert profile_for_device_name("AMD Instinct MI355X") == "mi355x"
    assert profile_for_device_name("AMD Instinct MI350X") is None  # lower clock: not the mi355x profile


# ------------------------------------------------------------------ the space and the model, per target

SOFTMAX = ("safe_softmax", {"m": 64, "n": 4096}, "float16")
ATTENTION = ("attention", {"b": 2, "h": 4, "m": 256, "n": 256, "d": 64, "e": 64}, "float16")


def _space(case, target: str):
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.space import SearchSpace

    name, shape, dtype = case
    spec = load_catalog_spec(name)
    return SearchSpace(make_problem(spec, shape, dtype), derive_cascade(spec), get_profile(target))


@pytest.mark.parametrize("target", FLEET)
def test_warps_fit_a_block_of_the_targets_threads(target: str) -> None:
    space = _space(SOFTMAX, target)
    warps = space.params("streaming_fused")["num_warps"]
    # 1,024 threads per block: 32 warps of 32, or 16 wavefronts of 64 (Triton's AMD num_warps)
    assert warps == ([1, 2, 4, 8, 16] if target.startswith("mi") else [1, 2, 4, 8, 16, 32])
    c = space.candidate("streaming_fused", {"block_n": 1024, "num_warps": 4, "num_stages": 2})
    assert space.check(c) is None
    # the register lower bound counts the target's lanes: spread over 64 lanes, a tile takes half the
    # registers per lane that 32 lanes take
    [r] = space.resources(c)
    [h] = _space(SOFTMAX, "h100").resources(c)
    lanes = 2 if target.startswith("mi") else 1
    assert r.min_regs_per_thread == -(-h.min_regs_per_thread // lanes)
    assert r.smem_bytes <= h.smem_bytes  # AMD stages no streamed tile in the LDS (next tests)


@pytest.mark.parametrize("target", FLEET)
@pytest.mark.parametrize("case", [SOFTMAX, ATTENTION], ids=["safe_softmax", "attention"])
def test_the_model_tuner_predicts_on_every_target(case, target: str) -> None:
    """Each target has feasible strategies, the model predicts a finite time for every one of
    them (no missing-unit KeyError), and a short model-tuned search ends on a valid config."""
    import math

    from tuner import ModelMeasurer, Tuner, predict

    space = _space(case, target)
    assert space.strategies(), space.not_valid()
    for strategy in space.strategies():
        c = next(space.enumerate([strategy]))
        p = predict(space.problem, space.derivation, c, space.profile)
        assert math.isfinite(p.time_s) and p.time_s > space.profile.launch_overhead_s
        assert p.details["kernels"][0]["blocks_per_sm"] >= 1
    result = Tuner(space, ModelMeasurer(space.problem, space.derivation, space.profile), seed=0).run(6)
    assert result.target == target and result.predicted and math.isfinite(result.time_ms) and result.time_ms > 0
    from tuner import Candidate

    assert space.check(Candidate.from_dict({"strategy": result.strategy, "config": result.config})) is None


def test_amd_lds_refuses_what_fits_an_h100() -> None:
    """Attention at d = e = 128 on a 64 x 128 tile, 2 stages: its tl.dot operands fit an H100
    block (compiled for sm_90: 145 KiB of 227) and an MI355X's 160 KiB LDS, not an MI300X CU's
    64 KiB (compiled for gfx942: 80 KiB): refused before compiling."""
    case = ("attention", {"b": 2, "h": 4, "m": 256, "n": 512, "d": 128, "e": 128}, "float16")
    tile = {"block_m": 64, "block_n": 128, "block_e": 128, "num_warps": 4, "num_stages": 2}
    h100, mi300x, mi355x = (_space(case, t) for t in ("h100", "mi300x", "mi355x"))
    c = h100.candidate("streaming_fused", tile)
    [r] = mi300x.resources(c)
    assert 64 * 1024 < r.smem_bytes <= 160 * 1024
    assert h100.check(c) is None and mi355x.check(c) is None
    reason = mi300x.check(c)
    assert reason is not None and reason.startswith(
        f"shared memory: {r.smem_bytes // 1024} KiB > 64 KiB LDS per CU on mi300x"), reason
    # the space still has tiles that fit the LDS
    assert any(mi300x.enumerate(["streaming_fused"]))


def test_amd_stages_only_dot_operands_in_lds() -> None:
    """Triton's AMD pipeliner keeps a softmax's streamed tiles in registers (compiled for gfx942:
    32 bytes of LDS on 3 stages), so a 16384-wide tile on 3 stages fits MI300X's 64 KiB, where an
    NVIDIA GPU stages 2 x 32 KiB of it in shared memory."""
    case = ("safe_softmax", {"m": 64, "n": 32768}, "float16")
    mi300x, h100 = _space(case, "mi300x"), _space(case, "h100")
    c = mi300x.candidate("streaming_fused", {"block_n": 16384, "num_warps": 8, "num_stages": 3})
    [amd], [nv] = mi300x.resources(c), h100.resources(c)
    assert amd.smem_bytes <= 2048 and nv.smem_bytes >= 2 * 16384 * 2
    assert mi300x.check(c) is None


def test_amd_occupancy_counts_wavefronts() -> None:
    """Blocks per CU: 32 wavefront slots and a 128K-register VGPR file on MI300X; a 4-wavefront
    program of 64 registers per lane holds 16K registers, so 8 fit, and 8 x 4 = 32 waves fill it."""
    from tuner.cost_model import KernelLoad, blocks_per_sm

    mi300x, h100 = get_profile("mi300x"), get_profile("h100")
    k = KernelLoad("k", 1000, 4, 2, True, 64, 16 * 1024, 0, 0, 0, 0, {}, 0)
    assert mi300x.registers_per_program(64, 4) == 64 * 64 * 4
    assert blocks_per_sm(k, mi300x) == 4  # LDS: 64 KiB / 16 KiB
    assert blocks_per_sm(KernelLoad(**{**k.__dict__, "smem": 1024}), mi300x) == 8  # waves: 32 / 4; VGPRs: 8
    assert blocks_per_sm(KernelLoad(**{**k.__dict__, "smem": 1024}), h100) == 8  # registers: 64K / (64 x 128)


def test_a_missing_matrix_unit_is_no_key_error() -> None:
    mi355x, a100 = get_profile("mi355x"), get_profile("a100")
    assert mi355x.dot_flops("tf32") == mi355x.peak_flops["fp32"] and a100.dot_flops("fp8") == a100.peak_flops["fp32"]
    assert mi355x.dot_flops("fp16") == mi355x.peak_flops["fp16"]
    # elementwise code issues one-value FP32 instructions: AMD's packed FP32 peak is twice that
    assert get_profile("mi300x").alu_flops == pytest.approx(81.7e12) and get_profile("h100").alu_flops == 67e12
