"""What a job-queue worker writes while a search runs (:mod:`service.worker`): the lease's
heartbeat (:class:`LeaseKeeper`) and each finished trial (:class:`TrialRecorder`, the Optuna
callback that also decides when the search stops). Both ride out a database outage: a renewal
that fails is skipped (the lease is long enough for a few), a trial is written again until the
database answers (:func:`service.store.db.retry_transient`).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from service.store import job_queue
from service.store.db import is_transient, note_outage, retry_transient
from service.errors import LeaseLost
from service.store.job_outcome import JobOutcome

log = logging.getLogger("foldwise.worker")
STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


class LeaseKeeper:
    """Renews the lease of one job every ``every`` seconds in a background thread.

    After a refused renewal it says why: ``cancel`` (the job was asked to cancel) or ``lost``
    (another worker holds it, or it finished). A database error skips one beat (logged); the
    lease is long enough for a few. A renewal that comes more than half a lease after the last
    one is logged (``lease renewal late``, with where the search was): the beat shares the GIL
    with the search, and a lease shorter than what holds the GIL is lost by a live worker.
    """

    def __init__(self, sessions: sessionmaker[Session], job_id: str, worker_id: str, *, lease_s: float,
                 every: float):
        self.sessions, self.job_id, self.worker_id = sessions, job_id, worker_id
        self.lease_s, self.every = lease_s, every
        self.cancel = False
        self.lost = False
        self._done = threading.Event()
        self._search = threading.current_thread()  # the search runs on the thread that holds the job
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id[:8]}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._done.wait(self.every):
            try:
                with self.sessions() as session:
                    start = time.monotonic()
                    renewed = job_queue.renew_lease(session, self.job_id, self.worker_id, self.lease_s)
                    now = time.monotonic()
                    if now - last > self.lease_s / 2:  # the lease nearly expired under a live worker
                        log.warning("lease renewal late", extra={
                            "job_id": self.job_id, "since_last_s": round(now - last, 2),
                            "renewal_s": round(now - start, 2), "lease_s": self.lease_s,
                            "search_at": _frame_of(self._search)})
                    last = now
                    if renewed:
                        continue
                    job = job_queue.get_job(session, self.job_id)
            except sa.exc.SQLAlchemyError as err:
                if is_transient(err):
                    note_outage()
                log.warning("lease renewal failed; retrying", extra={"job_id": self.job_id, "error": str(err)[:300]})
                continue
            if job.status == "running" and job.worker_id == self.worker_id and job.cancel_requested:
                self.cancel = True
            else:
                self.lost = True
            return


def _frame_of(thread: threading.Thread) -> str | None:
    """Where ``thread`` is now: after a late beat, the search's line next to what held the GIL."""
    frame = sys._current_frames().get(thread.ident)
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else None


@dataclass
class TrialRecorder:
    """The Optuna callback: records each finished trial and decides when to stop the study."""

    sessions: sessionmaker[Session]
    job_id: str
    worker_id: str
    keeper: LeaseKeeper
    stop: threading.Event
    deadline: float  # time.monotonic() at which budget.seconds is used up
    stopped_by: JobOutcome | None = None  # cancelled | released | lost: the search stopped early
    recorded: int = 0
    number_offset: int = 0  # added to Optuna's trial numbers: a range job's bucket (Worker._tune_range)
    errors: list[str] = field(default_factory=list)

    def __call__(self, study: Any, trial: Any) -> None:
        self.record(trial)
        stop = self.stop_reason()
        if stop is not None:
            self.stopped_by = stop
        if stop is not None or self.out_of_time():  # out of time: the best so far is stored
            study.stop()

    def catch_up(self, trials: Any) -> int:
        """Record the finished trials the job lacks (not those failed as orphans): a worker killed
        between Optuna's tell and this callback left a trial that used the budget but was never
        recorded. Returns how many were recorded."""
        from tuner import trial_result

        with self.sessions() as session:
            have = {t.number for t in job_queue.list_trials(session, self.job_id)}
        missing = [t for t in trials if t.number not in have and STATES.get(t.state.name)
                   and trial_result(t).get("outcome") != "orphaned"]
        for t in missing:
            self.record(t)
        return len(missing)

    def record(self, trial: Any) -> None:
        from tuner import trial_result

        state = STATES.get(trial.state.name)
        if state is not None and not self.keeper.lost:
            r = trial_result(trial)
            time_ms = float(trial.value) if state == "complete" and trial.value is not None else None
            def write() -> None:
                with self.sessions() as session:
                    job_queue.record_trial(
                        session, self.job_id, self.worker_id, number=trial.number + self.number_offset,
                        strategy=r.get("strategy") or trial.params.get("strategy"), config=r.get("config"),
                        time_ms=time_ms if time_ms is None or (math.isfinite(time_ms) and time_ms > 0) else None,
                        error=r.get("error") or r.get("reason"),
                        state=state if time_ms is not None or state != "complete" else "failed",
                        predicted=bool(r.get("predicted", False)),
                        source=str(trial.user_attrs.get("source") or "tpe"), compile=r.get("compile"))

            try:  # an outage waits here: the search cannot go on without its storage anyway
                retry_transient(write, what="recording a trial", stop=self.stop, logger=log)
                self.recorded += 1
            except LeaseLost:
                self.keeper.lost = True
            except sa.exc.SQLAlchemyError as err:  # the trial stays in Optuna's storage; go on
                self.errors.append(str(err)[:300])
                log.warning("could not record a trial", extra={"job_id": self.job_id, "trial": trial.number,
                                                                "error": str(err)[:300]})

    def stop_reason(self) -> JobOutcome | None:
        """Why the job's search must stop now with nothing stored, if it must."""
        if self.keeper.lost:
            return JobOutcome.LOST
        if self.keeper.cancel:
            return JobOutcome.CANCELLED
        if self.stop.is_set():  # the worker is stopping: the job goes back to the queue
            return JobOutcome.RELEASED
        return None

    def out_of_time(self) -> bool:
        """``budget.seconds`` is used up."""
        return time.monotonic() >= self.deadline
