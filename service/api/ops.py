"""What the routes do: plain functions of a Session (run in the thread pool by
:class:`service.api.deps.Db`), and :func:`submit_job`, the one call a submission makes; the
stores themselves are :mod:`service.spec_store`, :mod:`service.job_queue` and
:mod:`service.kernel_cache`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fuser_core import Spec, SpecError, bound_to_canonical, canonical_shape, load_spec, normalize_dtype
from service import job_queue, kernel_cache, spec_store
from service.api.cache import SpecCache
from service.api.deps import AppContext, Db
from service.api.problems import Problem, error_entry, invalid, invalid_field, not_found
from service.api.schemas import JobRequest, iso, job_view, kernel_view, trial_view, worker_view
from service.api.validation import ParsedSpecs, job_request, query_value
from service.bundle import dtype_text, parse_dtype_text, parse_shape_text, shape_text
from service.dim_names import DimNames
from service.models import Job, Kernel, SpecRecord
from service.settings import Settings
from service.tuning_request import TuningRequest

# ----------------------------------------------------------------------------- specs and names


@dataclass(frozen=True)
class SpecInfo:
    """A stored spec, parsed once: its canonical form and the names of the spec as first stored."""

    spec_hash: str
    canonical: Spec  # what jobs, kernels and bundles are keyed by
    source: Spec  # the spec as first submitted
    names: DimNames  # canonical versus first-stored names
    uncertified: list[str]  # the reductions whose certificate failed ([]: it holds)


def spec_info(session: Session, cache: SpecCache, spec_hash: str) -> SpecInfo | None:
    info = cache.get(spec_hash)
    if info is None:
        record = session.get(SpecRecord, spec_hash)
        if record is None:
            return None
        source = load_spec(record.source)
        info = SpecInfo(spec_hash, spec_store.job_spec(record), source, DimNames.of(source),
                        spec_store.uncertified(record.derivation))
        cache.put(spec_hash, info)
    return info


def job_view_named(session: Session, cache: SpecCache, job: Any) -> dict[str, Any]:
    """The job view, with ``display_shape``: the shape in the dim names of the spec as first
    stored (``shape`` itself is canonical, as kernels and bundles are keyed)."""
    view = job_view(job)
    info = spec_info(session, cache, job.spec_hash)
    view["display_shape"] = info.names.user_shape(job.shape) if info is not None else job.shape
    return view


# ----------------------------------------------------------------------------- jobs


@dataclass
class Submission:
    request: TuningRequest  # the submission, checked and bound once
    view: dict[str, Any] | None = None  # the job; None: not submitted yet
    created: bool = False  # this request queued a new search
    spec_stored: bool = True  # False: a spec never stored, derived before it is


async def submit_job(db: Db, ctx: AppContext, req: JobRequest, request: Any = None) -> Submission:
    """A ``POST /v1/jobs`` body, from its check to its job: the one call the route makes.

    1. :func:`_find_submitted` (a read, after the token check): the request checked and bound
       once, and the job of an identical earlier request if there is one (the answer);
    2. a spec never stored is derived off the event loop, bounded (:meth:`service.api.derive.Deriver.report`:
       one deadline, 429/503, stopped if ``request``'s client leaves; cached in-process, so storing it is fast);
    3. :func:`_submit` (a write): :func:`service.job_queue.submit_job` with the same request.
    """
    found = await db.run(_find_submitted, ctx.specs, ctx.parsed_specs, req, ctx.settings, read=True)
    if found.view is not None:
        return found
    if not found.spec_stored:
        await ctx.deriver.report(found.request.spec, found.request.source, request)
    return await db.run(_submit, ctx.specs, found.request)


_BY_DEDUPE = (sa.select(Job.__table__, Kernel.triton_version.label("k_triton"),
                        Kernel.generator_version.label("k_generator"))
              .outerjoin(Kernel, Kernel.id == Job.kernel_id).where(Job.dedupe_key == sa.bindparam("key")))


def _find_submitted(session: Session, cache: SpecCache, parsed: ParsedSpecs, req: JobRequest,
                    settings: Settings) -> Submission:
    """Check the request once (:func:`service.api.validation.job_request`, after the token
    check of this thread), then the idempotent fast path: the live job of an identical earlier
    request, found by its unique ``dedupe_key`` with one indexed read and no write lock. The
    answer's ``view`` is None when the request must be submitted (new, or its kernel predates
    this code); ``spec_stored`` says whether its spec is stored yet."""
    request = job_request(parsed, req, settings)
    # Core: a row, no ORM identity map
    job = session.connection().execute(_BY_DEDUPE, {"key": request.dedupe_key}).first()
    stale = job is not None and job.status == "succeeded" and (
        (job.k_triton, job.k_generator) != kernel_cache.current_versions())  # submit_job searches again
    if job is None or stale:
        stored = cache.get(request.spec_hash) is not None or session.get(SpecRecord, request.spec_hash) is not None
        return Submission(request, spec_stored=stored)
    info = spec_info(session, cache, job.spec_hash)
    if info is not None:  # an earlier request may have allowed what this one does not
        spec_store.refuse_uncertified(request.spec, info.uncertified, request.allow_uncertified)
    return Submission(request, view=job_view_named(session, cache, job), created=False)


def _submit(session: Session, cache: SpecCache, request: TuningRequest) -> Submission:
    """Submit a checked request (idempotent, :func:`service.job_queue.submit_job`)."""
    job, created = job_queue.submit_job(session, request)
    return Submission(request, view=job_view_named(session, cache, job), created=created)


def get_job(session: Session, cache: SpecCache, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, job_queue.get_job(session, job_id))


def list_jobs(session: Session, cache: SpecCache, *, shape: str | None = None, dtype: str | None = None,
              **filters: Any) -> list[dict[str, Any]]:
    """Job views, newest first. ``shape`` and ``dtype`` (query text, as :func:`lookup_kernel`
    reads them) narrow the list to one request key; they are read against the spec, so they
    need ``spec_hash``. A spec never stored has no jobs."""
    if (shape is not None or dtype is not None) and filters.get("spec_hash") is None:
        field = "shape" if shape is not None else "dtype"
        raise invalid_field((field,), f"filtering by {field} needs spec_hash (dim names and dtypes are read "
                                      "against the spec)", where="query")
    if shape is not None or dtype is not None:
        info = spec_info(session, cache, filters["spec_hash"])
        if info is None:
            return []
        if shape is not None:
            filters["shape_key"] = shape_text(_query_shape(info, shape))
        if dtype is not None:
            filters["dtype"] = dtype_text(_query_dtype(info, dtype))
    return [job_view_named(session, cache, job) for job in job_queue.list_jobs(session, **filters)]


def list_trials(session: Session, job_id: str) -> list[dict[str, Any]]:
    return [trial_view(t) for t in job_queue.list_trials(session, job_id)]


def cancel(session: Session, cache: SpecCache, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, job_queue.cancel_job(session, job_id))


# ----------------------------------------------------------------------------- kernels


def _query_problem(err: SpecError) -> Problem:
    loc = tuple(err.loc) or ("shape",)
    return invalid([error_entry(loc, err.message, where="query")])


def _query_shape(info: SpecInfo, shape: str) -> dict[str, int]:
    """A ``shape`` query (``d0=4,d1=300`` in canonical dim names, or in the names of the spec as
    first submitted) as the canonical shape jobs and kernels are keyed by; 422 otherwise."""
    from fuser_core import bind_shape

    raw = query_value(parse_shape_text, shape)
    try:
        if set(raw) <= set(info.canonical.dims):
            return bound_to_canonical(info.canonical, bind_shape(info.canonical, raw))
        return canonical_shape(info.source, raw)
    except SpecError as err:
        raise _query_problem(err) from None


def _query_dtype(info: SpecInfo, dtype: str) -> str | dict[str, str]:
    """A ``dtype`` query in its one normal form (:func:`fuser_core.normalize_dtype`); 422 otherwise."""
    try:
        return normalize_dtype(info.canonical, query_value(parse_dtype_text, dtype))
    except SpecError as err:
        raise _query_problem(err) from None


def lookup_kernel(session: Session, cache: SpecCache, *, spec_hash: str, target: str, shape: str | None,
                  dtype: str) -> dict[str, Any]:
    """The kernel view for a lookup: a tuned range holding the shape (the view of the bucket's
    kernel that serves it, with ``range``: every bucket, so a client loads them all at once), else
    the exact shape, else the nearest tuned one that can run it (``exact_match``).

    ``shape`` may use the canonical dim names (``d0=4,d1=300``, as :mod:`service.client`
    sends them and bundles speak) or the names of the spec as first submitted.
    """
    info = spec_info(session, cache, spec_hash)
    if info is None:
        raise not_found("kernel for spec_hash", spec_hash)
    cshape = _query_shape(info, shape) if shape is not None else None
    ndtype = _query_dtype(info, dtype)
    if cshape is not None:  # a tuned range holding the shape first: its buckets serve it (service.shape_ranges)
        in_range = kernel_cache.find_range(session, spec_hash=spec_hash, target=target.strip().lower(),
                                           dtype=ndtype, shape=cshape)
        if in_range is not None:
            row, serving, kernels = in_range
            return kernel_view(serving, serving.shape == cshape, kernel_range=(row, kernels))
    found = kernel_cache.find_kernel(session, spec_hash=spec_hash, target=target.strip().lower(), dtype=ndtype,
                                     shape=cshape)
    if found is None:
        what = f"spec {spec_hash[:16]}, target {target}, dtype {dtype}" + (f", shape {shape}" if shape else "")
        raise Problem(404, "Not found", f"no tuned kernel for {what}; submit a tuning job (POST /v1/jobs)",
                      kind="not-found")
    kernel, exact = found
    return kernel_view(kernel, exact)


def get_kernel(session: Session, kernel_id: str) -> dict[str, Any]:
    return kernel_view(kernel_cache.get_kernel(session, kernel_id))


def bundle_sha(session: Session, kernel_id: str) -> str:
    """The sha256 of the kernel's bundle (one primary-key lookup; the hot path of downloads)."""
    sha = session.execute(sa.select(Kernel.bundle_sha256).where(Kernel.id == kernel_id)).scalar_one_or_none()
    session.rollback()
    if sha is None:
        raise not_found("kernel", kernel_id)
    return sha


def bundle_bytes(session: Session, kernel_id: str) -> tuple[str, bytes]:
    """(sha256, bytes) of the kernel's bundle, re-hashed against its sha256 before it is served."""
    kernel = kernel_cache.get_kernel(session, kernel_id)
    return kernel.bundle_sha256, kernel_cache.get_bundle_bytes(session, kernel)


# ----------------------------------------------------------------------------- specs, workers


def get_spec(session: Session, spec_hash: str) -> dict[str, Any]:
    record = spec_store.get_spec(session, spec_hash)
    return {"spec_hash": record.spec_hash, "name": record.name, "spec": json.loads(record.source),
            "canonical": json.loads(record.canonical), "derivation": record.derivation,
            "created_at": iso(record.created_at)}


def list_workers(session: Session, *, alive_within_s: float) -> list[dict[str, Any]]:
    return [worker_view(w, alive_within_s=alive_within_s) for w in job_queue.list_workers(session)]


def ping(session: Session) -> None:
    session.execute(sa.text("SELECT 1"))
    session.rollback()
