"""The job queue and kernel cache (service/store/job_queue.py, kernel_cache.py, spec_store.py) on SQLite and PostgreSQL.

Every test runs on an empty SQLite file and on a fresh PostgreSQL database (the
``service_db_url`` fixture), migrated with ``service.store.db.upgrade``. Concurrency tests use real
threads, each with its own session (own connection), started together by a barrier.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from datetime import UTC, timedelta

import pytest
import sqlalchemy as sa

from fuser_core.errors import SpecError
from fuser_core.problem import make_problem
from fuser_core.spec import load_spec
from service import errors
from service.store import job_queue, kernel_cache, spec_store
from service.bundle import bundle_sha256, canonical_bytes, canonical_spec
from service.bundle_maker import make_bundle
from service.store.db import make_engine, session_factory, upgrade
from service.store.models import Bundle, Job, KernelRecord, WorkerRecord, utcnow
from service.tuning_request import tuning_request

LSE = {"foldwise": 1, "name": "lse", "inputs": {"x": {"dims": ["m", "n"]}},
       "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                 {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
       "outputs": ["den"]}
# the same computation with the dims named the other way round: rows are `n`, the reduced axis `m`
LSE_SWAPPED = {"foldwise": 1, "name": "lse2", "inputs": {"x": {"dims": ["n", "m"]}},
               "steps": [{"name": "a", "reduce": "max", "over": "m", "expr": "x"},
                         {"name": "b", "reduce": "sum", "over": "m", "expr": "exp(x - a)"}],
               "outputs": ["b"]}
SPEC = load_spec(LSE)
SOURCE = json.dumps(LSE)
VERSIONS = {"python": "3.11", "torch": "2.13.0", "triton": "3.9.0", "foldwise": "0.1.0"}


@pytest.fixture()
def Session(service_db_url):
    upgrade(service_db_url)
    engine = make_engine(service_db_url, pool_size=20)
    yield session_factory(engine)
    engine.dispose()


def submit(Session, *, n=64, m=4, dtype="float32", target="h100", measurer="model", spec=SPEC, source=SOURCE,
           shape=None):
    with Session() as s:
        request = tuning_request(spec, source, shape or {"m": m, "n": n}, dtype, target, measurer, 20, 60.0)
        return job_queue.submit_job(s, request)


def claim(Session, worker="w1", *, target="h100", measurer="model", lease=60.0):
    with Session() as s:
        return job_queue.claim_job(s, worker, target=target, measurer=measurer, lease_seconds=lease)


def expire(Session, job_id):
    with Session() as s:
        s.execute(sa.update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()


_BUNDLES: dict[tuple, dict] = {}


def bundle_for(job: Job, time_ms: float = 1.0, **measured) -> dict:
    """A real bundle (generated kernel) for the job's key; made once per key, then re-stamped."""
    key = (job.shape_key, job.dtype, job.target)
    if key not in _BUNDLES:
        _BUNDLES[key] = make_bundle(make_problem(canonical_spec(SPEC), job.shape, job.dtype_value), target=job.target,
                                    strategy="streaming_fused", config={}, measured={})
    bundle = copy.deepcopy(_BUNDLES[key])
    bundle["measured"] = {"time_ms": time_ms, "measurer": job.measurer, **measured}
    bundle["sha256"] = bundle_sha256(bundle)
    return bundle


def finish(Session, job, worker="w1", time_ms=1.0, **fields):
    with Session() as s:
        predicted = fields.pop("predicted", job.measurer == "model")
        return job_queue.finish_job(s, job.id, worker, bundle=bundle_for(job, time_ms),
                               kernel_fields={"time_ms": time_ms, "predicted": predicted, **fields})


def trial(Session, job_id, worker="w1", number=0, time_ms=1.0, state="complete", **kw):
    with Session() as s:
        job_queue.record_trial(s, job_id, worker, number=number, strategy=kw.get("strategy", "streaming_fused"),
                          config=kw.get("config", {"blocks": {}}), time_ms=time_ms, error=kw.get("error"),
                          state=state, predicted=True, source=kw.get("source", "tpe"), compile=kw.get("compile"))


