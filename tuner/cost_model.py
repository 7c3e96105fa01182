"""An analytical cost model: the time a candidate would take on a GPU profile.

For machines without a GPU the ``model`` measurer predicts instead of timing. The model is a
roofline with the three things that decide these kernels' speed on a real GPU, each term
simple, monotone and explainable (numbers in ``Prediction.details``):

1. **Bytes from HBM** (:func:`_KernelEvaluator.evaluate`). Every input is read once per pass
   that loads it (multi_pass: once per reduction, plus once more for outputs that keep the
   axis; streaming_fused: once, plus that second pass; row_resident: once; split_fused: once
   for the partial states, the workspace written and read back, and the combine kernel's
   second pass). An input that lacks a tiled lane dim (attention's K/V lack ``m``; a GEMM's W
   lacks ``m``) is requested by every program along that dim; those re-reads, and the re-reads
   of later passes, come from L2 when their *reuse distance* (bytes requested by all programs
   between two reads of the same line) fits in the usable L2, else from HBM. Outputs are
   written once.
2. **Work** (:mod:`tuner.analysis`): ``tl.dot`` FLOPs (2*M*N*K) at the tensor-core peak of the
   precision emit chose (fp16 inputs: fp16; bf16: bf16, at fp16's rate; mixed/fp32: IEEE fp32 on CUDA cores),
   elementwise ops from the sympy expressions (+, *, /, compares, selects: 1 ALU op per
   element at each node's own dims; exp/log/sqrt/rsqrt: one SFU op), reductions, top-k merges,
   corrections, address/mask arithmetic of every loaded element, and loop overhead.
3. **Parallelism**: occupancy (blocks per SM from registers, shared memory, warps), wave
   quantisation (``programs / (SMs x blocks per SM)`` waves; a partial last wave runs only its
   programs), and bandwidth that grows with the bytes each SM keeps in flight (Little's law:
   tile bytes x num_stages per program, with a soft knee).

4. **Compile facts** (when the compile gate, :mod:`tuner.compile_gate`, compiled the candidate):
   occupancy uses the compiler's registers per thread and shared bytes per program instead of
   the estimates (blocks per SM = min(regs_per_sm / registers per program, smem_per_sm / shared,
   max_warps / warps, max_blocks)), and a kernel that spills pays an estimated local-memory
   traffic: spill bytes per thread x 2 (stored and loaded) x threads x programs x iterations of
   its longest loop, through L2, and from HBM as far as the resident programs' spilled bytes
   miss L2. It is an estimate (ptxas' spill placement is not known: a spill outside the loop
   costs far less), meant to rank a spilling candidate below an equal one that does not spill.

A kernel's time is ``launch + sum over waves of max(memory time, compute time)`` (the sum when
nothing hides the one behind the other: one program per SM and no pipelining);
split_fused launches two kernels. :func:`tuner.chain_cost.predict_chain` models the unfused chain the same way
(one kernel per reduction, intermediates written to and read from memory in float32).

Example:
    >>> from fuser_core.catalog import load_catalog_spec
    >>> from fuser_core.derive import derive_cascade
    >>> from tuner.profiles import get_profile
    >>> from fuser_core.problem import make_problem
    >>> from tuner.space import SearchSpace
    >>> from fuser_core.codegen.strategies import STREAMING_FUSED
    >>> spec = load_catalog_spec("safe_softmax")
    >>> d, h100 = derive_cascade(spec), get_profile("h100")
    >>> problem = make_problem(spec, {"m": 4096, "n": 32768}, "float16")
    >>> space = SearchSpace(problem, d, h100)
    >>> c = space.candidate(STREAMING_FUSED.name, {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 3})
    >>> p = predict(problem, d, c, h100)
    >>> p.programs, p.details["kernels"][0]["bound"]
    (4096, 'memory (HBM)')
    >>> 512 <= p.bytes / 2**20 <= 768  # x read (its second pass, for y, partly from L2), y written
    True
    >>> p.time_s > p.bytes / h100.hbm_bytes_per_s
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fuser_core.codegen.gpu_compile import KernelBuild
from fuser_core.codegen.ops import FP8_DOT
from fuser_core.codegen.plan import KernelConfig, parallel_combine
from fuser_core.derive import Derivation
from fuser_core.problem import Problem
from fuser_core.spec import Spec
from tuner.analysis import (
    ELEMENT_BYTES,
    ITERATION_ALU,
    Anatomy,
    KernelSketch,
    Pass,
    cdiv,
    elements,
    input_info,
    pass_iterations,
    resources,
)
from tuner.compile_gate import CompileVerdict, kernel_facts_for
from tuner.profiles import GpuProfile
from tuner.static_bound import ISSUE_PER_SM_PER_CLOCK, SASS_LANES

if TYPE_CHECKING:  # chain imports the code generator's modules: loaded only when the chain is modelled
    pass

HBM_EFFICIENCY = 0.92  # best fraction of the datasheet bandwidth a streaming kernel reaches
DOT_EFFICIENCY = 0.75  # fraction of tensor-core peak a Triton tl.dot loop reaches
ISSUE_EFFICIENCY = 0.45  # fraction of the issue rate compiled code reaches (chosen: benchmarks/model_calibration.py)
ALU_EFFICIENCY = 0.8  # fraction of the vector-ALU issue rate (CUDA cores, AMD's SIMDs) reached by elementwise code
L2_USABLE = 0.5  # fraction of L2 that holds data for reuse (H100/A100 split L2 in two partitions)
SM_BYTES_PER_CLOCK = 64  # what one SM (CU) can take from L2 per clock
WARPS_TO_FILL_ALU = 8  # resident warps per SM for the CUDA cores to be busy (latency hiding)
WARPS_TO_FILL_DOT = 4  # one warp per SM sub-partition (one wavefront per SIMD of a CU) for the matrix units
SPILL_ACCESSES = 2  # a spilled byte is written to local memory and read back (per loop iteration)
PRECISION_UNIT = {"float16": "fp16", "bfloat16": "fp16", "tf32": "tf32", "ieee": "fp32"}


def dot_unit(precision: str, profile: GpuProfile) -> str:
    """The matrix unit a tl.dot of this precision runs on: an fp8 dot on the fp8 units where the
    target multiplies e4m3 in hardware, else on fp16's (its exact fallback, codegen.helpers.fp8_operand)."""
    if precision == FP8_DOT:
        return "fp8" if profile.target.fp8_native else "fp16"
    return PRECISION_UNIT.get(precision, precision)


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one candidate (or the chain). ``details`` explains it per kernel."""

    time_s: float
    bytes: float  # from/to HBM, all kernels
    flops: float  # tl.dot FLOPs + elementwise ops (ALU + SFU), all kernels
    programs: int  # of the first (main) kernel
    waves: float  # programs / (SMs x blocks per SM), first kernel
    occupancy: float  # resident warps / max warps per SM, first kernel
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def time_ms(self) -> float:
        return self.time_s * 1e3

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "bytes": self.bytes, "flops": self.flops, "programs": self.programs,
                "waves": self.waves, "occupancy": self.occupancy, "details": self.details}


# ---------------------------------------------------------------------- one kernel's numbers


@dataclass
class KernelLoad:
    """Totals of one launched kernel, what :func:`kernel_time` turns into seconds."""

    name: str
    programs: int
    num_warps: int
    num_stages: int
    looped: bool  # has a loop whose loads num_stages can pipeline
    regs: int
    smem: int
    hbm_bytes: float
    l2_bytes: float  # requested from L2 (hits and misses)
    alu: float  # element operations on CUDA cores
    sfu: float  # special-function operations
    dot_flops: dict[str, float]  # precision -> FLOPs
    bytes_in_flight: float  # per program (loads issued ahead of use)
    notes: dict[str, Any] = field(default_factory=dict)
    # what the compiled kernel issues, all programs (tuner.static_bound.static_bound's
    # "warp_instructions", "mufu", "tensor_macs"); None: the model's own estimates (alu, sfu) count
    issued: Mapping[str, float] | None = None


def miss_fraction(distance_bytes: float, profile: GpuProfile) -> float:
    """Share of re-reads that miss L2, from the reuse distance (bytes requested by everyone
    between two reads of a line): ``1 - exp(-distance / usable L2)``. A smooth stand-in for
    LRU's step (hashed sets, two partitions and imprecise timing blur the step on a real GPU):
    a distance of a tenth of the usable L2 misses 10%, one usable L2 63%, three 95%."""
    if distance_bytes <= 0:
        return 0.0
    return 1.0 - math.exp(-distance_bytes / (profile.l2_bytes * L2_USABLE))


def saturation(x: float) -> float:
    """Little's law with a soft knee: fraction of peak bandwidth for x = in flight / (bw x latency)."""
    return 1.0 - math.exp(-x) if x > 0 else 0.0


