"""split_fused: streaming_fused with the axis split over ``split`` programs (each folds its chunk
into a partial state) and a derived combine kernel that merges the partial states."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from fuser_core.codegen.config import KernelConfig, NotValid
from fuser_core.codegen.strategies.base import COMBINE, SPLIT, DefaultTiling
from fuser_core.codegen.strategies.streaming_fused import StreamingFused

if TYPE_CHECKING:
    from fuser_core.codegen.structure.build import KernelBuilder
    from fuser_core.codegen.structure.model import ModuleStructure
    from fuser_core.derive import Derivation

PART_DOC = ("{name}, split-fused part 1: program (lanes, s) folds chunk s of {a} with the derived incremental form "
            "and writes its partial state.")
COMBINE_DOC = ("{name}, split-fused part 2: merge the SPLIT partial states (each re-anchored to the merged "
               "dependencies with the derived corrections), then write the outputs.")
PARALLEL_COMBINE_DOC = ("{name}, split-fused part 2: program (lanes, s) merges the SPLIT partial states (each "
                        "re-anchored to the merged dependencies with the derived corrections), then writes chunk s "
                        "of the outputs.")


class SplitFused(StreamingFused):
    splits_axis = True
    tunables = (*StreamingFused.tunables, SPLIT, COMBINE)

    def check(self, derivation: Derivation, axis: str, blocks: Mapping[str, int], shape: Mapping[str, int],
              config: KernelConfig) -> None:
        super().check(derivation, axis, blocks, shape, config)
        if config.split < 2:
            raise NotValid(f"{self.name} needs split >= 2")

    def default_config(self, t: DefaultTiling) -> KernelConfig:
        """As streaming, with at least two chunks to split the axis into, and up to 8 of them."""
        config = super().default_config(t)
        blocks, n = dict(config.blocks), t.shape[t.axis]
        while -(-n // blocks[t.axis]) < 2 and blocks[t.axis] > 16:
            blocks[t.axis] //= 2
        return replace(config, blocks=blocks, split=max(2, min(8, -(-n // blocks[t.axis]))))

    @property
    def least_split(self) -> int:
        return 2

    def build(self, kernels: KernelBuilder) -> ModuleStructure:
        from fuser_core.codegen.strategies.split_walk import combine_kernel, split_part  # the code generator's: heavy

        return kernels.split_kernels(split_part, combine_kernel, PART_DOC, COMBINE_DOC, PARALLEL_COMBINE_DOC)
