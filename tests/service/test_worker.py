"""The job-queue worker (service/worker/__init__.py) on SQLite and PostgreSQL, in-process: a job tuned to
a verified bundle, cancel, a lost lease, a clean stop, budget.seconds, a crashing search, a
takeover that continues the dead worker's study, and ``foldwise worker`` in job-queue mode.

Real processes (SIGKILL, server restarts) are in tests/e2e/test_serve_and_worker.py.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import optuna
import pytest
import sqlalchemy as sa

from fuser_core.spec import load_spec
from service.store import job_queue, kernel_cache
from service.bundle import verify_bundle
from service.store.db import DatabaseBehind, study_storage_url
from service.store.job_outcome import JobOutcome
from service.binaries import stored_variants
from service.store.models import Job, KernelRecord, KernelBinary, utcnow
from service.settings import get_settings
from service.worker.tuning import SetupError
from service.tuning_request import tuning_request
from service.worker import Worker, run_worker
from tests.support.catalog import load_catalog
from tuner.search.storage import make_storage

RAW = load_catalog()["safe_softmax"]
SPEC = load_spec(RAW)
SHAPE = {"m": 4, "n": 64}


def settings(db_url: str, **kw):
    return get_settings(db_url=db_url, lease_seconds=kw.pop("lease_seconds", 10.0),
                        heartbeat_seconds=kw.pop("heartbeat_seconds", 0.2), **kw)


def submit(sessions, *, trials: int = 6, seconds: float = 600, shape=SHAPE) -> str:
    with sessions() as s:
        request = tuning_request(SPEC, json.dumps(RAW), shape, "float32", "h100", "model", trials, seconds)
        job, created = job_queue.submit_job(s, request)
        assert created
        return job.id


def reload(sessions, job_id: str) -> Job:
    with sessions() as s:
        return job_queue.get_job(s, job_id)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start(db_url: str, **kw) -> tuple[threading.Thread, threading.Event]:
    stop = kw.pop("stop", None) or threading.Event()
    cfg = kw.pop("settings", None) or settings(db_url)
    thread = threading.Thread(target=run_worker, args=(db_url,), daemon=True,
                              kwargs={"measurer": "model", "target": "h100", "stop": stop, "poll_s": 0.05,
                                      "settings": cfg, **kw})
    thread.start()
    return thread, stop


def test_worker_tunes_a_job_to_a_verified_bundle(db_url, sessions) -> None:
    job_id = submit(sessions, trials=6)
    assert run_worker(db_url, measurer="model", target="h100", once=True, worker_id="w-main",
                      settings=settings(db_url)) == 1
    job = reload(sessions, job_id)
    assert job.status == "succeeded" and job.error is None and job.trials_done == 6 and job.attempts == 1
    with sessions() as s:
        trials = job_queue.list_trials(s, job_id)
        kernel = kernel_cache.get_kernel(s, job.kernel_id)
        content = kernel_cache.get_bundle_bytes(s, kernel)
        workers = {w.id: w for w in job_queue.list_workers(s)}
        rows = s.execute(sa.select(KernelBinary.arch, KernelBinary.triton_version)
                         .where(KernelBinary.bundle_sha256 == kernel.bundle_sha256)).all()
        variants = stored_variants(s, kernel.bundle_sha256)
    assert [t.number for t in trials] == list(range(6)) and {t.worker_id for t in trials} == {"w-main"}
    assert all(t.state in ("complete", "pruned", "failed") and t.source for t in trials)
    # every candidate the space accepted went through the compile gate for the job's target (sm_90)
    gated = [t for t in trials if t.state == "complete"]
    assert gated and all(t.compile and all(k["ok"] and k["registers"] > 0 for k in t.compile) for t in gated)
    complete = [t for t in trials if t.state == "complete"]
    assert job.best["time_ms"] == min(t.time_ms for t in complete) == kernel.time_ms
    assert kernel.measurer == "model" and kernel.predicted and kernel.strategy == job.best["strategy"]
    assert kernel.baselines["unfused_chain"]["predicted"] is True

    bundle = json.loads(content)
    verify_bundle(bundle)
    assert bundle["sha256"] == kernel.bundle_sha256 and bundle["shape"] == {"d0": 4, "d1": 64}
    m = bundle["measured"]
    assert m["measurer"] == "model" and m["predicted"] is True and m["device"] is None
    assert m["time_ms"] == kernel.time_ms and m["triton_version"] and m["torch_version"] and m["date"]
    assert bundle["derivation"]["certificate"]["holds"] is True
    # the kernel's binary, compiled on this host for the job's target (h100: sm_90a), is stored
    import triton

    assert rows == [("sm_90a", triton.__version__)]
    [variant] = variants
    assert variant["arch"] == "sm_90a" and variant["triton_version"] == triton.__version__
    names = [k["name"] for k in variant["kernels"]]
    assert len(names) == (2 if bundle["strategy"] == "split_fused" else 1)
    assert all(f"def {n}(" in bundle["triton_source"] for n in names)
    assert set(workers["w-main"].versions) == {"python", "torch", "triton", "foldwise"}
    assert workers["w-main"].current_job_id is None and workers["w-main"].measurer == "model"

    study = optuna.load_study(study_name=job.study_name, storage=make_storage(study_storage_url(db_url), heartbeat_interval=None))
    assert len([t for t in study.trials if t.state.is_finished()]) == 6 and study.user_attrs["job_id"] == job_id


def test_worker_once_returns_when_there_is_nothing_to_do(db_url) -> None:
    start_t = time.monotonic()
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url)) == 0
    assert time.monotonic() - start_t < 20


def test_cancel_stops_the_search_and_keeps_the_trials(db_url, sessions) -> None:
    job_id = submit(sessions, trials=400)
    thread, stop = start(db_url)
    try:
        wait_for(lambda: reload(sessions, job_id).trials_done >= 2, what="two trials")
        with sessions() as s:
            assert job_queue.cancel_job(s, job_id).cancel_requested
        job = wait_for(lambda: (j := reload(sessions, job_id)).status == "cancelled" and j, what="cancelled")
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    with sessions() as s:
        kept = job_queue.list_trials(s, job_id)
    assert len(kept) >= 2 and job.kernel_id is None and job.trials_done == len(kept) < 400


def test_a_lost_lease_stops_the_worker_without_touching_the_job(db_url, sessions) -> None:
    job_id = submit(sessions, trials=400)
    thread, stop = start(db_url, once=True, worker_id="w-slow")
    try:
        wait_for(lambda: reload(sessions, job_id).trials_done >= 2, what="two trials")
        with sessions() as s:  # another worker took the job over (as after an expired lease)
            s.execute(sa.update(Job).where(Job.id == job_id).values(
                worker_id="w-thief", lease_expires_at=utcnow() + timedelta(seconds=60)))
            s.commit()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop after losing its lease"
    finally:
        stop.set()
    job = reload(sessions, job_id)
    assert job.status == "running" and job.worker_id == "w-thief" and job.kernel_id is None
    count = job.trials_done
    time.sleep(0.3)
    assert reload(sessions, job_id).trials_done == count  # nothing more written by the old holder


def test_stopping_a_worker_gives_its_job_back(db_url, sessions) -> None:
    job_id = submit(sessions, trials=400)
    thread, stop = start(db_url, once=True)
    wait_for(lambda: reload(sessions, job_id).trials_done >= 2, what="two trials")
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    job = reload(sessions, job_id)
    assert job.status == "queued" and job.worker_id is None and job.attempts == 0 and job.trials_done >= 2


def test_budget_seconds_ends_the_search_with_the_best_so_far(db_url, sessions) -> None:
    job_id = submit(sessions, trials=1000, seconds=1.5)
    run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url))
    job = reload(sessions, job_id)
    assert job.status == "succeeded" and 1 <= job.trials_done < 1000 and job.kernel_id


def test_budget_seconds_used_up_by_earlier_attempts(db_url, sessions) -> None:
    """A job taken over after its time budget is gone: no new trial; with no trial at all it fails
    saying so."""
    job_id = submit(sessions, trials=50, seconds=5)
    with sessions() as s:
        s.execute(sa.update(Job).where(Job.id == job_id).values(started_at=utcnow() - timedelta(seconds=60)))
        s.commit()
    run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url))
    job = reload(sessions, job_id)
    assert job.status == "failed" and "budget.seconds (5 s) was used up" in job.error and job.trials_done == 0


def test_a_range_job_is_derived_once_for_all_its_buckets(db_url, sessions, monkeypatch) -> None:
    """The worker derives a job's spec once (service.worker.Worker._tune): every bucket's search
    and every bucket's bundle (its kernel and its derivation report) use that derivation, in a
    fresh worker process too, whose report cache holds nothing."""
    import fuser_core
    import fuser_core.derive
    from fuser_core import spec_hash
    from fuser_core.report import clear_cache

    job_id = submit(sessions, trials=1, shape={"m": {"min": 1, "max": 4, "buckets": [2, 4]}, "n": 64})
    clear_cache()  # the submission derived the report in this process: a worker process has not
    real, calls = fuser_core.derive.derive_cascade, []

    def counted(spec, **kwargs):
        calls.append(spec_hash(spec))
        return real(spec, **kwargs)

    fuser_core.derive_cascade  # noqa: B018 (the lazy export, loaded before it is patched)
    monkeypatch.setattr(fuser_core, "derive_cascade", counted)
    monkeypatch.setattr(fuser_core.derive, "derive_cascade", counted)
    assert run_worker(db_url, measurer="model", target="h100", once=True,
                      settings=settings(db_url, compile_binaries=False)) == 1
    job = reload(sessions, job_id)
    with sessions() as s:
        bundles = [json.loads(kernel_cache.get_bundle_bytes(s, k)) for k in s.scalars(sa.select(KernelRecord))]
    assert job.status == "succeeded" and len(bundles) == 2, job.error
    # the job's spec (the cost model's unfused-chain baseline derives each step's own spec besides)
    assert calls.count(spec_hash(SPEC)) == 1, calls
    # each bundle's report, made from that derivation, in the bundle's (canonical) names
    assert all(b["derivation"]["certificate"]["holds"] is True and b["derivation"]["spec_hash"] == spec_hash(SPEC)
               for b in bundles)
    assert all(step["name"] in ("s0", "s1") for b in bundles for step in b["derivation"]["reductions"])


def test_a_crashing_search_fails_the_job_with_the_reason(db_url, sessions, monkeypatch) -> None:
    import service.worker.tuning

    job_id = submit(sessions, trials=4)

    def boom(*args, **kwargs):
        raise RuntimeError("the search blew up")

    monkeypatch.setattr(service.worker.tuning, "search_setup", boom)
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url)) == 1
    job = reload(sessions, job_id)
    assert job.status == "failed" and "RuntimeError: the search blew up" in job.error and job.dedupe_key is None
    monkeypatch.undo()
    assert submit(sessions, trials=4) != job_id  # a failed job is not reused: the same request searches again


def test_takeover_continues_the_dead_workers_study(db_url, sessions) -> None:
    """A worker dies after 3 trials (no release, its lease runs out); the next worker claims
    the job, continues the same Optuna study and finishes the shared budget."""
    job_id = submit(sessions, trials=8)
    cfg = settings(db_url, lease_seconds=1.0, heartbeat_seconds=0.2)
    stop = threading.Event()
    dead = Worker(db_url, measurer="model", target="h100", worker_id="w-dead", stop=stop, settings=cfg)
    dead._settle = lambda job, outcome, detail, keeper: JobOutcome.LOST  # dies: neither finishes nor releases
    watcher = threading.Thread(target=lambda: wait_for(lambda: reload(sessions, job_id).trials_done >= 3)
                               and stop.set(), daemon=True)
    try:
        dead.register()
        job = dead.claim()
        watcher.start()
        dead.process(job)
    finally:
        dead.close()
    assert reload(sessions, job_id).status == "running"
    time.sleep(1.1)  # the dead worker's lease expires
    assert run_worker(db_url, measurer="model", target="h100", once=True, worker_id="w-next", settings=cfg) == 1
    job = reload(sessions, job_id)
    assert job.status == "succeeded" and job.attempts == 2
    with sessions() as s:
        trials = job_queue.list_trials(s, job_id)
    by_worker = {w: [t.number for t in trials if t.worker_id == w] for w in ("w-dead", "w-next")}
    assert len(by_worker["w-dead"]) >= 3 and by_worker["w-next"]
    assert min(by_worker["w-next"]) > max(by_worker["w-dead"])  # the same study, numbering continued
    study = optuna.load_study(study_name=job.study_name, storage=make_storage(study_storage_url(db_url), heartbeat_interval=None))
    assert len([t for t in study.trials if t.state.is_finished()]) >= 8


def die_mid_trial(db_url: str, cfg, job_id: str) -> int:
    """A worker claims the job, starts an Optuna trial and dies (no release, no finish); returns
    the trial's number once the dead worker's lease has expired."""
    dead = Worker(db_url, measurer="model", target="h100", worker_id="w-dead", settings=cfg)
    try:
        dead.register()
        job = dead.claim()
        assert job.id == job_id
        study = optuna.create_study(study_name=job.study_name, storage=dead.storage, load_if_exists=True)
        number = study.ask().number  # the trial it was measuring when it died
    finally:
        dead.close()
    time.sleep(1.1)
    return number


def orphan_state(db_url: str, study_name: str, number: int) -> tuple[int, optuna.trial.FrozenTrial]:
    storage = make_storage(study_storage_url(db_url), heartbeat_interval=None)
    trials = optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False)
    running = len([t for t in trials if t.state == optuna.trial.TrialState.RUNNING])
    return running, next(t for t in trials if t.number == number)


@pytest.mark.parametrize("then", ["taken over", "cancelled"])
def test_a_trial_left_running_by_a_dead_worker_is_failed_by_the_next(db_url, sessions, then) -> None:
    """SIGKILLed mid-trial, a worker leaves an Optuna trial RUNNING; when the job was taken over
    and finished, or cancelled, before Optuna's heartbeat grace period ran out, nothing ended it
    (the soak found both). The next worker that takes or closes the job fails it, and it uses
    none of the trial budget."""
    job_id = submit(sessions, trials=5)
    cfg = settings(db_url, lease_seconds=1.0, heartbeat_seconds=0.2)
    orphan = die_mid_trial(db_url, cfg, job_id)
    if then == "cancelled":
        with sessions() as s:
            assert job_queue.cancel_job(s, job_id).cancel_requested  # nobody renews the lease to see it
    assert run_worker(db_url, measurer="model", target="h100", once=True, worker_id="w-next",
                      settings=cfg) == (1 if then == "taken over" else 0)
    job = reload(sessions, job_id)
    if then == "taken over":
        assert job.status == "succeeded" and job.attempts == 2 and job.trials_done == 5  # none for the orphan
    else:
        assert job.status == "cancelled" and job.attempts == 1
    running, left = orphan_state(db_url, job.study_name, orphan)
    assert running == 0
    assert left.state == optuna.trial.TrialState.FAIL and "lost job" in left.user_attrs["orphaned"]
    assert left.user_attrs["result"]["outcome"] == "orphaned"  # whatever it had set, it uses no budget


def test_bad_measurer_target_and_database_are_refused_before_any_job(db_url, tmp_path) -> None:
    with pytest.raises(SetupError, match="unknown measurer 'tpu'"):
        run_worker(db_url, measurer="tpu", target="h100", once=True)
    with pytest.raises(SetupError, match="unknown target 'v100'"):
        run_worker(db_url, measurer="model", target="v100", once=True)
    with pytest.raises(DatabaseBehind, match="foldwise db upgrade"):
        run_worker(f"sqlite:///{tmp_path / 'empty.db'}", measurer="model", target="h100", once=True)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SetupError, match="no CUDA GPU"):
            run_worker(db_url, measurer="cuda", target="h100", once=True)


@pytest.mark.parametrize("service_db_url", ["sqlite"], indirect=True)
def test_cli_worker_job_queue_mode(db_url, sessions, tmp_path, capsys) -> None:
    from service.cli import main

    job_id = submit(sessions, trials=3)
    assert main(["worker", "--db", db_url, "--measurer", "model", "--once", "--json", "--poll", "0.1",
                 "--log-level", "warning"]) == 0
    assert json.loads(capsys.readouterr().out) == {"jobs": 1}
    assert reload(sessions, job_id).status == "succeeded"
    assert main(["worker", "--db", db_url, "--trials", "3"]) == 2
    assert "--trials: only with --study" in capsys.readouterr().err
    assert main(["worker", "--db", db_url, "--measurer", "tpu", "--once"]) == 2
    assert "--measurer" in capsys.readouterr().err
    assert main(["worker", "--db", f"sqlite:///{tmp_path / 'new.db'}", "--measurer", "model", "--once"]) == 2
    assert "foldwise db upgrade" in capsys.readouterr().err


def test_a_trial_told_but_not_recorded_by_a_dead_worker_is_recorded_by_the_next(db_url, sessions) -> None:
    """Killed between Optuna's tell and its recording callback, a worker left a trial that used
    the budget but was missing from the job (the e2e takeover ended with 39 of 40 trials); the
    worker that finishes the job records it. A trial failed as an orphan is not recorded."""
    job_id = submit(sessions, trials=4)
    cfg = settings(db_url, lease_seconds=1.0, heartbeat_seconds=0.2)
    dead = Worker(db_url, measurer="model", target="h100", worker_id="w-dead", settings=cfg)
    try:
        dead.register()
        job = dead.claim()
        study = optuna.create_study(study_name=job.study_name, storage=dead.storage, load_if_exists=True)
        told = study.ask()
        told.set_user_attr("result", {"outcome": "measured", "strategy": "multi_pass", "time_ms": 1.5,
                                      "config": {"blocks": {"n": 16}}, "predicted": True})
        study.tell(told, 1.5)
        orphan = study.ask()
        orphan.set_user_attr("result", {"outcome": "orphaned"})
        study.tell(orphan, state=optuna.trial.TrialState.FAIL)
    finally:
        dead.close()
    time.sleep(1.1)  # the dead worker's lease expires
    assert run_worker(db_url, measurer="model", target="h100", once=True, worker_id="w-next", settings=cfg) == 1
    job = reload(sessions, job_id)
    assert job.status == "succeeded" and job.attempts == 2
    with sessions() as s:
        recorded = {t.number: t for t in job_queue.list_trials(s, job_id)}
    assert told.number in recorded and recorded[told.number].time_ms == 1.5
    assert recorded[told.number].strategy == "multi_pass"
    assert orphan.number not in recorded
    assert job.trials_done == len(recorded) >= 4


class Blinking:
    """A session factory whose every ``every``-th session raises OperationalError (connection
    refused, as psycopg says when PostgreSQL is down), ``failures`` times in all: the database
    blinks under the claim, the lease renewals, the trial records and the finish."""

    def __init__(self, real, *, every: int = 3, failures: int = 8):
        self.real, self.every, self.failures = real, every, failures
        self.calls = self.failed = 0

    def __call__(self):
        self.calls += 1
        if self.failed < self.failures and self.calls % self.every == 0:
            self.failed += 1
            raise sa.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused (injected)"))
        return self.real()


def test_database_errors_are_retried_and_the_worker_and_job_go_on(db_url, sessions, monkeypatch) -> None:
    """Issue 26: a job never fails because the database blinked, run_worker keeps running, and
    the job's lost-worker count (attempts) does not move. Errors are injected in the service
    sessions (claim, lease, trials, finish) and in Optuna's storage inside the search."""
    import service.store.db
    import tuner

    made: list[Blinking] = []
    real_factory, real_storage = service.store.db.session_factory, tuner.make_storage

    def blinking_factory(engine):
        made.append(Blinking(real_factory(engine)))
        return made[-1]

    told = {"n": 0}

    def flaky_storage(*args, **kwargs):
        storage = real_storage(*args, **kwargs)
        real_set = storage.set_trial_state_values

        def set_trial_state_values(trial_id, state, values=None):
            told["n"] += 1
            if told["n"] in (3, 4):  # mid-search, twice: Optuna's tell fails and the study stops
                raise sa.exc.OperationalError("UPDATE trials", {}, ConnectionRefusedError("server closed (injected)"))
            return real_set(trial_id, state, values)

        storage.set_trial_state_values = set_trial_state_values
        return storage

    monkeypatch.setattr(service.store.db, "session_factory", blinking_factory)
    monkeypatch.setattr(tuner, "make_storage", flaky_storage)
    first = submit(sessions, trials=8)
    thread, stop = start(db_url, worker_id="w-blink")
    try:
        wait_for(lambda: reload(sessions, first).status in ("succeeded", "failed"), timeout=120, what="the job")
        job = reload(sessions, first)
        assert job.status == "succeeded" and job.error is None, job.error
        assert job.attempts == 1 and job.trials_done == 8  # no lost worker counted; every trial recorded once
        assert made and made[0].failed == made[0].failures  # the errors did happen
        assert told["n"] >= 4
        # the worker is still taking jobs
        second = submit(sessions, trials=3, shape={"m": 8, "n": 64})
        wait_for(lambda: reload(sessions, second).status == "succeeded", timeout=120, what="a second job")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def run_to_end(db_url: str, sessions, job_id: str, worker_id: str, timeout: float = 180) -> Job:
    """A worker thread runs until the job has ended (succeeded or failed); the job as it ended."""
    thread, stop = start(db_url, worker_id=worker_id)
    try:
        wait_for(lambda: reload(sessions, job_id).status in ("succeeded", "failed"), timeout=timeout, what="the job")
        return reload(sessions, job_id)
    finally:
        stop.set()
        thread.join(30)


