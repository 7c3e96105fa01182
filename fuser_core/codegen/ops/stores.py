"""Operations that merge parts and write results: workspace loads and stores, part merges, final
values, output stores, the fallback flag and the first chunk's stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from fuser_core.codegen.names import STORE_HELPERS
from fuser_core.codegen.ops.base import Env, Op, block_params, env_reads, expr_helpers, tile_reads
from fuser_core.codegen.tritonize import VarRef
from fuser_core.reduce_ops import has_slots, reduce_op, returns_indices


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
                | tile_reads(self.entry_dims, self.dims))


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
        out = env_reads(self.env)
        if has_slots(self.op):
            out |= {f"{self.name}_indices", f"{self.name}_indices_part", f"offs_{self.slots}"}
        elif returns_indices(self.op):
            out |= {f"{self.name}_indices", f"{self.name}_indices_part"}
        return out

    def helpers(self) -> list[str]:
        merge = reduce_op(self.op).merge_helper
        return expr_helpers(self.left, self.right) + ([merge] if merge else [])


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
    source: VarRef | None = None

    def reads(self) -> set[str]:
        if not self.name:
            return set()
        return env_reads(self.env) if self.expr is not None else {self.source.name}

    def helpers(self) -> list[str]:
        return expr_helpers(self.expr) if self.name and self.expr is not None else []


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
               | tile_reads(self.entry_dims, self.dims))
        return out | (block_params(self.dims) if self.value_dims != self.dims else set())


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
    value: VarRef | None
    value_dims: tuple[str, ...]
    dtype: str
    constant: bool = False
    gate: str | None = None  # written only where this 0/1 flag is set (a fallback's outputs)

    def reads(self) -> set[str]:
        out = ({f"{self.name}_ptr"} | {f"stride_{self.name}_{d}" for d in self.part_dims}
               | tile_reads(self.part_dims, self.dims) | ({self.gate} if self.gate else set()))
        out |= env_reads(self.env) if self.expr is not None else {self.value.name}
        return out | (block_params(self.dims) if self.constant or self.value_dims != self.dims else set())

    def helpers(self) -> list[str]:
        return expr_helpers(self.expr) + ([STORE_HELPERS[self.dtype]] if self.dtype in STORE_HELPERS else [])


@dataclass(frozen=True, kw_only=True)
class FallbackFlag(Op):
    """``name = 1`` where some lane of the program's tile holds a dependency value its fused reductions
    do not hold (``checks``: each value and what it must not be: ``inf`` (+-inf) or ``nonfinite``
    (+-inf or NaN)), else 0: an int32 scalar, the gate of the fallback passes after the fused loop."""

    name: str
    checks: tuple[tuple[VarRef, str], ...]

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


@dataclass(frozen=True, kw_only=True)
class LastPartCombine(Op):
    """split_fused's combine in the part kernel's launch (``KernelConfig.combine`` "last_part"):
    after writing its partial state, each program takes a ticket for its lane block (an atomic
    add, acquire-release at GPU scope, after a barrier so every thread's stores precede it); the
    program that draws SPLIT - 1, the last to finish, sets the count back to 0 for the next launch
    and calls the combine kernel ``kernel`` as a function with ``args`` (its parameters, which this
    kernel takes too): the merge and the outputs, in the same launch, no second launch."""

    kernel: str
    args: tuple[str, ...]
    constexprs: tuple[str, ...]
    body: tuple[Op, ...] = ()  # the combine kernel's operations, what the call runs (for counting its loops)

    def reads(self) -> set[str]:
        return {*self.args, *self.constexprs, "tickets_ptr", "SPLIT"}

    def children(self) -> tuple[Op, ...]:
        return self.body
