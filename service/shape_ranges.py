"""Shape ranges: a job tuned over a range of sizes of one or more dims, one kernel per bucket.

A job's ``shape`` may give a dim as a range instead of a size (docs/API.md, "Shape ranges")::

    "shape": {"t": {"min": 1, "max": 16384}, "c": 4096}
    "shape": {"t": {"min": 1, "max": 16384, "buckets": [1, 8, 64, 512, 4096, 16384]}, "c": 4096}

Decisions, made here once:

- **Buckets.** Without ``buckets``, the powers of two within ``[min, max]``, plus ``max`` when
  it is not one (t in [1, 16384]: 1, 2, 4, ..., 16384, 15 buckets; [3, 100]: 4, 8, 16, 32, 64,
  100). Given ``buckets`` must be distinct integers within ``[min, max]`` and include ``max``
  (so every size of the range has a bucket); they are sorted. With several ranged dims a bucket
  is one choice per dim (the product); at most :data:`MAX_BUCKETS` buckets in all, since each
  is tuned on its own.
- **Which bucket serves a size.** The smallest bucket ``>= size``, per ranged dim (like vLLM's
  fused-MoE config tables, keyed by token count). Rounding *up* is what makes it safe: a bucket's
  kernel was generated at its upper size, and a dim the kernel holds whole in one block
  (``size_limits``, :mod:`service.bundle`) admits every size up to the one it was generated for.
- **Batch-invariant ranges.** A job with ``"batch_invariant": true`` gets one bucket per ranged
  dim, its ``max`` (given ``buckets`` are refused), so one kernel serves every size of the range.
  That is what makes a row's bits independent of the batch: a kernel's reduction order within a
  row is fixed by its configuration (blocks, split, warps; a split's partial states merge in part
  order), never by the sizes it runs at, and rows never share a reduction. Where buckets differ,
  a row at t = 1 and the same row at t = 37 can run two kernels with two orders. The flag is not
  stored: a range is batch-invariant when every ranged dim has one bucket (:func:`one_kernel`),
  so a job that gave ``buckets: [max]`` is the same job.
- **Canonical form.** A range job's shape is stored in the canonical dim names with every
  range complete (``{"d0": {"min": 1, "max": 16384, "buckets": [1, 2, ...]}, "d1": 64}``), and
  keyed by :func:`range_key` (``d0=1..16384[1;2;4;...],d1=64``): two submissions with the same
  buckets are one job; other buckets are another job.

This module is plain Python (no torch, sympy or database imports): the client uses
:func:`pick_bucket` on its hot path.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import InvalidRequest

MAX_BUCKETS = 32  # buckets per range job, over all ranged dims: each is a search of its own
TRIAL_STRIDE = 10_000  # a range job's trial numbers: bucket index (smallest first) * this + the bucket study's number
RANGE_FIELDS = ("min", "max", "buckets")


@dataclass(frozen=True)
class DimRange:
    """One ranged dim: sizes ``lo..hi``, tuned at ``buckets`` (sorted, the last is ``hi``)."""

    lo: int
    hi: int
    buckets: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"min": self.lo, "max": self.hi, "buckets": list(self.buckets)}

    def bucket_of(self, size: int) -> int | None:
        """The smallest bucket ``>= size``; None outside ``[min, max]``."""
        if not self.lo <= size <= self.hi:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, size)]


def is_range(value: Any) -> bool:
    """A shape entry that is a range (an object), not a size."""
    return isinstance(value, Mapping)


def has_ranges(shape: Mapping[str, Any]) -> bool:
    return isinstance(shape, Mapping) and any(is_range(v) for v in shape.values())


def default_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """The powers of two within ``[lo, hi]``, plus ``hi`` when it is not one."""
    out, p = [], 1
    while p <= hi:
        if p >= lo:
            out.append(p)
        p *= 2
    if not out or out[-1] != hi:
        out.append(hi)
    return tuple(out)


def _positive_int(value: Any, loc: tuple[str | int, ...], max_dim: int | None) -> int:
    top = f" to {max_dim}" if max_dim is not None else ""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (max_dim is not None and value > max_dim):
        raise InvalidRequest(f"must be an integer from 1{top or ' up'}, got {value!r:.40}", loc=loc)
    return value


def parse_range(dim: str, value: Any, *, max_dim: int | None = None, one_bucket: bool = False) -> DimRange:
    """A ``{"min", "max", "buckets"?}`` object checked; InvalidRequest naming ``shape.<dim>.<field>``.
    ``one_bucket`` (a batch-invariant job): the range's one bucket is its max; buckets are refused."""
    loc = ("shape", dim)
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"expected a size or a range {{\"min\": .., \"max\": ..}}, got {value!r:.40}", loc=loc)
    unknown = sorted(set(value) - set(RANGE_FIELDS), key=str)
    if unknown:
        raise InvalidRequest(f"unknown field; a range has {', '.join(RANGE_FIELDS)}", loc=(*loc, str(unknown[0])))
    for field in ("min", "max"):
        if field not in value:
            raise InvalidRequest("missing: a range needs min and max", loc=(*loc, field))
    lo = _positive_int(value["min"], (*loc, "min"), max_dim)
    hi = _positive_int(value["max"], (*loc, "max"), max_dim)
    if hi < lo:
        raise InvalidRequest(f"must be at least min ({lo}), got {hi}", loc=(*loc, "max"))
    given = value.get("buckets")
    if one_bucket and given is not None:
        raise InvalidRequest("a batch-invariant range is served by one kernel, tuned at max: leave buckets out",
                             loc=(*loc, "buckets"))
    if given is None:
        return DimRange(lo, hi, (hi,) if one_bucket else default_buckets(lo, hi))
    if not isinstance(given, list | tuple) or not given:
        raise InvalidRequest(f"expected a non-empty list of sizes, got {given!r:.40}", loc=(*loc, "buckets"))
    if len(given) > MAX_BUCKETS:
        raise InvalidRequest(f"{len(given)} buckets; at most {MAX_BUCKETS}", loc=(*loc, "buckets"))
    sizes = []
    for i, n in enumerate(given):
        n = _positive_int(n, (*loc, "buckets", i), max_dim)
        if not lo <= n <= hi:
            raise InvalidRequest(f"must be within min..max ({lo}..{hi}), got {n}", loc=(*loc, "buckets", i))
        if n in sizes:
            raise InvalidRequest(f"bucket {n} is given twice", loc=(*loc, "buckets", i))
        sizes.append(n)
    if hi not in sizes:  # a size above the last bucket would have no kernel to run it
        raise InvalidRequest(f"must include max ({hi}): a size is served by the smallest bucket >= it",
                             loc=(*loc, "buckets"))
    return DimRange(lo, hi, tuple(sorted(sizes)))


