"""A job that fails keeps its best kernel so far, marked partial (issue 26; docs/DECISIONS.md,
"Partial kernels"), on SQLite and PostgreSQL: the queue (service.store.job_queue.keep_partial and the
kernel cache's readers), the worker (a search that crashes after good trials, one that crashes
before any, a job failed for its lost workers), the API's job and kernel views and the dashboard.

Helpers are those of test_job_queue.py (the queue with real generated bundles), test_worker.py
(the worker in-process) and test_api.py (TestClient over the same database).
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from service import errors
from service.store import job_queue, kernel_cache
from service.bundle import verify_bundle
from service.store.models import Job, KernelRecord, utcnow
from service.tuning_request import tuning_request
from service.worker import run_worker
from service.worker.recording import TrialRecorder
from tests.service import test_job_queue as q
from tests.service.test_job_queue import Session  # noqa: F401 - the fixture (a session factory per backend)
from tests.service import test_worker as w
from tests.service.test_api import make_client, store_kernel


def _fail_with_partial(Session, job, worker="w1", time_ms=2.0, measurer=None):
    """The holder fails the job after a good trial; the job keeps a partial kernel of ``time_ms``."""
    q.trial(Session, job.id, worker, time_ms=time_ms)
    with Session() as s:
        job_queue.fail_job(s, job.id, worker, "CUDA error: illegal memory access")
    fields = {"time_ms": time_ms, "predicted": (measurer or job.measurer) == "model"}
    with Session() as s:
        return job_queue.keep_partial(s, job.id, bundle=q.bundle_for(job, time_ms, partial=True), kernel_fields=fields)


def _request(measurer="model"):
    return tuning_request(q.SPEC, q.SOURCE, {"m": 4, "n": 64}, "float32", "h100", measurer, 20, 60.0)


# ----------------------------------------------------------------------------- the queue and the cache


def test_a_partial_kernel_never_answers_and_a_success_outranks_it(Session) -> None:
    job, _ = q.submit(Session)
    q.claim(Session)
    partial = _fail_with_partial(Session, job, time_ms=2.0)
    failed = q.reload(Session, job.id)
    assert partial is not None and partial.partial and partial.job_id == job.id and partial.time_ms == 2.0
    assert failed.status == "failed" and failed.kernel_id == partial.id and failed.error.startswith("CUDA error")
    with Session() as s:  # no reader that answers a request sees it
        assert kernel_cache.exact_kernel(s, _request()) is None
        assert kernel_cache.find_kernel(s, spec_hash=job.spec_hash, target="h100", dtype="float32",
                                        shape={"d0": 4, "d1": 64}) is None
        assert kernel_cache.find_kernel(s, spec_hash=job.spec_hash, target="h100", dtype="float32", shape=None) is None
        assert kernel_cache.list_kernels(s, spec_hash=job.spec_hash) == []
        assert kernel_cache.get_kernel(s, partial.id).partial  # by its id (the failed job's link) it is there
        # kept once: a second call stores nothing, and a job that did not fail keeps none
        assert job_queue.keep_partial(s, job.id, bundle=q.bundle_for(job, 1.0), kernel_fields={"time_ms": 1.0}) is None

    # a new submission of the same request is queued (not answered by the partial kernel)
    again, created = q.submit(Session)
    assert created and again.status == "queued" and again.kernel_id is None
    assert q.claim(Session, "w2").id == again.id
    with Session() as s:
        assert job_queue.keep_partial(s, again.id, bundle=q.bundle_for(again), kernel_fields={"time_ms": 1.0}) is None
    # a worse partial of a later failure keeps the key's better one (ranked as finished kernels are)
    kept = _fail_with_partial(Session, again, "w2", time_ms=3.0)
    assert kept.id == partial.id and kept.time_ms == 2.0 and kept.job_id == job.id
    assert q.reload(Session, again.id).kernel_id == partial.id

    # a success, even slower than the partial kernel, is the key's kernel: it answers from now on
    third, created = q.submit(Session)
    assert created and q.claim(Session, "w3").id == third.id
    done = q.finish(Session, third, "w3", time_ms=5.0)
    assert not done.partial and done.id != partial.id and done.time_ms == 5.0
    with Session() as s:
        assert kernel_cache.exact_kernel(s, _request()).id == done.id
        found, exact = kernel_cache.find_kernel(s, spec_hash=job.spec_hash, target="h100", dtype="float32",
                                                shape={"d0": 4, "d1": 64})
        assert (found.id, exact) == (done.id, True)
        assert [k.id for k in kernel_cache.list_kernels(s, spec_hash=job.spec_hash)] == [done.id]
    answered, created = q.submit(Session)
    assert not created and answered.id == third.id and answered.kernel_id == done.id
    assert q.reload(Session, job.id).kernel_id == partial.id  # the failed job keeps its partial kernel

    # a partial kernel never takes a finished kernel's place: a cuda job (a prediction does not
    # answer it) that fails with a measured best replaces the key's partial kernel, not the finished one
    cuda, created = q.submit(Session, measurer="cuda")
    assert created and q.claim(Session, "gpu", measurer="cuda").id == cuda.id
    measured = _fail_with_partial(Session, cuda, "gpu", time_ms=4.0, measurer="cuda")
    assert measured.id == partial.id and measured.partial and not measured.predicted and measured.job_id == cuda.id
    with Session() as s:
        assert kernel_cache.exact_kernel(s, _request()).id == done.id
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 2


def test_a_partial_bundle_is_checked_as_a_finished_one(Session) -> None:
    job, _ = q.submit(Session)
    q.claim(Session)
    with Session() as s:
        job_queue.fail_job(s, job.id, "w1", "boom")
    other, _ = q.submit(Session, n=128)
    with Session() as s, pytest.raises(errors.InvalidBundle, match="shape"):
        job_queue.keep_partial(s, job.id, bundle=q.bundle_for(other), kernel_fields={"time_ms": 1.0})
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 0
    assert q.reload(Session, job.id).kernel_id is None


# ----------------------------------------------------------------------------- the worker


def test_a_job_failing_after_good_trials_keeps_its_best_kernel_as_partial(db_url, sessions, monkeypatch) -> None:
    job_id = w.submit(sessions, trials=40)
    real = TrialRecorder.__call__

    def crash_after_three(self, study, trial):
        real(self, study, trial)
        if self.recorded >= 3:
            raise RuntimeError("the GPU fell off the bus")

    monkeypatch.setattr(TrialRecorder, "__call__", crash_after_three)
    cfg = w.settings(db_url, compile_binaries=False)
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=cfg) == 1
    job = w.reload(sessions, job_id)
    assert job.status == "failed" and "RuntimeError: the GPU fell off the bus" in job.error
    assert job.trials_done == 3 and job.best is not None, job.best  # at least one good trial before the crash
    with sessions() as s:
        kernel = kernel_cache.get_kernel(s, job.kernel_id)
        bundle = json.loads(kernel_cache.get_bundle_bytes(s, kernel))
        assert kernel_cache.exact_kernel(s, tuning_request(w.SPEC, json.dumps(w.RAW), w.SHAPE, "float32", "h100",
                                                           "model", 40, 600)) is None
    assert kernel.partial and kernel.job_id == job_id
    assert (kernel.strategy, kernel.config, kernel.time_ms) == (job.best["strategy"], job.best["config"],
                                                                job.best["time_ms"])
    verify_bundle(bundle)
    assert bundle["measured"]["partial"] is True and bundle["sha256"] == kernel.bundle_sha256
    assert bundle["strategy"] == job.best["strategy"] and bundle["measured"]["time_ms"] == job.best["time_ms"]

    # the same request is searched again (not answered by the partial kernel); its success is the key's kernel
    monkeypatch.undo()
    again = w.submit(sessions, trials=2)
    assert again != job_id
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=cfg) == 1
    done = w.reload(sessions, again)
    with sessions() as s:
        found = kernel_cache.find_kernel(s, spec_hash=done.spec_hash, target="h100", dtype="float32",
                                         shape={"d0": 4, "d1": 64})
    assert done.status == "succeeded" and found is not None and found[0].id == done.kernel_id != kernel.id
    assert not found[0].partial and found[1] is True
    assert w.reload(sessions, job_id).kernel_id == kernel.id


def test_a_job_failing_with_no_good_trial_keeps_nothing(db_url, sessions, monkeypatch) -> None:
    import service.worker.tuning

    job_id = w.submit(sessions, trials=4)

    def boom(*args, **kwargs):
        raise RuntimeError("the search blew up")

    monkeypatch.setattr(service.worker.tuning, "search_setup", boom)
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=w.settings(db_url)) == 1
    job = w.reload(sessions, job_id)
    assert job.status == "failed" and job.best is None and job.kernel_id is None
    with sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 0


def test_a_job_failed_for_its_lost_workers_keeps_its_best(db_url, sessions) -> None:
    """Closed by the next claim after MAX_ATTEMPTS lost workers (service.store.job_queue.claim_job):
    the claiming worker stores the job's best trial as its partial kernel."""
    job_id = w.submit(sessions, trials=4)
    with sessions() as s:
        assert job_queue.claim_job(s, "w-dead", target="h100", measurer="model", lease_seconds=60).id == job_id
        job_queue.record_trial(s, job_id, "w-dead", number=0, strategy="streaming_fused", config={}, time_ms=0.5,
                               error=None, state="complete", predicted=True, source="tpe")
        s.execute(sa.update(Job).where(Job.id == job_id).values(
            attempts=job_queue.MAX_ATTEMPTS, lease_expires_at=utcnow()))
        s.commit()
    assert run_worker(db_url, measurer="model", target="h100", once=True, settings=w.settings(db_url)) == 0
    job = w.reload(sessions, job_id)
    assert job.status == "failed" and "worker lost 3 times" in job.error and job.kernel_id is not None
    with sessions() as s:
        kernel = kernel_cache.get_kernel(s, job.kernel_id)
    assert kernel.partial and (kernel.strategy, kernel.time_ms, kernel.job_id) == ("streaming_fused", 0.5, job_id)


