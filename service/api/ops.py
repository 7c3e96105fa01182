"""What the routes do, as plain functions of a Session (run in the thread pool by
:class:`service.api.deps.Db`); the job queue itself is :mod:`service.jobs`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fuser_core.canonical import canonical_names
from fuser_core.canonical import spec_hash as compute_spec_hash
from fuser_core.errors import SpecError
from fuser_core.spec import Spec, load_spec
from service import jobs
from service.api.cache import SpecCache
from service.api.problems import Problem, error_entry, invalid, not_found
from service.api.schemas import JobRequest, iso, job_view, kernel_view, trial_view, worker_view
from service.api.validation import check_job_request, parse_dtype_query, parse_shape_query, parse_spec
from service.bundle import canonical_bytes
from service.models import Job, Kernel, SpecRecord
from service.settings import Settings

# ----------------------------------------------------------------------------- specs and names


@dataclass(frozen=True)
class SpecInfo:
    """A stored spec, parsed once: its canonical form and the names of the spec as first stored."""

    spec_hash: str
    canonical: Spec  # what jobs, kernels and bundles are keyed by
    source: Spec  # the spec as first submitted
    to_user: dict[str, str]  # canonical dim -> first-stored dim

    def display_shape(self, shape: dict[str, int]) -> dict[str, int]:
        return {self.to_user.get(d, d): n for d, n in shape.items()}


def spec_info(session: Session, cache: SpecCache, spec_hash: str) -> SpecInfo | None:
    info = cache.get(spec_hash)
    if info is None:
        record = session.get(SpecRecord, spec_hash)
        if record is None:
            return None
        source = load_spec(record.source)
        names = canonical_names(source)
        info = SpecInfo(spec_hash, jobs.job_spec(record), source, {c: u for u, c in names.items() if u in source.dims})
        cache.put(spec_hash, info)
    return info


def job_view_named(session: Session, cache: SpecCache, job: Any) -> dict[str, Any]:
    """The job view, with ``display_shape``: the shape in the dim names of the spec as first
    stored (``shape`` itself is canonical, as kernels and bundles are keyed)."""
    view = job_view(job)
    info = spec_info(session, cache, job.spec_hash)
    view["display_shape"] = info.display_shape(job.shape) if info is not None else job.shape
    return view


# ----------------------------------------------------------------------------- jobs


@dataclass
class Submission:
    view: dict[str, Any] | None = None
    created: bool = False
    needs_derivation: Spec | None = None  # a new spec: derive it (with a time limit) first


class ParsedSpecs:
    """Specs parsed from request text, by the exact text (a spec is a value: the same text
    always parses to the same spec), so a repeated submission does not parse it again."""

    def __init__(self, max_items: int = 256):
        self._cache = SpecCache(max_items)

    def get(self, raw: dict[str, Any] | str) -> tuple[Spec, str, str]:
        """(spec, source text, spec_hash); Problem 422 for an invalid spec."""
        source = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
        hit = self._cache.get(source)
        if hit is None:
            spec, source = parse_spec(source)
            hit = (spec, source, compute_spec_hash(spec))
            self._cache.put(source, hit)
        return hit


def _request_key(spec: Spec, spec_hash: str, fields: dict[str, Any]) -> str:
    """The job's dedupe key, exactly as :func:`service.jobs.submit_job` computes it."""
    from service.bundle import canonical_shape, normalize_dtype

    cshape = canonical_shape(spec, fields["shape"])
    return jobs.dedupe_key(spec_hash, jobs.shape_key(cshape), jobs.dtype_key(normalize_dtype(spec, fields["dtype"])),
                           fields["target"], fields["measurer"])


_BY_DEDUPE = (sa.select(Job.__table__, Kernel.triton_version.label("k_triton"),
                        Kernel.generator_version.label("k_generator"))
              .outerjoin(Kernel, Kernel.id == Job.kernel_id).where(Job.dedupe_key == sa.bindparam("key")))


def find_submitted(session: Session, cache: SpecCache, parsed: ParsedSpecs, req: JobRequest,
                   settings: Settings) -> Submission | None:
    """The idempotent fast path: the live job of an identical earlier request, found by its
    unique ``dedupe_key`` with one indexed read and no write lock; None when the request must
    go through :func:`service.jobs.submit_job` (new, or its kernel predates this code)."""
    spec, _, shash = parsed.get(req.spec)
    fields = check_job_request(req, spec, settings)
    key = _request_key(spec, shash, fields)
    job = session.connection().execute(_BY_DEDUPE, {"key": key}).first()  # Core: a row, no ORM identity map
    if job is None:
        return None
    if job.status == "succeeded" and (job.k_triton, job.k_generator) != jobs.current_versions():
        return None  # its kernel predates this code (or is gone): submit_job searches again
    return Submission(view=job_view_named(session, cache, job), created=False)


