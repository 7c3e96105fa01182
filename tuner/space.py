"""The search space of one (spec, shape, dtypes, target): fused strategies and their parameters.

A :class:`Candidate` is a strategy and a :class:`~fuser_core.codegen.plan.KernelConfig`. The
:class:`SearchSpace` lists, per strategy, the choices of every parameter (powers of two within
the shape and the target), builds candidates from chosen values, and rejects candidates that
cannot fit **before anything compiles** (:meth:`SearchSpace.check`): the plan's own rules, a
tile larger than its dim, shared memory (the LDS on AMD: 64 KiB per CU on MI300X, where an
H100 block has 227 KiB), registers (by a lower bound, over the target's warp width: the
compile gate has the compiler's count), and warps for the tile.

Parameters (Optuna-style names; ``split`` only for split_fused):

- ``block_<axis>``: the loop axis tile (row_resident: the whole axis, one choice);
- ``block_<lane>``: rows per program for each lane dim. Lanes that are the free dims of a
  contraction (attention's ``m`` and ``e``, a GEMM's ``m`` and ``n``) start at 16 so that
  ``tl.dot`` applies; batch dims of a contraction (``b``, ``h``) stay 1 (a blocked batch dim
  turns a dot back into a broadcast product); other lanes take 1, 2, 4, ...;
- ``block_<inner>``: a K loop's tile (32, 64, 128: Triton's matmul tutorial's BLOCK_SIZE_K) for an
  inner sum too long for one block (:func:`~fuser_core.codegen.plan.loopable_inner_dims`: a producer
  GEMM's hidden size before a cross-entropy);
- ``num_warps`` 1..32 (32: a long resident row, as Liger-Kernel runs softmax over 32768), as many
  as fit the target's 1,024 threads per block: on AMD ``num_warps`` counts 64-lane wavefronts (as
  Triton's AMD backend does), so 1..16; ``num_stages`` 1..5 (1 for row_resident), ``split`` 2..64;
- ``per_lane`` 1 or 0 (streaming and split, where the derivation allows per-lane states): a
  streamed loop's running states per lane of the tile, or per tile (:attr:`KernelConfig.per_lane`);
- ``combine`` 0 or 1 (split, where no output keeps the axis): the partial states merged by a
  combine kernel, or by the last part program of each lane block, in the same launch
  (:attr:`KernelConfig.combine` "kernel", "last_part").

The unfused chain is a baseline, never a candidate.

Example:
    >>> from fuser_core.catalog import load_catalog_spec
    >>> from fuser_core.derive import derive_cascade
    >>> from fuser_core.problem import make_problem
    >>> from tuner.profiles import get_profile
    >>> spec = load_catalog_spec("safe_softmax")
    >>> problem = make_problem(spec, {"m": 4096, "n": 32768}, "float16")
    >>> space = SearchSpace(problem, derive_cascade(spec), get_profile("h100"))
    >>> space.strategies() == list(STRATEGIES)  # all: a 32768-long row fits the registers of 32 warps, as in Liger-Kernel
    True
    >>> c = space.candidate(STREAMING_FUSED.name, {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 2})
    >>> json.loads(c.key()) == {"strategy": STREAMING_FUSED.name, "config": c.config.to_dict()}
    True
    >>> space.check(c) is None, space.check(space.candidate(STREAMING_FUSED.name, {**c.values(space), "block_n": 65536}))
    (True, 'BLOCK_n = 65536 is larger than n (32768)')
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core.codegen.config import COMBINES
from fuser_core.codegen.plan import (
    CONTRACTION_BLOCK,
    MAX_TILE_ELEMENTS,
    KernelConfig,
    NotValid,
    contraction_dims,
    default_inner_block,
    k_tile_pinned,
    pinned_k_block,
    loop_axis,
    make_plan,
    next_pow2,
    valid_strategies,
)
from fuser_core.codegen.strategies import STRATEGIES, STREAMING_FUSED
from fuser_core.codegen.strategies.base import AXIS_BLOCK, COMBINE, NUM_STAGES, PER_LANE, SPLIT
from fuser_core.derive import Derivation
from fuser_core.problem import Problem
from tuner.analysis import Anatomy, ResourceEstimate, cdiv, input_info, resources
from tuner.profiles import GpuProfile

WARPS = (1, 2, 4, 8, 16, 32)
STAGES = (1, 2, 3, 4, 5)
# a K loop's tile is not searched: every kernel that sums a product over d sums it in the same tiles,
# in order (plan.k_tile_pinned: a backward's recomputed logits are then the forward's own)
# sm_90's wgmma gives each warpgroup 64 rows of the product: on a 64-row tile, 8 warps compute it twice
# (attention 64 x 128 on 8 warps at sm_90: 1.5x the HGMMA instructions and 2x the exps of 128 x 64)
WGMMA_ROWS = 64
MIN_AXIS_BLOCK = 16  # tl.dot's minimum; smaller loop tiles never pay on a GPU
MAX_LANE_BLOCK = 256
MAX_SPLIT = 64
MAX_CANDIDATES = 20_000  # enumerate() refuses spaces with more feasible candidates than this
RESOURCE_REASONS = ("shared memory", "registers", "num_warps")  # what warps and stages can change


@dataclass(frozen=True)
class Candidate:
    """A strategy and its configuration: one point of the search."""

    strategy: str
    config: KernelConfig

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "config": self.config.to_dict()}

    def key(self) -> str:
        """Stable JSON identity: repeated suggestions are answered from stored results by it."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> Candidate:
        return Candidate(str(raw["strategy"]), KernelConfig.from_dict(dict(raw["config"])))

    def values(self, space: SearchSpace) -> dict[str, int]:
        """The parameter values (``block_n``, ``num_warps``, ...) that make this candidate."""
        return space.values_of(self)


