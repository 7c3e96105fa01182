"""Operations that set a kernel up and bring values in: comments, program ids, offsets, chunks,
loads and gathers, loops, initial states, counts, copies and plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp

from fuser_core.codegen.names import FP8, TMA_LOADS, WIDE_OFFSETS, safe_name
from fuser_core.codegen.ops.base import Env, Op, block_params, env_reads, expr_helpers, tile_reads
from fuser_core.codegen.ops.bounds import Bound, bound_names


@dataclass(frozen=True, kw_only=True)
class Comment(Op):
    """``text`` as a comment line; with ``bounds``, its ``{}`` fields are those bounds as printed."""

    text: str
    bounds: tuple[Bound, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Program(Op):
    """The program ids of the lane dims (slowest first): ``pid_d`` for a lane in a tile, ``offs_d`` for
    a lane with block 1 (one program per index: its offset, a scalar; set up only where read)."""

    lanes: tuple[str, ...]
    tile: frozenset[str]  # lanes in a tile
    used: frozenset[str]  # scalar lanes whose offset some operation reads
    name: str = "pid"

    def reads(self) -> set[str]:
        return {x for d in self.lanes[1:] for x in (f"size_{d}", f"BLOCK_{d}")} | ({WIDE_OFFSETS} if self.used else set())


@dataclass(frozen=True, kw_only=True)
class Offsets(Op):
    """``offs_d = [base +] tl.arange(0, BLOCK_d)`` and, with ``mask``, ``mask_d = offs_d < size_d``;
    ``base``: ``pid`` (a lane: ``pid_d * BLOCK_d``), ``start`` (the loop's tile), ``start_d`` (a
    K loop's tile: :attr:`KernelPlan.contraction_loops`) or none. ``inside``:
    the tile lies inside the dim (a loop that stops at a tile boundary at or below ``size_d``), so
    its mask is a constant true the compiler folds away (unpredicated, full-width loads)."""

    dim: str
    base: str = ""
    mask: bool = True
    inside: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"offs_{self.dim}"

    @property
    def dims(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.dim,)

    def reads(self) -> set[str]:
        d = self.dim
        out = {f"BLOCK_{d}", WIDE_OFFSETS} | ({f"size_{d}", self.name} if self.mask and not self.inside else set())  # the mask reads the offsets
        return out | ({f"pid_{d}"} if self.base == "pid" else {self.base} if self.base else set())


@dataclass(frozen=True, kw_only=True)
class Chunk(Op):
    """``lo``: the first index of this program's chunk of the axis (split's part kernel: ``split =
    tl.program_id(1)`` first; a parallel combine kernel: ``tl.program_id(1) * chunk``)."""

    part: bool
    name: str = "lo"

    def reads(self) -> set[str]:
        return {"chunk"}


@dataclass(frozen=True, kw_only=True)
class Load(Op):
    """``name = tl.load(...)`` of ``input`` (spec dims ``input_dims``), as float32 (``kind`` tl.int32 for
    an index input; fp8 arrives as bits). ``fill``: the fold whose identity its masked lanes hold
    (else 0). ``hoisted``: loop-invariant, loaded once per program before the loops."""

    input: str
    name: str
    dims: tuple[str, ...]
    input_dims: tuple[str, ...]
    kind: str
    dtype: str | None
    # per input dim: (dim, offset format, stride, sizes it reads): fuser_core.merged.address
    address: tuple[tuple[str, str, str, tuple[str, ...]], ...]
    fill: str | None = None
    hoisted: bool = False
    # (outer, contiguous): the tile's two dims in memory order, where the tile may come through the
    # input's tensor descriptor (:class:`Descriptor`) when the launcher chooses TMA_LOADS; else ()
    descriptor: tuple[str, ...] = ()

    def reads(self) -> set[str]:
        out = ({f"{self.name}_ptr"} | {stride for _, _, stride, _ in self.address}
               | {s for *_, sizes in self.address for s in sizes} | tile_reads(self.input_dims, self.dims))
        return out | ({f"{self.name}_desc", TMA_LOADS} | block_params(self.descriptor) if self.descriptor else set())

    def helpers(self) -> list[str]:
        return ["fp8e4m3_to_float"] if self.dtype == FP8 else []


@dataclass(frozen=True, kw_only=True)
class Descriptor(Op):
    """``{var}_desc``: a tensor descriptor of the 2-d slice of the input read as ``var`` a program's tiles come from
    (``memory``: its (outer, contiguous) dims; the other dims at the program's offsets, in ``address``),
    made once per program where the launcher chose TMA_LOADS. Its loads (:attr:`Load.descriptor`)
    are whole tiles by the tensor memory accelerator, zero outside the tensor as the masked loads
    give, pipelined into shared memory for the tl.dot that reads them (Triton's tutorial 06)."""

    var: str
    memory: tuple[str, ...]
    address: tuple[tuple[str, str, str, tuple[str, ...]], ...]
    dims: tuple[str, ...] = ()  # a descriptor, no tile

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.var}_desc"

    def reads(self) -> set[str]:
        outer, inner = self.memory
        lanes = {x for d, _, stride, _ in self.address if d not in self.memory for x in (f"offs_{d}", stride)}
        strides = {stride for d, _, stride, _ in self.address if d == outer}
        return ({f"{self.var}_ptr", f"size_{outer}", f"size_{inner}", TMA_LOADS} | lanes | strides
                | block_params(self.memory))


@dataclass(frozen=True, kw_only=True)
class Gather(Op):
    """The one term of ``sum over axis of where(index(axis) == at, X, 0)`` (:attr:`KernelPlan.gathers`):
    ``at`` computed (``{name}_at``, on the lanes' dims), X's inputs that vary along the axis loaded
    at that index (``inputs``: (input, its spec dims, dtype, kind, the variable it is read as)), X
    evaluated there, 0 where ``at`` is outside the axis. One load per lane instead of a pass."""

    step: str
    name: str
    dims: tuple[str, ...]
    axis: str
    at: sp.Expr
    expr: sp.Expr
    env: Env
    # (input, its spec dims, dtype, kind, the variable it is read as, its address: fuser_core.merged.address)
    inputs: tuple[tuple[str, tuple[str, ...], str | None, str, str, tuple[tuple[str, str, str, tuple[str, ...]], ...]], ...]
    tile: tuple[str, ...]  # the lanes' tile dims of the loads (their masks)

    def reads(self) -> set[str]:
        out = env_reads(self.env) | {f"size_{self.axis}", WIDE_OFFSETS}
        for inp, dims, _, _, _, where in self.inputs:
            var = safe_name(inp)
            out |= {f"{var}_ptr"} | {stride for _, _, stride, _ in where} | {s for *_, sizes in where for s in sizes}
            out |= tile_reads([d for d in dims if d != self.axis], [d for d in self.tile if d in dims and d != self.axis])
        return out

    def helpers(self) -> list[str]:
        return expr_helpers(self.at, self.expr) + (["fp8e4m3_to_float"] if any(i[2] == FP8 for i in self.inputs) else [])


@dataclass(frozen=True, kw_only=True)
class Loop(Op):
    """``for var in range(lo, hi[, step]):`` over the ``span``: ``axis`` (the axis's tiles), ``chunk``
    (a split program's chunk of them), ``split`` (the SPLIT partial states), ``outputs`` /
    ``chunk_outputs`` (the pass that writes the outputs keeping the axis), ``fallback`` (a pass that
    runs only where a :class:`FallbackFlag` is set: its ``hi`` is 0 elsewhere). ``resident``: one tile
    holds the whole axis (row_resident), printed as its body. ``per_lane``: the states it folds keep
    one value per lane of the axis's tile (:func:`~fuser_core.codegen.structure.per_lane`);
    ``lanes`` merges them after the loop. ``hoisted``: inputs it reads, loaded before the loops
    (they do not vary along the axis). ``lo``, ``hi`` and ``step`` are :class:`Bound` data (what
    the loop reads is theirs: :meth:`reads`). ``window``: the part of the axis it covers when a mask bounds it (:class:`~fuser_core.codegen.bounds.Window`,
    for counting its trips); ``unmasked``: its tiles lie where the mask holds for every lane, so its
    body folds without the mask (the masked loop that follows it covers the rest). ``contraction``:
    a K loop inside a tile, over ``dim`` a block at a time (:attr:`KernelPlan.contraction_loops`)."""

    span: str
    var: str
    lo: Bound
    hi: Bound
    step: Bound | None
    body: tuple[Op, ...]
    resident: bool = False
    per_lane: bool = False
    lanes: tuple[Op, ...] = ()
    hoisted: tuple[str, ...] = ()
    window: Any = None
    unmasked: bool = False
    dim: str = ""  # a contraction loop's dim

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.var

    def reads(self) -> set[str]:
        return set() if self.resident else set(bound_names(self.lo, self.hi, self.step))

    def children(self) -> tuple[Op, ...]:
        return self.body + self.lanes


@dataclass(frozen=True, kw_only=True)
class InitState(Op):
    """``name = tl.full(shape, fill, dtype)`` (``fill`` None: ``tl.zeros``): an empty state."""

    name: str
    dims: tuple[str, ...]
    dtype: str  # float32 | int32
    fill: sp.Expr | int | None
    note: str = ""

    def reads(self) -> set[str]:
        return block_params(self.dims)


@dataclass(frozen=True, kw_only=True)
class Count(Op):
    """The count of values seen (kept only where a move reads it): ``init`` (0), ``tile`` (a loop's
    tile of at most BLOCK values before ``hi``), ``part`` (a split part's chunk: ``count_part``)."""

    mode: str
    axis: str
    hi: Bound | None = None
    name: str = "count"

    def reads(self) -> set[str]:
        if self.mode == "tile":
            return {"count", "start", f"BLOCK_{self.axis}"} | set(bound_names(self.hi))
        if self.mode == "part":
            return {"count", "split", "chunk", f"size_{self.axis}"}
        return set()


@dataclass(frozen=True, kw_only=True)
class Copy(Op):
    """``name = source``: an anchor kept before the tile (or part) moves it."""

    name: str
    dims: tuple[str, ...]
    source: str

    def reads(self) -> set[str]:
        return {self.source}


@dataclass(frozen=True, kw_only=True)
class Value(Op):
    """``name = expr``: an elementwise value (a running value, a moved accumulator) read by name."""

    name: str
    dims: tuple[str, ...]
    expr: sp.Expr
    env: Env
    note: str = ""

    def reads(self) -> set[str]:
        return env_reads(self.env)

    def helpers(self) -> list[str]:
        return expr_helpers(self.expr)
