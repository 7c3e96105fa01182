"""The strategies by name: the one place a strategy's name is written.

Everything else refers to a strategy through the objects and constants here (a plan, a
candidate, a stored kernel carry the name; :func:`strategy_named` gives its object back).

The unfused chain (:data:`BASELINE`) is not a strategy but the baseline fused kernels are
compared with: one kernel per reduction, through memory (:mod:`fuser_core.codegen.chain`), each
planned with :data:`ROW_RESIDENT` or :data:`MULTI_PASS` over a sub-spec. It has no configuration
to tune, is valid for every cascade, and is never a search candidate; it has a name because it is
measured, stored and shown beside the strategies.
"""

from __future__ import annotations

from fuser_core.codegen.config import NotValid
from fuser_core.codegen.strategies.base import Strategy
from fuser_core.codegen.strategies.multi_pass import MultiPass
from fuser_core.codegen.strategies.row_resident import RowResident
from fuser_core.codegen.strategies.split_fused import SplitFused
from fuser_core.codegen.strategies.streaming_fused import StreamingFused

ROW_RESIDENT = RowResident("row_resident")
STREAMING_FUSED = StreamingFused("streaming_fused")
SPLIT_FUSED = SplitFused("split_fused")
MULTI_PASS = MultiPass("multi_pass")

# name -> strategy, in plan order (the order valid_strategies reports and the tuner lists them)
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (ROW_RESIDENT, STREAMING_FUSED, SPLIT_FUSED, MULTI_PASS)}
# the order a run without a tuned kernel picks the first valid one in: one pass first, the split last
PREFERENCE: tuple[str, ...] = (STREAMING_FUSED.name, ROW_RESIDENT.name, SPLIT_FUSED.name, MULTI_PASS.name)
FALLBACK = MULTI_PASS.name  # always valid
BASELINE = "unfused_chain"


def strategy_named(name: str) -> Strategy:
    """The strategy called ``name``; :class:`NotValid` (saying which there are) for any other name."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise NotValid(f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}") from None


def is_fused(name: str | None) -> bool:
    """Is ``name`` a strategy that streams with running values (False for the baseline, None or another name)?"""
    return name in STRATEGIES and STRATEGIES[name].fused