def blocks_per_sm(k: KernelLoad, profile: GpuProfile) -> int:
    """Occupancy: programs one SM holds, limited by warps, registers, shared memory, blocks."""
    limits = [
        profile.max_blocks_per_sm,
        profile.max_warps_per_sm // k.num_warps,
        profile.regs_per_sm // max(1, profile.registers_per_program(k.regs, k.num_warps)),
        profile.smem_per_sm // max(1, k.smem),
    ]
    return max(1, min(limits))


def kernel_time(k: KernelLoad, profile: GpuProfile) -> tuple[float, dict[str, Any]]:
    """Seconds for one kernel: launch + full waves + the partial last wave."""
    S = profile.sm_count
    bps = blocks_per_sm(k, profile)
    slots = S * bps
    P = max(1, k.programs)
    per = {  # per program
        "hbm": k.hbm_bytes / P, "l2": k.l2_bytes / P, "alu": k.alu / P, "sfu": k.sfu / P,
        "dot": {prec: f / P for prec, f in k.dot_flops.items()},
        "instructions": (k.issued or {}).get("warp_instructions", 0.0) / P, "mufu": (k.issued or {}).get("mufu", 0.0) / P,
    }
    issue_peak = ISSUE_PER_SM_PER_CLOCK * profile.clock_hz  # warp instructions/s per SM
    sm_bw = SM_BYTES_PER_CLOCK * profile.clock_hz
    alu_rate = profile.alu_flops / 2 / S * ALU_EFFICIENCY  # instructions/s per SM (FMA = 2 FLOPs)
    sfu_rate = profile.sfu_ops_per_s / S

    def wave(n: int) -> dict[str, float]:
        busiest = cdiv(n, S)  # programs on the busiest SM
        warps = busiest * k.num_warps
        t_hbm = n * per["hbm"] / (profile.hbm_bytes_per_s * HBM_EFFICIENCY)  # the HBM roofline
        t_l2 = n * per["l2"] / profile.l2_bytes_per_s  # every request passes L2
        in_flight = busiest * k.bytes_in_flight  # Little's law on the busiest SM
        t_sm = busiest * per["l2"] / (sm_bw * max(1e-9, saturation(in_flight / (sm_bw * profile.mem_latency_s))))
        t_dot = sum(busiest * f / (profile.dot_flops(dot_unit(prec, profile)) / S * DOT_EFFICIENCY
                                   * min(1.0, warps / WARPS_TO_FILL_DOT)) for prec, f in per["dot"].items())
        fill = min(1.0, warps / WARPS_TO_FILL_ALU)
        hidden = (k.looped and k.num_stages > 1) or busiest >= 2
        if k.issued is None:
            t_cuda = max(busiest * per["alu"] / (alu_rate * fill), busiest * per["sfu"] / (sfu_rate * fill))
        else:  # the compiled kernel's own counts: every instruction it issues, every MUFU op
            # overlapped with memory, warps waiting on loads leave issue slots empty (ISSUE_EFFICIENCY);
            # a compute phase that follows its loads (nothing hides one behind the other) issues
            # independent element work at the full rate: its waits are the memory term already
            rate = issue_peak * (ISSUE_EFFICIENCY if hidden else 1.0)
            t_cuda = max(busiest * per["instructions"] / (rate * fill),
                         busiest * per["mufu"] * SASS_LANES / (sfu_rate * fill))
        t_mem, t_comp = max(t_hbm, t_l2, t_sm), t_dot + t_cuda  # tensor and CUDA cores take turns
        t = max(t_mem, t_comp) if hidden else t_mem + t_comp
        return {"t": t, "hbm": t_hbm, "l2": t_l2, "sm": t_sm, "dot": t_dot, "cuda": t_cuda, "overlap": hidden}

    full, rest = divmod(P, slots)
    parts = ([(full, wave(slots))] if full else []) + ([(1, wave(rest))] if rest else [])
    body = sum(count * w["t"] for count, w in parts)
    main = parts[0][1]
    terms = {"memory": max(main["hbm"], main["l2"], main["sm"]), "compute": main["dot"] + main["cuda"]}
    bound = max(terms, key=terms.get)
    if bound == "memory":
        names = {main["hbm"]: "memory (HBM)", main["l2"]: "memory (L2)", main["sm"]: "memory (bytes in flight)"}
        bound = names[terms["memory"]]
    details = {
        "time_s": profile.launch_overhead_s + body, "launch_s": profile.launch_overhead_s,
        "programs": P, "blocks_per_sm": bps, "waves": P / slots,
        "wave_quantisation": math.ceil(P / slots) / (P / slots),
        "occupancy": bps * k.num_warps / profile.max_warps_per_sm, "regs_per_thread": k.regs, "smem_bytes": k.smem,
        "hbm_bytes": k.hbm_bytes, "l2_bytes": k.l2_bytes, "alu_ops": k.alu, "sfu_ops": k.sfu,
        "dot_flops": dict(k.dot_flops), "bytes_in_flight_per_program": k.bytes_in_flight,
        "issued": dict(k.issued) if k.issued is not None else None,
        "bound": bound, "first_wave_terms_s": {x: main[x] for x in ("hbm", "l2", "sm", "dot", "cuda")},
        **k.notes,
    }
    return profile.launch_overhead_s + body, details


