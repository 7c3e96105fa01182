"""The kernel cache: the best kernel found per (spec, shape, dtype, target, Triton and
generator versions), with its bundle stored once by sha256 and re-hashed before it is served.

A kernel is keyed like a job (canonical shape, normalized dtype: :mod:`service.store.spec_store`,
:mod:`service.tuning_request`) plus the versions of the code that generated it
(:func:`current_versions`): a kernel from an older generator is not an exact answer. The job
queue stores a finished job's kernel here (:func:`store_kernel`), keeping the better of the
cached and the new one (a measurement beats a prediction, then lower time). Readers:
:func:`find_kernel` (exact, else the nearest tuned shape), :func:`get_kernel`,
:func:`get_bundle_bytes`, :func:`list_kernels`.

A failed job's best kernel is stored here too, marked ``partial`` (:func:`store_kernel` with
``partial=True``, in a row of its own: ``partial`` is part of the key). No reader that answers
"which kernel runs this request" sees one (:func:`exact_kernel`, :func:`find_kernel`,
:func:`list_kernels`): a partial kernel is reached only through its failed job or by its id
(:func:`get_kernel`), its view saying ``partial`` (docs/DECISIONS.md, "Partial kernels").

Functions that read end their transaction; the writers (:func:`store_kernel`) leave it to
the caller, which commits the job and its kernel together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.bundle import BundleError, canonical_bytes, verify_bundle
from service.store.db import MAX_LIST, get_row, newest_first
from service.errors import BundleCorrupted, InvalidBundle
from service.store.models import Bundle, Job, KernelRecord, KernelRange, new_id, utcnow
from service.shape_ranges import one_kernel, pick_bucket
from service.store.served_bundles import bundle_intact, store_served
from service.tuning_request import MEASURERS, TuningRequest, dtype_key, measurer_kind, shape_key

KERNEL_FIELDS = {"time_ms", "measurer", "predicted", "baselines", "strategy", "config"}


@lru_cache(maxsize=1)
def current_versions() -> tuple[str, str]:
    """(Triton version, generator version) of this code: the version part of kernel cache keys."""
    from importlib import metadata

    from fuser_core import GENERATOR_VERSION

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return triton_version, GENERATOR_VERSION


# ----------------------------------------------------------------------------- a request's kernel


def exact_kernel(session: Session, request: TuningRequest) -> KernelRecord | None:
    triton_version, generator_version = current_versions()
    return session.execute(sa.select(KernelRecord).where(
        KernelRecord.spec_hash == request.spec_hash, KernelRecord.shape_key == request.shape_key, KernelRecord.dtype == request.dtype_key,
        KernelRecord.target == request.target, KernelRecord.triton_version == triton_version,
        KernelRecord.generator_version == generator_version, KernelRecord.partial == sa.false())
        .execution_options(populate_existing=True)).scalar_one_or_none()


def kernel_is_current(session: Session, kernel_id: str | None) -> bool:
    kernel = session.get(KernelRecord, kernel_id, populate_existing=True) if kernel_id else None
    return kernel is not None and (kernel.triton_version, kernel.generator_version) == current_versions()


def kernel_serves(kernel: KernelRecord, measurer: str) -> bool:
    """A cached kernel answers a request for ``measurer`` when it was found that way, or was
    measured on a GPU (a measurement beats any prediction); a prediction never answers cuda."""
    return kernel.measurer == measurer or not kernel.predicted


def kernel_best(kernel: KernelRecord) -> dict[str, Any]:
    return {"strategy": kernel.strategy, "config": kernel.config, "time_ms": kernel.time_ms, "trial": None,
            "predicted": kernel.predicted}


# ----------------------------------------------------------------------------- storing


def bundle_content(bundle: Any) -> tuple[bytes, str]:
    """(bytes to store, sha256) of a verified bundle."""
    try:
        verify_bundle(bundle)
        return canonical_bytes(bundle), bundle["sha256"]
    except BundleError as err:
        raise InvalidBundle(f"bundle: {err}") from None


def kernel_values(job: Job, bundle: dict, given: Mapping[str, Any], *,
                  shape: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The KernelRecord row's values from the job (the key), the bundle and the measurement.
    ``shape``: the kernel's shape when it is not the job's (a range job's bucket)."""
    unknown = sorted(set(given) - KERNEL_FIELDS)
    if unknown:
        raise InvalidBundle(f"kernel_fields: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(KERNEL_FIELDS))}")
    expected = {"spec_hash": job.spec_hash, "shape": dict(shape) if shape is not None else job.shape,
                "dtype": job.dtype_value, "target": job.target}
    for field, value in expected.items():
        if bundle.get(field) != value:
            raise InvalidBundle(f"bundle: {field} {bundle.get(field)!r:.100} is not the job's {value!r:.100}")
    if "strategy" in given and given["strategy"] != bundle["strategy"]:
        raise InvalidBundle(f"kernel_fields: strategy {given['strategy']!r} is not the bundle's {bundle['strategy']!r}")
    measured = bundle.get("measured") or {}
    time_ms = given.get("time_ms", measured.get("time_ms"))
    if isinstance(time_ms, bool) or not isinstance(time_ms, int | float) or not math.isfinite(time_ms) or time_ms <= 0:
        raise InvalidBundle(f"kernel_fields: time_ms must be a positive number, got {time_ms!r:.40}")
    measurer = given.get("measurer", job.measurer)
    if measurer not in MEASURERS:
        raise InvalidBundle(f"kernel_fields: unknown measurer {measurer!r:.40}; one of {', '.join(MEASURERS)}")
    triton_version, generator_version = current_versions()
    return {
        "strategy": bundle["strategy"], "config": bundle.get("config") or dict(given.get("config") or {}),
        "time_ms": float(time_ms), "measurer": measurer, "predicted": bool(given.get("predicted", not measurer_kind(measurer).on_device)),
        "baselines": given.get("baselines"),
        "triton_version": str(bundle.get("triton_version") or triton_version)[:64],
        "generator_version": str(bundle.get("generator_version") or generator_version)[:64],
    }


