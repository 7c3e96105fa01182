"""The job-queue worker: claim a job, tune it, store its bundle; repeat.

``run_worker(db_url, measurer=..., target=...)`` is ``foldwise worker --db URL`` (and each of
``foldwise serve --workers N``'s threads). For each job it claims (:func:`service.store.job_queue.claim_job`):

1. reads the job's canonical spec and derives it once (every search and bundle of the job use
   that derivation), then sets up the search as ``foldwise tune`` does
   (:func:`service.worker.tuning.search_setup`) at the job's shape and dtype, with the target and
   measurer this worker checked once when it started;
2. runs :class:`tuner.search.tuner.Tuner` on the job's own Optuna study, stored beside the service
   database (:func:`service.store.db.study_storage_url`), so a worker that takes over a job whose
   worker died continues the same study: finished trials are kept, the trial budget is shared;
3. records every finished trial (:func:`service.store.job_queue.record_trial`) from an Optuna callback;
4. on success builds the bundle (:func:`service.bundle_maker.make_bundle`, from that derivation:
   its kernel and its derivation report) and finishes the job
   (:func:`service.store.job_queue.finish_job`); when no configuration worked, fails it with the reason.
   What became of the job is a :class:`service.store.job_outcome.JobOutcome`;
5. a job that failed (a crash, its lost workers) keeps the bundle of its best complete trial,
   marked partial (:meth:`Worker.keep_partial`, :func:`service.store.job_queue.keep_partial`).

**Leases.** A trial can take long (a GPU measurement, or the interpreter's first check of a
strategy), so the lease is renewed by a heartbeat thread (:class:`LeaseKeeper`) every
``heartbeat_seconds``, not between trials. The search stops after the current trial when the
lease is lost (the job was taken over: nothing more is written for it), when the job is asked
to cancel (:func:`service.store.job_queue.mark_cancelled`), when ``budget.seconds`` is used up (the best
so far is stored), or when the worker is asked to stop (the job goes back to the queue,
:func:`service.store.job_queue.release_job`). A worker killed outright (SIGKILL) just stops renewing; the
job is claimed again once its lease expires, and Optuna's own heartbeats fail the trial that
was running so it is retried.

**Outages.** Every database call is retried through an outage (:func:`service.store.db.retry_transient`);
a search stopped by one resumes its study when the database answers (:meth:`Worker._search`), and
``run_worker`` never exits for one. After an outage the worker leaves expired leases alone for a
lease (their live holders renew them first), so an outage never counts as a lost worker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.store import job_queue, spec_store
from service.store.db import database_error, is_transient, note_outage, retry_transient, seconds_since_outage
from service.errors import LeaseLost
from service.store.job_outcome import JobOutcome
from service.store.models import Job, utcnow
from service.shape_ranges import TRIAL_STRIDE, has_ranges
from service.tuning_request import measurer_kind
from service.worker.recording import STATES, LeaseKeeper, TrialRecorder  # noqa: F401 - STATES: re-exported

log = logging.getLogger("foldwise.worker")
# a search that crashed just before the worker was asked to stop (SIGTERM to the process group
# reaches the compile pool's processes too; the pool then breaks): how long to wait for that ask
SHUTDOWN_GRACE_S = 2.0
# searches resumed after database errors with no trial recorded in between: past that the error
# always comes back (a flapping database records trials between its outages and is ridden out)
MAX_RESUMES = 20
POLL_BACKOFF_S = (1.0, 10.0)  # the claim loop's wait after a database error: first, largest (doubling, jittered)
# the claim loop's pause after a job was given back for the host (a full disk): first, largest (doubling)
HOST_FAULT_PAUSE_S = (5.0, 60.0)


# what a job imports (a search, its checks, its bundle), by public names (each loads its module):
# loaded by Worker.warm_up before any lease is held
_JOB_NAMES = {"fuser_core": ("derive_cascade", "FAMILIES", "run", "GENERATOR_VERSION", "catalog_entries"),
              "tuner": ("Tuner", "ModelMeasurer", "CompileGate", "predict", "problem_bounds", "BASELINES")}


@dataclass(frozen=True)
class _JobSpec:
    """A claimed job's spec, read and derived once for all its searches and bundles."""

    spec: Any  # the canonical spec (service.store.spec_store.job_spec): the job's shape uses its names
    canonical: Any  # its JSON object, the study's ``spec`` attribute
    derivation: Any  # fuser_core.derive_cascade(spec): the job's one derivation


