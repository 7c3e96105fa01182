"""The operations of a generated kernel, in order: what the Triton printer prints and the tuner counts.

:func:`fuser_core.codegen.structure.build_structure` decides every kernel as an ordered list of
these operations (:attr:`~fuser_core.codegen.structure.Kernel.ops`); the printer
(:mod:`fuser_core.codegen.emit`) prints each with one method per type, and the tuner's analysis
(:mod:`tuner.analysis`) counts the same list. Every operation names the value it defines
(``name``, ``""`` when it defines none) and the tile dims that value lives on (``dims``, in the
kernel's dim order: attention's ``q`` is on ``("m", "d")``, a row's max in a one-row program on
``()``), so nothing downstream infers a value's dims from printed text. An expression an
operation prints is a sympy expression with its ``env``: every free symbol mapped to the
:class:`Ref` it reads (a variable on its dims, a size, a negated selection).

What each operation reads (:meth:`Op.reads`: kernel parameters and variables) comes from its
fields; a kernel's arguments are exactly the parameters its operations read, and the offsets
and masks of a dim are set up only where some operation reads them. The ``@triton.jit``
helpers a kernel calls (:meth:`Op.helpers`) come from the operations too, never from the
printed text.

The operations:

- :class:`Program`: the program ids of the lane dims (a lane with block 1 is a scalar offset);
- :class:`Offsets`: ``offs_d`` (and ``mask_d``) of one dim's tile;
- :class:`Chunk`: a split program's chunk of the loop axis (``lo``);
- :class:`Load`: an input loaded as float32 (int32 for index inputs), hoisted or not;
- :class:`Gather`: a reduction that is one term, ``sum of where(index(axis) == at, X, 0)``: X loaded at ``at``;
- :class:`Loop`: a loop over the axis (its tiles, a split chunk of them, or the SPLIT partial
  states), its body and, after a per-lane loop, the merge of its lanes; one resident tile is a
  loop with one iteration, printed without ``for``;
- :class:`InitState`, :class:`Count`, :class:`Copy`: the empty states, the count of values seen,
  an anchor kept before it moves;
- :class:`Value`: an elementwise value other operations read by name;
- :class:`Reduce`: a reduction of a whole tile into a new value (an inner reduction, or a
  resident row's), a ``tl.dot`` where the structure decided one;
- :class:`Fold`: one tile folded into an accumulator, per tile (reduced over the axis) or per lane
  (elementwise); :class:`Select`: a tile merged into a running arg-max or top-k;
- :class:`AnchorUpdate`: a dependency's anchor moved to its running (or merged) value;
- :class:`LaneMerge`: the lanes of a per-lane state folded over the axis with the merge rule;
- :class:`WorkspaceLoad`, :class:`PartMerge`: a split's partial state read and merged;
- :class:`Finalise`: a reduction's final value;
- :class:`WorkspaceStore`, :class:`OutputStore`: the partial state or an output part written;
- :class:`FallbackFlag`: 1 where a dependency of a fused reduction ended at a value its fused form
  does not hold (an infinity, a NaN), the gate of the fallback passes (a ``fallback`` loop) and of
  their results;
- :class:`FirstChunk`: operations only the program of chunk 0 runs; :class:`Comment`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import sympy as sp

from fuser_core.codegen.names import FP8, NAN_MAX_MIN, safe_name
from fuser_core.codegen.tritonize import Ref, helpers_of

Env = tuple[tuple[sp.Basic, "Ref"], ...]  # each free symbol of an operation's expressions -> what it reads


@dataclass(frozen=True)
class Dot:
    """sum over ``over`` of P * Q computed as ``tl.dot(P[i, over], Q[over, j])`` (times ``scale``,
    the factors that vary over no blocked dim, applied after the product)."""

    over: str
    i: str
    j: str
    p: sp.Expr
    q: sp.Expr
    scale: sp.Expr | None
    precision: str  # "tl.float16" | "tl.bfloat16" | "ieee": the operands' precision
    direct: tuple[str, ...] = ()  # inputs that are a factor as loaded (staged in shared memory once)

    @property
    def dims(self) -> frozenset[str]:
        return frozenset({self.i, self.j, self.over})

    @property
    def p_dims(self) -> frozenset[str]:
        return frozenset({self.i, self.over})

    @property
    def q_dims(self) -> frozenset[str]:
        return frozenset({self.over, self.j})

    @property
    def n_p_factors(self) -> int:
        return len(sp.Mul.make_args(self.p))

    @property
    def n_q_factors(self) -> int:
        return len(sp.Mul.make_args(self.q))


def env_refs(env: Env) -> Iterator[Ref]:
    return (ref for _, ref in env)


def _env_reads(env: Env) -> set[str]:
    return {ref.name for ref in env_refs(env)}


def _helpers(*exprs: sp.Expr | None) -> list[str]:
    out: list[str] = []
    for e in exprs:
        if e is not None:
            out += helpers_of(e)
    return out


def _max_min(op: str) -> list[str]:
    """The NaN-propagating helper a max/min fold or reduction prints (names.NAN_MAX_MIN)."""
    return [NAN_MAX_MIN[op]] if op in NAN_MAX_MIN else []


def _blocks(dims: Iterable[str]) -> set[str]:
    return {f"BLOCK_{d}" for d in dims}


def _tile_reads(dims: Iterable[str], tile: Iterable[str]) -> set[str]:
    """Offsets of every dim of a pointer tile, masks of those in a tile (a scalar lane needs none)."""
    return {f"offs_{d}" for d in dims} | {f"mask_{d}" for d in tile}


class Op:
    """An operation of a kernel. ``name``/``dims``: the value it defines and its tile dims."""

    name: str = ""
    dims: tuple[str, ...] = ()

    def reads(self) -> set[str]:
        """Kernel parameters and variables its printed code reads."""
        return set()

    def helpers(self) -> list[str]:
        """The ``@triton.jit`` helpers (fuser_core/codegen/helpers.py) its printed code calls."""
        return []

    def children(self) -> tuple[Op, ...]:
        """Operations nested in it (a loop's body and lane merge, chunk 0's stores)."""
        return ()


@dataclass(frozen=True, kw_only=True)
class Comment(Op):
    text: str


@dataclass(frozen=True, kw_only=True)
class Program(Op):
    """The program ids of the lane dims (slowest first): ``pid_d`` for a lane in a tile, ``offs_d`` for
    a lane with block 1 (one program per index: its offset, a scalar; set up only where read)."""

    lanes: tuple[str, ...]
    tile: frozenset[str]  # lanes in a tile
    used: frozenset[str]  # scalar lanes whose offset some operation reads
    name: str = "pid"

    def reads(self) -> set[str]:
        return {x for d in self.lanes[1:] for x in (f"size_{d}", f"BLOCK_{d}")}


@dataclass(frozen=True, kw_only=True)
class Offsets(Op):
    """``offs_d = [base +] tl.arange(0, BLOCK_d)`` and, with ``mask``, ``mask_d = offs_d < size_d``;
    ``base``: ``pid`` (a lane: ``pid_d * BLOCK_d``), ``start`` (the loop's tile) or none. ``inside``:
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
        out = {f"BLOCK_{d}"} | ({f"size_{d}", self.name} if self.mask and not self.inside else set())  # the mask reads the offsets
        return out | ({f"pid_{d}"} if self.base == "pid" else {"start"} if self.base == "start" else set())


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

    def reads(self) -> set[str]:
        return ({f"{self.name}_ptr"} | {stride for _, _, stride, _ in self.address}
                | {s for *_, sizes in self.address for s in sizes} | _tile_reads(self.input_dims, self.dims))

    def helpers(self) -> list[str]:
        return ["fp8e4m3_to_float"] if self.dtype == FP8 else []


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
        out = _env_reads(self.env) | {f"size_{self.axis}"}
        for inp, dims, _, _, _, where in self.inputs:
            var = safe_name(inp)
            out |= {f"{var}_ptr"} | {stride for _, _, stride, _ in where} | {s for *_, sizes in where for s in sizes}
            out |= _tile_reads([d for d in dims if d != self.axis], [d for d in self.tile if d in dims and d != self.axis])
        return out

    def helpers(self) -> list[str]:
        return _helpers(self.at, self.expr) + (["fp8e4m3_to_float"] if any(i[2] == FP8 for i in self.inputs) else [])


@dataclass(frozen=True, kw_only=True)
class Loop(Op):
    """``for var in range(lo, hi[, step]):`` over the ``span``: ``axis`` (the axis's tiles), ``chunk``
    (a split program's chunk of them), ``split`` (the SPLIT partial states), ``outputs`` /
    ``chunk_outputs`` (the pass that writes the outputs keeping the axis), ``fallback`` (a pass that
    runs only where a :class:`FallbackFlag` is set: its ``hi`` is 0 elsewhere). ``resident``: one tile
    holds the whole axis (row_resident), printed as its body. ``per_lane``: the states it folds keep
    one value per lane of the axis's tile (:func:`~fuser_core.codegen.structure.per_lane`);
    ``lanes`` merges them after the loop. ``hoisted``: inputs it reads, loaded before the loops
    (they do not vary along the axis). ``bounds``: the parameters and variables lo, hi and step read.
    ``window``: the part of the axis it covers when a mask bounds it (:class:`~fuser_core.codegen.bounds.Window`,
    for counting its trips); ``unmasked``: its tiles lie where the mask holds for every lane, so its
    body folds without the mask (the masked loop that follows it covers the rest)."""

    span: str
    var: str
    lo: str
    hi: str
    step: str | None
    bounds: frozenset[str]
    body: tuple[Op, ...]
    resident: bool = False
    per_lane: bool = False
    lanes: tuple[Op, ...] = ()
    hoisted: tuple[str, ...] = ()
    window: Any = None
    unmasked: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.var

    def reads(self) -> set[str]:
        return set() if self.resident else set(self.bounds)

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
        return _blocks(self.dims)


@dataclass(frozen=True, kw_only=True)
class Count(Op):
    """The count of values seen (kept only where a move reads it): ``init`` (0), ``tile`` (a loop's
    tile of at most BLOCK values before ``hi``), ``part`` (a split part's chunk: ``count_part``)."""

    mode: str
    axis: str
    hi: str = ""
    hi_reads: frozenset[str] = frozenset()
    name: str = "count"

    def reads(self) -> set[str]:
        if self.mode == "tile":
            return {"count", "start", f"BLOCK_{self.axis}"} | set(self.hi_reads)
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
        return _env_reads(self.env)

    def helpers(self) -> list[str]:
        return _helpers(self.expr)


def _dot_reads(dot: Dot | None, masked: bool, over: str) -> set[str]:
    if dot is None:
        return {f"mask_{over}"} if masked else set()
    # as_matrix may broadcast an operand to [BLOCK_row, BLOCK_col]
    return ({f"mask_{dot.over}"} if masked else set()) | _blocks((dot.i, dot.j, dot.over))


def _dot_helpers(dot: Dot | None) -> list[str]:
    if dot is None:
        return []
    return _helpers(dot.p, dot.q, dot.scale) + (["bf16_operand"] if dot.precision == "tl.bfloat16" else [])


@dataclass(frozen=True, kw_only=True)
class Reduce(Op):
    """``name = reduce(op) over the whole tile of over`` of ``expr`` (its masked lanes the identity,
    unless ``masked`` is False: its load filled them), or ``dot``. ``inner``: over an inner axis
    (held whole), else a resident row's reduction over the loop axis."""

    step: str
    name: str
    dims: tuple[str, ...]
    op: str
    over: str
    expr: sp.Expr
    env: Env
    inner: bool
    dot: Dot | None = None
    masked: bool = True
    note: str = ""

    def reads(self) -> set[str]:
        return _env_reads(self.env) | _dot_reads(self.dot, self.masked, self.over)

    def helpers(self) -> list[str]:
        return _dot_helpers(self.dot) if self.dot is not None else _helpers(self.expr) + _max_min(self.op)


@dataclass(frozen=True, kw_only=True)
class Fold(Op):
    """``name = op(prev, tile)``: one tile of ``expr`` folded into the accumulator ``name`` (per tile: the
    tile reduced over ``over`` first, or ``dot``; ``per_lane``: elementwise, each lane its own state).
    ``prev``: the accumulator moved to the new anchors (None: itself). ``masked``: the tile's masked
    lanes set to the identity (False: its load filled them)."""

    step: str
    name: str
    dims: tuple[str, ...]
    op: str
    over: str
    expr: sp.Expr
    env: Env
    prev: sp.Expr | None = None
    dot: Dot | None = None
    masked: bool = True
    per_lane: bool = False
    note: str = ""

    def reads(self) -> set[str]:
        out = _env_reads(self.env) | ({self.name} if self.prev is None else set())
        return out | _dot_reads(self.dot, self.masked, self.over)

    def helpers(self) -> list[str]:
        return _helpers(self.prev) + (_dot_helpers(self.dot) if self.dot is not None else _helpers(self.expr)) + _max_min(
            self.op)


@dataclass(frozen=True, kw_only=True)
class Select(Op):
    """A tile of ``expr`` merged into the running selection ``name`` (``{name}_values``,
    ``{name}_indices`` on ``dims``): arg-max/arg-min, or top-k/bottom-k over ``slots`` (k of them);
    arg-min and bottom-k select on negated values. ``prev``: the values moved (None: as they are)."""

    step: str
    name: str
    dims: tuple[str, ...]
    op: str
    over: str
    expr: sp.Expr
    env: Env
    prev: sp.Expr | None = None
    slots: str | None = None
    k: int | None = None
    tile_dims: tuple[str, ...] = ()  # the tile merged: the state's lanes and the axis
    broadcast: bool = False  # the value varies over fewer dims than the tile: broadcast to it

    def reads(self) -> set[str]:
        out = _env_reads(self.env) | {f"{self.name}_indices", f"offs_{self.over}", f"mask_{self.over}"}
        out |= {f"{self.name}_values"} if self.prev is None else set()
        out |= {f"offs_{self.slots}"} if self.slots else set()
        return out | (_blocks(self.tile_dims) if self.broadcast else set())

    def helpers(self) -> list[str]:
        merge = "topk_merge" if self.op in ("topk", "bottomk") else "argmax_merge"
        return _helpers(self.prev, self.expr) + [merge]


@dataclass(frozen=True, kw_only=True)
class AnchorUpdate(Op):
    """``name``, the anchor of ``dep``, moved to its running (or merged) value ``value``: a max/min's
    ``safe_anchor`` (0 while still infinite), or a running estimate of a sum (value x size / count)."""

    dep: str
    name: str
    dims: tuple[str, ...]
    value: Ref
    estimate: bool
    axis: str
    note: str = ""

    def reads(self) -> set[str]:
        return {self.value.name} | ({f"size_{self.axis}", "count"} if self.estimate else set())

    def helpers(self) -> list[str]:
        return [] if self.estimate else ["safe_anchor"]


@dataclass(frozen=True, kw_only=True)
class LaneMerge(Op):
    """``name = reduce(op) over axis`` of ``expr``: a per-lane state's lanes, each moved to the merged
    anchors, folded with the merge rule (each lane one part)."""

    step: str
    name: str
    dims: tuple[str, ...]
    op: str
    axis: str
    expr: sp.Expr
    env: Env

    def reads(self) -> set[str]:
        return _env_reads(self.env)

    def helpers(self) -> list[str]:
        return _helpers(self.expr) + _max_min(self.op)


@dataclass(frozen=True, kw_only=True)
class WorkspaceLoad(Op):
    """``{entry}_part``: partial state ``split`` of the workspace entry ``entry`` (masked lanes ``other``)."""

    entry: str
    dims: tuple[str, ...]
    entry_dims: tuple[str, ...]
    other: str

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.entry}_part"

    def reads(self) -> set[str]:
        e = self.entry
        return ({f"ws_{e}_ptr", f"stride_ws_{e}_split", "split"} | {f"stride_ws_{e}_{d}" for d in self.entry_dims}
                | _tile_reads(self.entry_dims, self.dims))


