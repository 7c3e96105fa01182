"""streaming_fused: one pass over the axis, valid when every reduction over it fused; later
reductions keep running values of earlier ones, corrected when those move (the derivation's forms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fuser_core.codegen.strategies.base import AXIS_BLOCK, LANE_BLOCKS, NUM_STAGES, NUM_WARPS, PER_LANE, Strategy

if TYPE_CHECKING:
    from fuser_core.codegen.structure.build import Walk


class StreamingFused(Strategy):
    fused = True
    tunables = (AXIS_BLOCK, LANE_BLOCKS, NUM_WARPS, NUM_STAGES, PER_LANE)
    doc = ("{name}, streaming-fused: one pass over {a}; later reductions are kept with running values of "
           "earlier ones and corrected when those move (derived by foldwise).")

    def walk(self, w: Walk) -> None:
        """One streamed loop over the axis, the reductions' final values, the outputs, the fallback passes."""
        from fuser_core.codegen.ops import bounds as bound

        w.streaming_loop("axis", bound.ZERO, bound.name(f"size_{w.axis}"))
        w.finalize()
        w.outputs()
        w.fallback()