# ---------------------------------------------------------------------- sketches -> loads


@dataclass
class _Layout:
    """How a kernel's programs are laid out: lanes (slowest to fastest), loop axis, split."""

    shape: Mapping[str, int]
    blocks: Mapping[str, int]
    lanes: tuple[str, ...]
    axis: str | None
    split: int = 1

    def nblk(self, d: str) -> int:
        return cdiv(self.shape[d], self.blocks.get(d, 1))

    @property
    def lane_programs(self) -> int:
        return math.prod(self.nblk(d) for d in self.lanes)

    def stride(self, d: str) -> int:
        """Programs between neighbours along lane d (the last lane is the fastest)."""
        i = self.lanes.index(d)
        return math.prod(self.nblk(x) for x in self.lanes[i + 1:])


class _KernelEvaluator:
    """Bytes, operations and bytes in flight of one kernel sketch."""

    def __init__(self, inputs: Mapping[str, tuple[tuple[str, ...], int]], stores: Mapping[str, int],
                 layout: _Layout, config: KernelConfig, profile: GpuProfile, cache: dict | None = None):
        self.cache = {} if cache is None else cache  # resources per (sketch, blocks, warps, stages)
        self.inputs = inputs  # loadable name -> (dims, bytes per element)
        self.stores = stores  # output part -> bytes per element
        self.L = layout
        self.config = config
        self.profile = profile

    def footprint(self, dims) -> int:
        return math.prod(self.L.shape[d] for d in dims)

    def evaluate(self, sketch: KernelSketch, earlier: Mapping[str, float] | None = None,
                 earlier_bytes: float = 0.0, compiled: KernelBuild | None = None,
                 issued: Mapping[str, float] | None = None) -> KernelLoad:
        """``earlier``: names read or written by earlier kernels -> bytes requested since (their
        reuse distance); ``earlier_bytes``: bytes requested by the earlier kernels (the workspace's);
        ``compiled``: the compiler's facts for this kernel, which replace the estimated registers
        and shared memory and add the spills' local-memory traffic; ``issued``: what its SASS issues
        (tuner.static_bound), which replaces the estimated ALU and SFU work."""
        L, c, prof = self.L, self.config, self.profile
        split_grid = sketch.grid == "lanes x split"
        programs = L.lane_programs * (L.split if split_grid else 1)
        key = (id(sketch), tuple(sorted(L.blocks.items())), c.num_warps, c.num_stages)
        r = self.cache.get(key)
        if r is None:
            r = self.cache[key] = resources(sketch, self.inputs, L.axis, L.blocks, c.num_warps, c.num_stages,
                                            prof.target)
        regs, smem, spill = r.regs_per_thread, r.smem_bytes, 0
        if compiled is not None and compiled.registers is not None:
            regs, smem, spill = compiled.registers, compiled.shared_bytes or 0, compiled.spill_bytes or 0
        looped = any(p.loop in ("axis", "chunk", "split") and pass_iterations(p, L.axis, L.shape, L.blocks, L.split) > 1
                     for p in sketch.passes) if L.axis else False
        probe = KernelLoad(sketch.name, programs, c.num_warps, c.num_stages, looped, regs, smem, 0, 0, 0, 0, {}, 0)
        concurrent = min(programs, prof.sm_count * blocks_per_sm(probe, prof))

        alu = sfu = 0.0
        dots: dict[str, float] = {}
        passes: list[dict[str, Any]] = []
        for p in sketch.passes:
            it = pass_iterations(p, L.axis, L.shape, L.blocks, L.split) if L.axis else 1
            for dims, (a, s) in p.ops.items():
                n = elements(dims, L.blocks) * it * programs
                alu += a * n
                sfu += s * n
            for d in p.dots:
                dots[d.precision] = dots.get(d.precision, 0.0) + 2.0 * elements(d.dims, L.blocks) * it * programs
            if p.loop != "once":
                alu += ITERATION_ALU * prof.warp_size * c.num_warps * it * programs
            passes.append(self.pass_traffic(p, it, programs, split_grid))

        # HBM: the first read of each input, and re-reads that miss L2
        request_per_program = sum(x["requested"] for x in passes) / programs
        hbm = l2 = 0.0
        first_seen: set[str] = set()
        for x in passes:
            pass_miss = miss_fraction(concurrent * x["requested"] / programs, prof)
            for name, fp, reuse, dist in x["reads"]:
                prog_miss = 0.0
                if reuse > 1:
                    prog_miss = 0.0 if dist < concurrent else miss_fraction(dist * request_per_program, prof)
                once = fp * (1 + (reuse - 1) * prog_miss)
                if name in first_seen:
                    hbm += once * pass_miss
                else:
                    first_seen.add(name)
                    hbm += once * (miss_fraction(earlier[name], prof) if earlier and name in earlier else 1.0)
                l2 += fp * reuse
            for _, written in x["writes"]:
                hbm += written
                l2 += written
            if x["ws_read"]:
                hbm += x["ws_read"] * miss_fraction(earlier_bytes, prof)
                l2 += x["ws_requested"]
        ws_written = 0.0
        for dims in sketch.ws_stores:
            ws_written += L.split * self.footprint(dims) * 4
        hbm += ws_written
        l2 += ws_written

        spill_l2 = spill_hbm = 0.0
        if spill:
            # An estimate: every spilled byte is stored and loaded back once per iteration of the
            # kernel's longest loop, by every thread of every program; local memory goes through
            # L1 to L2, and to HBM as far as the resident programs' spill footprint misses L2.
            longest = max((pass_iterations(p, L.axis, L.shape, L.blocks, L.split) if L.axis else 1
                           for p in sketch.passes), default=1)
            threads = prof.warp_size * c.num_warps
            spill_l2 = SPILL_ACCESSES * spill * threads * programs * max(1, longest)
            spill_hbm = spill_l2 * miss_fraction(spill * threads * concurrent, prof)
            l2 += spill_l2
            hbm += spill_hbm

        # bytes in flight per program: loads issued ahead (num_stages tiles in loops), weighted
        # over the passes by their bytes (a harmonic mean: the time each pass takes to stream)
        weights = [(x["requested"], x["in_flight"]) for x in passes if x["requested"] > 0 and x["in_flight"] > 0]
        total = sum(w for w, _ in weights)
        in_flight = total / sum(w / f for w, f in weights) if weights else 1.0
        notes: dict[str, Any] = {"passes": [p.loop for p in sketch.passes], "ws_bytes": ws_written,
                                 "compiled": compiled is not None and compiled.registers is not None,
                                 "spill_bytes": spill, "spill_l2_bytes": spill_l2, "spill_hbm_bytes": spill_hbm}
        return KernelLoad(sketch.name, programs, c.num_warps, c.num_stages, looped, regs, smem,
                          hbm, l2, alu, sfu, dots, in_flight, notes, issued)

    def pass_traffic(self, p: Pass, it: int, programs: int, split_grid: bool) -> dict[str, Any]:
        L = self.L
        reads, requested, tile_bytes = [], 0.0, 0.0
        for name in p.loads:
            dims, size = self.inputs[name]
            fp = self.footprint(dims) * size
            missing = [d for d in L.lanes if d not in dims]
            reuse = math.prod(L.nblk(d) for d in missing)
            dist = min((L.stride(d) for d in missing), default=0)
            streamed_by_split = p.loop == "chunk" and L.axis in dims
            if split_grid and not streamed_by_split:
                reuse *= L.split  # every part re-reads what does not depend on its chunk
                dist = dist or L.lane_programs
            reads.append((name, fp, reuse, dist))
            requested += fp * reuse
            if L.axis is None or L.axis in dims or it == 1:
                tile_bytes += elements(dims, L.blocks) * size
        ws_read = 0.0
        for dims in p.ws_loads:
            ws_read += L.split * self.footprint(dims) * 4
            tile_bytes += elements(dims, L.blocks) * 4
        # a combine kernel with SPLIT programs per lane block reads every part in each: the
        # workspace leaves HBM once (ws_read), L2 serves it SPLIT times
        ws_requested = ws_read * (L.split if split_grid else 1)
        requested += ws_requested
        writes = [(part, self.footprint(dims) * self.stores.get(part, 4)) for part, dims in p.stores]
        depth = self.config.num_stages if p.loop in ("axis", "chunk") and it > 1 else 1
        return {"reads": reads, "requested": requested, "writes": writes, "ws_read": ws_read,
                "ws_requested": ws_requested, "in_flight": tile_bytes * depth}


