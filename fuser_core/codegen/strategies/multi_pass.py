"""multi_pass: always valid; one loop over the axis per reduction, re-reading the input."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fuser_core.codegen.strategies.base import Strategy

if TYPE_CHECKING:
    from fuser_core.codegen.structure.build import Walk


class MultiPass(Strategy):
    doc = "{name}, multi-pass: one loop over {a} per reduction, re-reading the inputs."

    def walk(self, w: Walk) -> None:
        """A pass per reduction over the axis (the walk's :meth:`one_pass`), then the outputs."""
        for step in w.axis_steps():
            w.one_pass(step)
        w.outputs()
