"""What a kernel client call asks for: its spec argument worked out once, the request in
canonical form, and the in-process memo's keys and entries (:mod:`service.client`, module
docstring)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core import (
    CatalogError, Spec, SpecError, canonical_json, canonical_shape, load_spec, normalize_dtype, spec_hash, spec_source,
)
from service.bundle import BundleKernel, dtype_text, parse_shape_text, shape_text
from service.dim_names import DimNames
from service.shape_ranges import has_ranges, is_range
from service.tuning_request import check_target

MEMO_LIMIT = 4096  # requests (and spec arguments) remembered in-process; the oldest go first


def as_spec(spec: Spec | Mapping[str, Any] | str | bytes | os.PathLike) -> Spec:
    """A spec from a loaded Spec, a dict, JSON text/bytes, a path to a JSON file or a catalog
    name (``"safe_softmax"``, :mod:`fuser_core.catalog`)."""
    return spec_and_source(spec)[0]


def spec_and_source(spec: Any) -> tuple[Spec, str | None]:
    """(the spec, its JSON text as a job submits it): the caller's own text where there is one,
    so the server shows the caller's names; None for a loaded Spec (its canonical JSON is sent)."""
    if isinstance(spec, Spec):
        return spec, None
    if isinstance(spec, Mapping):
        return load_spec(spec), json.dumps(spec)
    if isinstance(spec, bytes):
        return load_spec(spec), spec.decode("utf-8")
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return load_spec(spec), spec
    if isinstance(spec, str | os.PathLike):
        try:
            text = spec_source(spec)
        except CatalogError as err:
            raise SpecError(str(err), loc=("spec",)) from None
        return load_spec(text), text.decode("utf-8")
    raise SpecError(f"expected a spec dict, JSON text, a path or a catalog name, got {type(spec).__name__}",
                    loc=("spec",))


def parse_shape(shape: Mapping[str, int] | str) -> dict[str, int]:
    """A shape dict, or ``"m=4,n=300"`` (:func:`service.bundle.parse_shape_text`)."""
    if isinstance(shape, Mapping):
        return dict(shape)
    return parse_shape_text(shape)


@dataclass(frozen=True)
class SpecFacts:
    """What a spec argument means, worked out once per distinct argument (it is hashed once)."""

    user: Spec  # the caller's spec (for a Spec argument, the object itself: memo keys hold it by id)
    shash: str
    names: DimNames  # canonical versus the caller's names
    source: str | None  # the caller's JSON text, for a tuning job (None: a loaded Spec, sent canonical)

    @staticmethod
    def of(spec: Any) -> SpecFacts:
        user, source = spec_and_source(spec)
        return SpecFacts(user, spec_hash(user), DimNames.of(user), source)


