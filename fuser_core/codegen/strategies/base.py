"""What a strategy is (docs/THEORY.md section 6): a way to lay a cascade's kernel out over its loop axis.

Each strategy is one :class:`Strategy` object in a module of its own, named once, in
:mod:`fuser_core.codegen.strategies.registry`. It holds:

- whether it is valid for a plan (:meth:`Strategy.check` raises :class:`NotValid` with the reason);
- its tunable parameters (:attr:`Strategy.tunables`, read by the tuner's search space);
- its default configuration (:meth:`Strategy.default_config`, what a Triton engineer starts from)
  and its reduced one for a check at a small shape (:meth:`Strategy.reduced_axis_block`);
- what it holds whole (:attr:`Strategy.holds_axis_whole`; inner axes and a top-k's slots are held
  whole by every strategy);
- how it builds: :meth:`Strategy.build`, its hook into the structure walk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fuser_core.codegen.config import MAX_TILE_ELEMENTS, KernelConfig, NotValid, next_pow2

if TYPE_CHECKING:
    from fuser_core.codegen.structure.build import KernelBuilder
    from fuser_core.codegen.structure.model import ModuleStructure
    from fuser_core.derive import Derivation
    from fuser_core.spec import Spec

# What a Triton engineer starts from (issue 22), read off Triton's tutorials and Liger-Kernel:
LOADS_PER_THREAD = 8  # 16-bit elements per thread and tile: one 128-bit load each
DOT_BLOCK_M = 128  # a contraction's row tile (FlashAttention's and tutorial 06's BLOCK_M on sm_90)
DOT_BLOCK_N = 128  # its column tile when it is a GEMM's output dim
MAX_DOT_INNER = 256  # the other free dim (attention's e: the head dim) is held whole up to this

# The tunable parameters a strategy may have (tuner.space names them block_<dim>, num_warps, ...)
AXIS_BLOCK = "axis block"  # the loop axis tile, several choices (else the whole axis, one choice)
LANE_BLOCKS = "lane blocks"  # rows per program for each lane dim
NUM_WARPS = "num_warps"
NUM_STAGES = "num_stages"  # software pipelining of a loop (1 where nothing loops)
SPLIT = "split"  # programs the loop axis is split over
PER_LANE = "per_lane"  # a streamed loop's running states per lane of the tile or per tile
COMBINE = "combine"  # a split's partial states merged by a combine kernel or in the part kernel's launch


@dataclass(frozen=True)
class DefaultTiling:
    """What :func:`fuser_core.codegen.plan.default_config` reads off the spec and shape before the
    strategy picks its configuration."""

    spec: Spec
    derivation: Derivation
    shape: Mapping[str, int]
    axis: str
    inner: tuple[str, ...]
    free: set[str]  # a contraction's free dims (plan.contraction_dims)
    dot_lanes: tuple[str, ...]  # free dims split over programs: the first is the dot's row dim
    held: int  # elements of the inner axes, which ride along in every tile
    blocks: Mapping[str, int]  # the contraction's other free dims, already decided


class Strategy:
    """One strategy. Subclasses say what differs; the name is given by the registry."""

    holds_axis_whole = False  # the loop axis in one tile: no loop over it
    fused = False  # one pass with running values: needs every reduction over the axis fused (a cast rounds
    #                with running values, so the kernel is exact only where the derivation is)
    splits_axis = False  # the axis split over ``split`` programs, and a combine kernel
    tunables: tuple[str, ...] = (AXIS_BLOCK, LANE_BLOCKS, NUM_WARPS, NUM_STAGES)
    doc = ""  # the main kernel's docstring: "{name}" the spec, "{a}" the loop axis

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    # ------------------------------------------------------------------ validity
    def check(self, derivation: Derivation, axis: str, blocks: Mapping[str, int], shape: Mapping[str, int],
              config: KernelConfig) -> None:
        """Raise :class:`NotValid` when this strategy cannot run this layout (the generic rules are
        :func:`fuser_core.codegen.plan.make_plan`'s)."""
        if self.fused:
            bad = [f for f in derivation.forms.values() if f.axis == axis and not f.fused]
            if bad:
                raise NotValid(f"{self.name} needs every reduction over {axis} fused; {bad[0].name} is not: "
                               f"{bad[0].reason}")

    # ------------------------------------------------------------------ configurations
    def default_config(self, t: DefaultTiling) -> KernelConfig:
        """The configuration a Triton engineer starts a loop over the axis from:

        - a contraction (attention's q.k and p.v, a GEMM): tensor-core tiles, the row dim
          ``DOT_BLOCK_M`` rows per program, the loop tile 64 (128 for heads of at most 64),
          8 warps only when ``BLOCK_M x BLOCK_N >= 128 x 128`` (tutorial 06's rule: two
          warpgroups on a smaller tile compute the same product twice);
        - otherwise loops take tiles of at least ``LOADS_PER_THREAD x 32 x num_warps`` elements,
          so that every thread issues 128-bit loads of 16-bit values: a long row two such loads a
          thread on 8 warps with its running states per tile (``per_lane`` false, Liger-Kernel's
          online softmax: one exp per element), a decode's keys four.
        """
        axis, held, n = t.axis, t.held, t.shape[t.axis]
        blocks = dict(t.blocks)
        row, *others = t.dot_lanes or (None,)
        num_warps, per_lane = 4, True
        if row is not None and next_pow2(t.shape[row]) >= 16:  # the tile the tuner's dot rows start from
            # fewer rows where the inner axes riding along would make the tile too large (a weight's
            # gradient over a hidden size of 1024: [v, d] on 64 rows)
            blocks[row] = min(DOT_BLOCK_M, next_pow2(t.shape[row]), max(16, MAX_TILE_ELEMENTS // held))
            blocks[axis] = max(16, min(next_pow2(n), 128 if held <= 64 and axis not in t.free else 64))
            num_warps = 8 if blocks[row] * blocks[axis] >= 128 * 128 or (axis in t.free and blocks[row] >= 128) else 4
        else:  # a streamed row (a decode's single query: its keys stream past the whole head dims)
            carried = max([held, *(blocks[d] for d in others)])  # elements per axis index of the widest tile
            if carried >= 64:  # K/V rows of a head: four 128-bit loads a thread in flight, as flash-decoding's 64-key tiles
                want = 4 * LOADS_PER_THREAD * 32 * num_warps
            else:  # a long row: Liger-Kernel's online softmax, states per tile over 16 values a thread on 8 warps
                num_warps, per_lane = 8, False
                want = 2 * LOADS_PER_THREAD * 32 * num_warps
            blocks[axis] = max(min(16, next_pow2(n)), min(next_pow2(n), next_pow2(-(-want // carried))))
        # per-tile states are a streamed loop's choice; elsewhere the flag stays at its default
        return KernelConfig(blocks, num_warps=num_warps, num_stages=3, per_lane=per_lane or not self.fused)

    def reduced_axis_block(self, n: int) -> int:
        """The loop axis tile for a check at a small shape (``n`` long): several tiles and a tail."""
        return min(16, next_pow2(n))

    @property
    def least_split(self) -> int:
        """The split a configuration of this strategy has unless tuned."""
        return 1

    # ------------------------------------------------------------------ building
    def build(self, kernels: KernelBuilder) -> ModuleStructure:
        """The module's structure: one kernel walked by :meth:`walk` (the hook into the structure walk)."""
        return kernels.one_kernel(self.walk, self.doc)

    def walk(self, w) -> None:
        """Walk the main kernel's operations on ``w`` (a :class:`~fuser_core.codegen.structure.build.Walk`)."""
        raise NotImplementedError