def split_shape(shape: Mapping[str, Any], *, max_dim: int | None = None,
                one_bucket: bool = False) -> tuple[dict[str, Any], dict[str, DimRange]]:
    """(the fixed sizes as given, the ranged dims checked); InvalidRequest naming every bad field,
    and ``shape`` when the buckets' product is over :data:`MAX_BUCKETS`. ``one_bucket``: see
    :func:`parse_range`."""
    fixed: dict[str, Any] = {}
    ranges: dict[str, DimRange] = {}
    errors: list[InvalidRequest] = []
    for dim, value in shape.items():
        if not is_range(value):
            fixed[dim] = value
            continue
        try:
            ranges[dim] = parse_range(dim, value, max_dim=max_dim, one_bucket=one_bucket)
        except InvalidRequest as err:
            errors.append(err)
    if errors:
        raise InvalidRequest.of(errors)
    total = 1
    for r in ranges.values():
        total *= len(r.buckets)
    if total > MAX_BUCKETS:
        counts = " x ".join(f"{d}: {len(r.buckets)}" for d, r in ranges.items())
        raise InvalidRequest(f"{total} buckets in all ({counts}); at most {MAX_BUCKETS}: give fewer buckets "
                             "or a narrower range", loc=("shape",))
    return fixed, ranges


def bucket_shapes(fixed: Mapping[str, int], ranges: Mapping[str, DimRange]) -> list[dict[str, int]]:
    """Every bucket's full shape, smallest first (the product over ranged dims)."""
    dims = sorted(ranges)
    return [{**fixed, **dict(zip(dims, uppers))}
            for uppers in itertools.product(*(ranges[d].buckets for d in dims))]


def ranges_of(shape: Mapping[str, Any]) -> dict[str, DimRange]:
    """The ranged dims of a stored (complete, canonical) range shape."""
    return {d: DimRange(int(v["min"]), int(v["max"]), tuple(int(n) for n in v["buckets"]))
            for d, v in shape.items() if is_range(v)}


def fixed_of(shape: Mapping[str, Any]) -> dict[str, int]:
    return {d: v for d, v in shape.items() if not is_range(v)}


def one_kernel(shape: Mapping[str, Any]) -> bool:
    """A stored range shape whose every size runs one kernel: batch-invariant (module docstring)."""
    return has_ranges(shape) and bucket_count(shape) == 1


def bucket_count(shape: Mapping[str, Any]) -> int:
    """How many buckets a stored shape has: 1 for a plain shape."""
    n = 1
    for v in shape.values():
        if is_range(v):
            n *= len(v["buckets"])
    return n


def range_view(shape: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job view says of a range job's buckets (None for a plain job): every bucket's full
    shape, smallest first, and the stride of its trials' numbers (trial n ran bucket n // stride)."""
    if not has_ranges(shape):
        return None
    return {"buckets": bucket_shapes(fixed_of(shape), ranges_of(shape)), "trial_number_stride": TRIAL_STRIDE,
            "batch_invariant": one_kernel(shape)}


def range_key(shape: Mapping[str, Any]) -> str:
    """A stored range shape as key text: ``d0=1..16384[1;2;4],d1=64`` (sorted by dim name)."""
    def text(v: Any) -> str:
        if not is_range(v):
            return str(int(v))
        return f"{int(v['min'])}..{int(v['max'])}[{';'.join(str(int(n)) for n in v['buckets'])}]"

    return ",".join(f"{d}={text(v)}" for d, v in sorted(shape.items()))


def pick_bucket(shape: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, int] | None:
    """The bucket (its full shape) serving ``sizes`` under the stored range ``shape``: fixed dims
    equal, each ranged dim rounded up to its smallest bucket; None when ``sizes`` is outside."""
    if set(sizes) != set(shape):
        return None
    out: dict[str, int] = {}
    for d, v in shape.items():
        if is_range(v):
            r = DimRange(int(v["min"]), int(v["max"]), tuple(v["buckets"]))
            upper = r.bucket_of(sizes[d])
            if upper is None:
                return None
            out[d] = upper
        elif sizes[d] != v:
            return None
        else:
            out[d] = v
    return out