@dataclass(frozen=True, kw_only=True)
class PartMerge(Op):
    """``name = op(left, right)``: the merged state so far and part ``split``, both moved to the merged
    anchors (a selection: ``topk_merge``/``argmax_merge`` of values and indices)."""

    step: str
    name: str
    dims: tuple[str, ...]
    op: str
    left: sp.Expr
    right: sp.Expr
    env: Env
    slots: str | None = None
    k: int | None = None

    def reads(self) -> set[str]:
        out = _env_reads(self.env)
        if self.op in ("topk", "bottomk"):
            out |= {f"{self.name}_indices", f"{self.name}_indices_part", f"offs_{self.slots}"}
        elif self.op in ("argmax", "argmin"):
            out |= {f"{self.name}_indices", f"{self.name}_indices_part"}
        return out

    def helpers(self) -> list[str]:
        extra = ["topk_merge"] if self.op in ("topk", "bottomk") else ["argmax_merge"] if self.op in ("argmax", "argmin") else []
        return _helpers(self.left, self.right) + extra


@dataclass(frozen=True, kw_only=True)
class Finalise(Op):
    """The final value of ``step``: ``expr`` (its realisation's value; None in an unfused kernel, whose
    value is its accumulator or ``source``, a selection's values). ``name``: the variable assigned,
    ``""`` when the value is already one (an accumulator, or a per-lane loop's merge computed it)."""

    step: str
    name: str
    dims: tuple[str, ...]
    expr: sp.Expr | None
    env: Env = ()
    source: Ref | None = None

    def reads(self) -> set[str]:
        if not self.name:
            return set()
        return _env_reads(self.env) if self.expr is not None else {self.source.name}

    def helpers(self) -> list[str]:
        return _helpers(self.expr) if self.name and self.expr is not None else []