def _rank(predicted: bool, time_ms: float) -> tuple[int, float]:
    return (1 if predicted else 0, time_ms)


def store_kernel(session: Session, job: Job, fields: dict[str, Any], digest: str, content: bytes, *,
                 shape: Mapping[str, int] | None = None, partial: bool = False) -> KernelRecord:
    """Store (or keep the better) kernel for the job's key; ``shape``: a range job's bucket,
    keyed by that shape instead of the job's. ``partial``: a failed job's best, ranked only
    against the key's partial kernel (a finished kernel is never replaced by one)."""
    kshape = dict(shape) if shape is not None else job.shape
    kkey = shape_key(kshape) if shape is not None else job.shape_key
    existing = session.execute(sa.select(KernelRecord).where(
        KernelRecord.spec_hash == job.spec_hash, KernelRecord.shape_key == kkey, KernelRecord.dtype == job.dtype,
        KernelRecord.target == job.target, KernelRecord.triton_version == fields["triton_version"],
        KernelRecord.generator_version == fields["generator_version"], KernelRecord.partial == partial).with_for_update()
        .execution_options(populate_existing=True)).scalar_one_or_none()
    new_rank = _rank(fields["predicted"], fields["time_ms"])
    if (existing is not None and _rank(existing.predicted, existing.time_ms) <= new_rank
            and _storedbundle_intact(session, existing.bundle_sha256)):
        return existing  # the cached kernel is at least as good (and its bundle intact): keep it
    _store_bundle(session, digest, content)
    now = utcnow()
    kernel = existing or KernelRecord(id=new_id(), spec_hash=job.spec_hash, shape=kshape, shape_key=kkey,
                                dtype=job.dtype, target=job.target, partial=partial, created_at=now)
    for name, value in fields.items():
        setattr(kernel, name, value)
    kernel.bundle_sha256, kernel.job_id, kernel.updated_at = digest, job.id, now
    if existing is None:
        session.add(kernel)
    session.flush()
    return kernel


def _store_bundle(session: Session, digest: str, content: bytes) -> None:
    row = session.get(Bundle, digest, populate_existing=True)
    if row is None:
        session.add(Bundle(sha256=digest, content=content, size=len(content), created_at=utcnow()))
        session.flush()
        store_served(session, json.loads(content), [])  # its format-2/-3 views; binaries add theirs (service.binaries)
    elif row.content != content:  # the stored copy was damaged: repair it with the verified bytes
        row.content, row.size = content, len(content)
    session.flush()


