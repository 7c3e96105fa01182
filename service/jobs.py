"""The job queue and the kernel cache: plain functions over a SQLAlchemy ``Session``.

**Names.** Everything stored is keyed in the *canonical* spec's names (dims ``d0, d1, ...``;
inputs keep their names), as bundles are (:mod:`service.bundle`): two specs with the same
``spec_hash`` may name or order their dims differently, and a shape keyed by the submitter's
names could then select another shape's kernel. So ``Job.shape``, ``Kernel.shape`` and their
``shape_key`` (``"d0=4,d1=300"``) are canonical, and the spec a worker tunes is
:func:`job_spec` (the canonical spec). :func:`display_shape` translates a canonical shape back
to the names of the spec as first stored, for people.

**Jobs.** A submission is idempotent on (spec_hash, shape, dtype, target, measurer): the
``dedupe_key`` column is unique, so of concurrent identical submissions exactly one INSERT
wins and the others find its job on retry. It stays set while the job is queued, running or
succeeded, and is cleared when a job fails or is cancelled, so a resubmission then starts
afresh. A kernel already cached for the exact key (with this code's Triton and generator
versions) is answered with a succeeded job instead of a new search.

**Leases.** A worker claims a job with a lease (``lease_expires_at``) and renews it while it
works. Only the holder (status ``running`` and ``worker_id`` = its id) may record trials,
finish, fail or cancel the job; anyone else gets :class:`LeaseLost`. A job whose lease
expired is taken over by the next claim (``attempts`` counts claims; after
``MAX_ATTEMPTS`` lost workers the job fails and says so). Holder checks lock the job row
(``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite transactions are ``BEGIN IMMEDIATE``,
service/db.py), and a claim is a conditional UPDATE that only one claimer can win.

**Transactions.** Every function here ends its transaction (commit, or rollback on error) —
on SQLite an open transaction holds the database's write lock. Objects stay readable after
commit with sessions from :func:`service.db.session_factory`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fuser_core.canonical import canonical_json, canonical_names, spec_hash as compute_spec_hash
from fuser_core.errors import SpecError
from fuser_core.spec import Spec, load_spec
from service.bundle import (BundleError, bundle_sha256, canonical_bytes, canonical_shape, dtype_text,
                            normalize_dtype, shape_text, verify_bundle)
from service.models import Bundle, Job, Kernel, SpecRecord, TrialRecord, UTCDateTime, WorkerRecord, new_id, utcnow

MEASURERS = ("cuda", "model")
MAX_ATTEMPTS = 3  # claims of one job; a job whose worker was lost this often fails
RETRIES = 5  # attempts of an insert that lost a race (IntegrityError) before giving up
MAX_ERROR_CHARS = 10_000
MAX_LIST = 1000
MAX_COMPILE_FACTS = 64  # kernels per trial (the unfused chain has one per reduction)


class JobError(Exception):
    """A job-queue operation that cannot be done; the message says why."""


class NotFound(JobError):
    """No job, kernel or worker with that id."""


class LeaseLost(JobError):
    """The worker no longer holds the job (taken over after its lease expired, or finished)."""


class InvalidRequest(SpecError, JobError):
    """A bad submission field; ``loc`` names it (``("target",)``, ``("budget", "trials")``)."""


class BundleCorrupted(JobError):
    """A stored bundle's bytes no longer match its sha256: it is never served."""


# ----------------------------------------------------------------------------- keys and names


def shape_key(shape: Mapping[str, int]) -> str:
    """``{"d1": 300, "d0": 4}`` -> ``"d0=4,d1=300"`` (sorted by dim name)."""
    for dim, size in shape.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequest(f"must be a positive integer, got {size!r:.40}", loc=("shape", str(dim)))
    return shape_text(shape)


def dtype_key(dtype: str | Mapping[str, str]) -> str:
    """One dtype name as is; a per-input map as compact sorted JSON (normalize it first:
    :func:`service.bundle.normalize_dtype`)."""
    return dtype_text(dtype)


def dedupe_key(spec_hash: str, shape_key_: str, dtype_key_: str, target: str, measurer: str) -> str:
    return hashlib.sha256("|".join((spec_hash, shape_key_, dtype_key_, target, measurer)).encode()).hexdigest()


@lru_cache(maxsize=1)
def current_versions() -> tuple[str, str]:
    """(Triton version, generator version) of this code: the version part of kernel cache keys."""
    from importlib import metadata

    from fuser_core.codegen.module import GENERATOR_VERSION

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return triton_version, GENERATOR_VERSION