@dataclass(frozen=True, kw_only=True)
class WorkspaceStore(Op):
    """Partial state ``entry`` (the variable, on ``value_dims``) written to the workspace at ``split``."""

    entry: str
    entry_dims: tuple[str, ...]
    dims: tuple[str, ...]  # the tile dims of the entry's dims
    value_dims: tuple[str, ...]

    def reads(self) -> set[str]:
        e = self.entry
        out = ({f"ws_{e}_ptr", f"stride_ws_{e}_split", "split", e} | {f"stride_ws_{e}_{d}" for d in self.entry_dims}
               | _tile_reads(self.entry_dims, self.dims))
        return out | (_blocks(self.dims) if self.value_dims != self.dims else set())


@dataclass(frozen=True, kw_only=True)
class OutputStore(Op):
    """Output ``part`` (pointer ``{name}_ptr``, spec dims ``part_dims``) written from ``expr`` (None: the
    reduction's final value ``value``), converted to ``dtype``, as a whole tile of its dims.
    ``constant``: the value prints as a number (stored through ``tl.full``); ``gate``: a 0/1 flag, the
    store masked off where it is 0 (the fallback's stores, after the fused ones)."""

    part: str
    name: str
    part_dims: tuple[str, ...]
    dims: tuple[str, ...]
    expr: sp.Expr | None
    env: Env
    value: Ref | None
    value_dims: tuple[str, ...]
    dtype: str
    constant: bool = False
    gate: str | None = None  # written only where this 0/1 flag is set (a fallback's outputs)

    def reads(self) -> set[str]:
        out = ({f"{self.name}_ptr"} | {f"stride_{self.name}_{d}" for d in self.part_dims}
               | _tile_reads(self.part_dims, self.dims) | ({self.gate} if self.gate else set()))
        out |= _env_reads(self.env) if self.expr is not None else {self.value.name}
        return out | (_blocks(self.dims) if self.constant or self.value_dims != self.dims else set())

    def helpers(self) -> list[str]:
        return _helpers(self.expr) + (["fp8e4m3_bits"] if self.dtype == FP8 else [])