# ---------------------------------------------------------------------- fused candidates


class _Model:
    """Everything about one bound problem that does not depend on the candidate."""

    def __init__(self, problem: Problem, derivation: Derivation):
        spec = problem.spec
        self.problem = problem
        self.spec = spec
        self.derivation = derivation
        self.shape = dict(problem.shape)  # bound once, by make_problem
        self.dtypes = dict(problem.dtypes)
        self.anatomy = Anatomy(spec, derivation, self.dtypes)
        self.inputs = input_info(spec, self.dtypes)
        self.stores = {p: ELEMENT_BYTES[d] for p, d in problem.output_dtypes.items()}
        self.resource_cache: dict = {}  # sketches live in self.anatomy's cache, so their ids are stable

    def predict(self, strategy: str, config: KernelConfig, profile: GpuProfile,
                compiled: CompileVerdict | None = None) -> Prediction:
        an = self.anatomy
        blocks = an.full_blocks(config.blocks, self.shape)
        layout = _Layout(self.shape, blocks, an.lanes, an.axis, config.split)
        if len(self.resource_cache) > 50_000:
            self.resource_cache.clear()
        ev = _KernelEvaluator(self.inputs, self.stores, layout, config, profile, self.resource_cache)
        loads: list[KernelLoad] = []
        touched: dict[str, float] = {}  # name -> requested bytes before the kernel that last read it
        done = 0.0
        sketches = an.kernels(strategy, blocks, parallel_combine(strategy, an.lanes, self.shape, blocks), config.per_lane,
                              an.contraction_loops(blocks, self.shape))
        issued = self.issued(strategy, config, compiled, profile)
        for kernel, built in zip(sketches, kernel_facts_for([k.name for k in sketches], compiled)):
            load = ev.evaluate(kernel, {n: done - at for n, at in touched.items()}, done, built, issued.get(kernel.name))
            loads.append(load)
            for p in kernel.passes:
                for name in p.loads:
                    touched[name] = done
            done += load.l2_bytes
        # a combine in the part kernel's launch (KernelConfig.combine "last_part") runs the same merge,
        # by the last program of each lane block: one launch fewer
        launches = len(loads) - (1 if config.combine == "last_part" else 0)
        return _combine(loads, profile, {"strategy": strategy, "config": config.to_dict(), "blocks": blocks}, launches)


    def issued(self, strategy: str, config: KernelConfig, compiled: CompileVerdict | None,
               profile: GpuProfile) -> dict[str, dict[str, float]]:
        """Per kernel name, what its SASS issues at this shape (every loop's body times its
        trips); empty without SASS facts (no compile, or an AMD target)."""
        if compiled is None or not compiled.kernels or not all(k.ok and k.sass for k in compiled.kernels):
            return {}
        from tuner.static_bound import problem_bounds

        bounds = problem_bounds(self.problem, self.derivation, strategy, config, compiled.kernels, profile)
        return {b["kernel"]: {x: b[x] for x in ISSUED_FIELDS} for b in bounds or []}