def flapping_storage(real_storage, fails):
    """``tuner.make_storage`` whose Optuna storage fails Optuna's tell of a result when ``fails(n)``
    (the n-th such tell) and then its next ``get_trial`` too, as a database that stops under the tell does: Optuna
    5's ``_run_trial`` then raises ``UnboundLocalError: updated_state`` in front of the database
    error (issue 37, 5)."""
    told = {"n": 0, "down": False, "failed": 0}

    def make(*args, **kwargs):
        storage = real_storage(*args, **kwargs)
        real_set, real_get = storage.set_trial_state_values, storage.get_trial

        def set_trial_state_values(trial_id, state, values=None):
            if state != optuna.trial.TrialState.COMPLETE:  # not a tell of a result (closing an orphan: FAIL)
                return real_set(trial_id, state, values)
            told["n"] += 1
            if fails(told["n"]):
                told["down"], told["failed"] = True, told["failed"] + 1
                raise sa.exc.OperationalError("UPDATE trials", {}, ConnectionRefusedError("server closed (injected)"))
            return real_set(trial_id, state, values)

        def get_trial(trial_id):
            if told["down"]:
                told["down"] = False
                raise sa.exc.OperationalError("SELECT trials", {}, ConnectionRefusedError("server closed (injected)"))
            return real_get(trial_id)

        storage.set_trial_state_values, storage.get_trial = set_trial_state_values, get_trial
        return storage

    return make, told


