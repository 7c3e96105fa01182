"""GPU profiles: the numbers a target names (docs/API.md "Targets").

A :class:`GpuProfile` is what the ``model`` measurer predicts from and what the search space
checks candidates against before anything compiles (shared memory, registers, warps). Its
:attr:`~GpuProfile.target` is the compile target (``fuser_core.Target``) its ``arch`` names.

The fleet is :data:`FLEET`: a100, l40s, h100, h200, b200 (NVIDIA, 32-thread warps) and mi300x,
mi355x (AMD, 64-lane wavefronts). On AMD the fields keep NVIDIA's names for AMD's units: a
compute unit (CU) is an ``sm``, a wavefront a ``warp``, the LDS is shared memory and the VGPR
file the registers; ``num_warps`` counts wavefronts, as Triton's AMD backend does.

Sources. The first group of fields are **public datasheet figures**, each profile naming its
own in a comment (NVIDIA's datasheets and architecture whitepapers; the CUDA C Programming
Guide's "Compute Capabilities" table for the per-SM limits; AMD's Instinct datasheets, CDNA
white papers and the ROCm "AMD GPU specifications" table for the per-CU ones). FLOP/s are
*dense* (no 2:4 sparsity), at boost clock. A field a datasheet does not give says "estimate"
where it is set. The fields after ``launch_overhead_s`` (clock, memory latency, L2 bandwidth)
are not on datasheets unless the profile says so: they are typical published micro-benchmark
values or figures derived from the architecture, used only by the cost model's bandwidth
terms, and marked "estimate".

Example:
    >>> p = get_profile("h100")
    >>> p.sm_count, p.peak_flops["fp16"] / 1e12
    (132, 989.0)
    >>> profile_for_device_name("NVIDIA H100 80GB HBM3")
    'h100'
    >>> get_profile("mi300x").target.warp_size, get_profile("mi300x").smem_per_sm // 1024
    (64, 64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fuser_core import Target
from fuser_core.targets import HIP

KB = 1024
MB = 1024 * 1024
# registers per thread (VGPRs per lane on AMD) are allocated in multiples of 8: the CUDA
# occupancy calculator's unit, and the VGPR allocation granule of gfx90a/gfx942/gfx950 (LLVM AMDGPU)
REGISTER_UNIT = 8


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model, as the tuner sees it."""

    name: str
    arch: str  # "sm_90", "gfx942": what Target.parse reads
    sm_count: int  # SMs; CUs on AMD
    hbm_bytes_per_s: float
    l2_bytes: int
    smem_per_sm: int  # shared memory (LDS on AMD) a block may use per SM (bytes)
    smem_per_block_max: int  # opt-in maximum per block (bytes)
    regs_per_sm: int  # 32-bit registers (the VGPR file on AMD, per CU)
    max_warps_per_sm: int  # resident warps (wavefronts on AMD)
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
    # -- datasheet, AMD only: FP32 FLOP/s of plain vector instructions (the FP64 vector figure,
    # the same 64 lanes per CU per clock). AMD's "fp32" peak counts packed FP32 (v_pk_fma_f32),
    # twice the rate of the one-value instructions elementwise code issues. None: peak_flops["fp32"].
    unpacked_fp32_flops: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @cached_property  # parsed once: the search space asks for the warp size per candidate
    def target(self) -> Target:
        """The compile target this GPU's arch names (``Target("hip", "gfx942", 64)`` for mi300x)."""
        return Target.parse(self.arch)

    @property
    def warp_size(self) -> int:
        """Threads per warp: 32 on NVIDIA, 64 per wavefront on AMD."""
        return self.target.warp_size

    @property
    def sm_word(self) -> str:
        """What the vendor calls an SM, as refusals name it: "SM", or "CU" (compute unit) on AMD."""
        return "CU" if self.target.backend == HIP else "SM"

    @property
    def smem_limit_words(self) -> str:
        """How the shared-memory limit reads in a refusal: "per block", or "LDS per CU" on AMD."""
        return "LDS per CU" if self.target.backend == HIP else "per block"

    @property
    def alu_flops(self) -> float:
        """FP32 FLOP/s of the elementwise (non-matrix) instructions: what the cost model's ALU term runs at."""
        return self.unpacked_fp32_flops or self.peak_flops["fp32"]

    def dot_flops(self, unit: str) -> float:
        """Peak FLOP/s of the matrix unit for ``unit`` ("fp16", "tf32", ...). A unit this GPU lacks
        (A100's fp8, MI355X's tf32) is charged at the fp32 rate: Triton does not compile such a
        dot there, so the compile gate prunes it; the model only must not fail on it."""
        return self.peak_flops.get(unit, self.peak_flops["fp32"])

    def registers_per_program(self, regs_per_thread: int, num_warps: int) -> int:
        """Registers one program (block) holds: the hardware allocates them per warp (wavefront),
        8 per thread (lane) at a time, so 26 registers per thread take 32."""
        per_thread = REGISTER_UNIT * -(-max(0, regs_per_thread) // REGISTER_UNIT)
        return per_thread * self.warp_size * num_warps

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["peak_flops"] = dict(self.peak_flops)
        out["notes"] = list(self.notes)
        out["target"] = {"backend": self.target.backend, "arch": self.target.arch_name, "warp_size": self.warp_size}
        return out


T = 1e12

# Dense FLOP/s at boost clock. NVIDIA's SFUs give 16 results per SM per clock (CUDA C
# Programming Guide, arithmetic-instruction throughput table); AMD's transcendentals run at a
# quarter of the 64-lane VALU rate, 16 per CU per clock (CDNA3/CDNA4 ISA: an estimate, as the
# datasheets do not give it).
PROFILES: dict[str, GpuProfile] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB) and Ampere GA100 whitepaper; per-SM
    # limits: CUDA C Programming Guide, compute capability 8.0
    "a100": GpuProfile(
        name="a100", arch="sm_80", sm_count=108, hbm_bytes_per_s=2.039e12, l2_bytes=40 * MB,
        smem_per_sm=164 * KB, smem_per_block_max=163 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T},  # no fp8 units
        sfu_ops_per_s=108 * 16 * 1.41e9, launch_overhead_s=3e-6,
        clock_hz=1.41e9, mem_latency_s=700e-9, l2_bytes_per_s=4.5e12, hbm_bytes=80 * 1000**3,
        notes=("A100 SXM4 80 GB",),
    ),
    # NVIDIA L40S datasheet (FLOP/s, 864 GB/s GDDR6, 48 GB; 142 RT cores = 142 SMs, 18,176 CUDA
    # cores / 128); boost clock 2,520 MHz from NVIDIA's L40S product specifications; per-SM
    # limits: CUDA C Programming Guide, compute capability 8.9 (100 KB shared, 48 warps, 24 blocks).
    # L2 96 MB: not on the datasheet (AD102's L2 as CUDA reports it for L40S): estimate.
    "l40s": GpuProfile(
        name="l40s", arch="sm_89", sm_count=142, hbm_bytes_per_s=864e9, l2_bytes=96 * MB,
        smem_per_sm=100 * KB, smem_per_block_max=99 * KB, regs_per_sm=64 * KB, max_warps_per_sm=48,
        max_blocks_per_sm=24,
        peak_flops={"fp32": 91.6 * T, "tf32": 183 * T, "fp16": 362.05 * T, "bf16": 362.05 * T, "fp8": 733 * T},
        sfu_ops_per_s=142 * 16 * 2.52e9, launch_overhead_s=3e-6,
        clock_hz=2.52e9, mem_latency_s=700e-9,
        l2_bytes_per_s=5.0e12,  # estimate (Ada L2 micro-benchmarks)
        hbm_bytes=48 * 1000**3,
        notes=("L40S PCIe 48 GB GDDR6 (the hbm_* fields hold its GDDR6 figures)",),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5) and Hopper architecture whitepaper; per-SM
    # limits: CUDA C Programming Guide, compute capability 9.0
    "h100": GpuProfile(
        name="h100", arch="sm_90", sm_count=132, hbm_bytes_per_s=3.35e12, l2_bytes=50 * MB,
        smem_per_sm=228 * KB, smem_per_block_max=227 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 67 * T, "tf32": 495 * T, "fp16": 989 * T, "bf16": 989 * T, "fp8": 1979 * T},
        sfu_ops_per_s=132 * 16 * 1.98e9, launch_overhead_s=3e-6,
        clock_hz=1.98e9, mem_latency_s=700e-9, l2_bytes_per_s=5.5e12, hbm_bytes=80 * 1000**3,
        notes=("H100 SXM5 80 GB",),
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): H100's compute, 141 GB HBM3e at 4.8 TB/s
    "h200": GpuProfile(
        name="h200", arch="sm_90", sm_count=132, hbm_bytes_per_s=4.8e12, l2_bytes=50 * MB,
        smem_per_sm=228 * KB, smem_per_block_max=227 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 67 * T, "tf32": 495 * T, "fp16": 989 * T, "bf16": 989 * T, "fp8": 1979 * T},
        sfu_ops_per_s=132 * 16 * 1.98e9, launch_overhead_s=3e-6,
        clock_hz=1.98e9, mem_latency_s=700e-9, l2_bytes_per_s=5.5e12, hbm_bytes=141 * 1000**3,
        notes=("H200 SXM 141 GB: H100's compute with HBM3e",),
    ),
    # NVIDIA HGX B200 datasheet, per-GPU column (180 GB HBM3e at 7.7 TB/s; FP32 75 TFLOPS; the
    # tensor figures it prints with sparsity, halved here: TF32 2.2 -> 1.1, FP16/BF16 4.5 -> 2.25,
    # FP8 9 -> 4.5 PFLOPS); per-SM limits: CUDA C Programming Guide, compute capability 10.0.
    # Not on the datasheet, so estimates: 148 SMs and the 126 MB L2 (as CUDA reports them for
    # B200), the 1.98 GHz clock (75 TFLOPS / (148 SMs x 128 FMA lanes x 2)), the L2 bandwidth.
    "b200": GpuProfile(
        name="b200", arch="sm_100", sm_count=148, hbm_bytes_per_s=7.7e12, l2_bytes=126 * MB,
        smem_per_sm=228 * KB, smem_per_block_max=227 * KB, regs_per_sm=64 * KB, max_warps_per_sm=64,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 75 * T, "tf32": 1100 * T, "fp16": 2250 * T, "bf16": 2250 * T, "fp8": 4500 * T},
        sfu_ops_per_s=148 * 16 * 1.98e9, launch_overhead_s=3e-6,
        clock_hz=1.98e9, mem_latency_s=700e-9,
        l2_bytes_per_s=10e12,  # estimate
        hbm_bytes=180 * 1000**3,
        notes=("HGX B200 180 GB (1,000 W)",),
    ),
    # AMD Instinct MI300X datasheet (304 CUs, 2,100 MHz peak engine clock, 192 GB HBM3 at
    # 5.3 TB/s; FP32 vector 163.4 (packed FP32), FP64 vector 81.7, TF32 653.7, FP16/BF16 1,307.4,
    # FP8 2,614.9 TFLOPS dense) and the AMD CDNA 3 white paper; per-CU limits from the ROCm "AMD GPU
    # specifications" table (LDS 64 KiB, VGPR file 512 KiB = 131,072 32-bit registers, L2 4 MiB
    # per XCD = 32 MiB; the 256 MiB Infinity Cache behind it is not modelled) and LLVM's AMDGPU
    # backend (8 waves per SIMD x 4 SIMDs = 32 per CU; 512 VGPRs per lane with the AGPRs).
    # A workgroup holds at most 1,024 work-items (16 wavefronts) and may use the CU's whole LDS.
    # Estimates: max_blocks_per_sm (one wave per workgroup at most fills the 32 wave slots),
    # the launch overhead, the memory latency, and the L2 bandwidth (CDNA 3 white paper: 2 KB
    # per clock per XCD's L2 -> 8 x 2,048 B x 2.1 GHz).
    "mi300x": GpuProfile(
        name="mi300x", arch="gfx942", sm_count=304, hbm_bytes_per_s=5.3e12, l2_bytes=32 * MB,
        smem_per_sm=64 * KB, smem_per_block_max=64 * KB, regs_per_sm=128 * KB, max_warps_per_sm=32,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 163.4 * T, "tf32": 653.7 * T, "fp16": 1307.4 * T, "bf16": 1307.4 * T, "fp8": 2614.9 * T},
        sfu_ops_per_s=304 * 16 * 2.1e9, launch_overhead_s=3e-6,
        clock_hz=2.1e9, mem_latency_s=700e-9, l2_bytes_per_s=8 * 2048 * 2.1e9, hbm_bytes=192 * 1000**3,
        regs_per_thread_max=512, threads_per_block_max=1024, unpacked_fp32_flops=81.7 * T,
        notes=("MI300X OAM 192 GB HBM3 (CDNA 3): CUs as SMs, LDS as shared memory, wavefronts as warps",),
    ),
    # AMD Instinct MI355X datasheet (256 CUs, 2,400 MHz peak engine clock, 288 GB HBM3e at
    # 8 TB/s; FP32 vector 157.3 (packed), FP64 vector 78.6, FP16/BF16 2,516.6, FP8 5,033.2 TFLOPS
    # dense; no TF32 row:
    # CDNA 4 has no TF32 matrix unit) and the AMD CDNA 4 white paper; per-CU limits from the ROCm
    # "AMD GPU specifications" table (LDS 160 KiB, VGPR file 512 KiB, L2 4 MiB per XCD = 32 MiB)
    # and LLVM's AMDGPU backend (32 waves per CU, 512 VGPRs per lane). Estimates as for mi300x.
    "mi355x": GpuProfile(
        name="mi355x", arch="gfx950", sm_count=256, hbm_bytes_per_s=8e12, l2_bytes=32 * MB,
        smem_per_sm=160 * KB, smem_per_block_max=160 * KB, regs_per_sm=128 * KB, max_warps_per_sm=32,
        max_blocks_per_sm=32,
        peak_flops={"fp32": 157.3 * T, "fp16": 2516.6 * T, "bf16": 2516.6 * T, "fp8": 5033.2 * T},  # no tf32 unit
        sfu_ops_per_s=256 * 16 * 2.4e9, launch_overhead_s=3e-6,
        clock_hz=2.4e9, mem_latency_s=700e-9, l2_bytes_per_s=8 * 2048 * 2.4e9, hbm_bytes=288 * 1000**3,
        regs_per_thread_max=512, threads_per_block_max=1024, unpacked_fp32_flops=78.6 * T,
        notes=("MI355X OAM 288 GB HBM3e (CDNA 4): CUs as SMs, LDS as shared memory, wavefronts as warps",),
    ),
}

# The fleet, in a fixed order (by vendor, then generation): what "--target all" compiles for.
FLEET: tuple[str, ...] = ("a100", "l40s", "h100", "h200", "b200", "mi300x", "mi355x")

# torch.cuda.get_device_name() -> profile, exact names only: parts whose figures differ from
# the profile (H100 PCIe / NVL, H200 NVL, A100 40 GB and PCIe, MI350X's lower clock) get no profile.
_DEVICE_NAMES = {
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA L40S": "l40s",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 SXM5 80GB": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA B200": "b200",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI355X": "mi355x",
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
