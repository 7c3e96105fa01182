"""The one request normaliser: a tuning submission bound and checked once.

Every way in — ``POST /v1/jobs`` (service/api/validation.py), the dashboard's submit form (the
same route), ``foldwise tune`` and the job-queue worker (service/cli/__init__.py, service/worker/tuning.py,
service/worker/__init__.py) — names its spec, shape, dtype, target, measurer and budget here:
:func:`tuning_request` checks each field once, binds the shape and dtypes to the spec once
(:mod:`fuser_core.problem`), and answers a :class:`TuningRequest` whose shape is canonical and
dtype normalized (the names bundles, jobs and kernels are keyed by, :mod:`service.bundle`).
Nothing downstream re-checks or re-binds: the job queue stores what it is given.

Also here, once: the measurer names (:data:`MEASURERS`), the targets (the GPU profiles of
:mod:`tuner.profiles`) and the job keys (:func:`shape_key`, :func:`dtype_key`, :func:`dedupe_key`).
Bad fields raise :class:`service.errors.InvalidRequest` naming each field.

The kernel client (:mod:`service.client`) checks its target here too, so this module stays
light: no sympy, SciPy, NumPy or database imports (tuner.profiles is read when needed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fuser_core import (
    MAX_ELEMENTS, MAX_WORK, Spec, SpecError, bind_shape, bound_to_canonical, check_sizes,
    normalize_dtype,
    spec_hash as compute_spec_hash,
)
from service.bundle import dtype_text, shape_text
from service.dim_names import DimNames
from service.errors import InvalidRequest
from service.shape_ranges import bucket_shapes, has_ranges, range_key, split_shape



@dataclass(frozen=True)
class MeasurerKind:
    """A measurer a job may name. ``on_device``: it times each kernel on a worker's GPU (the worker
    needs one matching the target, and the time is measured); else it predicts the time (the cost
    model, from the compiled kernel's SASS; no GPU)."""

    name: str
    on_device: bool


# the measurers a job may name; every decision about one reads its kind here, never its name
MEASURER_KINDS = {m.name: m for m in (MeasurerKind("cuda", on_device=True), MeasurerKind("model", on_device=False))}
MEASURERS = tuple(MEASURER_KINDS)


def measurer_kind(name: str) -> MeasurerKind:
    """The kind of a checked measurer name (:func:`check_measurer`)."""
    return MEASURER_KINDS[name]
# a target's name as a query parameter takes it (the GPU profiles' names are these characters): text
# with a NUL byte or a quote never reaches a database filter (PostgreSQL refuses NUL with a DataError)
TARGET_PATTERN = r"^[A-Za-z0-9_.-]{1,32}$"


# ----------------------------------------------------------------------------- single fields


def known_targets() -> list[str]:
    """The target names a request may use: the GPU profiles (:mod:`tuner.profiles`)."""
    from tuner import PROFILES

    return sorted(PROFILES)


def check_choice(value: Any, allowed: tuple[str, ...] | list[str], field: str) -> str:
    """``value`` lower-cased if it is one of ``allowed``; InvalidRequest naming ``field`` otherwise."""
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise InvalidRequest(f"unknown {field} {value!r:.60}; one of {', '.join(sorted(allowed))}", loc=(field,))
    return value.strip().lower()


def check_target(target: Any) -> str:
    return check_choice(target, known_targets(), "target")


def check_measurer(measurer: Any) -> str:
    return check_choice(measurer, MEASURERS, "measurer")


def check_budget(trials: Any, seconds: Any, limits: Limits | None = None) -> tuple[int, float]:
    limits = limits or Limits()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InvalidRequest(f"must be a positive integer, got {trials!r:.40}", loc=("budget", "trials"))
    if limits.max_trials is not None and trials > limits.max_trials:
        raise InvalidRequest(f"must be at most {limits.max_trials}, got {trials}", loc=("budget", "trials"))
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(f"must be a positive number of seconds, got {seconds!r:.40}", loc=("budget", "seconds"))
    if limits.max_seconds is not None and seconds > limits.max_seconds:
        raise InvalidRequest(f"must be at most {limits.max_seconds:g}, got {seconds:g}", loc=("budget", "seconds"))
    return trials, float(seconds)


# ----------------------------------------------------------------------------- keys


def shape_key(shape: Mapping[str, int]) -> str:
    """``{"d1": 300, "d0": 4}`` -> ``"d0=4,d1=300"`` (sorted by dim name)."""
    for dim, size in shape.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequest(f"must be a positive integer, got {size!r:.40}", loc=("shape", str(dim)))
    return shape_text(shape)


def dtype_key(dtype: str | Mapping[str, str]) -> str:
    """One dtype name as is; a per-input map as compact sorted JSON (normalize it first:
    :func:`fuser_core.problem.normalize_dtype`)."""
    return dtype_text(dtype)


def dedupe_key(spec_hash: str, shape_key_: str, dtype_key_: str, target: str, measurer: str) -> str:
    return hashlib.sha256("|".join((spec_hash, shape_key_, dtype_key_, target, measurer)).encode()).hexdigest()


# ----------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class Limits:
    """A server's limits on requests (from its Settings); None: no limit beyond the core's."""

    max_trials: int | None = None
    max_seconds: float | None = None
    max_dim: int | None = None
    max_elements: int = MAX_ELEMENTS
    max_work: int = MAX_WORK

    @classmethod
    def of(cls, settings: Any) -> Limits:
        """The limits of a :class:`service.settings.Settings`."""
        return cls(settings.max_trials, settings.max_seconds, settings.max_dim, settings.max_tensor_elements,
                   settings.max_work)


@dataclass(frozen=True)
class TuningRequest:
    """A checked submission: the caller's spec, and shape/dtype in the canonical names."""

    spec: Spec
    source: str  # the spec's JSON text as submitted
    spec_hash: str
    shape: dict[str, Any]  # complete, canonical dim names (d0, d1, ...); a ranged dim: {"min", "max", "buckets"}
    dtype: str | dict[str, str]  # normalized (fuser_core.problem.normalize_dtype)
    target: str
    measurer: str
    budget_trials: int
    budget_seconds: float
    allow_uncertified: bool = False  # tune a spec whose certificate fails (not part of the job's identity)
    # a range job's buckets: each one's complete canonical shape, smallest first (service.shape_ranges)
    buckets: tuple[dict[str, int], ...] = ()

    @property
    def is_range(self) -> bool:
        return bool(self.buckets)

    @cached_property
    def shape_key(self) -> str:
        return range_key(self.shape) if self.buckets else shape_text(self.shape)

    @cached_property
    def dtype_key(self) -> str:
        return dtype_text(self.dtype)

    @cached_property
    def dedupe_key(self) -> str:
        """A job's identity: submissions with the same key are the same job (service.store.job_queue)."""
        return dedupe_key(self.spec_hash, self.shape_key, self.dtype_key, self.target, self.measurer)


def tuning_request(spec: Spec, source: str | Mapping[str, Any], shape: Mapping[str, int],
                   dtype: str | Mapping[str, str], target: str, measurer: str, budget_trials: int,
                   budget_seconds: float, *, limits: Limits | None = None,
                   spec_hash: str | None = None, allow_uncertified: bool = False,
                   batch_invariant: bool = False) -> TuningRequest:
    """Check every field of a submission once and bind it to ``spec``.

    ``shape`` uses ``spec``'s own dim names; ``source`` is the spec as submitted (text or
    object); ``spec_hash`` may be given when the caller has it. Raises InvalidRequest whose
    ``errors`` name every bad field (budget, target, measurer, shape sizes, then the shape and
    dtype against the spec). ``batch_invariant``: one kernel for the whole range
    (:mod:`service.shape_ranges`, "Batch-invariant ranges"); it needs a ranged dim."""
    limits = limits or Limits()
    errors: list[SpecError] = []

    def check(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except SpecError as err:
            errors.append(err)
            return None

    budget = check(check_budget, budget_trials, budget_seconds, limits)
    ranges: dict = {}
    if has_ranges(shape):  # a range job (service.shape_ranges): fixed sizes, and ranges checked field by field
        split = check(lambda: split_shape(shape, max_dim=limits.max_dim, one_bucket=batch_invariant))
        if split is not None:
            shape, ranges = split
    elif batch_invariant:  # one size is one kernel already: the flag would promise nothing
        errors.append(InvalidRequest("needs a range: give the batch dim as {\"min\": .., \"max\": ..} and one "
                                     "kernel serves every size in it", loc=("batch_invariant",)))
    buckets = math.prod(len(r.buckets) for r in ranges.values())
    if budget is not None and limits.max_trials is not None and budget[0] * buckets > limits.max_trials:
        # a range job runs budget.trials per bucket: the server's limit is on what one request makes it run
        errors.append(InvalidRequest(f"{buckets} buckets x {budget[0]} trials = {budget[0] * buckets} trials in all; "
                                     f"at most {limits.max_trials} per job", loc=("budget", "trials")))
    if isinstance(shape, Mapping) and limits.max_dim is not None:
        for dim, size in shape.items():
            if isinstance(size, int) and not 1 <= size <= limits.max_dim:
                errors.append(InvalidRequest(f"must be an integer from 1 to {limits.max_dim}, got {size}",
                                             loc=("shape", dim)))
    target = check(check_target, target)
    measurer = check(check_measurer, measurer)
    if errors:
        raise InvalidRequest.of(errors)
    # every bucket is bound (and its sizes checked) as a job of its own would be; the largest is
    # the one the limits bind, but binding each costs microseconds and catches any per-size rule
    shapes = bucket_shapes(shape, ranges) if ranges else [shape]
    bounds = []
    for one in shapes:
        bound = check(bind_shape, spec, one)
        if bound is not None:
            check(lambda: check_sizes(spec, bound, max_elements=limits.max_elements, max_work=limits.max_work))
        bounds.append(bound)
        if errors:
            break
    ndtype = check(normalize_dtype, spec, dtype)
    if errors:
        raise InvalidRequest.of(errors)
    canon_shapes = tuple(bound_to_canonical(spec, b) for b in bounds)
    canon_shape: dict[str, Any] = canon_shapes[0]
    if ranges:
        names = DimNames.of(spec).to_canonical
        canon_ranges = {names[d]: r.as_json() for d, r in ranges.items()}
        canon_shape = {d: canon_ranges.get(d, n) for d, n in canon_shapes[0].items()}
    return TuningRequest(spec=spec, source=source if isinstance(source, str) else json.dumps(source),
                         spec_hash=spec_hash or compute_spec_hash(spec), shape=canon_shape,
                         dtype=ndtype, target=target, measurer=measurer, budget_trials=budget[0],
                         budget_seconds=budget[1], allow_uncertified=allow_uncertified,
                         buckets=canon_shapes if ranges else ())
