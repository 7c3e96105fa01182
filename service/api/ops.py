"""What the routes do: plain functions of a Session (run in the thread pool by
:class:`service.api.deps.Db`), and :func:`submit_job`, the one call a submission makes; the
stores themselves are :mod:`service.store.spec_store`, :mod:`service.store.job_queue` and
:mod:`service.store.kernel_cache`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fuser_core import Spec, SpecError, bound_to_canonical, canonical_shape, load_spec, normalize_dtype
from service.store import job_queue, kernel_cache, spec_store
from service.api.cache import SpecCache
from service.api.deps import AppContext, Db
from service.api.problems import HttpProblem, error_entry, invalid, invalid_field, not_found
from service.api.schemas import JobRequest, iso, job_view, kernel_view, trial_view, worker_view
from service.api.validation import CheckedJob, query_value
from service.bundle import dtype_text, parse_dtype_text, parse_shape_text, shape_text
from service.dim_names import DimNames
from service.store.models import Job, KernelRecord, SpecRecord, WorkerRecord, utcnow
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


def resolve_hash(session: Session, text: str, *, field: str = "spec_hash", where: str = "query") -> str | None:
    """A spec hash or a prefix of one (:func:`service.store.spec_store.resolve_hash`) as the full hash;
    None when no stored spec matches. 422 naming ``field`` for a malformed one, 409 naming it for
    an ambiguous prefix."""
    try:
        return spec_store.resolve_hash(session, text, field=field)
    except spec_store.AmbiguousHash as err:
        raise HttpProblem(409, "Ambiguous spec hash", f"{field}: {err.message}", kind="ambiguous-hash",
                          errors=[error_entry((field,), err.message, where=where)], matches=err.matches) from None
    except SpecError as err:
        raise invalid_field((field,), err.message, where=where) from None


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


def job_view_named(session: Session, cache: SpecCache, job: Any, live: LiveWorkers, *,
                   names: DimNames | None = None) -> dict[str, Any]:
    """The job view for people: ``display_shape`` and ``best.config.blocks`` in the caller's dim
    names (``names``: those of the spec the caller submitted; by default those of the spec as
    first stored; ``shape`` itself stays canonical, as kernels and bundles are keyed), and
    ``warnings``: why a queued job may wait forever (:func:`job_warnings`), computed now."""
    view = job_view(job)
    if names is None:
        info = spec_info(session, cache, job.spec_hash)
        names = info.names if info is not None else None
    if names is not None:
        view["display_shape"] = names.user_shape(job.shape)
        view["best"] = user_best(names, view["best"])
    else:
        view["display_shape"] = job.shape
    if view["range"] is not None:  # each bucket in the caller's dim names too, beside its canonical shape
        view["range"]["display_buckets"] = [names.user_shape(b) if names is not None else b
                                            for b in view["range"]["buckets"]]
    view["warnings"] = job_warnings(job, live(session) if job.status == "queued" else None)
    return view


def user_best(names: DimNames, best: dict[str, Any] | None) -> dict[str, Any] | None:
    """A job's (or trial's) ``{config: {blocks: {d0: ...}}}`` with the blocks in the caller's dim names."""
    config = (best or {}).get("config")
    if not isinstance(config, dict) or not isinstance(config.get("blocks"), dict):
        return best
    return {**best, "config": user_config(names, config)}  # type: ignore[dict-item]