#: what a kernel's SASS issues, all programs together (tuner.static_bound.static_bound's fields)
ISSUED_FIELDS = ("warp_instructions", "mufu", "tensor_macs")


def _combine(loads: list[KernelLoad], profile: GpuProfile, extra: dict[str, Any],
             launches: int | None = None) -> Prediction:
    """The kernels' times summed; ``launches``: how many launches they take (default: one each)."""
    kernels = []
    for load in loads:
        _, det = kernel_time(load, profile)
        kernels.append({"kernel": load.name, **det})
    first = kernels[0]
    flops = sum(k["alu_ops"] + k["sfu_ops"] + sum(k["dot_flops"].values()) for k in kernels)
    details = {**extra, "target": profile.name, "predicted": True, "kernels": kernels}
    fewer = len(kernels) - (len(kernels) if launches is None else launches)
    return Prediction(
        time_s=sum(k["time_s"] for k in kernels) - fewer * profile.launch_overhead_s,
        bytes=sum(k["hbm_bytes"] for k in kernels), flops=flops,
        programs=first["programs"], waves=first["waves"], occupancy=first["occupancy"], details=details,
    )


_MODELS: dict[tuple, tuple[Spec, Derivation, _Model]] = {}


def _model(problem: Problem, derivation: Derivation) -> _Model:
    """Per-problem analysis, cached (a search predicts thousands of candidates)."""
    spec = problem.spec
    key = (id(spec), id(derivation), tuple(sorted(problem.shape.items())), tuple(sorted(problem.dtypes.items())))
    hit = _MODELS.get(key)
    if hit is None or hit[0] is not spec or hit[1] is not derivation:
        if len(_MODELS) > 64:
            _MODELS.clear()
        hit = (spec, derivation, _Model(problem, derivation))
        _MODELS[key] = hit
    return hit[2]