def reload(Session, job_id) -> Job:
    with Session() as s:
        return job_queue.get_job(s, job_id)


def in_threads(n, fn):
    """Run fn(i) in n threads started together; return results (re-raising the first error)."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def run(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as err:  # collected and re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


# ----------------------------------------------------------------------------- submitting


def test_submit_is_idempotent_and_canonical(Session):
    job, created = submit(Session)
    assert created and job.status == "queued" and len(job.id) == 32
    assert job.shape == {"d0": 4, "d1": 64} and job.shape_key == "d0=4,d1=64" and job.dtype == "float32"
    assert job.created_at.tzinfo is not None and job.created_at.utcoffset() == timedelta(0)
    assert job.study_name.startswith("foldwise:") and job.study_name.endswith(job.id[:8])
    again, created2 = submit(Session)
    assert (again.id, created2) == (job.id, False)
    # per-input dtype map naming the same thing, and the spec with renamed dims: the same job
    renamed = load_spec(LSE_SWAPPED)
    assert submit(Session, dtype={"x": "float32"})[0].id == job.id
    assert submit(Session, spec=renamed, source=json.dumps(LSE_SWAPPED), shape={"n": 4, "m": 64})[0].id == job.id
    # ... but the same dim *names* with the other meaning are another shape, hence another job
    other, created3 = submit(Session, spec=renamed, source=json.dumps(LSE_SWAPPED), shape={"m": 4, "n": 64})
    assert created3 and other.shape == {"d0": 64, "d1": 4}
    assert submit(Session, measurer="cuda")[0].id != job.id
    assert submit(Session, target="a100")[0].id != job.id
    assert submit(Session, dtype="float16")[0].id != job.id
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Job)) == 5
        record = spec_store.get_spec(s, job.spec_hash)
        assert record.name == "lse" and json.loads(record.source) == LSE
        assert record.derivation["fusible"] is True and record.derivation["spec_hash"] == job.spec_hash
        assert spec_store.display_shape(record, job.shape) == {"m": 4, "n": 64}
        assert spec_store.job_spec(record).dims == ("d0", "d1")


@pytest.mark.parametrize("field,kwargs,message", [
    (("target",), {"target": "v100"}, "unknown target"),
    (("measurer",), {"measurer": "stopwatch"}, "unknown measurer"),
    (("shape", "k"), {"shape": {"m": 4, "n": 8, "k": 2}}, "unknown dim"),
    (("shape", "n"), {"shape": {"m": 4, "n": 0}}, "positive integer"),
    (("dtype",), {"dtype": "float128"}, "unknown dtype"),
])
def test_submit_rejects_bad_fields(Session, field, kwargs, message):
    with pytest.raises(SpecError, match=message) as info:
        submit(Session, **kwargs)
    assert info.value.loc == field
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Job)) == 0


def test_submit_rejects_bad_budget(Session):
    with pytest.raises(errors.InvalidRequest) as info:
        tuning_request(SPEC, SOURCE, {"m": 4, "n": 8}, "float32", "h100", "model", 0, 10.0)
    assert info.value.loc == ("budget", "trials")
    with pytest.raises(errors.InvalidRequest) as info:
        tuning_request(SPEC, SOURCE, {"m": 4, "n": 8}, "float32", "h100", "model", 5, float("nan"))
    assert info.value.loc == ("budget", "seconds")


def test_concurrent_identical_submissions_make_one_job(Session):
    results = in_threads(16, lambda i: submit(Session))
    assert len({job.id for job, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Job)) == 1


# ----------------------------------------------------------------------------- claiming, trials, finishing


def test_claim_trials_finish_and_resubmit(Session):
    with Session() as s:
        job_queue.register_worker(s, "w1", hostname="box", gpu_name=None, target="h100", measurer="model",
                             versions=VERSIONS)
    job, _ = submit(Session)
    claimed = claim(Session)
    assert claimed.id == job.id and claimed.status == "running" and claimed.worker_id == "w1"
    assert claimed.attempts == 1 and claimed.lease_expires_at > utcnow() and claimed.started_at is not None
    assert claim(Session, "w2") is None  # nothing else queued
    trial(Session, job.id, number=0, time_ms=3.0)
    trial(Session, job.id, number=1, time_ms=None, state="failed", error="too many registers")
    trial(Session, job.id, number=2, time_ms=2.0, config={"blocks": {"d1": 32}})
    trial(Session, job.id, number=3, time_ms=None, state="pruned", error="tile does not fit")
    trial(Session, job.id, number=0, time_ms=5.0)  # a re-report of trial 0 overwrites it
    mid = reload(Session, job.id)
    assert mid.trials_done == 4
    assert mid.best == {"strategy": "streaming_fused", "config": {"blocks": {"d1": 32}}, "time_ms": 2.0,
                        "trial": 2, "predicted": True}
    with Session() as s:
        trials = job_queue.list_trials(s, job.id)
        assert [(t.number, t.state, t.time_ms) for t in trials] == [
            (0, "complete", 5.0), (1, "failed", None), (2, "complete", 2.0), (3, "pruned", None)]
        assert trials[1].error == "too many registers" and trials[0].worker_id == "w1"
        assert job_queue.list_workers(s)[0].current_job_id == job.id
    kernel = finish(Session, job, time_ms=2.0)
    done = reload(Session, job.id)
    assert done.status == "succeeded" and done.kernel_id == kernel.id and done.finished_at is not None
    assert done.dedupe_key is not None and done.lease_expires_at is None
    assert (kernel.shape_key, kernel.dtype, kernel.target) == ("d0=4,d1=64", "float32", "h100")
    assert kernel.measurer == "model"
    assert kernel.predicted and kernel.time_ms == 2.0 and kernel.job_id == job.id
    assert (kernel.triton_version, kernel.generator_version) == kernel_cache.current_versions()
    with Session() as s:
        content = kernel_cache.get_bundle_bytes(s, kernel_cache.get_kernel(s, kernel.id))
        assert json.loads(content)["sha256"] == kernel.bundle_sha256
        assert canonical_bytes(json.loads(content)) == content
        assert job_queue.list_workers(s)[0].current_job_id is None
    # the same request again: the finished job, no new search
    again, created = submit(Session)
    assert (again.id, again.status, created) == (job.id, "succeeded", False)
    with pytest.raises(errors.LeaseLost):  # finished: nobody holds it any more
        trial(Session, job.id, number=9)


def test_record_trial_validation(Session):
    job, _ = submit(Session)
    claim(Session)
    with pytest.raises(errors.InvalidRequest, match="state"):
        trial(Session, job.id, state="great")
    with pytest.raises(errors.InvalidRequest, match="needs its time"):
        trial(Session, job.id, time_ms=None, state="complete")
    with pytest.raises(errors.InvalidRequest) as info:
        trial(Session, job.id, time_ms=-1.0)
    assert info.value.loc == ("time_ms",)
    with pytest.raises(errors.InvalidRequest) as info:
        trial(Session, job.id, compile={"kernel": "k"})  # one object per kernel, in a list
    assert info.value.loc == ("compile",)
    with pytest.raises(errors.NotFound):
        trial(Session, "0" * 32)
    long_error = {"kernel": "k", "ok": False, "error": "x" * (job_queue.MAX_ERROR_CHARS + 50)}
    trial(Session, job.id, number=3, time_ms=None, state="pruned",
          compile=[long_error] * (job_queue.MAX_COMPILE_FACTS + 1))
    with Session() as s:
        [kept] = [t for t in job_queue.list_trials(s, job.id) if t.number == 3]
    assert len(kept.compile) == job_queue.MAX_COMPILE_FACTS
    assert len(kept.compile[0]["error"]) <= job_queue.MAX_ERROR_CHARS


def test_kernel_short_circuit(Session):
    # a GPU-measured kernel answers a later model request at once, with a succeeded job
    cuda_job, _ = submit(Session, measurer="cuda")
    assert claim(Session, "gpu", measurer="cuda").id == cuda_job.id
    kernel = finish(Session, cuda_job, "gpu", time_ms=0.5, measurer="cuda", predicted=False)
    model_job, created = submit(Session, measurer="model")
    assert not created and model_job.id != cuda_job.id
    assert model_job.status == "succeeded" and model_job.kernel_id == kernel.id and model_job.best["time_ms"] == 0.5
    assert submit(Session, measurer="model")[0].id == model_job.id  # and that answer is stable
    assert claim(Session, "w1") is None  # nothing was queued
    # a prediction never answers a cuda request
    model2, _ = submit(Session, n=128)
    claim(Session)
    finish(Session, model2, time_ms=1.0)
    cuda2, created = submit(Session, n=128, measurer="cuda")
    assert created and cuda2.status == "queued"


def test_outdated_kernel_is_searched_again(Session):
    job, _ = submit(Session)
    claim(Session)
    finish(Session, job)
    with Session() as s:  # as if the generator changed since the kernel was made
        s.execute(sa.update(KernelRecord).values(generator_version="old"))
        s.commit()
    new, created = submit(Session)
    assert created and new.id != job.id and new.status == "queued"
    assert reload(Session, job.id).dedupe_key is None


def test_finish_rejects_bad_bundles(Session):
    job, _ = submit(Session)
    claim(Session)
    tampered = bundle_for(job)
    tampered["measured"]["time_ms"] = 0.001  # changed after hashing
    with Session() as s, pytest.raises(errors.InvalidBundle, match="sha256"):
        job_queue.finish_job(s, job.id, "w1", bundle=tampered, kernel_fields={"time_ms": 1.0})
    other, _ = submit(Session, n=128)
    with Session() as s, pytest.raises(errors.InvalidBundle, match="shape"):
        job_queue.finish_job(s, job.id, "w1", bundle=bundle_for(other), kernel_fields={"time_ms": 1.0})
    with Session() as s, pytest.raises(errors.InvalidBundle, match="unknown field 'speed'"):
        job_queue.finish_job(s, job.id, "w1", bundle=bundle_for(job), kernel_fields={"time_ms": 1.0, "speed": 2})
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 0
        assert s.scalar(sa.select(sa.func.count()).select_from(Bundle)) == 0
    assert reload(Session, job.id).status == "running"


def test_better_kernel_wins_per_key(Session):
    model_job, _ = submit(Session)
    cuda_job, _ = submit(Session, measurer="cuda")
    claim(Session, "cpu")
    claim(Session, "gpu", measurer="cuda")
    measured = finish(Session, cuda_job, "gpu", time_ms=5.0, measurer="cuda", predicted=False)
    # a faster *prediction* does not displace a measurement of the same key
    kept = finish(Session, model_job, "cpu", time_ms=1.0)
    assert kept.id == measured.id and kept.time_ms == 5.0 and not kept.predicted
    assert reload(Session, model_job.id).kernel_id == measured.id
    # a measurement replaces a prediction in place (same id, new bundle)
    model2, _ = submit(Session, n=256)
    cuda2, _ = submit(Session, n=256, measurer="cuda")
    claim(Session, "cpu")
    claim(Session, "gpu", measurer="cuda")
    predicted = finish(Session, model2, "cpu", time_ms=1.0)
    replaced = finish(Session, cuda2, "gpu", time_ms=3.0, measurer="cuda", predicted=False)
    assert replaced.id == predicted.id and replaced.time_ms == 3.0 and replaced.bundle_sha256 != predicted.bundle_sha256
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 2


def test_concurrent_finishes_of_one_key_store_one_kernel(Session):
    a, _ = submit(Session)
    b, _ = submit(Session, measurer="cuda")
    claim(Session, "cpu")
    claim(Session, "gpu", measurer="cuda")
    bundle_for(a)  # generate the kernel before the race
    calls = [(a, "cpu", 2.0, {}), (b, "gpu", 4.0, {"measurer": "cuda", "predicted": False})]
    kernels = in_threads(2, lambda i: finish(Session, calls[i][0], calls[i][1], calls[i][2], **calls[i][3]))
    assert kernels[0].id == kernels[1].id
    with Session() as s:
        only = s.execute(sa.select(KernelRecord)).scalars().all()
    assert len(only) == 1 and not only[0].predicted and only[0].time_ms == 4.0
    assert {reload(Session, j.id).kernel_id for j in (a, b)} == {only[0].id}


# ----------------------------------------------------------------------------- claims and leases


def test_claims_match_target_and_measurer(Session):
    h100, _ = submit(Session)
    a100, _ = submit(Session, target="a100")
    cuda, _ = submit(Session, measurer="cuda")
    assert claim(Session, "wa", target="a100").id == a100.id
    assert claim(Session, "wa", target="a100") is None
    assert claim(Session, "wc", measurer="cuda").id == cuda.id
    with Session() as s:
        job_queue.register_worker(s, "wh", hostname="box", gpu_name="NVIDIA H100 80GB HBM3", target="h100",
                             measurer="model", versions=VERSIONS)
        with pytest.raises(errors.JobError, match="registered for target 'h100'"):
            job_queue.claim_job(s, "wh", target="a100", measurer="model", lease_seconds=10)
    assert claim(Session, "wh").id == h100.id


def test_concurrent_claims_take_each_job_once(Session):
    ids = {submit(Session, n=16 * (i + 1))[0].id for i in range(8)}

    def drain(i):
        got = []
        while (job := claim(Session, f"w{i}")) is not None:
            got.append(job.id)
        return got

    claimed = [job_id for got in in_threads(4, drain) for job_id in got]
    assert sorted(claimed) == sorted(ids)  # every job once, none twice
    with Session() as s:
        rows = s.execute(sa.select(Job)).scalars().all()
        assert all(r.status == "running" and r.attempts == 1 for r in rows)


def test_claims_go_oldest_first(Session):
    first, _ = submit(Session, n=8)
    second, _ = submit(Session, n=16)
    assert claim(Session).id == first.id
    assert claim(Session).id == second.id


def test_expired_lease_is_taken_over_and_stale_worker_rejected(Session):
    job, _ = submit(Session)
    claim(Session, "w1")
    trial(Session, job.id, "w1", number=0, time_ms=4.0)
    with Session() as s:
        assert job_queue.renew_lease(s, job.id, "w1", 60.0)
        assert not job_queue.renew_lease(s, job.id, "w2", 60.0)  # not the holder
    assert claim(Session, "w2") is None  # the lease holds
    expire(Session, job.id)
    taken = claim(Session, "w2")
    assert taken.id == job.id and taken.worker_id == "w2" and taken.attempts == 2
    with Session() as s:
        assert not job_queue.renew_lease(s, job.id, "w1", 60.0)
    with pytest.raises(errors.LeaseLost, match="w2"):
        trial(Session, job.id, "w1", number=1)
    for call in (lambda s: job_queue.fail_job(s, job.id, "w1", "late"),
                 lambda s: job_queue.mark_cancelled(s, job.id, "w1"),
                 lambda s: job_queue.release_job(s, job.id, "w1"),
                 lambda s: job_queue.finish_job(s, job.id, "w1", bundle=bundle_for(job),
                                                kernel_fields={"time_ms": 1.0})):
        with Session() as s, pytest.raises(errors.LeaseLost):
            call(s)
    trial(Session, job.id, "w2", number=1, time_ms=3.0)  # the new holder carries on; earlier trials kept
    after = reload(Session, job.id)
    assert after.status == "running" and after.trials_done == 2 and after.best["time_ms"] == 3.0
    with Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 0


def test_a_lost_worker_stops_naming_the_job_taken_over_from_it(Session):
    with Session() as s:
        for wid in ("w1", "w2"):
            job_queue.register_worker(s, wid, hostname="box", gpu_name=None, target="h100", measurer="model",
                                      versions=VERSIONS)
    job, _ = submit(Session)
    claim(Session, "w1")
    with Session() as s:
        assert s.get(WorkerRecord, "w1").current_job_id == job.id
    expire(Session, job.id)  # w1 died holding it
    assert claim(Session, "w2").id == job.id
    with Session() as s:
        assert s.get(WorkerRecord, "w1").current_job_id is None  # was job.id for ever
        assert s.get(WorkerRecord, "w2").current_job_id == job.id


def test_tiny_lease_expires_by_itself(Session):
    job, _ = submit(Session)
    claim(Session, "w1", lease=0.05)
    time.sleep(0.2)
    assert claim(Session, "w2").id == job.id


def test_job_fails_after_workers_lost_three_times(Session):
    job, _ = submit(Session)
    for i in range(job_queue.MAX_ATTEMPTS):
        assert claim(Session, f"w{i}").id == job.id
        expire(Session, job.id)
    assert claim(Session, "w9") is None
    lost = reload(Session, job.id)
    assert lost.status == "failed" and "worker lost 3 times" in lost.error and "w2" in lost.error
    assert lost.dedupe_key is None and lost.finished_at is not None
    new, created = submit(Session)
    assert created and new.id != job.id


def test_fail_and_release(Session):
    job, _ = submit(Session)
    claim(Session, "w1")
    with Session() as s:
        job_queue.release_job(s, job.id, "w1")  # a clean shutdown: back to the queue, not a lost worker
    back = reload(Session, job.id)
    assert back.status == "queued" and back.worker_id is None and back.attempts == 0
    claim(Session, "w2")
    with Session() as s:
        job_queue.fail_job(s, job.id, "w2", "CUDA error: illegal memory access")
    failed = reload(Session, job.id)
    assert failed.status == "failed" and failed.error == "CUDA error: illegal memory access"
    assert failed.dedupe_key is None
    assert submit(Session)[1] is True  # a failed request can be submitted again


# ----------------------------------------------------------------------------- cancelling


def test_cancel_paths(Session):
    queued, _ = submit(Session, n=8)
    with Session() as s:
        assert job_queue.cancel_job(s, queued.id).status == "cancelled"
    assert reload(Session, queued.id).dedupe_key is None
    assert claim(Session) is None  # a cancelled job is never claimed
    running, created = submit(Session, n=8)
    assert created and running.id != queued.id  # resubmission starts a new job
    holder = "w1"
    assert claim(Session, holder).id == running.id
    trial(Session, running.id, holder, number=0, time_ms=2.0)
    with Session() as s:
        job = job_queue.cancel_job(s, running.id)
        assert job.status == "running" and job.cancel_requested
        assert not job_queue.renew_lease(s, running.id, holder, 60.0)  # the worker learns to stop
        with pytest.raises(errors.LeaseLost):
            job_queue.mark_cancelled(s, running.id, "someone-else")
        job_queue.mark_cancelled(s, running.id, holder)
    cancelled = reload(Session, running.id)
    assert cancelled.status == "cancelled" and cancelled.trials_done == 1 and cancelled.dedupe_key is None
    with Session() as s:
        assert len(job_queue.list_trials(s, running.id)) == 1  # finished trials are kept
        assert job_queue.cancel_job(s, running.id).status == "cancelled"  # finished: unchanged
        with pytest.raises(errors.NotFound):
            job_queue.cancel_job(s, "f" * 32)


def test_cancel_of_lost_running_job_is_settled_by_next_claim(Session):
    job, _ = submit(Session)
    claim(Session, "w1")
    with Session() as s:
        job_queue.cancel_job(s, job.id)
    expire(Session, job.id)  # the worker died before it saw the request
    assert claim(Session, "w2") is None
    assert reload(Session, job.id).status == "cancelled"


def test_finished_job_is_not_cancelled(Session):
    job, _ = submit(Session)
    claim(Session)
    finish(Session, job)
    with Session() as s:
        assert job_queue.cancel_job(s, job.id).status == "succeeded"


# ----------------------------------------------------------------------------- kernels


def test_find_kernel_exact_then_nearest(Session):
    for n in (64, 1024):
        job, _ = submit(Session, n=n)
        claim(Session)
        finish(Session, job, time_ms=n / 64)
    h = submit(Session)[0].spec_hash

    def find(s, shape, *, spec_hash=h, target="h100", dtype="float32"):
        return kernel_cache.find_kernel(s, spec_hash=spec_hash, target=target, dtype=dtype, shape=shape)

    with Session() as s:
        kernel, exact = find(s, {"d0": 4, "d1": 64})
        assert exact and kernel.shape == {"d0": 4, "d1": 64}
        kernel, exact = find(s, {"d0": 4, "d1": 128})
        assert not exact and kernel.shape == {"d0": 4, "d1": 64}  # |log2 2| = 1 < |log2 1/8| = 3
        kernel, exact = find(s, {"d0": 8, "d1": 700})
        assert not exact and kernel.shape == {"d0": 4, "d1": 1024}
        assert find(s, {"d0": 4, "d1": 64}, target="a100") is None
        assert find(s, {"d0": 4, "d1": 64}, dtype="float16") is None
        assert find(s, {"d0": 4}, spec_hash="0" * 64) is None
        assert find(s, None)[1] is False
        assert len(kernel_cache.list_kernels(s, spec_hash=h)) == 2
        # a kernel of another generator version is still served, but never as an exact match
        s.execute(sa.update(KernelRecord).values(generator_version="old"))
        s.commit()
        kernel, exact = find(s, {"d0": 4, "d1": 64})
        assert not exact and kernel.shape == {"d0": 4, "d1": 64}


@pytest.mark.parametrize("damage", ["flip", "whitespace", "truncate"])
def test_corrupted_bundle_is_never_served(Session, damage):
    job, _ = submit(Session)
    claim(Session)
    kernel = finish(Session, job)
    with Session() as s:
        row = s.get(Bundle, kernel.bundle_sha256)
        good = row.content
        bad = {"flip": good.replace(b'"time_ms":1.0', b'"time_ms":0.1'),
               "whitespace": good.replace(b'","', b'", "', 1), "truncate": good[:-10]}[damage]
        assert bad != good
        s.execute(sa.update(Bundle).where(Bundle.sha256 == row.sha256).values(content=bad))
        s.commit()
        with pytest.raises(errors.BundleCorrupted, match="hash mismatch"):
            kernel_cache.get_bundle_bytes(s, kernel_cache.get_kernel(s, kernel.id))


def test_finish_repairs_damaged_kernel_of_same_key(Session):
    """A kernel whose stored bundle is damaged is replaced by the next good result for its key."""
    a, _ = submit(Session)
    claim(Session)
    kernel = finish(Session, a, time_ms=1.0)
    with Session() as s:
        s.execute(sa.update(Bundle).values(content=b"{}"))
        s.commit()
    b, _ = submit(Session, measurer="cuda")
    claim(Session, "gpu", measurer="cuda")
    # slower and a prediction (not a measurement): would lose, but the cached one cannot be served
    again = finish(Session, b, "gpu", time_ms=9.0, measurer="cuda", predicted=True)
    assert again.id == kernel.id and again.time_ms == 9.0
    with Session() as s:
        stored = kernel_cache.get_bundle_bytes(s, kernel_cache.get_kernel(s, kernel.id))
        assert json.loads(stored)["sha256"] == again.bundle_sha256


# ----------------------------------------------------------------------------- workers and listing


def test_workers_and_listing(Session):
    with Session() as s:
        w = job_queue.register_worker(s, "gpu-1", hostname="node7", gpu_name="NVIDIA H100 80GB HBM3", target="H100",
                                 measurer="cuda", versions=VERSIONS)
        assert w.target == "h100" and w.last_heartbeat.tzinfo is not None
        first_beat = w.last_heartbeat
        job_queue.worker_heartbeat(s, "gpu-1", current_job_id=None)
        (listed,) = job_queue.list_workers(s)
        assert listed.id == "gpu-1" and listed.versions == VERSIONS and listed.last_heartbeat >= first_beat
        job_queue.register_worker(s, "gpu-1", hostname="node8", gpu_name=None, target="h100", measurer="model",
                             versions={})  # re-registration after a restart updates the row
        assert [(w.hostname, w.measurer) for w in job_queue.list_workers(s)] == [("node8", "model")]
        with pytest.raises(errors.NotFound):
            job_queue.worker_heartbeat(s, "nobody")
        with pytest.raises(errors.InvalidRequest):
            job_queue.register_worker(s, "x", hostname="h", gpu_name=None, target="tpu", measurer="model", versions={})
    a, _ = submit(Session, n=8)
    b, _ = submit(Session, n=16, target="a100")
    claim(Session, target="a100")
    with Session() as s:
        assert [j.id for j in job_queue.list_jobs(s)] == [b.id, a.id]  # newest first
        assert [j.id for j in job_queue.list_jobs(s, status="queued")] == [a.id]
        assert [j.id for j in job_queue.list_jobs(s, target="a100")] == [b.id]
        assert [j.id for j in job_queue.list_jobs(s, spec_hash=a.spec_hash, limit=1, offset=1)] == [a.id]
        assert job_queue.list_jobs(s, spec_hash="0" * 64) == []
        with pytest.raises(errors.NotFound):
            job_queue.get_job(s, "nope")
        with pytest.raises(errors.NotFound):
            job_queue.list_trials(s, "nope")
        with pytest.raises(errors.NotFound):
            kernel_cache.get_kernel(s, "nope")


def test_times_are_utc_on_both_backends(Session):
    job, _ = submit(Session)
    claim(Session)
    with Session() as s:
        row = s.get(Job, job.id)
        for value in (row.created_at, row.started_at, row.lease_expires_at, row.updated_at):
            assert value.tzinfo is not None and value.utcoffset() == timedelta(0)
        assert abs((row.created_at - utcnow()).total_seconds()) < 60
        assert row.lease_expires_at.tzinfo == UTC


def test_take_expired_false_claims_only_queued_jobs(Session) -> None:
    """A worker that just met a database outage passes take_expired=False: a lease that ran out
    during the outage stays with its (live) holder; a queued job is still claimed."""
    held, _ = submit(Session, n=64)
    queued, _ = submit(Session, n=128)
    assert claim(Session, "w-holder").id == held.id
    expire(Session, held.id)
    with Session() as s:
        got = job_queue.claim_job(s, "w2", target="h100", measurer="model", lease_seconds=60, take_expired=False)
    assert got.id == queued.id
    with Session() as s:
        assert job_queue.claim_job(s, "w3", target="h100", measurer="model", lease_seconds=60,
                                   take_expired=False) is None
        job = job_queue.get_job(s, held.id)
    assert job.worker_id == "w-holder" and job.attempts == 1
    assert claim(Session, "w3").id == held.id  # without the flag: taken over (a lost worker)


def test_release_worker_jobs_gives_back_only_their_jobs(Session) -> None:
    a, _ = submit(Session, n=64)
    b, _ = submit(Session, n=128)
    claim(Session, "w-stopping")
    claim(Session, "w-other")
    with Session() as s:
        assert job_queue.release_worker_jobs(s, ["w-stopping", "w-gone"]) == [a.id]
        mine, other = job_queue.get_job(s, a.id), job_queue.get_job(s, b.id)
    assert (mine.status, mine.worker_id, mine.attempts, mine.lease_expires_at) == ("queued", None, 0, None)
    assert other.status == "running" and other.worker_id == "w-other"
    with Session() as s:  # the stopping worker's late write is refused
        with pytest.raises(errors.LeaseLost):
            job_queue.record_trial(s, a.id, "w-stopping", number=0, strategy=None, config=None, time_ms=None,
                                   error="late", state="failed", predicted=True, source="tpe")