def test_a_database_that_flaps_more_often_than_the_resume_limit_fails_no_job(db_url, sessions, monkeypatch) -> None:
    """A database that goes down again and again (45 stops in 134 s in issue 37) stops the search
    more often than MAX_RESUMES; trials are recorded between the stops, so each stop is an outage
    ridden out, not an error that always comes back: the job succeeds with every trial once."""
    import service.worker
    import tuner

    monkeypatch.setattr(service.worker, "MAX_RESUMES", 2)
    make, told = flapping_storage(tuner.make_storage, lambda n: n % 2 == 0 and n <= 16)  # 8 stops
    monkeypatch.setattr(tuner, "make_storage", make)
    job = run_to_end(db_url, sessions, submit(sessions, trials=10), "w-flap")
    assert job.status == "succeeded" and job.error is None, job.error
    assert job.trials_done == 10 and job.attempts == 1
    assert told["failed"] == 8 > service.worker.MAX_RESUMES


def test_a_database_error_that_always_comes_back_fails_the_job_naming_it(db_url, sessions, monkeypatch) -> None:
    """Every tell fails from the third on: no trial is recorded between the resumes, so after
    MAX_RESUMES the job fails, and its error names the database's error, not the
    ``UnboundLocalError`` Optuna raises in front of it."""
    import service.worker
    import tuner

    monkeypatch.setattr(service.worker, "MAX_RESUMES", 2)
    make, told = flapping_storage(tuner.make_storage, lambda n: n >= 3)
    monkeypatch.setattr(tuner, "make_storage", make)
    job = run_to_end(db_url, sessions, submit(sessions, trials=10), "w-down")
    assert job.status == "failed" and "OperationalError" in job.error and "server closed (injected)" in job.error
    assert "UnboundLocalError" not in job.error
    assert told["failed"] == service.worker.MAX_RESUMES + 1 + 1  # the first stop, then one per resume