def new_worker_id() -> str:
    """``<host>-<pid>-<8 hex>``: readable in job views, unique across restarts."""
    return f"{socket.gethostname()[:80]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Worker:
    """One worker's state: its id, database, study storage and what it measures."""

    def __init__(self, db_url: str, *, measurer: str, target: str, worker_id: str | None = None,
                 stop: threading.Event | None = None, settings: Any = None):
        from service.store.db import check_current, make_engine, session_factory, study_storage_url
        from service.settings import get_settings
        from service.worker.tuning import checked_choice, cuda_measurer, quiet_optuna
        from service.tuning_request import check_measurer, check_target
        from tuner import get_profile, make_storage

        # checked once per worker: it claims only jobs of its target and measurer (service.store.job_queue.claim_job)
        measurer = checked_choice(check_measurer, measurer)
        self.profile = get_profile(checked_choice(check_target, target))
        # fail at start, not on the first job: no GPU, or the wrong one
        self.measurer_class = cuda_measurer(self.profile) if measurer_kind(measurer).on_device else None
        self.settings = settings or get_settings(db_url=db_url)
        self.db_url, self.measurer, self.target = db_url, measurer, self.profile.name
        self.worker_id = worker_id or new_worker_id()
        self.stop = stop or threading.Event()
        self.host_faults = 0  # jobs given back in a row because the host's disk was full (reset by a job that ends)
        quiet_optuna()
        self.engine = make_engine(db_url)
        self.retry(lambda: check_current(self.engine), "checking the database's migration")
        self.sessions = session_factory(self.engine)
        beat = max(1, round(self.settings.heartbeat_seconds))
        # Optuna's own heartbeat: a trial whose worker died is failed (and retried) once silent this long
        self.storage = self.retry(lambda: make_storage(
            study_storage_url(db_url), heartbeat_interval=beat,
            grace_period=max(2 * beat, math.ceil(self.settings.lease_seconds))), "opening the study storage")

    def retry(self, fn: Any, what: str) -> Any:
        """``fn()`` retried through a database outage (:func:`service.store.db.retry_transient`); gives
        up a few seconds after this worker is asked to stop."""
        return retry_transient(fn, what=what, stop=self.stop, logger=log)

    def close(self) -> None:
        self.storage.engine.dispose()
        self.engine.dispose()

    def register(self) -> None:
        from service.worker.tuning import gpu_name, versions

        gpu, versions_now = gpu_name(), versions()

        def register() -> None:
            with self.sessions() as session:
                job_queue.register_worker(session, self.worker_id, hostname=socket.gethostname(), gpu_name=gpu,
                                          target=self.target, measurer=self.measurer, versions=versions_now)

        self.retry(register, "registering the worker")
        log.info("worker registered", extra={"worker_id": self.worker_id, "target": self.target,
                                             "measurer": self.measurer})

    def warm_up(self) -> None:
        """Import what every job runs before the first claim. A job's lease is renewed by a thread
        that shares the GIL with the search, and an import holds the GIL for its file lookups and
        its C extensions' start-up: seconds on a loaded host, long enough for a short lease to
        expire during a first job that loaded them itself (the job was then taken over as lost)."""
        import importlib

        import sympy as sp

        import service.binaries  # noqa: F401
        import service.bundle_maker  # noqa: F401

        for package, names in _JOB_NAMES.items():
            for name in names:
                getattr(importlib.import_module(package), name)
        sp.lambdify([sp.Symbol("x")], sp.Symbol("x") + 1, modules="numpy")  # its printers load on first use

    def claim(self) -> Job | None:
        closed: list[tuple[str, str]] = []  # jobs of lost workers closed on the way (cancelled, or failed)
        # after an outage every lease looks expired while its live holder has yet to renew it
        take_expired = seconds_since_outage() >= self.settings.lease_seconds
        with self.sessions() as session:
            job = job_queue.claim_job(session, self.worker_id, target=self.target, measurer=self.measurer,
                                      lease_seconds=self.settings.lease_seconds, closed=closed,
                                      take_expired=take_expired)
        for job_id, study_name in closed:
            self.close_orphans(job_id, study_name)
            self.keep_partial(job_id)  # failed for its lost workers: it keeps its best so far (cancelled: nothing)
        return job

    def host_pause(self) -> float:
        """Seconds to wait before claiming again: none, or after jobs given back for a full disk,
        HOST_FAULT_PAUSE_S doubling with each one in a row (the disk may be freed, or another
        worker's host has room for the job meanwhile)."""
        if not self.host_faults:
            return 0.0
        first, largest = HOST_FAULT_PAUSE_S
        return min(largest, first * 2 ** (self.host_faults - 1))

    def idle(self) -> None:
        with self.sessions() as session:
            job_queue.worker_heartbeat(session, self.worker_id, None)

    # ------------------------------------------------------------------------- one job
    def process(self, job: Job) -> JobOutcome:
        """Tune one claimed job to its end; returns what became of it."""
        from tuner import HostFault

        log.info("job claimed", extra={"job_id": job.id, "worker_id": self.worker_id, "attempt": job.attempts})
        keeper = LeaseKeeper(self.sessions, job.id, self.worker_id, lease_s=self.settings.lease_seconds,
                             every=self.settings.heartbeat_seconds).start()
        try:
            outcome, detail = self._tune(job, keeper)
        except HostFault as err:  # the host's disk is full: nothing wrong with the job, which goes back
            log.warning("the host's disk is full; the job goes back to the queue and this worker pauses",
                        extra={"job_id": job.id, "worker_id": self.worker_id, "error": str(err)[:300]})
            outcome, detail = JobOutcome.RELEASED, None
            self.host_faults += 1
        except Exception as err:  # a crash of the search fails the job with the reason, never the worker
            if self.stop.wait(SHUTDOWN_GRACE_S):  # killed with us (a signal to the process group): give it back
                log.info("search stopped by the worker's shutdown", extra={"job_id": job.id, "error": repr(err)[:300]})
                outcome, detail = JobOutcome.RELEASED, None
            else:
                log.exception("job crashed", extra={"job_id": job.id})
                cause = database_error(err) or err  # not Optuna's UnboundLocalError in front of a database error
                outcome, detail = JobOutcome.FAILED, f"{type(cause).__name__}: {cause}"
        finally:
            keeper.stop()
        outcome = self._settle(job, outcome, detail, keeper)
        if outcome.finished:
            self.host_faults = 0
            self.close_orphans(job.id, job.study_name)
        if outcome == JobOutcome.FAILED:
            self.keep_partial(job.id)
        return outcome

    def keep_partial(self, job_id: str) -> None:
        """A failed job keeps its best kernel so far: the bundle of its best complete trial (the
        job's ``best``, recorded from trials that passed the correctness and compile gates),
        stored marked partial (:func:`service.store.job_queue.keep_partial`). Nothing for a job with no
        complete trial, one not failed, or a range job (a range is served whole or not at all).
        Best effort: the job has failed already, and stays failed with its reason whatever happens here."""
        from types import SimpleNamespace

        from fuser_core import derive_cascade, make_problem

        try:
            def read() -> Any:
                with self.sessions() as session:
                    job = job_queue.get_job(session, job_id)
                    return job, spec_store.get_spec(session, job.spec_hash)

            job, record = self.retry(read, "reading a failed job")
            best = job.best
            if job.status != JobOutcome.FAILED.value or job.kernel_id or not best or has_ranges(job.shape):
                return
            spec = spec_store.job_spec(record)
            space = SimpleNamespace(problem=make_problem(spec, job.shape, job.dtype_value),
                                    derivation=derive_cascade(spec), profile=self.profile)
            result = SimpleNamespace(strategy=best["strategy"], config=best["config"] or {}, time_ms=best["time_ms"],
                                     predicted=bool(best.get("predicted")), trials=job.trials_done,
                                     best_trial=best.get("trial"))
            bundle, fields = self._bundle(job, space, result, partial=True)

            def store() -> Any:
                with self.sessions() as session:
                    return job_queue.keep_partial(session, job_id, bundle=bundle, kernel_fields=fields)

            kernel = self.retry(store, "storing a failed job's partial kernel")
        except Exception:  # noqa: BLE001 - the failure is stored; its partial kernel is an extra
            log.exception("partial kernel not stored", extra={"job_id": job_id})
            return
        if kernel is not None:
            log.info("partial kernel kept", extra={"job_id": job_id, "kernel_id": kernel.id,
                                                   "time_ms": kernel.time_ms})

    def close_orphans(self, job_id: str, study_name: str) -> None:
        """Fail the RUNNING trials of the job's study that are not ours: we hold (or just ended or
        closed) the job, so they belong to a worker that lost it. Nothing else would end them
        before Optuna's heartbeat grace period, and then only if another trial of the study starts."""
        from tuner import fail_orphaned_trials

        try:
            n = fail_orphaned_trials(self.storage, study_name, f"its worker lost job {job_id}")
        except Exception:  # closing them is housekeeping: never fail the job for it
            log.exception("could not close orphaned trials", extra={"job_id": job_id})
            return
        if n:
            log.info("orphaned trials failed", extra={"job_id": job_id, "worker_id": self.worker_id, "trials": n})

    def _tune(self, job: Job, keeper: LeaseKeeper) -> tuple[JobOutcome, Any]:
        """The job's search (a range job's searches); the spec is derived once here, for every
        search and bundle of the job (each bundle's kernel and its derivation report).

        The spec store's derivation (``SpecRecord.derivation``, made at submission) is not read
        instead: it is the JSON report (text and the certificate, in the first submitter's names),
        while the search, the cost model and the kernel generator need the sympy
        :class:`fuser_core.Derivation`, which a report cannot be turned back into."""
        from fuser_core import SpecError, derive_cascade

        def read() -> Any:
            with self.sessions() as session:
                return spec_store.get_spec(session, job.spec_hash)

        record = self.retry(read, "reading the job's spec")
        spec, canonical = spec_store.job_spec(record), json.loads(record.canonical)
        elapsed = (utcnow() - job.started_at).total_seconds() if job.started_at else 0.0
        recorder = TrialRecorder(self.sessions, job.id, self.worker_id, keeper, self.stop,
                                 deadline=time.monotonic() + max(0.0, job.budget_seconds - elapsed))
        stopped = recorder.stop_reason()
        if stopped is not None:
            return stopped, None
        if job.attempts > 1:  # the previous holder's running trial would otherwise wait for its heartbeat grace
            self.close_orphans(job.id, job.study_name)
        try:
            tuned = _JobSpec(spec, canonical, derive_cascade(spec))
        except SpecError as err:
            return JobOutcome.FAILED, f"cannot tune this job: {err}"
        out_of_time = recorder.out_of_time()
        if has_ranges(job.shape):
            return self._tune_range(job, tuned, recorder, out_of_time)
        return self._search(job, tuned, job.shape, job.study_name, recorder, out_of_time)

    def _tune_range(self, job: Job, tuned: _JobSpec, recorder: TrialRecorder,
                    out_of_time: bool) -> tuple[JobOutcome, Any]:
        """A range job (service.shape_ranges): one search per bucket, each on its own study
        (``<job study>/<bucket shape>``, so a worker taking the job over continues each) with the
        job's ``budget.trials``; ``budget.seconds`` is for the whole job. Trials are recorded as
        ``bucket index (smallest first) * TRIAL_STRIDE + trial number``. A bucket with no
        result fails the job, naming the bucket: a range is served whole or not at all.

        The largest bucket is searched first: each study is warm-started from the best of its
        nearest tuned shape (tuner.search.warm_start), and a larger bucket's configuration is a
        sound start for a smaller one (every dim is masked), while a configuration tuned for
        t = 1 (one row per program) is the worst start for t = 16384."""
        from service.bundle import shape_text
        from service.shape_ranges import bucket_shapes, fixed_of, ranges_of

        shapes = bucket_shapes(fixed_of(job.shape), ranges_of(job.shape))
        found = []
        for i, shape in reversed(list(enumerate(shapes))):
            recorder.number_offset = i * TRIAL_STRIDE
            stopped = recorder.stop_reason()
            if stopped is not None:
                return stopped, None
            outcome, detail = self._search(job, tuned, shape, f"{job.study_name}/{shape_text(shape)}",
                                           recorder, out_of_time or recorder.out_of_time(), catch_up=False)
            if outcome != JobOutcome.SUCCEEDED:
                if outcome == JobOutcome.FAILED:
                    detail = f"bucket {i + 1} of {len(shapes)} ({shape_text(shape)}): {detail}"
                return outcome, detail
            found.append((shape, *detail))
            out_of_time = False
        return JobOutcome.SUCCEEDED, found[::-1]

    def _search(self, job: Job, tuned: _JobSpec, shape: Any, study_name: str, recorder: TrialRecorder,
                out_of_time: bool, *, catch_up: bool = True) -> tuple[JobOutcome, Any]:
        """One search (the job's, or a range job's bucket) on ``study_name``, with the job's
        derivation and this worker's target and measurer (checked when it started).

        A database outage stops Optuna (its storage is that database): once the database answers
        again, the trial that was running is closed and the same study goes on, its finished
        trials and shared budget kept, under the same lease (renewed meanwhile by the keeper).
        The job never fails for it, however often the database goes (45 stops in 134 s): only
        ``MAX_RESUMES`` resumes in a row with no trial recorded between them fail it (an error
        that always comes back)."""
        idle, recorded = 0, recorder.recorded
        while True:
            try:
                return self._search_once(job, tuned, shape, study_name, recorder, out_of_time, catch_up=catch_up)
            except Exception as err:
                idle = 0 if recorder.recorded > recorded else idle + 1
                recorded = recorder.recorded
                if not is_transient(err) or idle > MAX_RESUMES:  # not the database's, or it always comes back
                    raise
                note_outage()
                log.warning("database unreachable during the search; it resumes when the database answers",
                            extra={"job_id": job.id, "error": str(database_error(err) or err)[:300]})
            self.retry(self._ping, "waiting for the database")
            stopped = recorder.stop_reason()
            if stopped is not None:
                return stopped, None
            self.close_orphans(job.id, study_name)  # ours: the trial the outage cut off
            catch_up = True  # a trial told to Optuna but not recorded before the outage

    def _ping(self) -> None:
        with self.sessions() as session:
            session.execute(sa.text("SELECT 1"))
        with self.storage.engine.connect() as conn:  # Optuna's (on SQLite another file)
            conn.execute(sa.text("SELECT 1"))

    def _search_once(self, job: Job, tuned: _JobSpec, shape: Any, study_name: str, recorder: TrialRecorder,
                     out_of_time: bool, *, catch_up: bool = True) -> tuple[JobOutcome, Any]:
        from fuser_core import SpecError, make_problem
        from service.worker.tuning import search_setup
        from tuner import NoResult, Tuner

        try:
            space, measurer, gate, attrs = search_setup(
                make_problem(tuned.spec, shape, job.dtype_value), tuned.derivation, self.profile, self.measurer,
                tuned.canonical, measurer_class=self.measurer_class)
        except SpecError as err:
            return JobOutcome.FAILED, f"cannot tune this job: {err}"
        # budget.seconds already used up by earlier attempts: no new trial, the best of the study so far
        max_trials = 0 if out_of_time else None
        tuner = Tuner(space, measurer, seed=job.attempts - 1, gate=gate)  # another seed when a job is taken over
        try:
            result = tuner.run(job.budget_trials, storage=self.storage, study_name=study_name,
                               callbacks=[recorder], attrs={**attrs, "budget": job.budget_trials, "job_id": job.id},
                               max_trials=max_trials)
            binary = None
            if self.settings.compile_binaries:  # the binary the cuda measurer ran, before it closes
                from service.binaries import measured_binary_of

                binary = measured_binary_of(measurer, result.strategy, result.config)
        except NoResult as err:
            if recorder.stopped_by is not None:
                return recorder.stopped_by, None
            if out_of_time:
                return JobOutcome.FAILED, (f"budget.seconds ({job.budget_seconds:g} s) was used up before any "
                                           "trial finished")
            return JobOutcome.FAILED, str(err)
        finally:
            measurer.close()
        if recorder.stopped_by is not None:
            return recorder.stopped_by, None
        if (job.attempts > 1 or recorder.errors) and catch_up:
            import optuna

            study = optuna.load_study(study_name=study_name, storage=self.storage)
            n = recorder.catch_up(study.get_trials(deepcopy=False))
            if n:
                log.info("trials of a lost worker recorded", extra={"job_id": job.id, "trials": n})
        return JobOutcome.SUCCEEDED, (space, result, binary)

    def _settle(self, job: Job, outcome: JobOutcome, detail: Any, keeper: LeaseKeeper) -> JobOutcome:
        """Store what became of the job (its kernel, its failure, ...) as its holder; LOST when it is not."""
        extra = {"job_id": job.id, "worker_id": self.worker_id}
        if keeper.lost:
            outcome = JobOutcome.LOST

        def store() -> None:
            with self.sessions() as session:
                if outcome == JobOutcome.SUCCEEDED and has_ranges(job.shape):
                    self._finish_range(session, job, detail)
                elif outcome == JobOutcome.SUCCEEDED:
                    self._finish(session, job, *detail)
                elif outcome == JobOutcome.FAILED:
                    job_queue.fail_job(session, job.id, self.worker_id, str(detail))
                elif outcome == JobOutcome.CANCELLED:
                    job_queue.mark_cancelled(session, job.id, self.worker_id)
                elif outcome == JobOutcome.RELEASED:
                    job_queue.release_job(session, job.id, self.worker_id)

        try:  # an outage waits here (a stopping worker gives up soon: its lease expires, another takes over)
            self.retry(store, f"storing the job's outcome ({outcome})")
        except LeaseLost:
            outcome = JobOutcome.LOST
        except Exception as err:  # storing the result failed (a bad bundle, ...): the job fails with why
            outcome = self._fail_storing(job, err) if not is_transient(err) else self._unreachable(job)
        log.info(f"job {outcome}", extra={**extra, "outcome": str(outcome),
                                           "error": str(detail)[:500] if outcome == JobOutcome.FAILED else None})
        return outcome

    def _unreachable(self, job: Job) -> JobOutcome:
        log.warning("database unreachable while stopping; the job is taken over when its lease expires",
                    extra={"job_id": job.id, "worker_id": self.worker_id})
        return JobOutcome.LOST

    def _fail_storing(self, job: Job, err: Exception) -> JobOutcome:
        log.exception("could not store the job's result", extra={"job_id": job.id, "worker_id": self.worker_id})
        why = f"storing the result failed: {type(err).__name__}: {err}"

        def fail() -> None:
            with self.sessions() as session:
                job_queue.fail_job(session, job.id, self.worker_id, why)

        try:
            self.retry(fail, "failing the job")
            return JobOutcome.FAILED
        except LeaseLost:
            return JobOutcome.LOST
        except Exception as again:  # noqa: BLE001 - the worker goes on; the lease expires
            if not is_transient(again):
                log.exception("could not fail the job", extra={"job_id": job.id})
            return self._unreachable(job)

    def _finish(self, session: Session, job: Job, space: Any, result: Any, binary: dict | None = None) -> None:
        bundle, fields = self._bundle(job, space, result)
        job_queue.finish_job(session, job.id, self.worker_id, bundle=bundle, kernel_fields=fields,
                             variant=self._variant(bundle, binary))

    def _finish_range(self, session: Session, job: Job, found: list[tuple]) -> None:
        """Store every bucket's kernel and the range (service.store.job_queue.finish_range_job)."""
        made = [(shape, *self._bundle(job, space, result), binary) for shape, space, result, binary in found]
        job_queue.finish_range_job(session, job.id, self.worker_id,
                                   buckets=[(shape, bundle, fields) for shape, bundle, fields, _ in made],
                                   variants=[self._variant(bundle, binary) for _, bundle, _, binary in made])

    def _variant(self, bundle: dict, binary: dict | None) -> dict | None:
        """The bundle's binary (service.binaries.job_variant: the one the cuda measurer ran, else
        compiled on this host), made before the job is marked succeeded: compiled after it, the cubin
        appeared 18.7 s after ``succeeded`` under load, and a pipeline that downloads on success got
        source only (issue 37, 7); now it is stored in the finishing transaction (job_queue.finish_job). None: not
        wanted, or it failed (logged: the kernel is then served as source only)."""
        if not self.settings.compile_binaries:
            return None
        from service.binaries import job_variant
        from service.bundle import verify_variant

        try:
            variant = job_variant(bundle, binary)
            verify_variant(variant)  # checked here: storing it is then one write of the finishing transaction
            return variant
        except Exception as err:  # noqa: BLE001 - the kernel is stored; its binary is an extra
            log.warning("kernel binary not compiled", extra={"bundle_sha256": bundle["sha256"], "error": str(err)})
            return None

    def _bundle(self, job: Job, space: Any, result: Any, *, partial: bool = False) -> tuple[dict, dict]:
        """The bundle of a search's best configuration (generated from the job's one derivation),
        and its kernel fields. ``partial``: a failed job's best (:meth:`keep_partial`), which its
        bundle says too (``measured.partial``), so a downloaded copy cannot pass for a finished one."""
        from service.bundle_maker import make_bundle
        from service.worker.tuning import gpu_name

        measured = {
            "time_ms": result.time_ms, "measurer": job.measurer, "predicted": result.predicted,
            "device": gpu_name() if measurer_kind(job.measurer).on_device else None, "target": job.target,
            "trials": result.trials, "best_trial": result.best_trial, "study": job.study_name,
            "worker_id": self.worker_id,
        }
        if partial:
            measured["partial"] = True
        baselines = _baselines(space, result)
        if baselines:
            measured["baselines"] = baselines
        bundle = make_bundle(space.problem, target=self.profile, strategy=result.strategy, config=result.config,
                             measured=measured, derived=space.derivation)
        return bundle, {"time_ms": result.time_ms, "measurer": job.measurer, "predicted": result.predicted,
                        "baselines": baselines or None}


