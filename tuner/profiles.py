"""GPU profiles: the numbers a target names (docs/API.md "Targets").

A :class:`GpuProfile` is what the ``model`` measurer predicts from and what the search space
checks candidates against before anything compiles (shared memory, registers, warps).

Sources. The first group of fields are **public datasheet figures** (NVIDIA H100 Tensor Core
GPU datasheet and architecture whitepaper; H200 datasheet; A100 datasheet and Ampere
whitepaper; CUDA C Programming Guide, "Compute Capabilities" table, for the per-SM limits).
FLOP/s are *dense* (no 2:4 sparsity), at boost clock. The fields after ``launch_overhead_s``
(clock, memory latency, L2 bandwidth) are not on datasheets: they are typical published
micro-benchmark values, used only by the cost model's bandwidth terms, and marked "estimate".

Example:
    >>> p = get_profile("h100")
    >>> p.sm_count, p.peak_flops["fp16"] / 1e12
    (132, 989.0)
    >>> profile_for_device_name("NVIDIA H100 80GB HBM3")
    'h100'
"""

from __future__ import annotations

from dataclasses import dataclass, field

KB = 1024
MB = 1024 * 1024
REGISTER_UNIT = 8  # registers per thread are allocated in multiples of 8 (CUDA occupancy calculator)


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model, as the tuner sees it."""

    name: str
    arch: str  # "sm_90"
    sm_count: int
    hbm_bytes_per_s: float
    l2_bytes: int
    smem_per_sm: int  # shared memory a block may use per SM (bytes)
    smem_per_block_max: int  # opt-in maximum per block (bytes)
    regs_per_sm: int  # 32-bit registers
    max_warps_per_sm: int
    max_blocks_per_sm: int
    peak_flops: dict[str, float]  # "fp32", "tf32", "fp16", "bf16", "fp8" -> dense FLOP/s (a missing key: no such unit)
    sfu_ops_per_s: float  # special-function (ex2, lg2, rsqrt, rcp) results per second, whole chip
    launch_overhead_s: float  # per kernel launch, GPU side
    # -- estimates (not datasheet): see the module docstring
    clock_hz: float = 1.755e9
    mem_latency_s: float = 700e-9  # loaded HBM latency, for Little's law (bytes in flight)
    l2_bytes_per_s: float = 5.5e12
    hbm_bytes: int = 80 * 1000**3
    regs_per_thread_max: int = 255
    threads_per_block_max: int = 1024
    notes: tuple[str, ...] = field(default_factory=tuple)

    def registers_per_program(self, regs_per_thread: int, num_warps: int) -> int:
        """Registers one program (block) holds: the hardware allocates them per warp, in units
        of 256 (8 per thread), so 26 registers per thread take 32."""
        per_thread = REGISTER_UNIT * -(-max(0, regs_per_thread) // REGISTER_UNIT)
        return per_thread * 32 * num_warps

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["peak_flops"] = dict(self.peak_flops)
        out["notes"] = list(self.notes)
        return out


T = 1e12

# Public datasheet figures (see the module docstring); dense FLOP/s; SFU = 16 per SM per clock.
PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile(
        name="h100", arch="sm_90", sm_count=132, hbm_bytes_per_s=3.35e12, l2_bytes=50 * MB,
        smem_per_sm=228 * KB, smem_per_block_max=227 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 67 * T, "tf32": 495 * T, "fp16": 989 * T, "bf16": 989 * T, "fp8": 1979 * T},
        sfu_ops_per_s=132 * 16 * 1.98e9, launch_overhead_s=3e-6,
        clock_hz=1.98e9, mem_latency_s=700e-9, l2_bytes_per_s=5.5e12, hbm_bytes=80 * 1000**3,
        notes=("H100 SXM5 80 GB",),
    ),
    "h200": GpuProfile(
        name="h200", arch="sm_90", sm_count=132, hbm_bytes_per_s=4.8e12, l2_bytes=50 * MB,
        smem_per_sm=228 * KB, smem_per_block_max=227 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 67 * T, "tf32": 495 * T, "fp16": 989 * T, "bf16": 989 * T, "fp8": 1979 * T},
        sfu_ops_per_s=132 * 16 * 1.98e9, launch_overhead_s=3e-6,
        clock_hz=1.98e9, mem_latency_s=700e-9, l2_bytes_per_s=5.5e12, hbm_bytes=141 * 1000**3,
        notes=("H200 SXM 141 GB: H100's compute with HBM3e",),
    ),
    "a100": GpuProfile(
        name="a100", arch="sm_80", sm_count=108, hbm_bytes_per_s=2.039e12, l2_bytes=40 * MB,
        smem_per_sm=164 * KB, smem_per_block_max=163 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T},  # no fp8 units
        sfu_ops_per_s=108 * 16 * 1.41e9, launch_overhead_s=3e-6,
        clock_hz=1.41e9, mem_latency_s=700e-9, l2_bytes_per_s=4.5e12, hbm_bytes=80 * 1000**3,
        notes=("A100 SXM4 80 GB",),
    ),
}

# torch.cuda.get_device_name() -> profile, exact names only: parts whose figures differ from
# the profile (H100 PCIe / NVL, H200 NVL, A100 40 GB and PCIe) get no profile.
_DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 SXM5 80GB": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100",
}


def get_profile(name: str) -> GpuProfile:
    """The profile called ``name`` (case-insensitive); ValueError naming the known ones."""
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def profile_for_device_name(device_name: str) -> str | None:
    """The profile name for a ``torch.cuda.get_device_name()`` string, or None when no profile
    describes that GPU (e.g. an H100 PCIe, whose SM count and bandwidth differ)."""
    return _DEVICE_NAMES.get(" ".join(str(device_name).split()))
