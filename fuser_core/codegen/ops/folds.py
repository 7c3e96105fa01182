"""Operations that reduce: whole-tile reductions, folds into a state, selections, anchor updates
and lane merges.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from fuser_core.codegen.ops.base import FP8_DOT, Dot, Env, Op, block_params, env_reads, expr_helpers, max_min_helpers
from fuser_core.codegen.tritonize import VarRef
from fuser_core.reduce_ops import reduce_op


def dot_reads(dot: Dot | None, masked: bool, over: str) -> set[str]:
    if dot is None:
        return {f"mask_{over}"} if masked else set()
    # as_matrix may broadcast an operand to [BLOCK_row, BLOCK_col]
    return ({f"mask_{dot.over}"} if masked else set()) | block_params((dot.i, dot.j, dot.over))


def dot_helpers(dot: Dot | None) -> list[str]:
    if dot is None:
        return []
    operands = {"bfloat16": ["bf16_operand"], FP8_DOT: ["fp8_operand", "fp8_bits_operand"]}
    return expr_helpers(dot.p, dot.q, dot.scale) + operands.get(dot.precision, [])


@dataclass(frozen=True, kw_only=True)
class Reduce(Op):
    """``name = reduce(op) over the whole tile of over`` of ``expr`` (its masked lanes the identity,
    unless ``masked`` is False: its load filled them), or ``dot``. ``inner``: over an inner axis
    (held whole), else a resident row's reduction over the loop axis. ``into``: the tile's reduction
    added to ``name`` (a K loop's accumulator: :attr:`KernelPlan.contraction_loops`)."""

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
    into: bool = False

    def reads(self) -> set[str]:
        return env_reads(self.env) | dot_reads(self.dot, self.masked, self.over) | ({self.name} if self.into else set())

    def helpers(self) -> list[str]:
        return dot_helpers(self.dot) if self.dot is not None else expr_helpers(self.expr) + max_min_helpers(self.op)


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
        out = env_reads(self.env) | ({self.name} if self.prev is None else set())
        return out | dot_reads(self.dot, self.masked, self.over)

    def helpers(self) -> list[str]:
        return expr_helpers(self.prev) + (dot_helpers(self.dot) if self.dot is not None else expr_helpers(self.expr)) + max_min_helpers(
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
        out = env_reads(self.env) | {f"{self.name}_indices", f"offs_{self.over}", f"mask_{self.over}"}
        out |= {f"{self.name}_values"} if self.prev is None else set()
        out |= {f"offs_{self.slots}"} if self.slots else set()
        return out | (block_params(self.tile_dims) if self.broadcast else set())

    def helpers(self) -> list[str]:
        return expr_helpers(self.prev, self.expr) + [reduce_op(self.op).merge_helper]


@dataclass(frozen=True, kw_only=True)
class AnchorUpdate(Op):
    """``name``, the anchor of ``dep``, moved to its running (or merged) value ``value``: a max/min's
    ``safe_anchor`` (0 while still infinite), or a running estimate of a sum (value x size / count)."""

    dep: str
    name: str
    dims: tuple[str, ...]
    value: VarRef
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
        return env_reads(self.env)

    def helpers(self) -> list[str]:
        return expr_helpers(self.expr) + max_min_helpers(self.op)