# ----------------------------------------------------------------------------- reading


def get_kernel(session: Session, kernel_id: str) -> KernelRecord:
    return get_row(session, KernelRecord, kernel_id, "kernel with id")


def get_bundle_bytes(session: Session, kernel: KernelRecord) -> bytes:
    """The kernel's bundle exactly as stored, after re-checking its hash; a bundle whose bytes
    do not match its sha256 raises :class:`BundleCorrupted` and is never served."""
    row = session.get(Bundle, kernel.bundle_sha256, populate_existing=True)
    session.commit()
    if row is None:
        raise BundleCorrupted(f"stored bundle {kernel.bundle_sha256} of kernel {kernel.id} is missing")
    if not bundle_intact(row.content, row.sha256):
        raise BundleCorrupted(f"stored bundle {row.sha256} of kernel {kernel.id}: hash mismatch "
                              "(its bytes changed after it was stored); it is not served")
    return row.content


def _storedbundle_intact(session: Session, digest: str) -> bool:
    row = session.get(Bundle, digest, populate_existing=True)
    return row is not None and bundle_intact(row.content, row.sha256)


def list_kernels(session: Session, *, spec_hash: str | None = None, target: str | None = None,
                 dtype: str | None = None, limit: int = 100, offset: int = 0) -> list[KernelRecord]:
    """Finished kernels (not partial ones), newest first, filtered by any of spec_hash, target,
    dtype (a dtype_key)."""
    return newest_first(session, KernelRecord, limit, offset, spec_hash=spec_hash, target=target, dtype=dtype,
                        partial=False)


def find_kernel(session: Session, *, spec_hash: str, target: str, dtype: str | Mapping[str, str],
                shape: Mapping[str, int] | None) -> tuple[KernelRecord, bool] | None:
    """The kernel to serve for a request: (kernel, exact), or None.

    ``shape`` is canonical (``{"d0": 4, "d1": 300}``) and ``dtype`` normalized, as
    :mod:`service.client` sends them. Exact: the same shape, with this code's Triton and
    generator versions. Otherwise the nearest tuned shape of the same spec, target and dtype
    whose bundle's ``size_limits`` admit ``shape`` (a kernel holding a dim whole in a block of
    256 cannot run 300, however near; service.bundle, "Other sizes"): least sum over dims of
    ``|log2(a/b)|``; ties: current versions, a measurement, faster, newer; ``exact`` False.
    None when no kernel admits the shape. ``shape=None``: the best by those ties, not exact.
    """
    skey = shape_key(shape) if shape is not None else None
    query = (sa.select(KernelRecord).where(KernelRecord.spec_hash == spec_hash, KernelRecord.target == str(target).strip().lower(),
                                     KernelRecord.dtype == dtype_key(dtype), KernelRecord.partial == sa.false())
             .limit(10 * MAX_LIST))
    candidates = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    if not candidates:
        session.commit()
        return None
    current = current_versions()

    def order(k: KernelRecord) -> tuple:
        distance = 0.0 if shape is None else _shape_distance(shape, k.shape)
        newer = -k.updated_at.timestamp()
        return (distance, (k.triton_version, k.generator_version) != current, k.predicted, k.time_ms, newer, k.id)

    best = None
    for k in sorted(candidates, key=order):  # nearest first; the first one that can run the shape
        if shape is not None and math.isinf(_shape_distance(shape, k.shape)):
            break
        if shape is None or k.shape_key == skey or _admits(session, k.bundle_sha256, shape):
            best = k
            break
    session.commit()
    if best is None:
        return None
    exact = skey is not None and best.shape_key == skey and (best.triton_version, best.generator_version) == current
    return best, exact


def _admits(session: Session, bundle_sha256: str, shape: Mapping[str, int]) -> bool:
    """Whether the stored bundle's ``size_limits`` hold ``shape`` (read only for nearest answers)."""
    limits = _size_limits(session, bundle_sha256)
    return limits is not None and all(shape.get(d, 0) <= n for d, n in limits.items())


