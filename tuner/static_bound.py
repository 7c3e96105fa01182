"""The static bound of a compiled kernel: the least time its SASS can take on a GPU profile.

NVIDIA only: SASS is what ptxas gives for a cubin, its instructions issued per 32-lane warp. An
AMD kernel (an hsaco) has no SASS count, so :func:`module_bounds` answers None for AMD profiles.

From the compile gate's facts (:class:`fuser_core.codegen.gpu_compile.KernelBuild`, whose
``sass`` is :mod:`fuser_core.codegen.sass`'s count of the cubin) and the launch (programs,
warps, iterations of each innermost loop), four times, each at the profile's rate:

- **memory**: the bytes that must come from HBM over its bandwidth: the bytes the kernel's
  global loads and stores request (each ``LDG``/``STG``'s width x 32 lanes, predicated-off
  lanes counted too: exact for full tiles), at most ``unique_bytes`` (every input read and every
  output written once) when given, since the rest may hit L2 (attention's K and V, read by every
  row block of a head). L2's own rate is not a bound here: it is not known well enough to bound
  by (FlashAttention on an H100 requests ~19 TB/s of K and V from it);
- **issue**: warp instructions over the SMs' issue rate (4 warp instructions per SM per clock:
  one per sub-partition);
- **SFU**: ``MUFU`` operations (one per lane) over the special-function units' rate;
- **tensor**: the multiply-adds of the tensor-core instructions (HGMMA/HMMA shapes; on sm_100,
  whose UTCHMMA/UTCQMMA do not show theirs, the kernel's dots: :func:`dot_macs`) x 2 over the
  peak of their operand type.

The bound is the largest; the kernel cannot run faster than it. Per element (``elements``: what
the kernel processes, e.g. a row's values or attention's scores) it also gives the issued
thread-instructions, exps (``MUFU.EX2``), all special-function ops and input reads, the units the issue tables of issue 22 use.

Iterations: the i-th innermost SASS loop runs ``trips[i]`` times per program; give one number
when every loop runs the same count. Straight-line code runs once.

Example::

    bound = static_bound(build.sass, programs=4096, num_warps=4, trips=[32, 32], profile=get_profile("h100"),
                         elements=4096 * 32768)
    bound["bound"], bound["per_element"]["exp"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fuser_core.codegen.sass import TCGEN05_MMA
from fuser_core.targets import CUDA
from tuner.profiles import GpuProfile

ISSUE_PER_SM_PER_CLOCK = 4  # warp instructions: four sub-partitions, one each per clock
SASS_LANES = 32  # threads per warp instruction in SASS (NVIDIA's warp)
TENSOR_UNITS = {"f16": "fp16", "bf16": "bf16", "tf32": "tf32", "e4m3": "fp8", "e5m2": "fp8", "f32": "tf32",
                "kind_f16": "fp16", "kind_f8f6f4": "fp8", "kind_mxf4": "fp4"}  # the last three: sm_100's (sass.TCGEN05_MMA)
TCGEN05_KINDS = frozenset(TCGEN05_MMA.values())


def _per_warp(sass: Mapping[str, Any], trips: Sequence[float]) -> dict[str, float]:
    """Counts one warp issues in one program: straight-line code once, each loop trips[i] times."""
    total = sass["total"]
    loops = sass.get("loops") or []
    out = {"instructions": float(total["instructions"]), "mufu": _mufu(total), "ex2": _ex2(total), "load_bytes": _bytes(total["load_bits"]),
           "store_bytes": _bytes(total["store_bits"]), "tensor_macs": float(total["tensor_macs"])}
    for i, lp in enumerate(loops):
        extra = float(trips[i] if i < len(trips) else trips[-1]) - 1.0  # once is in the total already (0 trips: -1)
        out["instructions"] += extra * lp["instructions"]
        out["mufu"] += extra * _mufu(lp)
        out["ex2"] += extra * _ex2(lp)
        out["load_bytes"] += extra * _bytes(lp["load_bits"])
        out["store_bytes"] += extra * _bytes(lp["store_bits"])
        out["tensor_macs"] += extra * lp["tensor_macs"]
    return out


def _mufu(counts: Mapping[str, Any]) -> float:
    return float(sum(v for k, v in counts["classes"].items() if k.startswith("mufu.")))


def _ex2(counts: Mapping[str, Any]) -> float:
    return float(counts["classes"].get("mufu.ex2", 0))


def _bytes(widths: Mapping[str, int]) -> float:
    return float(sum(int(bits) // 8 * SASS_LANES * n for bits, n in widths.items()))


def tensor_unit(sass: Mapping[str, Any]) -> str | None:
    """The profile's peak-FLOPs key for the kernel's tensor-core instructions (None: none)."""
    kinds = sass["total"].get("tensor") or {}
    if not kinds:
        return None
    kind = max(kinds, key=kinds.get)
    return TENSOR_UNITS.get(kind.split(".")[-1], "fp16")


def static_bound(sass: Mapping[str, Any], *, programs: int, num_warps: int, trips: Sequence[float] | float,
                 profile: GpuProfile, elements: int | None = None, input_bytes: int | None = None,
                 unique_bytes: int | None = None, tma_bytes: float = 0.0, dot_macs: float = 0.0) -> dict[str, Any]:
    """The four times and the bound (module docstring); ``input_bytes``: the inputs' size, for
    the reads per element; ``unique_bytes``: the minimum traffic (None: all requested bytes
    count as HBM traffic); ``tma_bytes``: what a program loads by TMA (:func:`descriptor_bytes`:
    a ``UTMALDG``'s box is not in its SASS), counted where the SASS has TMA loads; ``dot_macs``:
    what a program's dots multiply-add (:func:`dot_macs`), counted where the SASS has Blackwell's
    tensor-core instructions (their shape is not in it)."""
    trips = [float(trips)] if isinstance(trips, (int, float)) else [float(t) for t in trips] or [1.0]
    w = _per_warp(sass, trips)
    warps = programs * num_warps
    chip = {k: v * warps for k, v in w.items()}
    if sass["total"]["classes"].get("tma"):
        chip["load_bytes"] += tma_bytes * programs
    if any(kind in TCGEN05_KINDS for kind in sass["total"].get("tensor") or {}):
        chip["tensor_macs"] += dot_macs * programs
    unit = tensor_unit(sass)
    requested = chip["load_bytes"] + chip["store_bytes"]
    hbm = requested if unique_bytes is None else min(requested, unique_bytes)
    terms = {
        "memory": hbm / profile.hbm_bytes_per_s,
        "issue": chip["instructions"] / (profile.sm_count * ISSUE_PER_SM_PER_CLOCK * profile.clock_hz),
        "sfu": chip["mufu"] * SASS_LANES / profile.sfu_ops_per_s,
        "tensor": (2 * chip["tensor_macs"] / profile.peak_flops[unit]) if unit and unit in profile.peak_flops else 0.0,
    }
    limiter = max(terms, key=terms.get)
    out: dict[str, Any] = {"terms_s": terms, "bound": limiter, "time_s": terms[limiter],
                           "load_bytes": chip["load_bytes"], "store_bytes": chip["store_bytes"],
                           "warp_instructions": chip["instructions"], "mufu": chip["mufu"],
                           "tensor_macs": chip["tensor_macs"], "tensor_unit": unit}
    if elements:
        out["per_element"] = {
            "instructions": chip["instructions"] * SASS_LANES / elements,  # thread instructions
            "exp": chip["ex2"] * SASS_LANES / elements,  # MUFU.EX2: the exps
            "sfu": chip["mufu"] * SASS_LANES / elements,  # every MUFU op (exps, reciprocals, logs)
            "tensor_macs": chip["tensor_macs"] / elements,
        }
        if input_bytes:
            out["per_element"]["input_reads"] = chip["load_bytes"] / input_bytes
    return out


def loop_trips(plan: Any, loop: Any, shape: Mapping[str, int]) -> float:
    """Iterations of a structure loop (``fuser_core.codegen.ops.Loop``) averaged over the programs:
    a split chunk's share, SPLIT partial states, or, for a loop a mask bounds
    (fuser_core.codegen.bounds), each program's own window of the axis; none for a fallback pass,
    which runs only for rows whose dependency ended +-inf or NaN (a bound is a floor: the rows
    that need it are the exception, and counting it as run charged a bottom-right causal mask
    four times the tensor work of the one it skips)."""
    import sympy as sp

    from fuser_core.codegen.bounds import axis_window
    from fuser_core.codegen.ops import Fold
    from fuser_core.codegen.structure import reads_count
    from fuser_core import dim_symbol, is_dim_symbol, symbol_kind
    from fuser_core import is_selection

    blocks, a = plan.blocks, plan.axis
    full = -(-shape[a] // blocks[a])
    if loop.resident:
        return 1.0
    if loop.span == "contraction":  # a K loop: the dim a block at a time
        return float(-(-shape[loop.dim] // blocks[loop.dim]))
    if loop.span == "fallback":
        return 0.0
    if loop.span == "split":
        return float(plan.config.split)
    if loop.span in ("chunk", "chunk_outputs"):
        chunk = -(-(-(-shape[a] // plan.config.split)) // blocks[a]) * blocks[a]
        full = chunk // blocks[a]
    window = loop.window  # a loop split at its mask knows its part
    if window is None and loop.span in ("axis", "chunk"):
        folds = [(op.op, op.expr) for op in loop.body if isinstance(op, Fold)]
        window = axis_window(a, folds, counts=plan.rules.fused and reads_count(plan),
                             selections=any(is_selection(s.reduce) for s in plan.axis_reductions()))
    if window is None:
        return float(full)
    lanes = sorted({symbol_kind(s)[1] for e in (window.lo, window.hi) if e is not None
                    for s in e.free_symbols if not is_dim_symbol(s, "size")})
    if len(lanes) > 1:
        return float(full)
    sizes = {dim_symbol("size", x): v for x, v in shape.items()}

    def trips(at: Mapping[sp.Symbol, int]) -> int:
        lo = max(0, int(window.lo.subs(at))) // blocks[a] * blocks[a] if window.lo is not None else 0
        hi = min(shape[a], int(window.hi.subs(at))) if window.hi is not None else shape[a]
        return max(0, -(-(hi - lo) // blocks[a]))

    if not lanes:  # the same part for every program (a loop's whole tiles, or its last partial one)
        return min(float(full), float(trips(sizes)))
    d = lanes[0]
    n = -(-shape[d] // blocks[d])
    total = sum(trips({dim_symbol("first", d): i * blocks[d],
                       dim_symbol("last", d): min((i + 1) * blocks[d], shape[d]) - 1, **sizes})
                for i in range(n))
    return min(float(full), total / n)


def loops_with_trips(plan: Any, kernel: Any, shape: Mapping[str, int]) -> list[tuple[Any, tuple[Any, ...], float, bool]]:
    """Each loop of ``kernel`` (a resident one is its body) with the operations directly in it (not
    in a loop it holds), its trips per program times those of the loops holding it (a K loop runs
    its trips per trip of the axis loop around it) and whether it is innermost (holds no loop: the
    loops SASS facts count, :func:`fuser_core.codegen.sass.loops`), in order, outer first."""
    from fuser_core.codegen.ops import Loop

    out: list[tuple[Any, tuple[Any, ...], float, bool]] = []

    def direct(ops: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any]]:
        here, nested = [], []
        for op in ops:
            if isinstance(op, Loop) and not op.resident:
                nested.append(op)
            elif isinstance(op, Loop):
                more, deeper = direct(op.body)
                here += more
                nested += deeper
            else:
                here.append(op)
                more, deeper = direct(tuple(op.children()))
                here += more
                nested += deeper
        return tuple(here), nested

    def visit(loop: Any, outer: float) -> None:
        here, nested = direct(loop.body)
        trips = outer * kernel_loop_trips(plan, kernel, loop, shape)
        out.append((loop, here, trips, not nested))
        for inner in nested:
            visit(inner, trips)

    for loop in direct(kernel.ops)[1]:
        visit(loop, 1.0)
    return out


def innermost_trips(plan: Any, kernel: Any, shape: Mapping[str, int]) -> list[float]:
    """Trips per program of each innermost loop, in order: :func:`static_bound`'s ``trips``."""
    return [trips for _, _, trips, innermost in loops_with_trips(plan, kernel, shape) if innermost] or [1.0]


def kernel_loop_trips(plan: Any, kernel: Any, loop: Any, shape: Mapping[str, int]) -> float:
    """:func:`loop_trips` averaged over ``kernel``'s programs: a loop over the SPLIT partial states
    inside a kernel whose grid is split is the combine the last program of each lane block runs
    (KernelConfig.combine "last_part"), one program in SPLIT."""
    trips = loop_trips(plan, loop, shape)
    return trips / plan.config.split if loop.span == "split" and kernel.grid.split else trips


def descriptor_bytes(plan: Any, kernel: Any, shape: Mapping[str, int]) -> float:
    """Bytes one program of ``kernel`` loads through tensor descriptors (its loads with a
    ``descriptor``: a whole tile each, every trip of their loop), for :func:`static_bound`."""
    import math

    from fuser_core.codegen.ops import Load
    from tuner.analysis import ELEMENT_BYTES

    total = 0.0
    for _, ops, trips, _ in loops_with_trips(plan, kernel, shape):
        tile = sum(math.prod(plan.blocks[d] for d in op.descriptor) * ELEMENT_BYTES[op.dtype]
                   for op in ops if isinstance(op, Load) and op.descriptor)
        total += tile * trips if tile else 0.0
    return total


# tcgen05.mma's smallest tile: 64 rows (cta_group::1), 8 columns, a depth of 32 bytes of operand
TCGEN05_MIN_ROWS, TCGEN05_MIN_COLS, TCGEN05_DEPTH_BYTES = 64, 8, 32


def dot_macs(plan: Any, kernel: Any, shape: Mapping[str, int]) -> float:
    """Multiply-adds one program of ``kernel`` asks the tensor cores for (its ``tl.dot``s, every
    trip of their loop), each dot's tile padded to tcgen05.mma's smallest: for :func:`static_bound`
    on sm_100, whose ``UTCHMMA``/``UTCQMMA`` keep their shape out of the SASS text."""
    from fuser_core.codegen.ops import FP8_DOT

    def up(n: int, step: int) -> int:
        return -(-max(n, 1) // step) * step

    total = 0.0
    for _, ops, trips, _ in loops_with_trips(plan, kernel, shape):
        macs = 0.0
        for op in ops:
            dot = getattr(op, "dot", None)
            if dot is None:
                continue
            depth = TCGEN05_DEPTH_BYTES // (1 if dot.precision == FP8_DOT else 2)
            macs += (up(plan.blocks.get(dot.i, 1), TCGEN05_MIN_ROWS) * up(plan.blocks.get(dot.j, 1), TCGEN05_MIN_COLS)
                     * up(plan.blocks.get(dot.over, 1), depth))
        total += macs * trips if macs else 0.0
    return total


def module_bounds(plan: Any, structure: Any, builds: Sequence[Any], profile: GpuProfile, shape: Mapping[str, int],
                  unique_bytes: int | None = None) -> list[dict[str, Any]] | None:
    """Per kernel of a generated module, its static bound (:func:`static_bound`) from its compile
    facts (``builds``: the compile gate's KernelBuild per kernel, in launch order) and the
    structure's grid and loops; None when a kernel has no SASS facts, as on an AMD profile.
    ``unique_bytes``: the module's minimum traffic, charged to its first kernel."""
    import math

    if profile.target.backend != CUDA:
        return None
    out = []
    for i, (kernel, build) in enumerate(zip(structure.kernels, builds)):
        sass = getattr(build, "sass", None)
        if not sass:
            return None
        programs = math.prod(-(-shape[d] // b) for d, b in kernel.grid.lanes) * (
            plan.config.split if kernel.grid.split else 1)
        trips = innermost_trips(plan, kernel, shape)
        bound = static_bound(sass, programs=programs, num_warps=plan.config.num_warps, trips=trips, profile=profile,
                             unique_bytes=unique_bytes if i == 0 else None,
                             tma_bytes=descriptor_bytes(plan, kernel, shape), dot_macs=dot_macs(plan, kernel, shape))
        out.append({"kernel": kernel.name, "programs": programs, "trips": trips, **bound})
    return out


def load_width(sass: Mapping[str, Any]) -> int | None:
    """The widest global load the hot loop issues (bits), else the kernel's; None: no loads."""
    loops = sass.get("loops") or []
    hot = max(loops, key=lambda lp: lp["instructions"], default=None)
    widths = (hot or sass["total"])["load_bits"] or sass["total"]["load_bits"]
    return max((int(b) for b in widths), default=None)




def min_bytes(spec: Any, shape: Mapping[str, int], dtypes: Mapping[str, str]) -> int:
    """The minimum traffic: every input read once, every output written once."""
    import math

    from fuser_core import output_dtypes
    from tuner.analysis import ELEMENT_BYTES

    total = sum(math.prod(shape[d] for d in i.dims) * ELEMENT_BYTES[dtypes[i.name]] for i in spec.inputs)
    for part, dt in output_dtypes(spec, dict(dtypes)).items():
        total += math.prod(shape[d] for d in spec.step(part.split(".")[0]).dims) * ELEMENT_BYTES[dt]
    return total


# the last few problem_bounds answers, by the identity of their arguments (each held, so no id is
# reused while its entry lives): a gated trial asks twice for one verdict, the cost model's issued
# counts and the model measurer's static floor, and the plan and structure are the cost
_BOUNDS: dict[tuple, tuple[tuple, list[dict[str, Any]] | None]] = {}
_BOUNDS_KEPT = 16


def problem_bounds(problem: Any, derivation: Any, strategy: str, config: Any, builds: Sequence[Any],
                   profile: GpuProfile) -> list[dict[str, Any]] | None:
    """:func:`module_bounds` of the module generated for (``problem``, ``strategy``, ``config``: a
    KernelConfig) from its compiled kernels ``builds``, the problem's minimum traffic charged once;
    None without SASS facts."""
    from fuser_core.codegen.plan import make_plan
    from fuser_core.codegen.structure import build_structure

    held = (problem, derivation, builds, profile)
    key = (*map(id, held), strategy, repr(config.to_dict()))
    if key in _BOUNDS:
        return _BOUNDS[key][1]
    plan = make_plan(problem.spec, derivation, strategy, problem.shape, config)
    structure = build_structure(plan, problem.dtypes, problem.output_dtypes)
    out = module_bounds(plan, structure, builds, profile, problem.shape,
                        min_bytes(problem.spec, problem.shape, problem.dtypes))
    if len(_BOUNDS) >= _BOUNDS_KEPT:
        del _BOUNDS[next(iter(_BOUNDS))]  # the oldest
    _BOUNDS[key] = (held, out)
    return out


__all__ = ["ISSUE_PER_SM_PER_CLOCK", "descriptor_bytes", "dot_macs", "innermost_trips", "kernel_loop_trips", "load_width", "loop_trips", "loops_with_trips", "min_bytes",
           "module_bounds", "problem_bounds", "static_bound", "tensor_unit"]