def test_a_full_cache_disk_fails_no_job_and_leaves_no_temporary_file(db_url, sessions, monkeypatch, tmp_path) -> None:
    """The disk under the kernel cache fills up mid-search (issue 37, 5: it failed the job with
    "does not compile ... No space left on device" and left .tmp files): the job goes back to
    the queue (no lost worker counted), the worker pauses, and once there is room the same study
    goes on to the job's end, every trial recorded once. The partial .tmp files are removed."""
    import errno
    import os
    from pathlib import Path

    import service.worker

    monkeypatch.setenv("FOLDWISE_CACHE_DIR", str(tmp_path / "cache"))  # modules not generated before
    monkeypatch.setattr(service.worker, "HOST_FAULT_PAUSE_S", (0.05, 0.1))
    real_write = Path.write_text
    writes = {"n": 0, "full": 0}

    def write_text(self, data, *args, **kwargs):
        if self.suffix == ".tmp":
            writes["n"] += 1
            if 2 <= writes["n"] <= 4:  # three cache writes meet a full disk, after a partial write
                writes["full"] += 1
                real_write(self, data[:7], *args, **kwargs)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    job = run_to_end(db_url, sessions, submit(sessions, trials=6, shape={"m": 4, "n": 77}), "w-full")
    assert job.status == "succeeded" and job.error is None, job.error
    assert job.attempts == 1 and job.trials_done == 6
    with sessions() as s:
        trials = job_queue.list_trials(s, job.id)
    assert not any("No space left" in (t.error or "") for t in trials)  # no candidate charged for the disk
    assert writes["full"] == 3
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_run_worker_waits_for_a_database_that_is_down_at_start(db_url, sessions, monkeypatch) -> None:
    """A worker started while the database is unreachable waits (no exit) and then works."""
    import service.store.db

    real_check = service.store.db.check_current
    calls = {"n": 0}

    def down_then_up(engine):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise sa.exc.OperationalError("SELECT version_num", {}, ConnectionRefusedError("connection refused"))
        return real_check(engine)

    monkeypatch.setattr(service.store.db, "check_current", down_then_up)
    job_id = submit(sessions, trials=2)
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url)) == 1
    assert calls["n"] == 4 and reload(sessions, job_id).status == "succeeded"


