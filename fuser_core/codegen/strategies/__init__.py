"""One module per strategy (docs/THEORY.md section 6) and their registry: see
:mod:`fuser_core.codegen.strategies.registry` (the names) and :mod:`~fuser_core.codegen.strategies.base`
(what a strategy holds)."""

from fuser_core.codegen.strategies.base import DefaultTiling, Strategy
from fuser_core.codegen.strategies.registry import (
    BASELINE,
    FALLBACK,
    MULTI_PASS,
    PREFERENCE,
    ROW_RESIDENT,
    SPLIT_FUSED,
    STRATEGIES,
    STREAMING_FUSED,
    is_fused,
    strategy_named,
)

__all__ = ["BASELINE", "FALLBACK", "MULTI_PASS", "PREFERENCE", "ROW_RESIDENT", "SPLIT_FUSED", "STRATEGIES",
           "STREAMING_FUSED", "DefaultTiling", "Strategy", "is_fused", "strategy_named"]
