"""Which values an index input may hold, read from the spec itself.

An index input compared for equality with ``index(dim)`` selects a position along ``dim``: a
gather (cross-entropy's ``where(index(v) == target, logits, 0)``). A value outside
``[0, size(dim))`` selects nothing, and the spec's formula would turn it silently into a number
(cross-entropy's loss becomes the logsumexp); so such values are refused before a launch, with an
error naming the input, the position and the value. The exceptions are the constants the spec
compares the input with for (in)equality itself (``where(target == ignore_index, 0, ...)``): the
spec says what they mean. An index input only compared by order (``index(n) < kv_len``) takes
any value: a length beyond the axis is the whole axis, a start below 0 is its beginning.

The check runs where the data is, on NumPy arrays or torch tensors alike; for a tensor on a GPU
it costs one small reduction and one synchronisation per call (:func:`first_out_of_range`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core import expr as ex
from fuser_core.spec import Spec


@dataclass(frozen=True)
class IndexRange:
    """Index input ``name`` must lie in [0, size(dim)) or be one of ``allowed``."""

    name: str
    dim: str
    allowed: tuple[float, ...]


def _refs(node: Any, name: str) -> bool:
    return any(isinstance(n, ex.Ref) and n.name == name for n in ex.walk(node))


def _constant(node: Any, params: Mapping[str, Any]) -> float | None:
    """A number, a negated number, or a param that is a number (ignore_index = -100)."""
    if isinstance(node, ex.Num):
        return float(node.value)
    if isinstance(node, ex.Neg):
        inner = _constant(node.operand, params)
        return None if inner is None else -inner
    if isinstance(node, ex.Ref) and node.name in params:
        return _constant(params[node.name], params)
    return None


def index_ranges(spec: Spec) -> tuple[IndexRange, ...]:
    """The range rule of every index input that some step compares for equality with
    ``index(dim)`` (the smallest such dim's rule is enforced by checking each)."""
    params = {p.name: p.expr for p in spec.params}
    index_inputs = {i.name for i in spec.inputs if i.is_index}
    dims: dict[str, list[str]] = {}
    allowed: dict[str, set[float]] = {}
    for step in spec.steps:
        for node in ex.walk(step.expr):
            if not isinstance(node, ex.Compare) or node.op not in ("==", "!="):
                continue
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if not (isinstance(a, ex.Ref) and a.name in index_inputs):
                    continue
                if isinstance(b, ex.Index):
                    dims.setdefault(a.name, []).append(b.dim)
                elif (value := _constant(b, params)) is not None:
                    allowed.setdefault(a.name, set()).add(value)
    return tuple(IndexRange(name, dim, tuple(sorted(allowed.get(name, ())))) for name, ds in dims.items()
                 for dim in dict.fromkeys(ds))


def first_out_of_range(rule: IndexRange, values: Any, size: int) -> tuple[tuple[int, ...], int] | None:
    """(position, value) of the first element of ``values`` (a NumPy array or a torch tensor)
    outside the rule, or None when all are inside. One pass over the values.

    An empty axis (``size`` 0) has no position to select and nothing to read: its reductions give
    their identities whatever the index holds (fuser_core.empty), so no value is refused."""
    if size == 0:
        return None
    bad = (values < 0) | (values >= size)
    for value in rule.allowed:
        bad &= values != value
    if not bool(bad.any()):
        return None
    if hasattr(bad, "dim"):  # torch
        first = bad.nonzero()[0]
    else:  # NumPy, imported here: the client loads this module without it
        import numpy as np

        first = np.argwhere(bad)[0]
    position = tuple(int(i) for i in first)
    return position, int(values[position])


def out_of_range_message(rule: IndexRange, size: int, position: tuple[int, ...], value: int) -> str:
    """The error text, for the caller to raise with the input's name as its location."""
    extra = "".join(f" or {int(v)}" for v in rule.allowed)
    return (f"holds {value} at position {list(position)}; its values select a position along {rule.dim} "
            f"and must lie in [0, {size}){extra}")