def user_config(names: DimNames, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tile config whose ``blocks`` are keyed by canonical dims, keyed by the caller's names."""
    if not isinstance(config, dict) or not isinstance(config.get("blocks"), dict):
        return config
    return {**config, "blocks": names.user_shape(config["blocks"])}


# ----------------------------------------------------------------------------- live workers


def alive_within_s(settings: Settings) -> float:
    """How recent a worker's heartbeat must be for it to count as live: the lease time (a worker
    heartbeats every ``heartbeat_seconds``, also while idle and polling), at least three beats."""
    return max(settings.lease_seconds, 3 * settings.heartbeat_seconds)


class LiveWorkers:
    """The (target, measurer) pairs of live workers (:func:`alive_within_s`), read at most once per
    request, and only when a queued job needs them."""

    def __init__(self, within_s: float):
        self.within_s = within_s
        self._pairs: set[tuple[str, str]] | None = None

    def __call__(self, session: Session) -> set[tuple[str, str]]:
        if self._pairs is None:
            cutoff = utcnow() - timedelta(seconds=self.within_s)
            rows = session.execute(sa.select(WorkerRecord.target, WorkerRecord.measurer).distinct()
                                   .where(WorkerRecord.last_heartbeat >= cutoff)).all()
            self._pairs = {(r.target, r.measurer) for r in rows}
        return self._pairs


def job_warnings(job: Any, live: set[tuple[str, str]] | None) -> list[str]:
    """Why a queued job may never run: no live worker claims its (target, measurer)
    (:func:`service.store.job_queue.claim_job` matches both). Empty once one registers."""
    if job.status != "queued" or live is None or (job.target, job.measurer) in live:
        return []
    start = (f"start one: foldwise serve --targets {job.target}, or foldwise worker --target {job.target} "
             f"--measurer {job.measurer}")
    if any(target == job.target for target, _ in live):
        return [f"no live worker takes target {job.target} with measurer {job.measurer}; the job waits until one "
                f"does ({start})"]
    return [f"no live worker takes target {job.target}; the job waits until one does ({start})"]


# ----------------------------------------------------------------------------- jobs


@dataclass
class Submission:
    request: TuningRequest  # the submission, checked and bound once
    view: dict[str, Any] | None = None  # the job; None: not submitted yet
    created: bool = False  # this request queued a new search
    spec_stored: bool = True  # False: a spec never stored, derived before it is


async def submit_job(db: Db, ctx: AppContext, req: JobRequest, request: Any = None) -> Submission:
    """A ``POST /v1/jobs`` body, from its check to its job: the one call the route makes.

    1. after the token check, the request checked and bound once, spec and every field, in the
       spec parser's child (:meth:`service.api.derive.DerivationPool.job_request`: off the API's
       GIL, within the deadline);
    2. :func:`_find_submitted` (a read): the job of an identical earlier request if there is one
       (the answer);
    3. a spec never stored is derived off the event loop, bounded (:meth:`service.api.derive.DerivationPool.report`:
       one deadline, 429/503, stopped if ``request``'s client leaves; cached in-process, so storing it is fast);
    4. :func:`_submit` (a write): :func:`service.store.job_queue.submit_job` with the same request.
    """
    live = LiveWorkers(alive_within_s(ctx.settings))
    await db.authorize()  # nothing is parsed for a request without a valid token
    checked = await ctx.deriver.job_request(req, ctx.settings)
    r = checked.request
    spec_store.remember_parsed(r.source, r.spec, r.spec_hash)  # storing it compares the text: parsed already
    found = await db.run(_find_submitted, ctx.specs, checked, live, read=True)
    if found.view is not None:
        return found
    if not found.spec_stored:
        await ctx.deriver.report(checked.key, r.source, request)
    return await db.run(_submit, ctx.specs, checked, live)


_BY_DEDUPE = (sa.select(Job.__table__, KernelRecord.triton_version.label("k_triton"),
                        KernelRecord.generator_version.label("k_generator"))
              .outerjoin(KernelRecord, KernelRecord.id == Job.kernel_id).where(Job.dedupe_key == sa.bindparam("key")))


def _find_submitted(session: Session, cache: SpecCache, checked: CheckedJob, live: LiveWorkers) -> Submission:
    """The idempotent fast path of a checked request: the live job of an identical earlier
    request, found by its unique ``dedupe_key`` with one indexed read and no write lock. The
    answer's ``view`` is None when the request must be submitted (new, or its kernel predates
    this code); ``spec_stored`` says whether its spec is stored yet."""
    request = checked.request
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
    return Submission(request, view=job_view_named(session, cache, job, live, names=checked.names), created=False)


def _submit(session: Session, cache: SpecCache, checked: CheckedJob, live: LiveWorkers) -> Submission:
    """Submit a checked request (idempotent, :func:`service.store.job_queue.submit_job`); the
    job view in the submitter's own dim names (docs/API.md: each caller sees theirs, not the
    first submitter's)."""
    request = checked.request
    job, created = job_queue.submit_job(session, request)
    if cache.get(request.spec_hash) is None:  # what GET /v1/jobs reads of the spec, without parsing it again
        record = session.get(SpecRecord, request.spec_hash)
        if record is not None and record.source == request.source:  # stored as this request wrote it
            cache.put(request.spec_hash, SpecInfo(request.spec_hash, checked.canonical, request.spec, checked.names,
                                                  spec_store.uncertified(record.derivation)))
    return Submission(request, view=job_view_named(session, cache, job, live, names=checked.names), created=created)


def get_job(session: Session, cache: SpecCache, live: LiveWorkers, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, job_queue.get_job(session, job_id), live)


def list_jobs(session: Session, cache: SpecCache, live: LiveWorkers, *, shape: str | None = None,
              dtype: str | None = None, **filters: Any) -> list[dict[str, Any]]:
    """Job views, newest first. ``shape`` and ``dtype`` (query text, as :func:`lookup_kernel`
    reads them) narrow the list to one request key; they are read against the spec, so they
    need ``spec_hash``. A spec never stored has no jobs."""
    if (shape is not None or dtype is not None) and filters.get("spec_hash") is None:
        field = "shape" if shape is not None else "dtype"
        raise invalid_field((field,), f"filtering by {field} needs spec_hash (dim names and dtypes are read "
                                      "against the spec)", where="query")
    if filters.get("spec_hash") is not None:
        filters["spec_hash"] = resolve_hash(session, filters["spec_hash"])
        if filters["spec_hash"] is None:  # no stored spec has that prefix: no jobs
            return []
    if shape is not None or dtype is not None:
        info = spec_info(session, cache, filters["spec_hash"])
        if info is None:
            return []
        if shape is not None:
            filters["shape_key"] = shape_text(_query_shape(info, shape))
        if dtype is not None:
            filters["dtype"] = dtype_text(_query_dtype(info, dtype))
    return [job_view_named(session, cache, job, live) for job in job_queue.list_jobs(session, **filters)]


def list_trials(session: Session, cache: SpecCache, job_id: str) -> list[dict[str, Any]]:
    """The job's trials, their tile configs in the dim names of the spec as first stored."""
    trials = job_queue.list_trials(session, job_id)
    job = job_queue.get_job(session, job_id) if trials else None
    info = spec_info(session, cache, job.spec_hash) if job is not None else None
    views = [trial_view(t) for t in trials]
    if info is not None:
        for view in views:
            view["config"] = user_config(info.names, view["config"])
    return views


def cancel(session: Session, cache: SpecCache, live: LiveWorkers, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, job_queue.cancel_job(session, job_id), live)


# ----------------------------------------------------------------------------- kernels


def _query_problem(err: SpecError) -> HttpProblem:
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
                  dtype: str, batch_invariant: bool = False) -> dict[str, Any]:
    """The kernel view for a lookup: a tuned range holding the shape (the view of the bucket's
    kernel that serves it, with ``range``: every bucket, so a client loads them all at once), else
    the exact shape, else the nearest tuned one that can run it (``exact_match``). With
    ``batch_invariant``: only a range one kernel serves whole, and nothing else (a kernel for one
    size, or a range of several buckets, would give a row other bits at another batch size).

    ``shape`` may use the canonical dim names (``d0=4,d1=300``, as :mod:`service.client`
    sends them and bundles speak) or the names of the spec as first submitted.
    """
    asked = spec_hash
    spec_hash = resolve_hash(session, spec_hash) or asked
    info = spec_info(session, cache, spec_hash)
    if info is None:
        raise not_found("kernel for spec_hash", asked)
    cshape = _query_shape(info, shape) if shape is not None else None
    ndtype = _query_dtype(info, dtype)
    if batch_invariant and cshape is None:
        raise invalid_field(("shape",), "a batch-invariant lookup needs the shape it runs", where="query")
    if cshape is not None:  # a tuned range holding the shape first: its buckets serve it (service.shape_ranges)
        in_range = kernel_cache.find_range(session, spec_hash=spec_hash, target=target.strip().lower(),
                                           dtype=ndtype, shape=cshape, batch_invariant=batch_invariant)
        if in_range is not None:
            row, serving, kernels = in_range
            return kernel_view(serving, serving.shape == cshape, kernel_range=(row, kernels))
    found = None if batch_invariant else kernel_cache.find_kernel(
        session, spec_hash=spec_hash, target=target.strip().lower(), dtype=ndtype, shape=cshape)
    if found is None:
        what = f"spec {spec_hash[:16]}, target {target}, dtype {dtype}" + (f", shape {shape}" if shape else "")
        kind = "batch-invariant range holding it (a job with \"batch_invariant\": true)" if batch_invariant else \
            "tuned kernel"
        raise HttpProblem(404, "Not found", f"no {kind} for {what}; submit a tuning job (POST /v1/jobs)",
                          kind="not-found")
    kernel, exact = found
    return kernel_view(kernel, exact)


def get_kernel(session: Session, kernel_id: str) -> dict[str, Any]:
    return kernel_view(kernel_cache.get_kernel(session, kernel_id))


def bundle_sha(session: Session, kernel_id: str) -> str:
    """The sha256 of the kernel's bundle (one primary-key lookup; the hot path of downloads)."""
    sha = session.execute(sa.select(KernelRecord.bundle_sha256).where(KernelRecord.id == kernel_id)).scalar_one_or_none()
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
    full = resolve_hash(session, spec_hash, where="path")
    if full is None:
        raise not_found("spec with hash", spec_hash)
    record = spec_store.get_spec(session, full)
    return {"spec_hash": record.spec_hash, "name": record.name, "spec": json.loads(record.source),
            "canonical": json.loads(record.canonical), "derivation": record.derivation,
            "created_at": iso(record.created_at)}


def list_workers(session: Session, *, alive_within_s: float) -> list[dict[str, Any]]:
    return [worker_view(w, alive_within_s=alive_within_s) for w in job_queue.list_workers(session)]


def ping(session: Session) -> None:
    session.execute(sa.text("SELECT 1"))
    session.rollback()