@dataclass(frozen=True)
class KernelRequest:
    """One validated request: the caller's spec, and shape/dtype/target in canonical form."""

    user: Spec
    shash: str
    cshape: dict[str, int]
    ndtype: str | dict[str, str]
    target: str
    names: DimNames  # canonical versus the caller's names
    source: str | None = None  # the caller's JSON text, for a tuning job (None: send the canonical form)
    # only a range one kernel serves whole answers it (service.shape_ranges, "Batch-invariant ranges")
    batch_invariant: bool = False
    # a range job's shape, canonical ({"d1": {"min": 1, "max": 64}, ...}); cshape is then its largest bucket
    job_range: dict[str, Any] | None = None

    @staticmethod
    def make(spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str], target: str) -> KernelRequest:
        return KernelRequest.of(SpecFacts.of(spec), shape, dtype, target)

    @staticmethod
    def of(facts: SpecFacts, shape: Mapping[str, Any] | str, dtype: str | Mapping[str, str],
           target: str, batch_invariant: bool = False) -> KernelRequest:
        """``shape`` may give dims as ranges (``{"t": {"min": 1, "max": 64}}``, a tuning job's form):
        the request is then for the range's largest sizes, and its job for the range."""
        user, given = facts.user, parse_shape(shape)
        sizes = {d: v["max"] if is_range(v) and "max" in v else v for d, v in given.items()}
        cshape = canonical_shape(user, sizes)  # names each unknown or missing dim
        job_range = {facts.names.to_canonical[d]: v for d, v in given.items()} if has_ranges(given) else None
        return KernelRequest(user, facts.shash, cshape, normalize_dtype(user, dtype), check_target(target),
                             facts.names, facts.source, batch_invariant, job_range)

    @property
    def key(self) -> str:
        """The disk index key of (spec_hash, shape, dtype, target)."""
        text = "|".join([self.shash, shape_text(self.cshape), dtype_text(self.ndtype), self.target])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def query(self) -> dict[str, str]:
        """The request key as ``GET /v1/kernels`` and ``GET /v1/jobs`` take it."""
        query = {"spec_hash": self.shash, "target": self.target, "shape": shape_text(self.cshape),
                 "dtype": dtype_text(self.ndtype)}
        return {**query, "batch_invariant": "true"} if self.batch_invariant else query

    def job_fields(self) -> dict[str, Any]:
        """The spec and shape of ``POST /v1/jobs``, in the caller's names when their text is at
        hand; a loaded Spec has none to send, so its canonical form and the canonical shape."""
        shape = self.job_range or self.cshape
        fields = {"batch_invariant": True} if self.batch_invariant else {}
        if self.source is None:
            return {**fields, "spec": canonical_json(self.user), "shape": shape}
        return {**fields, "spec": self.source, "shape": self.names.user_shape(shape)}

    def show(self, shape: Any) -> str:
        """A canonical shape in the caller's dim names, for messages."""
        if not isinstance(shape, Mapping):
            return str(shape)
        return shape_text(self.names.user_shape(shape))

    @property
    def what(self) -> str:
        return (f"spec {self.user.name} ({self.shash[:16]}), shape {self.show(self.job_range or self.cshape)}, "
                f"dtype {dtype_text(self.ndtype)}, target {self.target}"
                + (", batch-invariant" if self.batch_invariant else ""))


# ----------------------------------------------------------------------------- the memo


def spec_key(spec: Any) -> Hashable | None:
    """A cheap hashable stand-in for a spec argument (None: there is none, take the slow path).
    Text and bytes are their own key; a loaded Spec is keyed by identity (the memo entry holds
    the object, so its id is not reused while the entry lives); a dict by its JSON text."""
    kind = type(spec)
    if kind is str or kind is bytes:
        return spec
    if isinstance(spec, Spec):
        return ("spec", id(spec))
    if isinstance(spec, os.PathLike):
        return ("path", os.fspath(spec))
    if isinstance(spec, Mapping):
        try:
            return ("json", json.dumps(spec, sort_keys=True))
        except (TypeError, ValueError):
            return None
    return None


def sizes_key(value: Any) -> Hashable | None:
    """A shape or dtype argument as a memo key: text as is, a dict as its items in order (an
    order the caller varies only costs one more slow call). Sizes must be exact ints (a float
    or a bool goes the slow way, which refuses it), dtypes text."""
    kind = type(value)
    if kind is str:
        return value
    if kind is dict:
        items = tuple(value.items())
        for _, v in items:
            if type(v) is not int and type(v) is not str:
                return None
        return items
    return None


def memo_key(spec: Any, shape: Any, dtype: Any, target: Any, allow_nearest: bool,
             batch_invariant: bool = False) -> Hashable | None:
    """The in-process memo's key of a ``get`` call, from its arguments as given (no parsing)."""
    skey = spec_key(spec)
    shape_key = sizes_key(shape)
    dtype_key = sizes_key(dtype)
    if skey is None or shape_key is None or dtype_key is None or type(target) is not str:
        return None
    return (skey, shape_key, dtype_key, target, bool(allow_nearest), bool(batch_invariant))


def bounded_put(memo: dict, key: Hashable, value: Any) -> None:
    """``memo[key] = value``, the oldest entries dropped past MEMO_LIMIT (hold the memo's lock)."""
    memo.pop(key, None)  # re-inserted last: eviction follows insertion order
    memo[key] = value
    while len(memo) > MEMO_LIMIT:
        del memo[next(iter(memo))]


@dataclass(frozen=True)
class Found:
    """A loaded kernel and where it came from (None for both: the disk cache, offline)."""

    kernel: BundleKernel
    bundle_sha256: str | None  # the kernel view's (format-1) bundle_sha256
    kernel_id: str | None


@dataclass
class MemoEntry:
    found: Found
    req: KernelRequest
    allow_nearest: bool
    fresh_until: float  # time.monotonic() after which a call schedules a revalidation
    revalidating: bool = False