@dataclass(frozen=True, kw_only=True)
class FallbackFlag(Op):
    """``name = 1`` where some lane of the program's tile holds a dependency value its fused reductions
    do not hold (``checks``: each value and what it must not be: ``inf`` (+-inf) or ``nonfinite``
    (+-inf or NaN)), else 0: an int32 scalar, the gate of the fallback passes after the fused loop."""

    name: str
    checks: tuple[tuple[Ref, str], ...]

    def reads(self) -> set[str]:
        return {ref.name for ref, _ in self.checks}


@dataclass(frozen=True, kw_only=True)
class FirstChunk(Op):
    """``if lo == 0:`` ``body``: what only the program of chunk 0 runs (a parallel combine's row outputs)."""

    body: tuple[Op, ...]

    def reads(self) -> set[str]:
        return {"lo"}

    def children(self) -> tuple[Op, ...]:
        return self.body


def walk(ops: Iterable[Op]) -> Iterator[Op]:
    """Every operation of ``ops`` and, depth first, those nested in it."""
    for op in ops:
        yield op
        yield from walk(op.children())


def assuming(op: Op, subs: Mapping[sp.Basic, sp.Basic]) -> Op:
    """``op`` with ``subs`` applied to every expression it and the operations inside it hold (a
    loop's mask condition replaced by true where every lane satisfies it)."""
    changes: dict[str, Any] = {}
    for f in fields(op):
        v = getattr(op, f.name)
        if isinstance(v, sp.Basic):
            changes[f.name] = v.xreplace(subs)
        elif isinstance(v, Dot):
            changes[f.name] = replace(v, p=v.p.xreplace(subs), q=v.q.xreplace(subs))
        elif isinstance(v, tuple) and v and all(isinstance(x, Op) for x in v):
            changes[f.name] = tuple(assuming(x, subs) for x in v)
    return replace(op, **changes) if changes else op