def _size_limits(session: Session, digest: str) -> dict[str, int] | None:
    cached = _LIMITS.get(digest)
    if cached is None:
        content = session.execute(sa.select(Bundle.content).where(Bundle.sha256 == digest)).scalar_one_or_none()
        try:
            cached = dict(json.loads(content)["size_limits"]) if content is not None else None
        except (ValueError, KeyError, TypeError):
            cached = None
        if cached is not None:  # content addressed: a digest's limits never change
            if len(_LIMITS) >= 4096:
                _LIMITS.clear()
            _LIMITS[digest] = cached
    return cached


_LIMITS: dict[str, dict[str, int]] = {}


# ----------------------------------------------------------------------------- ranges (service.shape_ranges)


def store_range(session: Session, job: Job, kernels: list[tuple[dict[str, int], KernelRecord]]) -> KernelRange:
    """The range job's result: its key mapped to each bucket's kernel (``(bucket shape, kernel)``,
    smallest first), replacing an earlier range row for the same key. The caller commits."""
    triton_version, generator_version = current_versions()
    existing = session.execute(sa.select(KernelRange).where(
        KernelRange.spec_hash == job.spec_hash, KernelRange.shape_key == job.shape_key, KernelRange.dtype == job.dtype,
        KernelRange.target == job.target, KernelRange.triton_version == triton_version,
        KernelRange.generator_version == generator_version).with_for_update()
        .execution_options(populate_existing=True)).scalar_one_or_none()
    now = utcnow()
    row = existing or KernelRange(id=new_id(), spec_hash=job.spec_hash, shape=job.shape, shape_key=job.shape_key,
                                  dtype=job.dtype, target=job.target, triton_version=triton_version,
                                  generator_version=generator_version, created_at=now)
    row.buckets = [{"shape": dict(shape), "kernel_id": k.id} for shape, k in kernels]
    row.job_id, row.updated_at = job.id, now
    if existing is None:
        session.add(row)
    session.flush()
    return row


def find_range(session: Session, *, spec_hash: str, target: str, dtype: str | Mapping[str, str],
               shape: Mapping[str, int],
               batch_invariant: bool = False) -> tuple[KernelRange, KernelRecord, list[KernelRecord]] | None:
    """The tuned range holding ``shape`` (canonical): (range, the kernel of the bucket serving
    ``shape``, every bucket's kernel smallest first), or None. Only ranges of this code's Triton
    and generator versions count (as exact kernels); of several holding the shape, the newest;
    with ``batch_invariant``, only ranges one kernel serves whole (service.shape_ranges.one_kernel)."""
    triton_version, generator_version = current_versions()
    rows = session.execute(sa.select(KernelRange).where(
        KernelRange.spec_hash == spec_hash, KernelRange.target == str(target).strip().lower(),
        KernelRange.dtype == dtype_key(dtype), KernelRange.triton_version == triton_version,
        KernelRange.generator_version == generator_version)
        .order_by(KernelRange.updated_at.desc()).limit(MAX_LIST)
        .execution_options(populate_existing=True)).scalars()
    for row in rows:
        bucket = pick_bucket(row.shape, shape)
        if bucket is None or (batch_invariant and not one_kernel(row.shape)):
            continue
        ids = [b["kernel_id"] for b in row.buckets]
        by_id = {k.id: k for k in session.execute(sa.select(KernelRecord).where(KernelRecord.id.in_(ids))
                                                  .execution_options(populate_existing=True)).scalars()}
        if len(by_id) != len(set(ids)):
            continue  # a bucket's kernel is gone: the range is not served
        kernels = [by_id[i] for i in ids]
        serving = next(k for b, k in zip(row.buckets, kernels) if b["shape"] == bucket)
        session.commit()
        return row, serving, kernels
    session.commit()
    return None


def _shape_distance(a: Mapping[str, int], b: Mapping[str, Any]) -> float:
    if not isinstance(b, Mapping) or set(a) != set(b):
        return math.inf
    try:
        return sum(abs(math.log2(a[d] / b[d])) for d in a)
    except (TypeError, ValueError, ZeroDivisionError):
        return math.inf
