"""A kernel's tunable parameters (:class:`KernelConfig`) and the refusal every planning step raises
(:class:`NotValid`): below the plan and the strategies, which both build and check configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


MAX_TILE_ELEMENTS = 1 << 16  # elements of the largest tensor a program holds


# split_fused's ways to merge its partial states (KernelConfig.combine)
COMBINES = ("kernel", "last_part")


@dataclass(frozen=True)
class KernelConfig:
    """Tunable parameters: tile sizes per dim, warps, stages, split count."""

    blocks: dict[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    split: int = 1
    # a streamed loop keeps its running states per lane of the tile where the derivation allows it
    # (structure.per_lane: no cross-warp reduction per tile, a correction exp per element); False:
    # per tile, as Liger-Kernel's and the tutorials' online softmax (one exp per element, two
    # tile reductions per iteration). A tuning choice; absent from to_dict() when True, so the
    # configs stored before it keep their keys.
    per_lane: bool = True
    # split_fused's merge of the partial states: a combine kernel launched after the part kernel
    # ("kernel"), or the last program of each lane block to finish its chunk, in the same launch
    # ("last_part": an atomic ticket per lane block; one launch). A tuning choice; absent from
    # to_dict() when "kernel", so the configs stored before it keep their keys.
    combine: str = "kernel"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"blocks": dict(sorted(self.blocks.items())), "num_warps": self.num_warps,
                               "num_stages": self.num_stages, "split": self.split}
        if not self.per_lane:
            out["per_lane"] = False
        if self.combine != "kernel":
            out["combine"] = self.combine
        return out

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> KernelConfig:
        if not isinstance(raw, dict):
            raise ValueError("config must be a JSON object")
        unknown = set(raw) - {"blocks", "num_warps", "num_stages", "split", "per_lane", "combine"}
        if unknown:
            raise ValueError(f"unknown config field {sorted(unknown)[0]!r}")
        blocks = raw.get("blocks", {})
        if not isinstance(blocks, dict) or not all(isinstance(v, int) and v >= 1 for v in blocks.values()):
            raise ValueError("config.blocks must map dims to positive integers")
        for v in blocks.values():
            if v & (v - 1):
                raise ValueError(f"config.blocks: {v} is not a power of two")
        if not isinstance(raw.get("per_lane", True), bool):
            raise ValueError("config.per_lane must be true or false")
        if raw.get("combine", "kernel") not in COMBINES:
            raise ValueError(f"config.combine must be one of {', '.join(COMBINES)}")
        out = KernelConfig(dict(blocks), int(raw.get("num_warps", 4)), int(raw.get("num_stages", 2)),
                           int(raw.get("split", 1)), bool(raw.get("per_lane", True)), raw.get("combine", "kernel"))
        if out.num_warps not in (1, 2, 4, 8, 16, 32) or out.split < 1 or out.num_stages < 1:
            raise ValueError("config: num_warps in 1..32 (power of two), split >= 1, num_stages >= 1")
        return out


class NotValid(Exception):
    """This strategy cannot run this (spec, shape, config); the message says why."""
