"""A tuned shape range as one callable: each call runs the kernel of the bucket its sizes fall in.

:class:`RangeKernel` wraps one :class:`service.bundle.BundleKernel` per bucket of a range job
(:mod:`service.shape_ranges`). A call reads the ranged dims' sizes from the input tensors'
shapes, on the host (no device sync, no request), picks the smallest bucket ``>= size`` per
ranged dim, and calls that bucket's kernel with the same arguments; every check and launch is
the bucket kernel's own. A size below the range's ``min`` runs the smallest bucket (rounding up
is always safe: service.shape_ranges); a size above ``max`` is refused: no kernel was
generated for it. Fixed dims are checked by the bucket kernel as usual (they must fit its
``size_limits``).

``last_bucket`` is the bucket (its shape, the caller's dim names) the latest call ran: for tests
and logs. Everything that describes the kernel (``spec``, ``input_names``, ``output_parts``,
``output_shapes`` ...) is the largest bucket's, the same for every bucket.

Light like service.bundle: no torch import here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from service.bundle import BundleError, BundleKernel
from service.bundle.leading import call_folded
from service.dim_names import DimNames


class RangeKernel:
    """``kernel(inputs)`` / ``kernel(x=..., w=...)`` over a tuned range (module docstring)."""

    def __init__(self, shape: Mapping[str, Any], buckets: Sequence[tuple[Mapping[str, int], BundleKernel]]):
        """``shape``: the range in canonical dim names (``{"d0": {"min", "max", "buckets"}, "d1": 64}``);
        ``buckets``: (canonical bucket shape, its kernel speaking the caller's names), any order."""
        if not buckets:
            raise BundleError("buckets: a range needs at least one bucket's kernel")
        self.range_shape = dict(shape)
        kernels = [k for _, k in buckets]
        self._largest = kernels[-1]
        names = DimNames.of(self._largest.spec)
        self._ranged = sorted(d for d, v in shape.items() if isinstance(v, Mapping))
        # per ranged dim: (caller's name, min, max, sorted uppers, where to read its size: (input, axis, times))
        self._dims = []
        paged = {p.dim: (table, len(p.by), p.page_size) for table, p in self._largest.spec.page_tables.items()}
        for d in self._ranged:
            name = names.user(d)
            where = next(((inp, dims.index(name), 1) for inp, dims in self._largest.input_dims.items() if name in dims),
                         paged.get(name))  # a paged dim: its table's width in pages, times the page size
            if where is None:  # every dim of a spec is some input's (fuser_core); a bundle that says otherwise is bad
                raise BundleError(f"shape.{name}: no input has this dim, so a call cannot pick its bucket")
            v = shape[d]
            self._dims.append((name, int(v["min"]), int(v["max"]), tuple(sorted(int(n) for n in v["buckets"])), where))
        self._kernels: dict[tuple[int, ...], BundleKernel] = {}
        self._shapes: dict[tuple[int, ...], dict[str, int]] = {}
        for cshape, kernel in buckets:
            key = tuple(int(cshape[d]) for d in self._ranged)
            self._kernels[key] = kernel
            self._shapes[key] = names.user_shape(cshape)
        missing = [u for u in self._all_keys() if u not in self._kernels]
        if missing:
            raise BundleError(f"buckets: no kernel for bucket {missing[0]} of the range")
        self.last_bucket: dict[str, int] | None = None

    def _all_keys(self) -> list[tuple[int, ...]]:
        keys: list[tuple[int, ...]] = [()]
        for *_, uppers, _where in self._dims:
            keys = [k + (u,) for k in keys for u in uppers]
        return keys

    # -- which bucket
    def bucket_for(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """The bucket (its tuned shape, caller's names) that runs ``sizes`` (caller's dim -> size)."""
        return self._shapes[self._key(sizes)]

    def _key(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        key = []
        for name, lo, hi, uppers, _where in self._dims:
            n = sizes[name]
            if n > hi:
                raise BundleError(f"inputs: dim {name} = {n} is above the tuned range {lo}..{hi} of this kernel; "
                                  "tune a range (or a shape) that holds it")
            key.append(uppers[bisect.bisect_left(uppers, n)])  # smallest bucket >= n (below min: the first)
        return tuple(key)

    def kernel_for(self, sizes: Mapping[str, int]) -> BundleKernel:
        return self._kernels[self._key(sizes)]

    @property
    def buckets(self) -> list[tuple[dict[str, int], BundleKernel]]:
        """(bucket shape in the caller's names, its kernel), smallest first."""
        return [(self._shapes[k], self._kernels[k]) for k in sorted(self._kernels)]

    @property
    def shape(self) -> dict[str, Any]:
        """The tuned range, caller's names: fixed sizes and ``{"min", "max", "buckets"}``."""
        return DimNames.of(self._largest.spec).user_shape(self.range_shape)

    # -- running
    def __call__(self, inputs: Mapping[str, Any] | None = None, /, *, out: Mapping[str, Any] | None = None,
                 **tensors: Any) -> dict[str, Any]:
        given = inputs if inputs is not None else tensors
        if isinstance(given, Mapping) and not (inputs is not None and tensors):  # [b, s, c] for x[t, c]: the bucket of t
            folded = call_folded(self, self._largest.input_dims, self._largest.output_dims, given, out)
            if folded is not None:
                return folded
        sizes = {}
        for name, _lo, _hi, _uppers, (inp, axis, times) in self._dims:
            t = given.get(inp) if isinstance(given, Mapping) else None
            if t is None or len(t.shape) <= axis:  # let the kernel's own checks name what is wrong
                return self._largest(inputs, out=out, **tensors)
            sizes[name] = int(t.shape[axis]) * times
        key = self._key(sizes)
        self.last_bucket = self._shapes[key]
        return self._kernels[key](inputs, out=out, **tensors)

    def __getattr__(self, name: str) -> Any:
        # what describes the kernel (spec, input and output names, dtypes, output_shapes...) is
        # every bucket's; the largest's stands for them
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._largest, name)

    def __repr__(self) -> str:
        ranged = ", ".join(f"{n}={lo}..{hi} ({len(u)} buckets)" for n, lo, hi, u, _ in self._dims)
        return f"RangeKernel({self._largest.spec.name}, {ranged}, target={self._largest.target})"