def job_spec(record: SpecRecord) -> Spec:
    """The spec whose dim names a job's ``shape`` uses: the canonical spec."""
    return load_spec(record.canonical, printed=True)


def display_shape(record: SpecRecord, shape: Mapping[str, int]) -> dict[str, int]:
    """A canonical shape in the dim names of the spec as first stored (``record.source``)."""
    names = canonical_names(load_spec(record.source))
    back = {canon: user for user, canon in names.items()}
    return {back.get(d, d): n for d, n in shape.items()}


def _check_choice(value: Any, allowed: tuple[str, ...] | list[str], field: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise InvalidRequest(f"unknown {field} {value!r:.60}; one of {', '.join(sorted(allowed))}", loc=(field,))
    return value.strip().lower()


def _check_target(target: Any) -> str:
    from tuner.profiles import PROFILES

    return _check_choice(target, list(PROFILES), "target")


def _check_budget(trials: Any, seconds: Any) -> tuple[int, float]:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InvalidRequest(f"must be a positive integer, got {trials!r:.40}", loc=("budget", "trials"))
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(f"must be a positive number of seconds, got {seconds!r:.40}", loc=("budget", "seconds"))
    return trials, float(seconds)


def _clip(text: str | None, limit: int = MAX_ERROR_CHARS) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= limit else text[: limit - 20] + " ... (truncated)"


# ----------------------------------------------------------------------------- specs


def ensure_spec(session: Session, spec: Spec, source: str) -> SpecRecord:
    """The stored record of ``spec`` (by spec_hash), storing it with its derivation report once.

    ``source`` is the spec JSON as submitted; it must parse to the same spec_hash. The
    derivation (seconds, for large specs) is computed outside any transaction; a concurrent
    insert of the same spec is resolved by reading the winner's record. Commits.
    """
    shash = compute_spec_hash(spec)
    record = session.get(SpecRecord, shash)
    session.commit()
    if record is not None:
        return record
    if not isinstance(source, str):
        source = json.dumps(source)
    if compute_spec_hash(load_spec(source)) != shash:
        raise InvalidRequest("the spec source does not parse to the spec given", loc=("spec",))
    from fuser_core.report import derivation_report

    report = derivation_report(spec)
    for _ in range(RETRIES):
        record = session.get(SpecRecord, shash)
        if record is not None:
            session.commit()
            return record
        record = SpecRecord(spec_hash=shash, name=spec.name, canonical=canonical_json(spec), source=source,
                            derivation=report)
        session.add(record)
        try:
            session.commit()
            return record
        except IntegrityError:
            session.rollback()
    raise JobError(f"could not store spec {shash}: concurrent writers kept conflicting")


def get_spec(session: Session, spec_hash: str) -> SpecRecord:
    record = session.get(SpecRecord, spec_hash)
    session.commit()
    if record is None:
        raise NotFound(f"no spec with hash {spec_hash!r:.80}")
    return record


# ----------------------------------------------------------------------------- submitting


def submit_job(session: Session, spec: Spec, source: str, shape: Mapping[str, int], dtype: str | Mapping[str, str],
               target: str, measurer: str, budget_trials: int, budget_seconds: float) -> tuple[Job, bool]:
    """Queue a tuning job, or return the existing one for the same request: (job, created).

    ``created`` is True only when a new search was queued. A kernel already cached for the
    exact key answers with a succeeded job (an existing one, or a new row pointing at the
    kernel; ``created`` False). Bad fields raise :class:`InvalidRequest` / SpecError naming
    them. Race-safe: see the module docstring. Commits.
    """
    target = _check_target(target)
    measurer = _check_choice(measurer, MEASURERS, "measurer")
    budget_trials, budget_seconds = _check_budget(budget_trials, budget_seconds)
    cshape = canonical_shape(spec, shape)  # SpecError naming the dim (in the caller's names)
    ndtype = normalize_dtype(spec, dtype)
    record = ensure_spec(session, spec, source)
    key = _Key(record.spec_hash, cshape, shape_key(cshape), dtype_key(ndtype), ndtype, target, measurer)
    for _ in range(RETRIES):
        try:
            job, created = _submit_once(session, key, budget_trials, budget_seconds)
            session.commit()
            return job, created
        except IntegrityError:  # an identical submission won the race: read its job next time round
            session.rollback()
    raise JobError("could not submit the job: concurrent submissions kept conflicting; try again")


class _Key:
    """A job's identity, computed once per submission."""

    def __init__(self, spec_hash: str, shape: dict[str, int], skey: str, dkey: str, dtype: Any, target: str,
                 measurer: str):
        self.spec_hash, self.shape, self.shape_key, self.dtype_key = spec_hash, shape, skey, dkey
        self.dtype, self.target, self.measurer = dtype, target, measurer
        self.dedupe = dedupe_key(spec_hash, skey, dkey, target, measurer)

    def study_name(self, job_id: str) -> str:
        from tuner.search import study_name_for

        # one study per job: a job resubmitted after failing searches afresh (warm-started
        # from its predecessor's study, which tuner.search.warm_start finds by spec and shape)
        return f"{study_name_for(self.spec_hash, self.shape, self.dtype, self.target, self.measurer)}:{job_id[:8]}"


def _submit_once(session: Session, key: _Key, budget_trials: int, budget_seconds: float) -> tuple[Job, bool]:
    job = session.execute(sa.select(Job).where(Job.dedupe_key == key.dedupe)
                          .execution_options(populate_existing=True)).scalar_one_or_none()
    if job is not None:
        if job.status != "succeeded" or _kernel_is_current(session, job.kernel_id):
            return job, False
        job.dedupe_key = None  # its kernel predates this code's Triton/generator: search again
        session.flush()
    kernel = _exact_kernel(session, key)
    now = utcnow()
    if kernel is not None and _kernel_serves(kernel, key.measurer):
        job = _new_job(key, budget_trials, budget_seconds, now, status="succeeded", kernel_id=kernel.id,
                       started_at=now, finished_at=now, best=_kernel_best(kernel))
        session.add(job)
        session.flush()
        return job, False
    job = _new_job(key, budget_trials, budget_seconds, now, status="queued")
    session.add(job)
    session.flush()
    return job, True


def _new_job(key: _Key, budget_trials: int, budget_seconds: float, now: datetime, **fields: Any) -> Job:
    job_id = new_id()
    return Job(id=job_id, spec_hash=key.spec_hash, shape=key.shape, shape_key=key.shape_key, dtype=key.dtype_key,
               target=key.target, measurer=key.measurer, budget_trials=budget_trials, budget_seconds=budget_seconds,
               dedupe_key=key.dedupe, cancel_requested=False, attempts=0, trials_done=0,
               study_name=key.study_name(job_id), created_at=now, updated_at=now, **fields)


def _exact_kernel(session: Session, key: _Key) -> Kernel | None:
    triton_version, generator_version = current_versions()
    return session.execute(sa.select(Kernel).where(
        Kernel.spec_hash == key.spec_hash, Kernel.shape_key == key.shape_key, Kernel.dtype == key.dtype_key,
        Kernel.target == key.target, Kernel.triton_version == triton_version,
        Kernel.generator_version == generator_version).execution_options(populate_existing=True)).scalar_one_or_none()


def _kernel_is_current(session: Session, kernel_id: str | None) -> bool:
    kernel = session.get(Kernel, kernel_id, populate_existing=True) if kernel_id else None
    return kernel is not None and (kernel.triton_version, kernel.generator_version) == current_versions()


def _kernel_serves(kernel: Kernel, measurer: str) -> bool:
    """A cached kernel answers a request for ``measurer`` when it was found that way, or was
    measured on a GPU (a measurement beats any prediction); a prediction never answers cuda."""
    return kernel.measurer == measurer or not kernel.predicted


def _kernel_best(kernel: Kernel) -> dict[str, Any]:
    return {"strategy": kernel.strategy, "config": kernel.config, "time_ms": kernel.time_ms, "trial": None,
            "predicted": kernel.predicted}


# ----------------------------------------------------------------------------- reading jobs


def get_job(session: Session, job_id: str) -> Job:
    """The job; :class:`NotFound` if there is none."""
    job = session.get(Job, job_id, populate_existing=True)
    session.commit()
    if job is None:
        raise NotFound(f"no job with id {job_id!r:.80}")
    return job


def list_jobs(session: Session, *, status: str | None = None, spec_hash: str | None = None,
              target: str | None = None, limit: int = 100, offset: int = 0) -> list[Job]:
    """Jobs, newest first, filtered by any of status, spec_hash, target."""
    query = sa.select(Job).order_by(Job.created_at.desc(), Job.id)
    if status is not None:
        query = query.where(Job.status == status)
    if spec_hash is not None:
        query = query.where(Job.spec_hash == spec_hash)
    if target is not None:
        query = query.where(Job.target == target)
    return _page(session, query, limit, offset)


def _page(session: Session, query: sa.Select, limit: int, offset: int) -> list[Any]:
    query = query.limit(max(0, min(int(limit), MAX_LIST))).offset(max(0, int(offset)))
    rows = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    session.commit()
    return rows


def list_trials(session: Session, job_id: str) -> list[TrialRecord]:
    """Every recorded trial of the job, by trial number; :class:`NotFound` for no job."""
    if session.get(Job, job_id) is None:
        session.commit()
        raise NotFound(f"no job with id {job_id!r:.80}")
    query = sa.select(TrialRecord).where(TrialRecord.job_id == job_id).order_by(TrialRecord.number)
    rows = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    session.commit()
    return rows


# ----------------------------------------------------------------------------- cancelling


def cancel_job(session: Session, job_id: str) -> Job:
    """Queued: cancelled at once. Running: ``cancel_requested`` (the worker sees it when it
    renews its lease and calls :func:`mark_cancelled`). Finished: unchanged. Commits."""
    job = _locked_job(session, job_id)
    now = utcnow()
    if job.status == "queued":
        _close(job, "cancelled", now)
    elif job.status == "running" and not job.cancel_requested:
        job.cancel_requested = True
        job.updated_at = now
    session.commit()
    return job


def _locked_job(session: Session, job_id: str) -> Job:
    """The job row, locked until the transaction ends (PostgreSQL; SQLite: the whole database)."""
    query = sa.select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    job = session.execute(query).scalar_one_or_none()
    if job is None:
        session.rollback()
        raise NotFound(f"no job with id {job_id!r:.80}")
    return job


def _close(job: Job, status: str, now: datetime, error: str | None = None) -> None:
    """Finish a job as failed or cancelled: a resubmission of the same request starts a new job."""
    job.status = status
    job.error = _clip(error) if error is not None else job.error
    job.dedupe_key = None
    job.lease_expires_at = None
    job.finished_at = now
    job.updated_at = now


# ----------------------------------------------------------------------------- workers


def register_worker(session: Session, worker_id: str, *, hostname: str, gpu_name: str | None, target: str,
                    measurer: str, versions: Mapping[str, Any]) -> WorkerRecord:
    """Record (or re-record, after a restart) a worker and what it can run. Commits."""
    if not isinstance(worker_id, str) or not 1 <= len(worker_id) <= 128:
        raise InvalidRequest("must be 1 to 128 characters", loc=("worker_id",))
    target = _check_target(target)
    measurer = _check_choice(measurer, MEASURERS, "measurer")
    now = utcnow()
    for _ in range(RETRIES):
        worker = session.get(WorkerRecord, worker_id, populate_existing=True)
        if worker is None:
            worker = WorkerRecord(id=worker_id)
            session.add(worker)
        worker.hostname, worker.gpu_name = str(hostname)[:255], (str(gpu_name)[:255] if gpu_name else None)
        worker.target, worker.measurer, worker.versions = target, measurer, dict(versions)
        worker.current_job_id, worker.started_at, worker.last_heartbeat = None, now, now
        try:
            session.commit()
            return worker
        except IntegrityError:
            session.rollback()
    raise JobError(f"could not register worker {worker_id!r}: concurrent registrations kept conflicting")


def worker_heartbeat(session: Session, worker_id: str, current_job_id: str | None = None) -> None:
    """The worker is alive (and working on ``current_job_id``). Commits."""
    result = session.execute(sa.update(WorkerRecord).where(WorkerRecord.id == worker_id)
                             .values(last_heartbeat=utcnow(), current_job_id=current_job_id))
    session.commit()
    if result.rowcount == 0:
        raise NotFound(f"no worker with id {worker_id!r:.80}; register it first")


def list_workers(session: Session) -> list[WorkerRecord]:
    """Every registered worker, most recently seen first."""
    query = sa.select(WorkerRecord).order_by(WorkerRecord.last_heartbeat.desc(), WorkerRecord.id)
    return _page(session, query, MAX_LIST, 0)


def _set_worker_job(session: Session, worker_id: str, job_id: str | None, now: datetime) -> None:
    # unregistered workers are allowed (no row to update)
    session.execute(sa.update(WorkerRecord).where(WorkerRecord.id == worker_id)
                    .values(current_job_id=job_id, last_heartbeat=now))


# ----------------------------------------------------------------------------- claiming and leases


def claim_job(session: Session, worker_id: str, *, target: str, measurer: str, lease_seconds: float,
              closed: list[tuple[str, str]] | None = None) -> Job | None:
    """The oldest queued job for (target, measurer), or a running one whose lease expired;
    None when there is none. The claim holds for ``lease_seconds``. Commits.

    A registered worker may only claim jobs for the target it registered. Expired jobs that
    were asked to cancel are cancelled, and those already claimed ``MAX_ATTEMPTS`` times fail
    ("worker lost ..."), instead of being claimed; their ``(id, study_name)`` are appended to
    ``closed`` (their lost worker's trials are the caller's to end).
    """
    if not lease_seconds > 0:
        raise InvalidRequest("must be positive", loc=("lease_seconds",))
    target = _check_target(target)
    measurer = _check_choice(measurer, MEASURERS, "measurer")
    _check_worker_target(session, worker_id, target)
    for _ in range(100):  # each round settles one candidate: claimed, closed, or lost to another worker
        now = utcnow()
        candidate = session.execute(_claimable(target, measurer, now)).scalar_one_or_none()
        if candidate is None:
            session.commit()
            return None
        if candidate.status == "running" and _close_expired(candidate, now):
            if closed is not None:
                closed.append((candidate.id, candidate.study_name))
            session.commit()
            continue
        if _take(session, candidate.id, worker_id, now, lease_seconds):
            _set_worker_job(session, worker_id, candidate.id, now)
            session.commit()
            return get_job(session, candidate.id)
        session.rollback()  # another worker took it between our read and our update
    session.rollback()
    return None


def _check_worker_target(session: Session, worker_id: str, target: str) -> None:
    worker = session.get(WorkerRecord, worker_id, populate_existing=True)
    if worker is not None and worker.target != target:
        session.rollback()
        raise JobError(f"worker {worker_id!r} registered for target {worker.target!r} cannot take {target!r} jobs")


def _claimable_where(now: datetime) -> sa.ColumnElement[bool]:
    expired = sa.and_(Job.status == "running", Job.lease_expires_at < now)
    return sa.or_(Job.status == "queued", expired)


def _claimable(target: str, measurer: str, now: datetime) -> sa.Select:
    return (sa.select(Job).where(Job.target == target, Job.measurer == measurer, _claimable_where(now))
            .order_by(Job.created_at, Job.id).limit(1)
            .with_for_update(skip_locked=True).execution_options(populate_existing=True))


def _close_expired(job: Job, now: datetime) -> bool:
    """Close a job whose worker was lost, when it must not run again; True if closed."""
    if job.cancel_requested:
        _close(job, "cancelled", now)
        return True
    if job.attempts >= MAX_ATTEMPTS:
        _close(job, "failed", now, f"worker lost {job.attempts} times (last: worker {job.worker_id!r}, "
                                   f"lease expired at {job.lease_expires_at:%Y-%m-%d %H:%M:%S} UTC)")
        return True
    return False


def _take(session: Session, job_id: str, worker_id: str, now: datetime, lease_seconds: float) -> bool:
    """The claim itself: a conditional UPDATE that only one worker can win (rowcount 1)."""
    result = session.execute(
        sa.update(Job).where(Job.id == job_id, _claimable_where(now))
        .values(status="running", worker_id=worker_id, lease_expires_at=now + timedelta(seconds=lease_seconds),
                attempts=Job.attempts + 1, updated_at=now,
                started_at=sa.func.coalesce(Job.started_at, sa.literal(now, UTCDateTime())))
        .execution_options(synchronize_session=False))
    return result.rowcount == 1


def renew_lease(session: Session, job_id: str, worker_id: str, lease_seconds: float) -> bool:
    """Extend the worker's lease; False (and no change) if it no longer holds the job or the
    job was asked to cancel (then the worker stops and calls :func:`mark_cancelled`). Commits."""
    now = utcnow()
    result = session.execute(
        sa.update(Job).where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running",
                             Job.cancel_requested == sa.false())
        .values(lease_expires_at=now + timedelta(seconds=lease_seconds), updated_at=now)
        .execution_options(synchronize_session=False))
    if result.rowcount == 1:
        _set_worker_job(session, worker_id, job_id, now)
    session.commit()
    return result.rowcount == 1