def test_a_worker_that_met_an_outage_does_not_take_over_live_leases(db_url, sessions, monkeypatch) -> None:
    """After an outage every lease looks expired; a worker that just met one claims only queued
    jobs for a lease, so the live holder keeps its job and no lost worker is counted."""
    import service.store.db

    job_id = submit(sessions, trials=4)
    with sessions() as s:  # another (live) worker holds it, its lease run out during the outage
        assert job_queue.claim_job(s, "w-holder", target="h100", measurer="model", lease_seconds=5).id == job_id
        s.execute(sa.update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
    monkeypatch.setattr(service.store.db, "_last_outage", {"at": time.monotonic()})
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url)) == 0
    job = reload(sessions, job_id)
    assert job.status == "running" and job.worker_id == "w-holder" and job.attempts == 1
    monkeypatch.setattr(service.store.db, "_last_outage", {"at": float("-inf")})  # a lease later: a dead holder's job
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=settings(db_url)) == 1
    assert reload(sessions, job_id).attempts == 2


def test_a_job_is_succeeded_only_once_its_binary_is_stored(db_url, sessions, monkeypatch) -> None:
    """Issue 37, 7: the binary used to be compiled after the job was marked succeeded (18.7 s later
    under load), so a pipeline that downloaded on success got source only. It is now compiled first
    and stored in the finishing transaction: when it is written, another connection still sees the
    job running, and once the job is seen succeeded its binary is there."""
    import service.binaries as binaries

    job_id = submit(sessions, trials=2)
    seen: list[str] = []
    real = binaries.store_variant

    reader = sa.create_engine(db_url)  # a plain reader (the service's sessions begin IMMEDIATE on SQLite)

    def spy(session, bundle_sha256, variant):
        with reader.connect() as other:  # what a client polling the job sees at this moment
            seen.append(other.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id}).scalar())
        return real(session, bundle_sha256, variant)

    monkeypatch.setattr(binaries, "store_variant", spy)
    assert run_worker(db_url, measurer="model", target="h100", once=True, worker_id="w-bin",
                      settings=settings(db_url)) == 1
    job = reload(sessions, job_id)
    reader.dispose()
    assert job.status == "succeeded" and seen == ["running"], seen
    with sessions() as s:
        kernel = kernel_cache.get_kernel(s, job.kernel_id)
        assert [v["arch"] for v in stored_variants(s, kernel.bundle_sha256)] == ["sm_90a"]