def submit(session: Session, cache: SpecCache, parsed: ParsedSpecs, req: JobRequest, settings: Settings, *,
           derived: bool = False) -> Submission:
    """Validate and submit a job (idempotent, :func:`service.jobs.submit_job`).

    A spec not stored yet is not submitted on the first call: ``needs_derivation`` asks the
    caller to derive it outside the database thread with a time limit, then call again with
    ``derived=True`` (the derivation is cached in-process, so ``ensure_spec`` finds it).
    """
    spec, source, shash = parsed.get(req.spec)
    fields = check_job_request(req, spec, settings)
    if not derived and cache.get(shash) is None and session.get(SpecRecord, shash) is None:
        session.rollback()
        return Submission(needs_derivation=spec)
    job, created = jobs.submit_job(session, spec, source, fields["shape"], fields["dtype"], fields["target"],
                                   fields["measurer"], req.budget.trials, req.budget.seconds)
    return Submission(view=job_view_named(session, cache, job), created=created)


def get_job(session: Session, cache: SpecCache, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, jobs.get_job(session, job_id))


def list_jobs(session: Session, cache: SpecCache, **filters: Any) -> list[dict[str, Any]]:
    return [job_view_named(session, cache, job) for job in jobs.list_jobs(session, **filters)]


def list_trials(session: Session, job_id: str) -> list[dict[str, Any]]:
    return [trial_view(t) for t in jobs.list_trials(session, job_id)]


def cancel(session: Session, cache: SpecCache, job_id: str) -> dict[str, Any]:
    return job_view_named(session, cache, jobs.cancel_job(session, job_id))


# ----------------------------------------------------------------------------- kernels


def _query_problem(err: SpecError) -> Problem:
    loc = tuple(err.loc) or ("shape",)
    return invalid([error_entry(loc, err.message, where="query")])


def lookup_kernel(session: Session, cache: SpecCache, *, spec_hash: str, target: str, shape: str | None,
                  dtype: str) -> dict[str, Any]:
    """The kernel view for a lookup: exact shape, else the nearest tuned one (``exact_match``).

    ``shape`` may use the canonical dim names (``d0=4,d1=300``, as :mod:`service.client`
    sends them and bundles speak) or the names of the spec as first submitted.
    """
    from fuser_core.reference import bind_shape
    from service.bundle import normalize_dtype

    info = spec_info(session, cache, spec_hash)
    if info is None:
        raise not_found("kernel for spec_hash", spec_hash)
    cshape = None
    if shape is not None:
        raw = parse_shape_query(shape)
        try:
            if set(raw) <= set(info.canonical.dims):
                cshape = bind_shape(info.canonical, raw)
            else:
                from service.bundle import canonical_shape

                cshape = canonical_shape(info.source, raw)
        except SpecError as err:
            raise _query_problem(err) from None
    try:
        ndtype = normalize_dtype(info.canonical, parse_dtype_query(dtype))
    except SpecError as err:
        raise _query_problem(err) from None
    found = jobs.find_kernel(session, spec_hash=spec_hash, target=target.strip().lower(), dtype=ndtype, shape=cshape)
    if found is None:
        what = f"spec {spec_hash[:16]}, target {target}, dtype {dtype}" + (f", shape {shape}" if shape else "")
        raise Problem(404, "Not found", f"no tuned kernel for {what}; submit a tuning job (POST /v1/jobs)",
                      kind="not-found")
    kernel, exact = found
    return kernel_view(kernel, exact)


def get_kernel(session: Session, kernel_id: str) -> dict[str, Any]:
    return kernel_view(jobs.get_kernel(session, kernel_id))


def bundle_sha(session: Session, kernel_id: str) -> str:
    """The sha256 of the kernel's bundle (one primary-key lookup; the hot path of downloads)."""
    sha = session.execute(sa.select(Kernel.bundle_sha256).where(Kernel.id == kernel_id)).scalar_one_or_none()
    session.rollback()
    if sha is None:
        raise not_found("kernel", kernel_id)
    return sha


def bundle_bytes(session: Session, kernel_id: str) -> tuple[str, bytes]:
    """(sha256, bytes) of the kernel's bundle, re-hashed against its sha256 before it is served."""
    kernel = jobs.get_kernel(session, kernel_id)
    return kernel.bundle_sha256, jobs.get_bundle_bytes(session, kernel)


def bundle2_bytes(session: Session, kernel_id: str, arch: str | None) -> tuple[str, bytes]:
    """(sha256, bytes) of the kernel's format-2 bundle: its stored format-1 bundle (re-hashed)
    with the stored binaries of ``arch`` (None: every arch; none stored: ``binaries`` is {})."""
    from service.binaries import stored_variants
    from service.bundle import bundle_v2

    _, content = bundle_bytes(session, kernel_id)
    bundle = json.loads(content)
    out = bundle_v2(bundle, stored_variants(session, bundle["sha256"], arch))
    return out["sha256"], canonical_bytes(out)


# ----------------------------------------------------------------------------- specs, workers


def get_spec(session: Session, spec_hash: str) -> dict[str, Any]:
    record = jobs.get_spec(session, spec_hash)
    return {"spec_hash": record.spec_hash, "name": record.name, "spec": json.loads(record.source),
            "canonical": json.loads(record.canonical), "derivation": record.derivation,
            "created_at": iso(record.created_at)}


def list_workers(session: Session, *, alive_within_s: float) -> list[dict[str, Any]]:
    return [worker_view(w, alive_within_s=alive_within_s) for w in jobs.list_workers(session)]


def ping(session: Session) -> None:
    session.execute(sa.text("SELECT 1"))
    session.rollback()
