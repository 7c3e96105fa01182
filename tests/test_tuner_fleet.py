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
    assert (l40s.sm_count, l40s.hbm_bytes_per_s, l40s.smem_per_sm, l40s.max_warps_per_sm) == (142, 864e9, 100 * 1024, 48)
    assert l40s.peak_flops["fp16"] == 362.05e12 and l40s.peak_flops["fp8"] == 733e12
    assert (b200.hbm_bytes_per_s, b200.peak_flops["fp16"], b200.peak_flops["fp8"]) == (7.7e12, 2250e12, 4500e12)
    mi300x, mi355x = get_profile("mi300x"), get_profile("mi355x")
    assert (mi300x.sm_count, mi300x.hbm_bytes_per_s, mi300x.smem_per_sm, mi300x.clock_hz) == (304, 5.3e12, 64 * 1024, 2.1e9)
    assert mi300x.peak_flops["fp16"] == pytest.approx(1307.4e12) and mi300x.peak_flops["fp8"] == pytest.approx(2614.9e12)
    assert (mi355x.sm_count, mi355x.hbm_bytes_per_s, mi355x.smem_per_sm, mi355x.clock_hz) == (256, 8e12, 160 * 1024, 2.4e9)
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
