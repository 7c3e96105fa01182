"""The leased job queue: plain functions over a SQLAlchemy ``Session``.

**Jobs.** A submission (a :class:`service.tuning_request.TuningRequest`, checked and bound
once) is idempotent on (spec_hash, shape, dtype, target, measurer): the ``dedupe_key`` column
is unique, so of concurrent identical submissions exactly one INSERT wins and the others find
its job on retry. It stays set while the job is queued, running or succeeded, and is cleared
when a job fails or is cancelled, so a resubmission then starts afresh. A kernel already
cached for the exact key (:mod:`service.store.kernel_cache`, with this code's Triton and generator
versions) is answered with a succeeded job instead of a new search; a failed job's partial
kernel (:func:`keep_partial`) never is. The spec is stored once
(:mod:`service.store.spec_store`); jobs keep the canonical shape.

**Leases.** A worker claims a job with a lease (``lease_expires_at``) and renews it while it
works. Only the holder (status ``running`` and ``worker_id`` = its id) may record trials,
finish, fail or cancel the job; anyone else gets :class:`LeaseLost`. A job whose lease
expired is taken over by the next claim (``attempts`` counts claims; after
``MAX_ATTEMPTS`` lost workers the job fails and says so). Holder checks lock the job row
(``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite transactions are ``BEGIN IMMEDIATE``,
service/store/db.py), and a claim is a conditional UPDATE that only one claimer can win.

**Transactions.** Every function here ends its transaction (commit, or rollback on error) —
on SQLite an open transaction holds the database's write lock. Objects stay readable after
commit with sessions from :func:`service.store.db.session_factory`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.store import kernel_cache
from service.store.db import MAX_LIST, RETRIES, committed, get_row, newest_first, page
from service.errors import InvalidRequest, JobError, LeaseLost, NotFound
from service.store.job_outcome import JobOutcome
from service.store.models import Job, KernelRecord, TrialRecord, UTCDateTime, WorkerRecord, new_id, utcnow
from service.store.spec_store import ensure_spec, refuse_uncertified, uncertified
from service.tuning_request import TuningRequest, check_choice, check_measurer, check_target

MAX_ATTEMPTS = 3  # claims of one job; a job whose worker was lost this often fails
MAX_ERROR_CHARS = 10_000
MAX_COMPILE_FACTS = 64  # kernels per trial (the unfused chain has one per reduction)


def submit_job(session: Session, request: TuningRequest) -> tuple[Job, bool]:
    """Queue a tuning job, or return the existing one for the same request: (job, created).

    ``request`` was checked and bound once (:func:`service.tuning_request.tuning_request`);
    nothing here checks it again. ``created`` is True only when a new search was queued. A
    kernel already cached for the exact key answers with a succeeded job (an existing one, or
    a new row pointing at the kernel; ``created`` False). Race-safe: see the module
    docstring. Commits.
    """
    record = ensure_spec(session, request.spec, request.source, request.spec_hash)
    refuse_uncertified(request.spec, uncertified(record.derivation), request.allow_uncertified)
    for _ in range(RETRIES):
        try:
            job, created = _submit_once(session, request)
            session.commit()
            return job, created
        except IntegrityError:  # an identical submission won the race: read its job next time round
            session.rollback()
    raise JobError("could not submit the job: concurrent submissions kept conflicting; try again")


def _study_name(request: TuningRequest, job_id: str) -> str:
    from tuner import study_name_for

    # one study per job: a job resubmitted after failing searches afresh (warm-started
    # from its predecessor's study, which tuner.search.warm_start finds by spec and shape)
    shape = request.shape
    if request.is_range:  # the range as text (d0=1..16384); each bucket's study adds its shape (service.worker)
        shape = {d: f"{v['min']}..{v['max']}" if isinstance(v, Mapping) else v for d, v in shape.items()}
    name = study_name_for(request.spec_hash, shape, request.dtype, request.target, request.measurer)
    return f"{name}:{job_id[:8]}"


def _submit_once(session: Session, request: TuningRequest) -> tuple[Job, bool]:
    job = session.execute(sa.select(Job).where(Job.dedupe_key == request.dedupe_key)
                          .execution_options(populate_existing=True)).scalar_one_or_none()
    if job is not None:
        if job.status != "succeeded" or kernel_cache.kernel_is_current(session, job.kernel_id):
            return job, False
        job.dedupe_key = None  # its kernel predates this code's Triton/generator: search again
        session.flush()
    # a range job is answered from the cache only through its dedupe key (above): its result is
    # one kernel per bucket, which no single cached kernel stands for
    kernel = None if request.is_range else kernel_cache.exact_kernel(session, request)
    now = utcnow()
    if kernel is not None and kernel_cache.kernel_serves(kernel, request.measurer):
        job = _new_job(request, now, status="succeeded", kernel_id=kernel.id,
                       started_at=now, finished_at=now, best=kernel_cache.kernel_best(kernel))
        session.add(job)
        session.flush()
        return job, False
    job = _new_job(request, now, status="queued")
    session.add(job)
    session.flush()
    return job, True


def _new_job(request: TuningRequest, now: datetime, **fields: Any) -> Job:
    job_id = new_id()
    return Job(id=job_id, spec_hash=request.spec_hash, shape=request.shape, shape_key=request.shape_key,
               dtype=request.dtype_key, target=request.target, measurer=request.measurer,
               budget_trials=request.budget_trials, budget_seconds=request.budget_seconds,
               dedupe_key=request.dedupe_key, cancel_requested=False, attempts=0, trials_done=0,
               study_name=_study_name(request, job_id), created_at=now, updated_at=now, **fields)


# ----------------------------------------------------------------------------- reading jobs


def get_job(session: Session, job_id: str) -> Job:
    """The job; :class:`NotFound` if there is none."""
    return get_row(session, Job, job_id, "job with id")


def list_jobs(session: Session, *, status: str | None = None, spec_hash: str | None = None,
              target: str | None = None, shape_key: str | None = None, dtype: str | None = None,
              limit: int = 100, offset: int = 0) -> list[Job]:
    """Jobs, newest first, filtered by any of status, spec_hash, target, shape_key (canonical,
    :func:`service.tuning_request.shape_key`) and dtype (:func:`service.tuning_request.dtype_key`)."""
    return newest_first(session, Job, limit, offset, status=status, spec_hash=spec_hash, target=target,
                        shape_key=shape_key, dtype=dtype)


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
        _close(job, JobOutcome.CANCELLED, now)
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


def _close(job: Job, outcome: JobOutcome, now: datetime, error: str | None = None) -> None:
    """Finish a job as failed or cancelled (its status, the outcome's string): a resubmission of
    the same request starts a new job."""
    assert outcome in (JobOutcome.FAILED, JobOutcome.CANCELLED)
    job.status = outcome.value
    job.error = _clip(error) if error is not None else job.error
    job.dedupe_key = None
    job.lease_expires_at = None
    job.finished_at = now
    job.updated_at = now


def _clip(text: str | None, limit: int = MAX_ERROR_CHARS) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= limit else text[: limit - 20] + " ... (truncated)"


# ----------------------------------------------------------------------------- workers


def register_worker(session: Session, worker_id: str, *, hostname: str, gpu_name: str | None, target: str,
                    measurer: str, versions: Mapping[str, Any]) -> WorkerRecord:
    """Record (or re-record, after a restart) a worker and what it can run. Commits."""
    if not isinstance(worker_id, str) or not 1 <= len(worker_id) <= 128:
        raise InvalidRequest("must be 1 to 128 characters", loc=("worker_id",))
    target = check_target(target)
    measurer = check_measurer(measurer)
    now = utcnow()
    for _ in range(RETRIES):
        worker = session.get(WorkerRecord, worker_id, populate_existing=True)
        if worker is None:
            worker = WorkerRecord(id=worker_id)
            session.add(worker)
        worker.hostname, worker.gpu_name = str(hostname)[:255], (str(gpu_name)[:255] if gpu_name else None)
        worker.target, worker.measurer, worker.versions = target, measurer, dict(versions)
        worker.current_job_id, worker.started_at, worker.last_heartbeat = None, now, now
        if committed(session):
            return worker
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
    return page(session, query, MAX_LIST, 0)


def _set_worker_job(session: Session, worker_id: str, job_id: str | None, now: datetime) -> None:
    # unregistered workers are allowed (no row to update)
    session.execute(sa.update(WorkerRecord).where(WorkerRecord.id == worker_id)
                    .values(current_job_id=job_id, last_heartbeat=now))


# ----------------------------------------------------------------------------- claiming and leases


def claim_job(session: Session, worker_id: str, *, target: str, measurer: str, lease_seconds: float,
              closed: list[tuple[str, str]] | None = None, take_expired: bool = True) -> Job | None:
    """The oldest queued job for (target, measurer), or a running one whose lease expired;
    None when there is none. The claim holds for ``lease_seconds``. Commits.

    ``target`` and ``measurer`` are taken as checked (:func:`service.tuning_request.check_target`,
    ``check_measurer``): the worker checks them once, when it starts, and claims with them for
    every job (a name that is not a target's matches no job). A registered worker may only claim
    jobs for the target it registered. Expired jobs that
    were asked to cancel are cancelled, and those already claimed ``MAX_ATTEMPTS`` times fail
    ("worker lost ..."), instead of being claimed; their ``(id, study_name)`` are appended to
    ``closed`` (their lost worker's trials are the caller's to end).

    ``take_expired=False``: only queued jobs. A worker that just met a database outage passes it
    for one lease after the database answers again: every lease looks expired then, although
    their holders are alive and renew within a heartbeat; taking them over would count a lost
    worker (``attempts``) for each, and MAX_ATTEMPTS outages would fail the job.
    """
    if not lease_seconds > 0:
        raise InvalidRequest("must be positive", loc=("lease_seconds",))
    _check_worker_target(session, worker_id, target)
    for _ in range(100):  # each round settles one candidate: claimed, closed, or lost to another worker
        now = utcnow()
        candidate = session.execute(_claimable(target, measurer, now, take_expired)).scalar_one_or_none()
        if candidate is None:
            session.commit()
            return None
        if candidate.status == "running" and _close_expired(candidate, now):
            if closed is not None:
                closed.append((candidate.id, candidate.study_name))
            _forget_lost_holder(session, candidate.id, worker_id)
            session.commit()
            continue
        if _take(session, candidate.id, worker_id, now, lease_seconds, take_expired):
            _forget_lost_holder(session, candidate.id, worker_id)
            _set_worker_job(session, worker_id, candidate.id, now)
            session.commit()
            return get_job(session, candidate.id)
        session.rollback()  # another worker took it between our read and our update
    session.rollback()
    return None


def _forget_lost_holder(session: Session, job_id: str, claimant: str) -> None:
    """A job taken over (or closed) after its lease expired is no longer its lost worker's: that
    worker's row stops naming it (a dead worker kept a ``current_job_id`` for ever)."""
    session.execute(sa.update(WorkerRecord)
                    .where(WorkerRecord.current_job_id == job_id, WorkerRecord.id != claimant)
                    .values(current_job_id=None))


def _check_worker_target(session: Session, worker_id: str, target: str) -> None:
    worker = session.get(WorkerRecord, worker_id, populate_existing=True)
    if worker is not None and worker.target != target:
        session.rollback()
        raise JobError(f"worker {worker_id!r} registered for target {worker.target!r} cannot take {target!r} jobs")


def _claimable_where(now: datetime, take_expired: bool = True) -> sa.ColumnElement[bool]:
    if not take_expired:
        return Job.status == "queued"
    expired = sa.and_(Job.status == "running", Job.lease_expires_at < now)
    return sa.or_(Job.status == "queued", expired)


def _claimable(target: str, measurer: str, now: datetime, take_expired: bool = True) -> sa.Select:
    return (sa.select(Job).where(Job.target == target, Job.measurer == measurer,
                                 _claimable_where(now, take_expired))
            .order_by(Job.created_at, Job.id).limit(1)
            .with_for_update(skip_locked=True).execution_options(populate_existing=True))


def _close_expired(job: Job, now: datetime) -> bool:
    """Close a job whose worker was lost, when it must not run again; True if closed."""
    if job.cancel_requested:
        _close(job, JobOutcome.CANCELLED, now)
        return True
    if job.attempts >= MAX_ATTEMPTS:
        _close(job, JobOutcome.FAILED, now, f"worker lost {job.attempts} times (last: worker {job.worker_id!r}, "
                                   f"lease expired at {job.lease_expires_at:%Y-%m-%d %H:%M:%S} UTC)")
        return True
    return False


def _take(session: Session, job_id: str, worker_id: str, now: datetime, lease_seconds: float,
          take_expired: bool = True) -> bool:
    """The claim itself: a conditional UPDATE that only one worker can win (rowcount 1)."""
    result = session.execute(
        sa.update(Job).where(Job.id == job_id, _claimable_where(now, take_expired))
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
    _close(job, JobOutcome.CANCELLED, now)
    _set_worker_job(session, worker_id, None, now)
    session.commit()


def fail_job(session: Session, job_id: str, worker_id: str, error: str) -> None:
    """The holder gives up on the job: failed, with ``error`` saying why. Commits."""
    job = _held(session, job_id, worker_id)
    now = utcnow()
    _close(job, JobOutcome.FAILED, now, error or "failed (no reason given)")
    _set_worker_job(session, worker_id, None, now)
    session.commit()


def keep_partial(session: Session, job_id: str, *, bundle: dict, kernel_fields: dict) -> KernelRecord | None:
    """A failed job keeps its best kernel so far: ``bundle`` (of its best complete trial, which
    passed the correctness and compile gates) stored as :func:`finish_job` stores one, but as the
    key's ``partial`` kernel (:func:`service.store.kernel_cache.store_kernel`: ranked only against the
    key's partial kernel, never served by a lookup or a submission), and the job points at it.

    Only a failed job that keeps none yet: None (nothing stored) otherwise. Anyone may call it
    (the worker that failed the job, or the one that failed it for its lost workers). Commits."""
    content, digest = kernel_cache.bundle_content(bundle)
    for _ in range(RETRIES):
        job = _locked_job(session, job_id)
        if job.status != JobOutcome.FAILED.value or job.kernel_id is not None:
            session.rollback()
            return None
        try:
            fields = kernel_cache.kernel_values(job, bundle, kernel_fields)
            kernel = kernel_cache.store_kernel(session, job, fields, digest, content, partial=True)
        except JobError:
            session.rollback()
            raise
        except IntegrityError:  # another failed job stored the key's partial kernel concurrently
            session.rollback()
            continue
        job.kernel_id, job.updated_at = kernel.id, utcnow()
        if committed(session):
            return kernel
    raise JobError(f"could not store the partial kernel of job {job_id}: concurrent writers kept conflicting")


# ----------------------------------------------------------------------------- trials


def record_trial(session: Session, job_id: str, worker_id: str, *, number: int, strategy: str | None,
                 config: Mapping[str, Any] | None, time_ms: float | None, error: str | None, state: str,
                 predicted: bool, source: str | None, compile: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Store (or overwrite) trial ``number`` of the job, and update the job's progress and best.

    ``compile``: the compile gate's facts per kernel (tuner.compile_gate.CompileVerdict.facts),
    stored as given (at most MAX_COMPILE_FACTS kernels, errors clipped).

    :class:`LeaseLost` if ``worker_id`` does not hold the job. Commits.
    """
    state = check_choice(state, ("complete", "failed", "pruned"), "state")
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


def finish_job(session: Session, job_id: str, worker_id: str, *, bundle: dict, kernel_fields: dict,
               variant: dict | None = None) -> KernelRecord:
    """Store the job's result: its bundle and the kernel for its cache key; the job succeeds.

    ``bundle`` must verify (:func:`service.bundle.verify_bundle`: format, fields, sha256) and
    be for the job's spec, shape, dtype and target. The kernel's strategy, config and
    Triton/generator versions are the bundle's (what was generated); ``kernel_fields`` gives
    the measurement: ``time_ms`` (else ``bundle["measured"]["time_ms"]``), ``measurer``
    (default the job's), ``predicted`` (default: measurer is ``model``), ``baselines``;
    ``strategy`` if given must be the bundle's, ``config`` is used only for a bundle
    without one. If a kernel for the same key exists and is at least as good (a measurement
    beats a prediction, then lower time), the job points at it and it is kept; else it is
    replaced in place (same id). ``variant``: the bundle's compiled binary, stored in the same
    transaction when the kernel takes this bundle, so the job is never ``succeeded`` before it
    (issue 37, 7). :class:`LeaseLost` if not the holder. Commits.
    """
    content, digest = kernel_cache.bundle_content(bundle)
    for _ in range(RETRIES):
        job = _held(session, job_id, worker_id)
        try:
            fields = kernel_cache.kernel_values(job, bundle, kernel_fields)
            kernel = kernel_cache.store_kernel(session, job, fields, digest, content)
            _store_variants(session, [(kernel, digest, variant)])
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
            job.best = kernel_cache.kernel_best(kernel)
        _set_worker_job(session, worker_id, None, now)
        if committed(session):
            return kernel
    raise JobError(f"could not store the kernel of job {job_id}: concurrent writers kept conflicting")


def finish_range_job(session: Session, job_id: str, worker_id: str, *,
                     buckets: Sequence[tuple[Mapping[str, int], dict, dict]],
                     variants: Sequence[dict | None] = ()) -> list[KernelRecord]:
    """Store a range job's result (:mod:`service.shape_ranges`): per bucket ``(shape, bundle,
    kernel_fields)`` as :func:`finish_job` stores one kernel (keyed by the bucket's shape; a
    better kernel already cached for that shape is kept), then the range row naming them; the
    job succeeds, pointing at the largest bucket's kernel. ``variants``: per bucket, its binary
    (:func:`finish_job`). All in one transaction. :class:`LeaseLost` if not the holder. Commits."""
    contents = [(shape, bundle, fields, *kernel_cache.bundle_content(bundle)) for shape, bundle, fields in buckets]
    for _ in range(RETRIES):
        job = _held(session, job_id, worker_id)
        try:
            kernels = []
            for shape, bundle, fields, content, digest in contents:
                values = kernel_cache.kernel_values(job, bundle, fields, shape=shape)
                kernels.append((dict(shape), kernel_cache.store_kernel(session, job, values, digest, content,
                                                                       shape=shape)))
            kernel_cache.store_range(session, job, kernels)
            _store_variants(session, [(k, digest, v) for (_, k), (*_, digest), v
                                      in zip(kernels, contents, list(variants) or [None] * len(kernels))])
        except JobError:
            session.rollback()
            raise
        except IntegrityError:  # another job stored one of the same kernels concurrently
            session.rollback()
            continue
        now = utcnow()
        job.status, job.kernel_id, job.lease_expires_at = "succeeded", kernels[-1][1].id, None
        job.finished_at = job.updated_at = now
        if job.best is None:
            job.best = kernel_cache.kernel_best(kernels[-1][1])
        _set_worker_job(session, worker_id, None, now)
        if committed(session):
            return [k for _, k in kernels]
    raise JobError(f"could not store the kernels of range job {job_id}: concurrent writers kept conflicting")


def _store_variants(session: Session, stored: Sequence[tuple[KernelRecord, str, dict | None]]) -> None:
    """Each (kernel, its job's bundle sha256, binary): the binary stored where the kernel took
    that bundle (a better kernel kept from before keeps its own)."""
    from service.binaries import store_variant

    for kernel, digest, variant in stored:
        if variant is not None and kernel.bundle_sha256 == digest:
            store_variant(session, digest, variant)


def release_worker_jobs(session: Session, worker_ids: Sequence[str]) -> list[str]:
    """Give back every job the given workers hold (a stopping process whose workers did not end
    their trials in time: their late writes then get :class:`LeaseLost`). Not counted as lost
    workers, as :func:`release_job`. Returns the released jobs' ids. Commits."""
    if not worker_ids:
        return []
    now = utcnow()
    held = sa.and_(Job.status == "running", Job.worker_id.in_(list(worker_ids)))
    ids = list(session.execute(sa.select(Job.id).where(held).with_for_update()).scalars())
    if ids:
        session.execute(sa.update(Job).where(Job.id.in_(ids), held)
                        .values(status="queued", worker_id=None, lease_expires_at=None, updated_at=now,
                                attempts=sa.case((Job.attempts > 0, Job.attempts - 1), else_=0))
                        .execution_options(synchronize_session=False))
        session.execute(sa.update(WorkerRecord).where(WorkerRecord.id.in_(list(worker_ids)))
                        .values(current_job_id=None))
    session.commit()
    return ids
