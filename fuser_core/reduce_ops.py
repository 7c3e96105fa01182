"""The reduce kinds, one table: what each reduction is, for every module that branches on one.

A spec's step names its reduction in ``reduce`` (:data:`SPEC_REDUCE_KINDS`: sum, max, min, topk,
argmax, argmin); the derivation adds ``bottomk``, a topk realised on values multiplied by a negative
factor (:attr:`ReduceOp.swapped`). Each :class:`ReduceOp` says, once, what the spec loader, the
derivation, the realisations, the reference, the certificate, the code generator and the tuner ask:

- ``selection``: it keeps chosen elements and their positions (values and indices), not a combination;
- ``returns_indices``: the step's value is positions (an int32 output), not values;
- ``slots``: it keeps ``k`` ranked slots (a topk step's ``as`` dim; its parts ``.values``/``.indices``);
- ``order``: it is decided by the order of values (its integrand separates as ``a(D) G(x) + b(D)``);
- ``swapped``: the kind it becomes on values multiplied by a negative factor;
- ``negated``: a selection run on negated values (the kernels' selections all pick the largest);
- ``identity``: the value of its empty fold (a selection's values; their indices start at 0);
- ``excludes_masked``: a fold drops elements a where() on indices masks to its identity
  (:mod:`fuser_core.masks`); selections keep them (a top-k of a short row still has k slots);
- ``in_tile``: it may be reduced over a whole tile at once (an inner reduction, a lane merge);
- ``triton_reduce``: the Triton reduction of a whole tile, for a kind Triton reduces as we need;
- ``nan_helper``: the NaN-propagating ``@triton.jit`` helper (fuser_core/codegen/helpers.py) that
  combines two values, and reduces a tile with ``tl.reduce`` (``tl.max``/``tl.min`` drop NaN);
- ``merge_helper``: the helper that merges a selection's state with a tile's or another part's.

Light (no sympy, no numpy): the spec loader reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ReduceOp:
    name: str
    in_spec: bool  # a spec's "reduce" may name it (bottomk comes from the derivation only)
    selection: bool = False
    returns_indices: bool = False
    slots: bool = False
    order: bool = False
    swapped: str | None = None
    negated: bool = False
    identity: float = -math.inf
    excludes_masked: bool = False
    in_tile: bool = False
    triton_reduce: str | None = None
    nan_helper: str | None = None
    merge_helper: str | None = None


# in the order a spec's error message lists them
REDUCE_OPS: dict[str, ReduceOp] = {r.name: r for r in (
    ReduceOp("sum", True, identity=0.0, excludes_masked=True, in_tile=True, triton_reduce="tl.sum"),
    ReduceOp("max", True, order=True, swapped="min", excludes_masked=True, in_tile=True, nan_helper="max_nan"),
    ReduceOp("min", True, order=True, swapped="max", identity=math.inf, excludes_masked=True, in_tile=True,
             nan_helper="min_nan"),
    ReduceOp("topk", True, selection=True, slots=True, order=True, swapped="bottomk", merge_helper="topk_merge"),
    ReduceOp("argmax", True, selection=True, returns_indices=True, order=True, swapped="argmin",
             merge_helper="argmax_merge"),
    ReduceOp("argmin", True, selection=True, returns_indices=True, order=True, swapped="argmax", negated=True,
             merge_helper="argmax_merge"),
    ReduceOp("bottomk", False, selection=True, slots=True, order=True, negated=True, merge_helper="topk_merge"),
)}
SPEC_REDUCE_KINDS = tuple(name for name, r in REDUCE_OPS.items() if r.in_spec)


def reduce_op(kind: str) -> ReduceOp:
    """The table's row for ``kind``; ValueError for a kind it does not have."""
    try:
        return REDUCE_OPS[kind]
    except KeyError:
        raise ValueError(f"unknown reduce kind {kind!r}") from None


def _has(kind: str | None, flag: str) -> bool:
    row = REDUCE_OPS.get(kind) if kind is not None else None
    return row is not None and getattr(row, flag)


# each: False for None (an elementwise step's ``reduce``) and for a kind the table does not have
def is_selection(kind: str | None) -> bool:
    return _has(kind, "selection")


def returns_indices(kind: str | None) -> bool:
    return _has(kind, "returns_indices")


def has_slots(kind: str | None) -> bool:
    return _has(kind, "slots")


def excludes_masked(kind: str | None) -> bool:
    return _has(kind, "excludes_masked")


def in_tile(kind: str | None) -> bool:
    return _has(kind, "in_tile")


def is_negated(kind: str | None) -> bool:
    return _has(kind, "negated")


def is_extremum(kind: str | None) -> bool:
    """max or min: decided by order, combining values (not a selection)."""
    return _has(kind, "order") and not _has(kind, "selection")