def _held(session: Session, job_id: str, worker_id: str) -> Job:
    """The job, locked, if ``worker_id`` holds it; else :class:`LeaseLost`."""
    job = _locked_job(session, job_id)
    if job.status != "running" or job.worker_id != worker_id:
        holder = f"held by worker {job.worker_id!r}" if job.status == "running" else f"it is {job.status}"
        session.rollback()
        raise LeaseLost(f"worker {worker_id!r} no longer holds job {job_id} ({holder})")
    return job


def release_job(session: Session, job_id: str, worker_id: str) -> None:
    """Give a held job back to the queue (a worker shutting down cleanly); the claim does
    not count as a lost worker. :class:`LeaseLost` if not the holder. Commits."""
    job = _held(session, job_id, worker_id)
    now = utcnow()
    job.status, job.worker_id, job.lease_expires_at = "queued", None, None
    job.attempts = max(0, job.attempts - 1)
    job.updated_at = now
    _set_worker_job(session, worker_id, None, now)
    session.commit()


def mark_cancelled(session: Session, job_id: str, worker_id: str) -> None:
    """The holder stopped the search of a job asked to cancel; its trials are kept. Commits."""
    job = _held(session, job_id, worker_id)
    now = utcnow()
    _close(job, "cancelled", now)
    _set_worker_job(session, worker_id, None, now)
    session.commit()


