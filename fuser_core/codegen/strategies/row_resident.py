"""row_resident: the whole loop axis of a row in one tile, any cascade; one read, one write.

Valid while the axis fits one block (``MAX_RESIDENT_BLOCK``) and the tile fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fuser_core.codegen.config import KernelConfig, NotValid, next_pow2
from fuser_core.codegen.strategies.base import LANE_BLOCKS, NUM_WARPS, DefaultTiling, Strategy

if TYPE_CHECKING:
    import sympy as sp

    from fuser_core.codegen.structure.build import Walk
    from fuser_core.derive import Derivation
    from fuser_core.spec import Step

MAX_RESIDENT_BLOCK = 1 << 16
RESIDENT_TILE = 8192  # values a row_resident program holds when its rows are short


def resident_warps(block: int) -> int:
    """Warps for a row held whole: enough that each thread keeps at most ~32 of its elements
    (Liger-Kernel's rule; a 32768-wide row spilled at 4 warps, and needs 32 to stay at ~47 registers)."""
    return 32 if block >= 32768 else 16 if block >= 4096 else 8 if block >= 2048 else 4


class RowResident(Strategy):
    holds_axis_whole = True
    tunables = (LANE_BLOCKS, NUM_WARPS)  # the axis block is the whole axis; nothing loops, so one stage
    doc = "{name}, row-resident: the whole {a} axis of a row in one tile; one read, one write."

    def check(self, derivation: Derivation, axis: str, blocks: Mapping[str, int], shape: Mapping[str, int],
              config: KernelConfig) -> None:
        if blocks[axis] < shape[axis]:
            raise NotValid(f"{self.name} needs BLOCK_{axis} >= size({axis}) = {shape[axis]}")
        if blocks[axis] > MAX_RESIDENT_BLOCK:
            raise NotValid(f"the row ({shape[axis]}) is too long to keep resident (max {MAX_RESIDENT_BLOCK})")
        super().check(derivation, axis, blocks, shape, config)

    def default_config(self, t: DefaultTiling) -> KernelConfig:
        """The whole axis in one tile, :func:`resident_warps`; short rows several per program,
        ~RESIDENT_TILE values a program (measured on an H200: softmax 16384 x 1024 fp16 ran 8 rows
        on 16 warps in 0.023 ms, 16 rows on 4 in 0.033)."""
        spec, axis = t.spec, t.axis
        blocks = dict(t.blocks)
        blocks[axis] = next_pow2(t.shape[axis])
        rows = [d for d in spec.dims if d not in t.inner and d != axis and d not in t.free
                and not any(s.as_dim == d for s in spec.steps)]
        if rows and not t.dot_lanes:
            per = max(1, min(next_pow2(t.shape[rows[-1]]), RESIDENT_TILE // (blocks[axis] * t.held)))
            if per > 1:
                blocks[rows[-1]] = per
        num_warps = resident_warps(math.prod(blocks.get(d, 1) for d in rows) * blocks[axis] * t.held)
        return KernelConfig(blocks, num_warps=num_warps, num_stages=1)  # no loop: nothing to pipeline

    def reduced_axis_block(self, n: int) -> int:
        return next_pow2(n)

    def walk(self, w: Walk) -> None:
        """The axis as one tile: each reduction straight off it (:func:`direct_reduction`), then the outputs."""
        import sympy as sp

        from fuser_core.codegen.ops import Comment
        from fuser_core.codegen.ops import bounds as bound

        a = w.axis

        def body():
            w.axis_tile("0")
            for step in w.axis_steps():
                integrand = w.conv.integrand(step)
                # no identity_loads here: the row stays live through every reduction and output, and with
                # -inf in its masked lanes sm_90 spilled more (safe_softmax n=32768: 560 -> 992 bytes)
                w.need([integrand])
                w.add(Comment(text=f"# {step.name} = {step.reduce} over {a} of {sp.sstr(integrand)}"))
                direct_reduction(w, step, integrand)
            w.outputs()

        w.loop("axis", "start", bound.ZERO, bound.name(f"size_{a}"), bound.name(f"BLOCK_{a}"), body, resident=True)


def direct_reduction(w: Walk, step: Step, value: sp.Expr) -> None:
    """``step`` over the whole axis, one tile: its reduction is the tile's (a tl.dot where the
    structure decides one); a selection folds its one tile into its state."""
    from fuser_core.codegen.names import safe_name
    from fuser_core.codegen.ops import Reduce
    from fuser_core.reduce_ops import is_selection

    op = w.effective_op(step)
    if not is_selection(op):  # the whole axis is one tile: its reduction is the value
        env = w.env(value)
        dot, masked, dims = w.tile_fold(step, value, env)
        if dot is not None:
            dot = w.dot_excluded(dot, value, op)
            env = w.env(dot.p, dot.q, dot.scale)
        var = safe_name(step.name)
        w.add(Reduce(step=step.name, name=var, dims=dims, op=op, over=w.axis, expr=value, env=env, inner=False,
                     dot=dot, masked=masked))
        w.values[step.name] = w.let(var, dims)
        return
    acc = w.init_state(step)[0]
    w.fold(step, acc, value)
    if is_selection(step.reduce):
        w.set_result(step, w.selected(step, acc), f"{acc}_indices")
    else:
        w.set_result(step, w.var(acc))