# ----------------------------------------------------------------------------- the views


def test_the_job_and_kernel_views_say_partial(db_url, sessions) -> None:
    with sessions() as s:
        request = tuning_request(w.SPEC, json.dumps(w.RAW), w.SHAPE, "float32", "h100", "model", 4, 600)
        job, _ = job_queue.submit_job(s, request)
        job_queue.claim_job(s, "w1", target="h100", measurer="model", lease_seconds=600)
    spec_hash = job.spec_hash
    from fuser_core.problem import make_problem
    from service.bundle import canonical_spec
    from service.bundle_maker import make_bundle

    bundle = make_bundle(make_problem(canonical_spec(w.SPEC), job.shape, "float32"), target="h100",
                         strategy="streaming_fused", config={},
                         measured={"time_ms": 0.02, "measurer": "model", "predicted": True, "partial": True})
    with sessions() as s:
        job_queue.fail_job(s, job.id, "w1", "out of memory")
        partial = job_queue.keep_partial(s, job.id, bundle=bundle, kernel_fields={"time_ms": 0.02})
    with make_client(db_url) as client:
        view = client.get(f"/v1/jobs/{job.id}").json()
        assert view["status"] == "failed" and view["kernel_id"] is None and view["kernel_url"] is None
        assert view["partial_kernel_id"] == partial.id and view["partial_kernel_url"] == f"/v1/kernels/{partial.id}"
        kview = client.get(view["partial_kernel_url"]).json()
        assert kview["partial"] is True and kview["job_id"] == job.id and kview["bundle_sha256"] == bundle["sha256"]
        got = client.get(kview["bundle_url"])
        assert got.status_code == 200 and json.loads(got.content)["measured"]["partial"] is True
        lookup = {"spec_hash": spec_hash, "target": "h100", "shape": "m=4,n=64", "dtype": "float32"}
        assert client.get("/v1/kernels", params=lookup).status_code == 404
        assert client.get("/v1/dashboard/kernels", params={"spec_hash": spec_hash}).json()["kernels"] == []
        source = client.get(f"/v1/specs/{spec_hash}/source").json()
        assert source["kernel_id"] is None  # generated source defaults to a finished kernel only
        body = {"spec": w.RAW, "shape": w.SHAPE, "dtype": "float32", "target": "h100", "measurer": "model",
                "budget": {"trials": 4, "seconds": 600}}
        resubmitted = client.post("/v1/jobs", json=body)
        assert resubmitted.status_code == 202 and resubmitted.json()["status"] == "queued"
        with sessions() as s:
            job_queue.cancel_job(s, resubmitted.json()["id"])
        finished = store_kernel(sessions, w.RAW, w.SHAPE, time_ms=0.05)
        found = client.get("/v1/kernels", params=lookup).json()
        assert found["id"] == finished != partial.id and found["partial"] is False and found["exact_match"] is True
        rows = client.get("/v1/dashboard/kernels", params={"spec_hash": spec_hash}).json()["kernels"]
        assert [r["id"] for r in rows] == [finished]
        assert client.get(f"/v1/jobs/{job.id}").json()["partial_kernel_id"] == partial.id
        metrics = client.get("/metrics").text
    assert "foldwise_kernels 1.0" in metrics  # finished kernels only
