"""Data safety through the real paths (HTTP server, worker loop), beyond test_api/test_job_queue:

- many parallel identical submissions over HTTP to a live server on PostgreSQL (a spec the
  server has never derived, so the derivation and the spec insert race too) make one job;
- a worker whose job was taken over *after its search ended* (between tuning and storing
  the result) stores nothing: the worker loop reports ``lost``, the job stays the new
  holder's, no kernel and no bundle appear;
- a bundle whose stored bytes do not match its hash is never served, whatever the in-memory
  bundle cache holds: corrupting one kernel's bundle refuses that one (an error, not bytes)
  and leaves another's untouched; a bundle verified and cached before its row was damaged is
  served as verified (the bytes hash to the ETag, never the damaged bytes); a restarted
  server (empty cache) refuses it; a kernel cannot point at a missing bundle (foreign key).
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from fuser_core.problem import make_problem
from fuser_core.spec import load_spec
from service import errors
from service.store import job_queue
from service.api import create_app
from service.bundle import canonical_spec
from service.bundle_maker import make_bundle
from service.store.db import make_engine
from service.store.models import Bundle, Job, KernelRecord, utcnow
from service.settings import get_settings
from service.tuning_request import tuning_request
from service.worker import Worker, run_worker
from tests.support.catalog import load_catalog

SOFTMAX = load_catalog()["safe_softmax"]


# ----------------------------------------------------------------------------- submissions


@pytest.mark.postgres
def test_parallel_identical_submissions_over_http_make_one_job(fresh_postgres_url, tmp_path) -> None:
    from tests.support.servers import LiveServer

    server = LiveServer(fresh_postgres_url, tmp_path)
    try:
        spec = copy.deepcopy(SOFTMAX)
        spec["doc"] = "never derived by this server"
        body = {"spec": spec, "shape": {"m": 8, "n": 96}, "dtype": "float32", "target": "h100",
                "measurer": "model", "budget": {"trials": 4, "seconds": 60}}
        barrier = threading.Barrier(24)

        def submit(_: int) -> httpx.Response:
            with httpx.Client(base_url=server.base, timeout=60) as c:
                barrier.wait()
                return c.post("/v1/jobs", json=body)

        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(submit, range(48)))
        assert {r.status_code for r in results} == {202}, [r.text[:200] for r in results if r.status_code != 202]
        assert len({r.json()["id"] for r in results}) == 1
        assert sum(r.headers["foldwise-job-created"] == "true" for r in results) == 1
        assert {r.headers["location"] for r in results} == {results[0].json()["url"]}
        listed = httpx.get(server.base + "/v1/jobs", timeout=10).json()
        assert listed["count"] == 1
    finally:
        server.stop()
    engine = make_engine(fresh_postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 1
            assert conn.execute(sa.text("SELECT count(*) FROM specs")).scalar() == 1
    finally:
        engine.dispose()


# ----------------------------------------------------------------------------- a stale worker


def test_a_worker_that_lost_its_job_before_storing_the_result_stores_nothing(db_url, sessions, monkeypatch) -> None:
    with sessions() as s:
        job, _ = job_queue.submit_job(s, tuning_request(load_spec(SOFTMAX), json.dumps(SOFTMAX), {"m": 4, "n": 64},
                                                        "float32", "h100", "model", 3, 600))
    outcomes: list[str] = []
    real_settle = Worker._settle

    def settle_after_takeover(self, job, outcome, detail, keeper):
        # the search is over; before the result is stored, another worker takes the job over
        # (as after an expired lease while this one was paused)
        with self.sessions() as s:
            s.execute(sa.update(Job).where(Job.id == job.id).values(
                worker_id="w-thief", lease_expires_at=utcnow() + timedelta(seconds=60)))
            s.commit()
        outcomes.append(outcome)
        result = real_settle(self, job, outcome, detail, keeper)
        outcomes.append(result)
        return result

    monkeypatch.setattr(Worker, "_settle", settle_after_takeover)
    cfg = get_settings(db_url=db_url, lease_seconds=30.0, heartbeat_seconds=5.0)
    done = run_worker(db_url, measurer="model", target="h100", worker_id="w-stale", poll_s=0.05, once=True,
                      settings=cfg)
    assert done == 1
    assert outcomes == ["succeeded", "lost"]  # it had a result, and was refused storing it
    with sessions() as s:
        stored = s.get(Job, job.id, populate_existing=True)
        assert stored.status == "running" and stored.worker_id == "w-thief" and stored.kernel_id is None
        assert s.scalar(sa.select(sa.func.count()).select_from(KernelRecord)) == 0
        assert s.scalar(sa.select(sa.func.count()).select_from(Bundle)) == 0
        # and it cannot fail or release the job either
        for call in (lambda: job_queue.fail_job(s, job.id, "w-stale", "x"),
                     lambda: job_queue.release_job(s, job.id, "w-stale"),
                     lambda: job_queue.mark_cancelled(s, job.id, "w-stale")):
            with pytest.raises(errors.LeaseLost):
                call()


# ----------------------------------------------------------------------------- corrupted bundles


def store_kernel(sessions, shape: dict) -> tuple[str, str, bytes]:
    """A succeeded job with a real bundle; (kernel id, bundle sha256, bundle bytes)."""
    spec = load_spec(SOFTMAX)
    with sessions() as s:
        request = tuning_request(spec, json.dumps(SOFTMAX), shape, "float32", "h100", "model", 4, 600)
        job, _ = job_queue.submit_job(s, request)
        claimed = job_queue.claim_job(s, "w", target="h100", measurer="model", lease_seconds=600)
        bundle = make_bundle(make_problem(canonical_spec(spec), claimed.shape, claimed.dtype_value), target="h100",
                             strategy="streaming_fused", config={},
                             measured={"time_ms": 0.01, "measurer": "model", "predicted": True})
        kernel = job_queue.finish_job(s, job.id, "w", bundle=bundle, kernel_fields={"time_ms": 0.01})
        content = s.get(Bundle, kernel.bundle_sha256).content
        return kernel.id, kernel.bundle_sha256, content


def damage(sessions, sha: str, content: bytes) -> None:
    with sessions() as s:
        s.execute(sa.update(Bundle).where(Bundle.sha256 == sha).values(content=content))
        s.commit()


def refused(r: httpx.Response, original: bytes) -> None:
    assert r.status_code >= 500 or r.status_code == 404, r.status_code
    assert r.headers["content-type"].startswith("application/problem+json")
    assert original not in r.content and b"triton_source" not in r.content


@pytest.mark.parametrize("fast_path", [True, False])
def test_corruption_is_never_served_whatever_the_cache_holds(db_url, sessions, fast_path) -> None:
    a_id, a_sha, a_bytes = store_kernel(sessions, {"m": 4, "n": 64})
    b_id, b_sha, b_bytes = store_kernel(sessions, {"m": 4, "n": 128})
    assert a_sha != b_sha
    settings = get_settings(db_url=db_url)
    with TestClient(create_app(settings, fast_path=fast_path)) as client:
        r = client.get(f"/v1/kernels/{a_id}/bundle")
        assert r.status_code == 200 and r.content == a_bytes  # A is verified and now cached

        # B is damaged (never fetched): B is refused, A is untouched
        damage(sessions, b_sha, b_bytes.replace(b"streaming_fused", b"multi_pass_xyz", 1))
        refused(client.get(f"/v1/kernels/{b_id}/bundle"), b_bytes)
        refused(client.get(f"/v1/kernels/{b_id}/bundle"), b_bytes)  # and not cached as a side effect
        r = client.get(f"/v1/kernels/{a_id}/bundle")
        assert r.status_code == 200 and r.content == a_bytes

        # A damaged after it was verified and cached: what is served is the verified copy, whose
        # bytes hash to the ETag; the damaged bytes are never served
        damage(sessions, a_sha, a_bytes[:-10] + b"0000000000")
        r = client.get(f"/v1/kernels/{a_id}/bundle")
        assert r.status_code == 200 and r.content == a_bytes
        assert r.headers["etag"] == f'"{hashlib.sha256(json.dumps({k: v for k, v in json.loads(r.content).items() if k != "sha256"}, sort_keys=True, separators=(",", ":")).encode()).hexdigest()}"'

        # a kernel cannot point at a bundle that is not stored: the database refuses it
        with sessions() as s, pytest.raises(sa.exc.IntegrityError):
            s.execute(sa.update(KernelRecord).where(KernelRecord.id == b_id).values(bundle_sha256="f" * 64))
            s.commit()

    # a restarted server has an empty cache: the damaged A is refused too
    with TestClient(create_app(settings, fast_path=fast_path)) as client:
        refused(client.get(f"/v1/kernels/{a_id}/bundle"), a_bytes)
        # repairing the row (a worker storing the same verified bundle again) serves it again
        damage(sessions, a_sha, a_bytes)
        assert client.get(f"/v1/kernels/{a_id}/bundle").content == a_bytes