def pow2_range(lo: int, hi: int) -> list[int]:
    out, b = [], max(1, lo)
    while b <= hi:
        out.append(b)
        b *= 2
    return out


class SearchSpace:
    """The fused-kernel search space of one problem (spec, shape, dtypes) on one target."""

    def __init__(self, problem: Problem, derivation: Derivation, profile: GpuProfile):
        spec = problem.spec
        self.problem = problem
        self.spec = spec
        self.derivation = derivation
        self.shape = problem.shape
        self.dtypes = problem.dtypes
        self.profile = profile
        self.axis, self.inner = loop_axis(spec)
        self.anatomy = Anatomy(spec, derivation, self.dtypes)
        self.lanes = self.anatomy.lanes
        # inner dims too long for one block, summed in a K loop of CONTRACTION_BLOCK tiles
        self.k_loops = tuple(d for d in self.anatomy.inner
                             if default_inner_block(d, self.anatomy.loopable, self.shape) < next_pow2(self.shape[d]))
        self.free_dims, self.batch_dims = contraction_dims(spec, derivation)
        self.k_tile_pinned = k_tile_pinned(spec, derivation)
        self._valid = valid_strategies(spec, derivation, self.shape)
        self._checked: dict[str, str | None] = {}
        self._empty: dict[str, str | None] = {}  # strategy -> None if some candidate fits, else a reason
        self._last_reason: dict[str, str] = {}

    # ------------------------------------------------------------------ choices
    def strategies(self) -> list[str]:
        """Fused strategies valid for this spec and shape (plan.valid_strategies) that have at
        least one candidate fitting the target, in plan order."""
        return [s for s in STRATEGIES if self._valid.get(s) is None and self._fits(s)]

    def not_valid(self) -> dict[str, str]:
        """Strategy -> why it is not in :meth:`strategies`."""
        out = {s: r for s, r in self._valid.items() if r is not None}
        for s in STRATEGIES:
            if s not in out and not self._fits(s):
                out[s] = f"no configuration fits {self.profile.name}: {self._empty[s]}"
        return out

    def _fits(self, strategy: str) -> bool:
        if strategy not in self._empty:
            first = next(self._enumerate(strategy), None)
            self._empty[strategy] = None if first is not None else self._last_reason.get(strategy, "no tiling")
        return self._empty[strategy] is None

    def lane_choices(self, d: str) -> list[int]:
        top = next_pow2(self.shape[d])
        if d in self.batch_dims and d not in self.free_dims:
            return [1]
        if d in self.free_dims and top >= 16:
            return pow2_range(16, min(top, MAX_LANE_BLOCK))
        return pow2_range(1, min(top, MAX_LANE_BLOCK))

    def axis_choices(self, strategy: str) -> list[int]:
        top = next_pow2(self.shape[self.axis])
        if self.k_tile_pinned:  # a GEMM's K summed as the forward's K loop sums it
            return [pinned_k_block(self.shape[self.axis])]
        if AXIS_BLOCK not in STRATEGIES[strategy].tunables:  # the whole axis in one tile
            return [top]
        return pow2_range(min(MIN_AXIS_BLOCK, top), min(top, MAX_TILE_ELEMENTS))

    def params(self, strategy: str) -> dict[str, list[int]]:
        """Parameter name -> its choices (powers of two) for ``strategy``."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
        tunables = STRATEGIES[strategy].tunables
        out: dict[str, list[int]] = {f"block_{self.axis}": self.axis_choices(strategy)}
        for d in self.lanes:
            out[f"block_{d}"] = self.lane_choices(d)
        for d in self.k_loops:  # one choice (the comment above WARPS)
            out[f"block_{d}"] = [CONTRACTION_BLOCK]
        out["num_warps"] = [w for w in WARPS if self.profile.warp_size * w <= self.profile.threads_per_block_max]
        out["num_stages"] = list(STAGES) if NUM_STAGES in tunables else [1]
        if SPLIT in tunables:
            most = min(MAX_SPLIT, cdiv(self.shape[self.axis], min(self.axis_choices(strategy))))
            out["split"] = pow2_range(2, most) or [2]
        if PER_LANE in tunables and self._lanes_possible:
            out["per_lane"] = [1, 0]  # running states per lane of the tile, or per tile (KernelConfig.per_lane)
        if COMBINE in tunables and not any(self.axis in self.spec.step(p.split(".")[0]).dims
                                           for p in self.spec.output_parts):
            out["combine"] = list(range(len(COMBINES)))  # KernelConfig.combine, by its index in COMBINES
        return out

    @property
    def _lanes_possible(self) -> bool:
        """Could a streamed loop keep per-lane states here (structure.per_lane at the smallest blocks)?"""
        if not hasattr(self, "_lanes_cache"):
            from fuser_core.codegen.structure import per_lane

            try:
                plan = make_plan(self.spec, self.derivation, STREAMING_FUSED.name, self.shape,
                                 KernelConfig({d: 1 for d in self.lanes} | {self.axis: MIN_AXIS_BLOCK}))
                self._lanes_cache = per_lane(plan, ())[0]
            except NotValid:
                self._lanes_cache = False
        return self._lanes_cache

    def candidate(self, strategy: str, values: Mapping[str, int]) -> Candidate:
        """The candidate for chosen ``values``; a parameter left out takes its only choice (or,
        with several, the plan's default). Nothing is validated here: see :meth:`check`."""
        params = self.params(strategy)

        def value(name: str, default: int) -> int:
            if name in values:
                return int(values[name])
            return params[name][0] if len(params.get(name, ())) == 1 else default

        blocks = {self.axis: value(f"block_{self.axis}", min(next_pow2(self.shape[self.axis]), 64))}
        for d in self.lanes:
            blocks[d] = value(f"block_{d}", params[f"block_{d}"][0])
        for d in self.k_loops:
            blocks[d] = value(f"block_{d}", CONTRACTION_BLOCK)
        config = KernelConfig(
            blocks,
            num_warps=value("num_warps", 4),
            num_stages=value("num_stages", 2),
            split=value("split", STRATEGIES[strategy].least_split) if SPLIT in STRATEGIES[strategy].tunables else 1,
            per_lane=bool(value("per_lane", 1)),
            combine=COMBINES[value("combine", 0)],
        )
        return Candidate(strategy, config)

    def values_of(self, candidate: Candidate) -> dict[str, int]:
        c = candidate.config
        out = {f"block_{d}": b for d, b in c.blocks.items()}
        out.update(num_warps=c.num_warps, num_stages=c.num_stages)
        if SPLIT in STRATEGIES[candidate.strategy].tunables:
            out["split"] = c.split
        if "per_lane" in self.params(candidate.strategy):
            out["per_lane"] = int(c.per_lane)
        if "combine" in self.params(candidate.strategy):
            out["combine"] = COMBINES.index(c.combine)
        return out

    # ------------------------------------------------------------------ feasibility
    def blocks_of(self, candidate: Candidate) -> dict[str, int]:
        """Every dim's block as the kernel will have it (inner and topk dims whole)."""
        return self.anatomy.full_blocks(candidate.config.blocks, self.shape)

    def resources(self, candidate: Candidate) -> list[ResourceEstimate]:
        """Per launched kernel: estimated registers, shared memory, largest tile."""
        blocks = self.blocks_of(candidate)
        c = candidate.config
        info = input_info(self.spec, self.dtypes)
        loops = self.anatomy.contraction_loops(blocks, self.shape)
        return [resources(k, info, self.axis, blocks, c.num_warps, c.num_stages, self.profile.target)
                for k in self.anatomy.kernels(candidate.strategy, blocks, per_lane=c.per_lane, loops=loops)]

    def check(self, candidate: Candidate) -> str | None:
        """Why ``candidate`` cannot run on the target, or None; decided before compiling."""
        key = candidate.key()
        if key not in self._checked:
            self._checked[key] = self._check(candidate)
        return self._checked[key]

    def _check(self, candidate: Candidate) -> str | None:
        strategy, c = candidate.strategy, candidate.config
        if strategy not in STRATEGIES:
            return f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}"
        if self._valid.get(strategy) is not None:
            return f"{strategy} is not valid here: {self._valid[strategy]}"
        params = self.params(strategy)
        values = self.values_of(candidate)
        for name in params:
            if name not in values:
                return f"{name} is missing"
        for name, v in values.items():
            if name not in params:
                return f"{name} is not a parameter of {strategy}"
            if name.startswith("block_"):
                d = name[6:]
                if v < 1 or v & (v - 1):
                    return f"BLOCK_{d} = {v} is not a power of two"
                if v > next_pow2(self.shape[d]):
                    return f"BLOCK_{d} = {v} is larger than {d} ({self.shape[d]})"
            if v not in params[name]:
                return f"{name} = {v} is not among the choices {params[name]}"
        n, block = self.shape[self.axis], c.blocks[self.axis]
        if STRATEGIES[strategy].splits_axis and c.split > cdiv(n, block):
            return (f"split = {c.split} > {cdiv(n, block)} tiles of {self.axis} ({n} / BLOCK {block}): "
                    "some parts would be empty")
        try:
            make_plan(self.spec, self.derivation, strategy, self.shape, c)
        except NotValid as err:
            return str(err)
        return self._check_resources(candidate)

    def _check_resources(self, candidate: Candidate) -> str | None:
        strategy, c = candidate.strategy, candidate.config
        p = self.profile
        threads = p.warp_size * c.num_warps
        blocks = self.blocks_of(candidate)
        loops = self.anatomy.contraction_loops(blocks, self.shape)
        kernels = self.anatomy.kernels(strategy, blocks, per_lane=c.per_lane, loops=loops)
        rows = self.anatomy.dot_rows(strategy, blocks, per_lane=c.per_lane, loops=loops)
        for kernel, r, dot_rows in zip(kernels, self.resources(candidate), rows):
            where = f" ({kernel.name})" if len(kernels) > 1 else ""  # split_fused's part or combine kernel
            if r.smem_bytes > p.smem_per_block_max:
                return (f"shared memory{where}: {r.smem_bytes // 1024} KiB > {p.smem_per_block_max // 1024} KiB "
                        f"{p.smem_limit_words} on {p.name} "
                        f"(tl.dot operands and pipelined loads x num_stages = {c.num_stages})")
            # registers are pruned here by a lower bound only: the compile gate has ptxas's count
            if r.min_regs_per_thread > p.regs_per_thread_max:
                return (f"registers{where}: at least {r.min_regs_per_thread} per thread > {p.regs_per_thread_max} "
                        f"({r.live_elements} live values over {threads} threads)")
            if r.min_regs_per_thread * threads > p.regs_per_sm:
                return (f"registers{where}: at least {r.min_regs_per_thread} per thread x {threads} threads > "
                        f"{p.regs_per_sm} per {p.sm_word} on {p.name}")
            if c.num_warps > 4 and (p.target.capability or 0) >= 90:  # wgmma: NVIDIA sm_90 on
                short = [d for d in dot_rows if blocks[d] < WGMMA_ROWS * c.num_warps // 4]
                if short:
                    return (f"num_warps = {c.num_warps} on a tl.dot of BLOCK_{short[0]} = {blocks[short[0]]} rows: a "
                            f"warpgroup (4 warps) takes {WGMMA_ROWS} rows of a wgmma, so two warpgroups would "
                            "compute the same product")
            if kernel is kernels[0] and \
                    threads > 4 * r.tile_elements and c.num_warps > 1:  # the combine kernel shares num_warps
                return (f"num_warps = {c.num_warps} ({threads} threads) for a largest tile of {r.tile_elements} "
                        "elements: more than 4 threads per element")
        return None

    # ------------------------------------------------------------------ exhaustive
    def size(self) -> int:
        """Combinations of parameter choices over all strategies (feasible or not)."""
        return sum(math.prod(len(v) for v in self.params(s).values()) for s in self.strategies())

    def enumerate(self, strategies: Iterable[str] | None = None) -> Iterator[Candidate]:
        """Every feasible candidate (of ``strategies``, default all), strategy by strategy.
        Tilings that fail the plan are skipped before their warps x stages are tried; more than
        MAX_CANDIDATES feasible candidates is an error (the exhaustive benchmark would not be
        exhaustive)."""
        count = 0
        chosen = self.strategies() if strategies is None else [s for s in self.strategies() if s in set(strategies)]
        for strategy in chosen:
            for c in self._enumerate(strategy):
                count += 1
                if count > MAX_CANDIDATES:
                    raise ValueError(f"more than {MAX_CANDIDATES} feasible candidates: too many to enumerate")
                yield c

    def _enumerate(self, strategy: str) -> Iterator[Candidate]:
        params = self.params(strategy)
        tiling = [n for n in params if n not in ("num_warps", "num_stages")]
        for combo in itertools.product(*(params[n] for n in tiling)):
            values = dict(zip(tiling, combo))
            probe = self.candidate(strategy, {**values, "num_warps": 1, "num_stages": 1})
            reason = self.check(probe)
            if reason is not None and not reason.startswith(RESOURCE_REASONS):
                self._last_reason[strategy] = reason
                continue
            for warps, stages in itertools.product(params["num_warps"], params["num_stages"]):
                c = self.candidate(strategy, {**values, "num_warps": warps, "num_stages": stages})
                reason = self.check(c)
                if reason is None:
                    yield c
                else:
                    self._last_reason[strategy] = reason