def fail_job(session: Session, job_id: str, worker_id: str, error: str) -> None:
    """The holder gives up on the job: failed, with ``error`` saying why. Commits."""
    job = _held(session, job_id, worker_id)
    now = utcnow()
    _close(job, "failed", now, error or "failed (no reason given)")
    _set_worker_job(session, worker_id, None, now)
    session.commit()


# ----------------------------------------------------------------------------- trials


def record_trial(session: Session, job_id: str, worker_id: str, *, number: int, strategy: str | None,
                 config: Mapping[str, Any] | None, time_ms: float | None, error: str | None, state: str,
                 predicted: bool, source: str | None, compile: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Store (or overwrite) trial ``number`` of the job, and update the job's progress and best.

    ``compile``: the compile gate's facts per kernel (tuner.compile_gate.CompileVerdict.facts),
    stored as given (at most MAX_COMPILE_FACTS kernels, errors clipped).

    :class:`LeaseLost` if ``worker_id`` does not hold the job. Commits.
    """
    state = _check_choice(state, ("complete", "failed", "pruned"), "state")
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise InvalidRequest(f"must be a non-negative integer, got {number!r:.40}", loc=("number",))
    if time_ms is not None and not (isinstance(time_ms, int | float) and math.isfinite(time_ms) and time_ms > 0):
        raise InvalidRequest(f"must be a positive number or null, got {time_ms!r:.40}", loc=("time_ms",))
    if config is not None and not isinstance(config, Mapping):
        raise InvalidRequest(f"must be an object or null, got {type(config).__name__}", loc=("config",))
    if state == "complete" and time_ms is None:
        raise InvalidRequest("a complete trial needs its time", loc=("time_ms",))
    if compile is not None and (isinstance(compile, str | bytes | Mapping)
                                or not all(isinstance(k, Mapping) for k in compile)):
        raise InvalidRequest("must be a list of objects or null", loc=("compile",))
    job = _held(session, job_id, worker_id)
    now = utcnow()
    trial = session.execute(sa.select(TrialRecord).where(TrialRecord.job_id == job_id, TrialRecord.number == number)
                            .execution_options(populate_existing=True)).scalar_one_or_none()
    if trial is None:
        trial = TrialRecord(job_id=job_id, number=number, created_at=now)
        session.add(trial)
    trial.worker_id, trial.strategy = worker_id, (strategy[:64] if strategy else None)
    trial.config = dict(config) if config is not None else None
    trial.time_ms = float(time_ms) if time_ms is not None else None
    trial.error, trial.state, trial.predicted = _clip(error), state, bool(predicted)
    trial.source = _clip(source, 512)
    trial.compile = None if compile is None else [
        {k: (_clip(v) if isinstance(v, str) else v) for k, v in dict(kernel).items()}
        for kernel in list(compile)[:MAX_COMPILE_FACTS]]
    session.flush()
    job.trials_done = session.scalar(sa.select(sa.func.count()).select_from(TrialRecord)
                                     .where(TrialRecord.job_id == job_id)) or 0
    job.best = _best_trial(session, job_id)
    job.updated_at = now
    session.commit()


def _best_trial(session: Session, job_id: str) -> dict[str, Any] | None:
    best = session.execute(
        sa.select(TrialRecord).where(TrialRecord.job_id == job_id, TrialRecord.state == "complete",
                                     TrialRecord.time_ms.is_not(None))
        .order_by(TrialRecord.time_ms, TrialRecord.number).limit(1)).scalar_one_or_none()
    if best is None:
        return None
    return {"strategy": best.strategy, "config": best.config, "time_ms": best.time_ms, "trial": best.number,
            "predicted": best.predicted}


# ----------------------------------------------------------------------------- finishing


KERNEL_FIELDS = {"time_ms", "measurer", "predicted", "baselines", "strategy", "config"}


def finish_job(session: Session, job_id: str, worker_id: str, *, bundle: dict, kernel_fields: dict) -> Kernel:
    """Store the job's result: its bundle and the kernel for its cache key; the job succeeds.

    ``bundle`` must verify (:func:`service.bundle.verify_bundle`: format, fields, sha256) and
    be for the job's spec, shape, dtype and target. The kernel's strategy, config and
    Triton/generator versions are the bundle's (what was generated); ``kernel_fields`` gives
    the measurement: ``time_ms`` (else ``bundle["measured"]["time_ms"]``), ``measurer``
    (default the job's), ``predicted`` (default: measurer is ``model``), ``baselines``;
    ``strategy`` if given must be the bundle's, ``config`` is used only for a bundle
    without one. If a kernel for the same key exists and is at least as good (a measurement
    beats a prediction, then lower time), the job points at it and it is kept; else it is
    replaced in place (same id). :class:`LeaseLost` if not the holder. Commits.
    """
    content, digest = _bundle_content(bundle)
    for _ in range(RETRIES):
        job = _held(session, job_id, worker_id)
        try:
            fields = _kernel_values(job, bundle, kernel_fields)
            kernel = _store_kernel(session, job, fields, digest, content)
        except JobError:
            session.rollback()
            raise
        except IntegrityError:  # another job stored the same kernel key or bundle concurrently
            session.rollback()
            continue
        now = utcnow()
        job.status, job.kernel_id, job.lease_expires_at = "succeeded", kernel.id, None
        job.finished_at = job.updated_at = now
        if job.best is None:
            job.best = _kernel_best(kernel)
        _set_worker_job(session, worker_id, None, now)
        try:
            session.commit()
            return kernel
        except IntegrityError:
            session.rollback()
    raise JobError(f"could not store the kernel of job {job_id}: concurrent writers kept conflicting")


class InvalidBundle(JobError):
    """A bundle that fails verification or is not for its job."""


def _bundle_content(bundle: Any) -> tuple[bytes, str]:
    """(bytes to store, sha256) of a verified bundle."""
    try:
        verify_bundle(bundle)
        return canonical_bytes(bundle), bundle["sha256"]
    except BundleError as err:
        raise InvalidBundle(f"bundle: {err}") from None


def _kernel_values(job: Job, bundle: dict, given: Mapping[str, Any]) -> dict[str, Any]:
    """The Kernel row's values from the job (the key), the bundle and the measurement."""
    unknown = sorted(set(given) - KERNEL_FIELDS)
    if unknown:
        raise InvalidBundle(f"kernel_fields: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(KERNEL_FIELDS))}")
    expected = {"spec_hash": job.spec_hash, "shape": job.shape, "dtype": job.dtype_value, "target": job.target}
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
        "time_ms": float(time_ms), "measurer": measurer, "predicted": bool(given.get("predicted", measurer == "model")),
        "baselines": given.get("baselines"),
        "triton_version": str(bundle.get("triton_version") or triton_version)[:64],
        "generator_version": str(bundle.get("generator_version") or generator_version)[:64],
    }


def _rank(predicted: bool, time_ms: float) -> tuple[int, float]:
    return (1 if predicted else 0, time_ms)


def _store_kernel(session: Session, job: Job, fields: dict[str, Any], digest: str, content: bytes) -> Kernel:
    existing = session.execute(sa.select(Kernel).where(
        Kernel.spec_hash == job.spec_hash, Kernel.shape_key == job.shape_key, Kernel.dtype == job.dtype,
        Kernel.target == job.target, Kernel.triton_version == fields["triton_version"],
        Kernel.generator_version == fields["generator_version"]).with_for_update()
        .execution_options(populate_existing=True)).scalar_one_or_none()
    new_rank = _rank(fields["predicted"], fields["time_ms"])
    if (existing is not None and _rank(existing.predicted, existing.time_ms) <= new_rank
            and _stored_bundle_intact(session, existing.bundle_sha256)):
        return existing  # the cached kernel is at least as good (and its bundle intact): keep it
    _store_bundle(session, digest, content)
    now = utcnow()
    kernel = existing or Kernel(id=new_id(), spec_hash=job.spec_hash, shape=job.shape, shape_key=job.shape_key,
                                dtype=job.dtype, target=job.target, created_at=now)
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
    elif row.content != content:  # the stored copy was damaged: repair it with the verified bytes
        row.content, row.size = content, len(content)
    session.flush()


# ----------------------------------------------------------------------------- kernels


def get_kernel(session: Session, kernel_id: str) -> Kernel:
    kernel = session.get(Kernel, kernel_id, populate_existing=True)
    session.commit()
    if kernel is None:
        raise NotFound(f"no kernel with id {kernel_id!r:.80}")
    return kernel


def get_bundle_bytes(session: Session, kernel: Kernel) -> bytes:
    """The kernel's bundle exactly as stored, after re-checking its hash; a bundle whose bytes
    do not match its sha256 raises :class:`BundleCorrupted` and is never served."""
    row = session.get(Bundle, kernel.bundle_sha256, populate_existing=True)
    session.commit()
    if row is None:
        raise BundleCorrupted(f"stored bundle {kernel.bundle_sha256} of kernel {kernel.id} is missing")
    if not _bundle_intact(row.content, row.sha256):
        raise BundleCorrupted(f"stored bundle {row.sha256} of kernel {kernel.id}: hash mismatch "
                              "(its bytes changed after it was stored); it is not served")
    return row.content


def _stored_bundle_intact(session: Session, digest: str) -> bool:
    row = session.get(Bundle, digest, populate_existing=True)
    return row is not None and _bundle_intact(row.content, row.sha256)


def _bundle_intact(content: bytes, digest: str) -> bool:
    """The bytes parse, are canonical, name ``digest`` and hash to it."""
    try:
        obj = json.loads(content)
        return (isinstance(obj, dict) and obj.get("sha256") == digest and canonical_bytes(obj) == content
                and bundle_sha256(obj) == digest)
    except (ValueError, BundleError, RecursionError):
        return False


def list_kernels(session: Session, *, spec_hash: str | None = None, target: str | None = None,
                 dtype: str | None = None, limit: int = 100, offset: int = 0) -> list[Kernel]:
    """Kernels, newest first, filtered by any of spec_hash, target, dtype (a dtype_key)."""
    query = sa.select(Kernel).order_by(Kernel.created_at.desc(), Kernel.id)
    if spec_hash is not None:
        query = query.where(Kernel.spec_hash == spec_hash)
    if target is not None:
        query = query.where(Kernel.target == target)
    if dtype is not None:
        query = query.where(Kernel.dtype == dtype)
    return _page(session, query, limit, offset)


def find_kernel(session: Session, *, spec_hash: str, target: str, dtype: str | Mapping[str, str],
                shape: Mapping[str, int] | None) -> tuple[Kernel, bool] | None:
    """The kernel to serve for a request: (kernel, exact), or None.

    ``shape`` is canonical (``{"d0": 4, "d1": 300}``) and ``dtype`` normalized, as
    :mod:`service.client` sends them. Exact: the same shape, with this code's Triton and
    generator versions. Otherwise the nearest tuned shape of the same spec, target and dtype
    (least sum over dims of ``|log2(a/b)|``; ties: current versions, a measurement, faster,
    newer), with ``exact`` False. ``shape=None``: the best by those ties, not exact.
    """
    skey = shape_key(shape) if shape is not None else None
    query = (sa.select(Kernel).where(Kernel.spec_hash == spec_hash, Kernel.target == str(target).strip().lower(),
                                     Kernel.dtype == dtype_key(dtype)).limit(10 * MAX_LIST))
    candidates = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    session.commit()
    if not candidates:
        return None
    current = current_versions()

    def order(k: Kernel) -> tuple:
        distance = 0.0 if shape is None else _shape_distance(shape, k.shape)
        newer = -k.updated_at.timestamp()
        return (distance, (k.triton_version, k.generator_version) != current, k.predicted, k.time_ms, newer, k.id)

    best = min(candidates, key=order)
    if shape is not None and math.isinf(_shape_distance(shape, best.shape)):
        return None
    exact = skey is not None and best.shape_key == skey and (best.triton_version, best.generator_version) == current
    return best, exact


def _shape_distance(a: Mapping[str, int], b: Mapping[str, Any]) -> float:
    if not isinstance(b, Mapping) or set(a) != set(b):
        return math.inf
    try:
        return sum(abs(math.log2(a[d] / b[d])) for d in a)
    except (TypeError, ValueError, ZeroDivisionError):
        return math.inf