def predict(problem: Problem, derivation: Derivation, candidate: Any, profile: GpuProfile,
            compiled: CompileVerdict | None = None) -> Prediction:
    """Predicted time of a fused candidate (a :class:`tuner.space.Candidate`) on ``profile``;
    ``compiled``: the compile gate's verdict on it, whose registers, shared memory and spills
    replace the model's estimates (see the module docstring, item 3)."""
    return _model(problem, derivation).predict(candidate.strategy, candidate.config, profile, compiled)


def exhaustive_best(space: Any, strategies: Any = None) -> tuple[Any, Prediction, int]:
    """(best candidate, its prediction, candidates tried) over every feasible candidate of a
    :class:`tuner.space.SearchSpace` (the exhaustive optimum the search is compared with)."""
    best: tuple[Any, Prediction] | None = None
    count = 0
    for c in space.enumerate(strategies):
        count += 1
        p = predict(space.problem, space.derivation, c, space.profile)
        if best is None or p.time_s < best[1].time_s:
            best = (c, p)
    if best is None:
        raise ValueError("no feasible candidate")
    return best[0], best[1], count


# ---------------------------------------------------------------------- any compiled kernel


def predict_compiled(kernels: Sequence[Mapping[str, Any]], profile: GpuProfile,
                     unique_bytes: int | None = None, name: str = "compiled") -> Prediction:
    """Predicted time of kernels known only by their compiled code (an expert's: Liger's, a
    tutorial's, the split-KV decoder), the same :func:`kernel_time` as Foldwise's candidates
    with every number read off the SASS. ``kernels``: per launch, in order, ``build`` (a
    :class:`KernelBuild` with SASS facts), ``programs``, ``num_warps`` and ``trips`` (per
    innermost loop, as :func:`tuner.static_bound.static_bound` takes them). What the SASS cannot
    tell, the model assumes: the bytes the loads request all come from HBM, at most
    ``unique_bytes`` for the first kernel (every input read once: the rest hits L2), and a
    program keeps one iteration of its hottest loop in flight (num_stages of them when the
    compiler pipelines it)."""
    from tuner.static_bound import static_bound

    loads = []
    for i, k in enumerate(kernels):
        build = k["build"]
        if not build.ok or not build.sass:
            raise ValueError(f"{build.kernel}: no SASS facts ({build.error or 'not compiled for NVIDIA'})")
        trips = [float(t) for t in k["trips"]] or [1.0]
        bound = static_bound(build.sass, programs=k["programs"], num_warps=k["num_warps"], trips=trips, profile=profile,
                             unique_bytes=unique_bytes if i == 0 else None)
        requested = bound["load_bytes"] + bound["store_bytes"]
        hbm = requested if unique_bytes is None or i else min(requested, unique_bytes)
        loops = build.sass.get("loops") or []
        looped = bool(loops) and max(trips) > 1
        stages = build.num_stages or 1
        hot = max(loops, key=lambda lp: lp["instructions"]) if looped else build.sass["total"]
        in_flight = sum(int(b) // 8 * SASS_LANES * n for b, n in hot["load_bits"].items()) * k["num_warps"]
        in_flight *= stages if looped else 1
        unit = bound["tensor_unit"]
        dots = {unit: 2.0 * bound["tensor_macs"]} if unit else {}
        issued = {x: bound[x] for x in ISSUED_FIELDS}
        loads.append(KernelLoad(build.kernel, k["programs"], k["num_warps"], stages, looped, build.registers or 0,
                                build.shared_bytes or 0, hbm, requested, 0.0, 0.0, dots, max(1.0, in_flight),
                                {"from": "SASS"}, issued))
    return _combine(loads, profile, {"strategy": name})