def _baselines(space: Any, result: Any) -> dict[str, Any]:
    """The cost model's predictions for the unfused kernel chain and (for measured kernels) for
    the chosen configuration: labelled predictions, for speedup columns. Never fails a job."""
    from fuser_core import BASELINE
    from tuner import predict, predict_chain

    out: dict[str, Any] = {}
    try:
        chain = predict_chain(space.problem, space.derivation, space.profile)
        out[BASELINE] = {"time_ms": chain.time_s * 1e3, "predicted": True}
        if not result.predicted:
            from tuner import Candidate

            candidate = Candidate.from_dict({"strategy": result.strategy, "config": result.config})
            p = predict(space.problem, space.derivation, candidate, space.profile)
            out["predicted_ms"] = p.time_s * 1e3
    except Exception as err:  # noqa: BLE001  (a baseline is a nicety)
        log.debug("no baseline", extra={"error": str(err)[:300]})
    return out


def run_worker(db_url: str, *, measurer: str, target: str, worker_id: str | None = None,
               stop: threading.Event | None = None, poll_s: float = 1.0, once: bool = False,
               settings: Any = None) -> int:
    """Take jobs for (target, measurer) from the database at ``db_url`` until ``stop`` is set
    (or, with ``once``, after at most one job); returns how many jobs it processed.

    Raises :class:`service.worker.tuning.SetupError` for a bad measurer/target (or ``cuda`` without a
    matching GPU) and :class:`service.store.db.DatabaseBehind` for an unmigrated database, before
    taking any job. Database errors are logged and retried, with backoff, however long the
    database is unreachable (at start, while polling, during a job): the worker never exits for one.
    """
    worker = Worker(db_url, measurer=measurer, target=target, worker_id=worker_id, stop=stop, settings=settings)
    done, backoff = 0, POLL_BACKOFF_S[0]
    try:
        worker.register()
        worker.warm_up()
        while not worker.stop.is_set():
            try:
                job = worker.claim()
                backoff = POLL_BACKOFF_S[0]
                if job is None:
                    if once:
                        break
                    worker.idle()
                    worker.stop.wait(poll_s)
                    continue
            except sa.exc.SQLAlchemyError as err:
                if is_transient(err):
                    note_outage()
                log.warning("database error while polling; retrying", extra={
                    "worker_id": worker.worker_id, "error": str(err)[:300], "retry_in_s": round(backoff, 2)})
                worker.stop.wait(backoff * random.uniform(0.5, 1.5))
                backoff = min(2 * backoff, POLL_BACKOFF_S[1])
                continue
            worker.process(job)
            done += 1
            worker.stop.wait(worker.host_pause())
            if once:
                break
    finally:
        worker.close()
    return done
