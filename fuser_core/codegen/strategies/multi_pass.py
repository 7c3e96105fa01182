"""multi_pass: always valid; one loop over the axis per reduction, re-reading the input."""

from __future__ import annotations

from fuser_core.codegen.strategies.base import Strategy


class MultiPass(Strategy):
    doc = "{name}, multi-pass: one loop over {a} per reduction, re-reading the inputs."

    def walk(self, w) -> None:
        w.multi_pass()
