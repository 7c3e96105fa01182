"""The HTTP API (service/api): every /v1 endpoint through TestClient over a migrated database
(SQLite file and a fresh PostgreSQL database), problem+json errors naming the field, limits,
idempotent submissions (also many at once, from two apps), the auth matrix, path validation
before any query, ETag/304, metrics and JSON logs.

Kernels are stored with service.store.job_queue directly (claim, a real generated bundle, finish): the
tuner itself is tested in test_worker.py and end to end in tests/e2e/test_serve_and_worker.py.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from fuser_core.canonical import spec_hash as compute_spec_hash
from fuser_core.report import derivation_report
from fuser_core.problem import make_problem
from fuser_core.spec import MAX_SPEC_BYTES, load_spec
from service.store import job_queue, kernel_cache
from service.api import create_app
from service.auth import create_token, revoke_token
from service.bundle import bundle_sha256, canonical_spec
from service.bundle_maker import make_bundle
from service.store.db import DatabaseBehind
from service.store.models import ApiToken, Job
from service.settings import get_settings
from service.tuning_request import tuning_request
from tests.support.catalog import CATALOG_DIR, load_catalog
from tests.support.slow_specs import slow_spec

SOFTMAX = load_catalog()["safe_softmax"]
SHAPE = {"m": 4, "n": 64}
PROBLEM = "application/problem+json"


def make_client(db_url: str, **kwargs) -> TestClient:
    settings = get_settings(db_url=db_url, host=kwargs.pop("host", "127.0.0.1"), max_trials=kwargs.pop("max_trials", 500))
    return TestClient(create_app(settings, **kwargs))


@pytest.fixture()
def client(db_url):
    with make_client(db_url) as c:
        yield c


def job_body(**overrides) -> dict:
    body = {"spec": copy.deepcopy(SOFTMAX), "shape": dict(SHAPE), "dtype": "float32", "target": "h100",
            "measurer": "model", "budget": {"trials": 8, "seconds": 600}}
    body.update(overrides)
    return body


def assert_problem(r, status: int, field: str | None = None, text: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    body = r.json()
    assert body["status"] == status and body["title"] and body["detail"] and body["type"]
    if field is not None:
        fields = [e["field"] for e in body.get("errors", [])]
        assert field in fields, (field, body)
        assert field in body["detail"] or fields.index(field) > 0
    if text is not None:
        assert text in json.dumps(body), body
    return body


def store_kernel(sessions, raw: dict = SOFTMAX, shape: dict = SHAPE, *, time_ms: float = 0.01) -> str:
    """A succeeded job with a real bundle (generated kernel) for (raw, shape); returns the kernel id."""
    spec = load_spec(raw)
    with sessions() as s:
        request = tuning_request(spec, json.dumps(raw), shape, "float32", "h100", "model", 4, 600)
        job, _ = job_queue.submit_job(s, request)
        claimed = job_queue.claim_job(s, "test-worker", target="h100", measurer="model", lease_seconds=600)
        assert claimed is not None and claimed.id == job.id
        bundle = make_bundle(make_problem(canonical_spec(spec), claimed.shape, claimed.dtype_value), target="h100",
                             strategy="streaming_fused", config={},
                             measured={"time_ms": time_ms, "measurer": "model", "predicted": True})
        kernel = job_queue.finish_job(s, job.id, "test-worker", bundle=bundle, kernel_fields={"time_ms": time_ms})
        return kernel.id


# ----------------------------------------------------------------------------- basics


def test_openapi_health_metrics_and_unknown_routes(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/derivations", "/v1/backward", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/trials",
                 "/v1/jobs/{job_id}/cancel", "/v1/kernels", "/v1/kernels/{kernel_id}",
                 "/v1/kernels/{kernel_id}/bundle", "/v1/workers", "/v1/specs/{spec_hash}", "/healthz", "/metrics"):
        assert path in paths, path
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "foldwise_jobs{status=\"queued\"} 0.0" in metrics.text
    assert_problem(client.get("/v1/nothing"), 404, text="/v1/nothing")
    assert_problem(client.delete("/v1/jobs"), 405)


def test_create_app_refuses_an_unmigrated_database(tmp_path) -> None:
    with pytest.raises(DatabaseBehind, match="foldwise db upgrade"):
        create_app(get_settings(db_url=f"sqlite:///{tmp_path / 'empty.db'}"))


# ----------------------------------------------------------------------------- derivations


def test_backward_is_the_cli_json_and_a_refusal_names_the_field(client, capsys) -> None:
    """POST /v1/backward (issue 39): foldwise backward --json --no-derive, computed in a derivation
    child; a spec the backward refuses answers 422 naming its field."""
    from service.cli import main

    r = client.post("/v1/backward", json={"spec": "rmsnorm"})
    assert r.status_code == 200, r.text
    assert main(["backward", "rmsnorm", "--json", "--no-derive"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert r.json()["specs"] == cli["specs"] and r.json()["gradients"] == cli["gradients"]
    assert r.json()["certificate"]["holds"] and r.json()["saved"] == ["ms"]
    body = assert_problem(client.post("/v1/backward", json={"spec": "moe_routing"}), 422, "spec.steps[2].reduce",
                          "topk")
    assert body["errors"][0]["step"] == "gate"
    assert_problem(client.post("/v1/backward", json={"spec": 42}), 422, "spec")



def test_derivation_is_the_cli_json_and_errors_name_the_field(client, capsys) -> None:
    from service.cli import main

    r = client.post("/v1/derivations", json={"spec": SOFTMAX})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert main(["derive", str(CATALOG_DIR / "safe_softmax.json"), "--json"]) == 0
    assert r.json() == json.loads(capsys.readouterr().out)
    assert client.post("/v1/derivations", json={"spec": json.dumps(SOFTMAX)}).json() == r.json()  # JSON text too

    bad = copy.deepcopy(SOFTMAX)
    bad["steps"][1]["expr"] = "exp(x - q)"
    body = assert_problem(client.post("/v1/derivations", json={"spec": bad}), 422, "spec.steps[1].expr", "'q'")
    assert body["errors"][0]["step"] == "den" and body["errors"][0]["loc"] == ["spec", "steps", 1, "expr"]
    bad = copy.deepcopy(SOFTMAX)
    bad["stpes"] = []
    assert_problem(client.post("/v1/derivations", json={"spec": bad}), 422, text="stpes")
    bad = copy.deepcopy(SOFTMAX)
    bad["steps"][0]["expr"] = "x.__class__"  # never evaluated: the grammar refuses it
    assert_problem(client.post("/v1/derivations", json={"spec": bad}), 422, "spec.steps[0].expr")
    assert_problem(client.post("/v1/derivations", json={"spec": 42}), 422, "spec")
    assert_problem(client.post("/v1/derivations", json={}), 422, "spec")
    assert_problem(client.post("/v1/derivations", json={"spec": SOFTMAX, "extra": 1}), 422, "extra")
    assert_problem(client.post("/v1/derivations", content=b"{not json", headers={"Content-Type": "application/json"}),
                   422, text="JSON")
    big = {**SOFTMAX, "doc": "x" * (MAX_SPEC_BYTES - 100)}
    assert_problem(client.post("/v1/derivations", json={"spec": big}), 422, "spec", str(MAX_SPEC_BYTES))
    huge = b'{"spec": "' + b"x" * (4 * MAX_SPEC_BYTES) + b'"}'
    assert_problem(client.post("/v1/derivations", content=huge, headers={"Content-Type": "application/json"}),
                   413)


def _child_pids(client: TestClient, seen: set[int], stop: threading.Event) -> None:
    while not stop.is_set():
        seen.update(client.app.state.ctx.deriver.running)
        time.sleep(0.01)


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_derivation_past_its_deadline_answers_503_and_is_stopped(db_url) -> None:
    """The derivation and its certificate share one deadline; past it the child deriving is
    killed (no work goes on after the 503), and the pool serves the next request."""
    from fuser_core.report import clear_cache

    clear_cache()
    with make_client(db_url, derive_timeout_s=3.0) as c:
        c.app.state.ctx.deriver.warm_up(wait=True)  # the forkserver's imports: not within the deadline
        seen: set[int] = set()
        stop = threading.Event()
        watcher = threading.Thread(target=_child_pids, args=(c, seen, stop))
        watcher.start()
        try:
            r = c.post("/v1/derivations", json={"spec": slow_spec(45)})  # ~10 s of derivation and certificate
        finally:
            stop.set()
            watcher.join()
        assert_problem(r, 503, text="longer than")
        assert r.json()["type"].endswith("derivation-timeout") and int(r.headers["retry-after"]) >= 1
        assert len(seen) == 1 and all(_gone(pid) for pid in seen), seen
        deriver = c.app.state.ctx.deriver
        assert deriver.killed == 1 and not deriver.running
        ok = c.post("/v1/derivations", json={"spec": SOFTMAX})  # the pool takes the next one
        assert ok.status_code == 200 and ok.json()["name"] == "safe_softmax", ok.text
        again = c.post("/v1/derivations", json={"spec": SOFTMAX})  # cached: no child
        assert again.json() == ok.json() and deriver.killed == 1


def test_a_derivation_error_in_the_child_names_the_field_and_step(client) -> None:
    """Errors found while deriving (in the DerivationPool's child process) come back as they would
    in-process: 422 naming ``spec`` and the caller's step."""
    from tests.fuser_core.test_limits import CRAFTED

    r = client.post("/v1/derivations", json={"spec": CRAFTED["maximum_chain"][0]})
    assert_problem(r, 422, "spec", "exceeds its limits")
    assert "step 'e8'" in r.text, r.text


def test_derivations_past_the_pool_and_queue_answer_429(db_url) -> None:
    from fuser_core.report import clear_cache

    clear_cache()
    settings = get_settings(db_url=db_url, derive_workers=1, derive_queue=0)
    with TestClient(create_app(settings, derive_timeout_s=2.0)) as c:
        c.app.state.ctx.deriver.warm_up(wait=True)  # the forkserver's imports: not within the deadline
        first: list = []
        t = threading.Thread(target=lambda: first.append(c.post("/v1/derivations", json={"spec": slow_spec(30)})))
        t.start()
        deadline = time.monotonic() + 10
        while not c.app.state.ctx.deriver.running and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.post("/v1/derivations", json={"spec": slow_spec(30, tag=1)})
        assert_problem(r, 429, text="retry later")
        assert r.json()["type"].endswith("derivation-busy") and int(r.headers["retry-after"]) >= 1
        t.join(30)
        assert first[0].status_code == 503, first[0].text


def test_identical_derivations_in_flight_share_one_child(db_url, monkeypatch) -> None:
    """Six identical requests at once with room for one derivation and no queue: one child
    derives, every request gets its answer (none 429)."""
    from fuser_core.report import clear_cache
    from service.api.derive import DerivationPool

    clear_cache()
    real_derive, children = DerivationPool._derive, []

    async def counted(self, *args, **kwargs):
        children.append(args[0])
        return await real_derive(self, *args, **kwargs)

    monkeypatch.setattr(DerivationPool, "_derive", counted)
    settings = get_settings(db_url=db_url, derive_workers=1, derive_queue=0)
    with TestClient(create_app(settings)) as c:
        c.app.state.ctx.deriver.warm_up(wait=True)
        spec = load_catalog()["layernorm"]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: c.post("/v1/derivations", json={"spec": spec}), range(6)))
        assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
        assert children == ["layernorm"], children


def test_a_new_spec_is_derived_once_by_its_submission(db_url, monkeypatch) -> None:
    """POST /v1/jobs for a spec never stored derives it once (the route's one call,
    service.api.ops.submit_job), in the DerivationPool's child process: storing the spec uses that
    derivation (nothing is derived in the API's process), and a second identical submission
    derives nothing."""
    import fuser_core.derive
    from fuser_core.report import clear_cache
    from service.api.derive import DerivationPool

    clear_cache()
    real_derive, children = DerivationPool._derive, []

    async def counted(self, *args, **kwargs):
        children.append(args[0])
        return await real_derive(self, *args, **kwargs)

    monkeypatch.setattr(DerivationPool, "_derive", counted)
    in_process = []
    real = fuser_core.derive.derive_cascade
    monkeypatch.setattr(fuser_core.derive, "derive_cascade",
                        lambda spec, **kw: in_process.append(spec.name) or real(spec, **kw))
    with make_client(db_url) as c:
        first = c.post("/v1/jobs", json=job_body())
        assert first.status_code == 202 and first.headers["foldwise-job-created"] == "true", first.text
        assert children == ["safe_softmax"] and in_process == [], (children, in_process)
        again = c.post("/v1/jobs", json=job_body())
        assert again.json()["id"] == first.json()["id"] and len(children) == 1


def test_a_submission_whose_derivation_is_too_slow_answers_503_and_stores_nothing(db_url) -> None:
    from fuser_core.report import clear_cache

    clear_cache()
    with make_client(db_url, derive_timeout_s=1.0) as c:
        c.app.state.ctx.deriver.warm_up(wait=True)  # the forkserver's imports: not within the deadline
        body = job_body(spec=slow_spec(30), shape={"m": 4, "n": 64})
        r = c.post("/v1/jobs", json=body)
        assert_problem(r, 503, text="longer than")
        assert r.headers["retry-after"] and c.get("/v1/jobs").json()["count"] == 0
        assert c.get(f"/v1/specs/{compute_spec_hash(load_spec(slow_spec(30)))}").status_code == 404
        assert c.app.state.ctx.deriver.killed == 1 and not c.app.state.ctx.deriver.running


def test_submit_is_idempotent_with_location_and_views(client, sessions) -> None:
    r1 = client.post("/v1/jobs", json=job_body())
    assert r1.status_code == 202 and r1.headers["foldwise-job-created"] == "true"
    job = r1.json()
    assert r1.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["progress"] == {"trials_done": 0, "trials_budget": 8}
    assert job["spec_hash"] == compute_spec_hash(load_spec(SOFTMAX))
    assert job["shape"] == {"d0": 4, "d1": 64} and job["display_shape"] == SHAPE
    assert job["budget"] == {"trials": 8, "seconds": 600} and job["best"] is None and job["kernel_id"] is None

    r2 = client.post("/v1/jobs", json=job_body())  # the same request: the same job, nothing new
    assert r2.status_code == 202 and r2.json()["id"] == job["id"] and r2.headers["foldwise-job-created"] == "false"
    renamed = json.loads(json.dumps(SOFTMAX).replace('"n"', '"cols"'))  # same spec_hash, other dim names
    r3 = client.post("/v1/jobs", json=job_body(spec=renamed, shape={"m": 4, "cols": 64}, budget={"trials": 9}))
    assert r3.json()["id"] == job["id"]
    other = client.post("/v1/jobs", json=job_body(shape={"m": 4, "n": 128})).json()
    assert other["id"] != job["id"]

    assert client.get(f"/v1/jobs/{job['id']}").json() == {**job, "display_shape": SHAPE}
    listed = client.get("/v1/jobs").json()
    assert [j["id"] for j in listed["jobs"]] == [other["id"], job["id"]] and listed["count"] == 2
    assert [j["id"] for j in client.get("/v1/jobs", params={"limit": 1, "offset": 1}).json()["jobs"]] == [job["id"]]
    assert client.get("/v1/jobs", params={"status": "succeeded"}).json()["jobs"] == []
    assert len(client.get("/v1/jobs", params={"spec_hash": job["spec_hash"], "target": "H100"}).json()["jobs"]) == 2
    assert client.get("/v1/jobs", params={"target": "a100"}).json()["jobs"] == []
    assert_problem(client.get("/v1/jobs", params={"status": "done"}), 422, "status")
    assert_problem(client.get("/v1/jobs", params={"limit": 0}), 422, "limit")
    assert_problem(client.get("/v1/jobs", params={"spec_hash": "abc"}), 422, "spec_hash")
    assert client.get(f"/v1/jobs/{job['id']}/trials").json() == {"job_id": job["id"], "trials": []}

    spec_view = client.get(f"/v1/specs/{job['spec_hash']}").json()
    assert spec_view["spec"] == SOFTMAX and spec_view["derivation"] == derivation_report(load_spec(SOFTMAX))
    assert spec_view["canonical"]["steps"][0]["name"] == "s0"

    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")  # queued: cancelled at once
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = client.post("/v1/jobs", json=job_body())  # a cancelled job is not reused
    assert again.status_code == 202 and again.json()["id"] != job["id"] and again.json()["status"] == "queued"


def test_jobs_listed_by_request_key(client) -> None:
    """``GET /v1/jobs?spec_hash=&target=&shape=&dtype=``: the jobs of one request key (the
    client names a queued job in its "no kernel" error), shape in either naming."""
    job = client.post("/v1/jobs", json=job_body()).json()
    client.post("/v1/jobs", json=job_body(shape={"m": 4, "n": 128}))
    half = client.post("/v1/jobs", json=job_body(dtype="float16")).json()
    shash = job["spec_hash"]

    def ids(**params) -> list[str]:
        r = client.get("/v1/jobs", params=params)
        assert r.status_code == 200, r.text
        return [j["id"] for j in r.json()["jobs"]]

    assert len(ids(spec_hash=shash)) == 3
    assert ids(spec_hash=shash, target="h100", shape="m=4,n=64", dtype="float32") == [job["id"]]
    assert ids(spec_hash=shash, shape="d0=4,d1=64", dtype='{"x": "float32"}') == [job["id"]]  # canonical, a map
    assert ids(spec_hash=shash, shape="n=64,m=4") == [half["id"], job["id"]]
    assert ids(spec_hash=shash, dtype="float16") == [half["id"]]
    assert ids(spec_hash=shash, shape="m=4,n=64", status="running") == []
    assert ids(spec_hash="0" * 64, shape="m=4,n=64") == []  # a spec never stored has no jobs
    assert_problem(client.get("/v1/jobs", params={"shape": "m=4,n=64"}), 422, "shape", "needs spec_hash")
    assert_problem(client.get("/v1/jobs", params={"dtype": "float16"}), 422, "dtype", "needs spec_hash")
    assert_problem(client.get("/v1/jobs", params={"spec_hash": shash, "shape": "m=4"}), 422, "shape.n")
    assert_problem(client.get("/v1/jobs", params={"spec_hash": shash, "dtype": "float128"}), 422, "dtype")


def test_submission_of_a_cached_kernel_is_200_with_the_kernel(client, sessions) -> None:
    kernel_id = store_kernel(sessions)
    r = client.post("/v1/jobs", json=job_body())
    assert r.status_code == 200 and r.json()["status"] == "succeeded" and r.json()["kernel_id"] == kernel_id
    assert r.headers["location"] == r.json()["url"] and r.headers["foldwise-job-created"] == "false"
    assert client.post("/v1/jobs", json=job_body()).json()["id"] == r.json()["id"]


BAD_SUBMISSIONS = [
    ({"shape": {"m": 4, "q": 64}}, "shape.q", "unknown dim"),
    ({"shape": {"m": 4}}, "shape.n", "no size"),
    ({"shape": {"m": 4, "n": 0}}, "shape.n", "from 1"),
    ({"shape": {"m": 4, "n": "64"}}, "shape.n", None),
    ({"shape": {"m": 4, "n": 64.0}}, "shape.n", None),
    ({"shape": {"m": 2**31, "n": 64}}, "shape.m", "2147483647"),
    ({"shape": {"m": 2**20, "n": 2**20}}, "shape", "input 'x' (m=1048576, n=1048576) would have 1099511627776 "
                                                 "elements; the limit per tensor is 2147483648"),
    ({"budget": {"trials": 501}}, "budget.trials", "at most 500"),
    ({"budget": {"trials": 0}}, "budget.trials", None),
    ({"budget": {"trials": 5, "seconds": 10**9}}, "budget.seconds", "at most"),
    ({"budget": {"trials": 5, "seconds": -1}}, "budget.seconds", None),
    ({"target": "v100"}, "target", "unknown target"),
    ({"measurer": "tpu"}, "measurer", None),
    ({"dtype": "float128"}, "dtype", "unknown dtype"),
    ({"dtype": {"y": "float16"}}, "dtype", "unknown input"),
    ({"budgt": {}}, "budgt", "Extra inputs"),
]


def test_submit_validation_names_the_field(client) -> None:
    for change, field, text in BAD_SUBMISSIONS:
        assert_problem(client.post("/v1/jobs", json=job_body(**change)), 422, field, text)
    assert client.get("/v1/jobs").json()["jobs"] == []  # nothing stored


def test_a_union_field_is_one_error_with_both_reasons(client) -> None:
    """A shape size is an integer or a range: a string fails both branches, answered once (issue 37, 11)."""
    r = client.post("/v1/jobs", json=job_body(shape={"m": "4", "n": 300}))
    assert r.status_code == 422
    assert r.json()["errors"] == [{"field": "shape.m", "loc": ["shape", "m"], "in": "body",
                                   "message": "Input should be a valid integer or a valid dictionary"}]


def test_body_errors_name_the_body_or_the_content_type(client) -> None:
    def post(content: str, content_type: str | None = "application/json") -> list[dict]:
        r = client.post("/v1/jobs", content=content, headers={"content-type": content_type} if content_type else {})
        assert r.status_code == 422 and r.headers["content-type"].startswith(PROBLEM)
        return r.json()["errors"]

    # the README's curl when the command inside $(...) failed: the spec's value is missing
    [e] = post('{"spec": , "shape": {"m": 64, "n": 4096}}')
    assert (e["field"], e["in"]) == ("body", "body")
    assert e["message"] == ("the request body is not valid JSON: the value of 'spec' is missing (line 1 column 10); "
                            "was it made by a command that failed?")
    [e] = post('{"spec": {},\n "shape": 3')
    assert e["field"] == "body" and "Expecting ',' delimiter at line 2 column 12, near" in e["message"]
    assert post("")[0] == {"field": "body", "loc": ["body"], "in": "body",
                           "message": "the request body is empty; expected a JSON object"}
    assert post("[1]")[0]["field"] == "body"
    for content_type, shown in (("text/plain", "got 'text/plain'"), (None, "none was sent")):
        [e] = post(json.dumps(job_body()), content_type)
        assert (e["field"], e["in"]) == ("content-type", "header") and e["message"].endswith(shown)
        assert e["message"].startswith("must be application/json")


PAPER_ATTENTION = {"b": 128, "h": 16, "m": 512, "n": 512, "d": 64, "e": 64}  # suites.json "paper", its first case


def test_the_papers_attention_shape_is_accepted(client) -> None:
    """Its dims multiply to 2**41, but its largest tensor (the step s, b*h*m*n) has 2**29 elements."""
    attention = load_catalog()["attention"]
    r = client.post("/v1/jobs", json=job_body(spec=attention, shape=PAPER_ATTENTION, dtype="float16"))
    assert r.status_code == 202, r.text
    job = client.get(r.headers["location"]).json()
    assert job["status"] == "queued" and job["display_shape"] == PAPER_ATTENTION


def test_size_limits_name_the_tensor(client) -> None:
    # issue 36: a limit applies to what a strategy stores. A 131072-token context is accepted: its score
    # matrix s0 (2**39 elements) is a step no fused strategy stores (the unfused chain refuses the shape)
    long_context = {"b": 1, "h": 32, "m": 131072, "n": 131072, "d": 128, "e": 128}
    r = client.post("/v1/jobs", json=job_body(spec=load_catalog()["attention_causal"], shape=long_context,
                                              dtype="bfloat16"))
    assert r.status_code == 202, r.text
    outer = {"foldwise": 1, "name": "outer", "inputs": {"x": {"dims": ["m"]}, "y": {"dims": ["n"]}},
             "steps": [{"name": "p", "expr": "x * y"}], "outputs": ["p"]}  # an output every strategy writes
    assert_problem(client.post("/v1/jobs", json=job_body(spec=outer, shape={"m": 2**16, "n": 2**16})), 422, "shape",
                   "output 'p' (m=65536, n=65536) would have 4294967296 elements; the limit per tensor is 2147483648")
    outer = {"foldwise": 1, "name": "outer", "inputs": {"x": {"dims": ["m", "n"]}, "y": {"dims": ["k", "l"]}},
             "steps": [{"name": "s", "reduce": "sum", "over": "n", "expr": "x * y"}], "outputs": ["s"]}
    wide = {"m": 1, "n": 2**30, "k": 2**15, "l": 2**15}  # every tensor 2**30, the sum iterates 2**60 points
    assert_problem(client.post("/v1/jobs", json=job_body(spec=outer, shape=wide)), 422, "shape",
                   "step 's' iterates over m=1, k=32768, l=32768, n=1073741824: 1152921504606846976 points; "
                   "the limit is 281474976710656")


def test_many_parallel_identical_submissions_make_one_job(db_url) -> None:
    """32 concurrent submissions through two apps (two servers) on one database: one job."""
    with make_client(db_url) as a, make_client(db_url) as b:
        b.post("/v1/derivations", json={"spec": SOFTMAX})  # warm the in-process derivation cache once
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: (a if i % 2 else b).post("/v1/jobs", json=job_body()), range(32)))
        assert {r.status_code for r in results} == {202}
        assert len({r.json()["id"] for r in results}) == 1
        assert sum(r.headers["foldwise-job-created"] == "true" for r in results) == 1
        assert a.get("/v1/jobs").json()["count"] == 1


COMPILED = {"kernel": "safe_softmax_row_resident_kernel", "ok": True, "registers": 40, "spill_bytes": 0,
            "shared_bytes": 1040, "num_warps": 4, "num_stages": 1}


def test_trials_cancel_of_a_running_job_and_workers(client, sessions) -> None:
    job = client.post("/v1/jobs", json=job_body()).json()
    with sessions() as s:
        job_queue.register_worker(s, "w-1", hostname="h", gpu_name=None, target="h100", measurer="model",
                             versions={"python": "3"})
        assert job_queue.claim_job(s, "w-1", target="h100", measurer="model", lease_seconds=60).id == job["id"]
        job_queue.record_trial(s, job["id"], "w-1", number=0, strategy="row_resident", config={"num_warps": 4},
                          time_ms=0.5, error=None, state="complete", predicted=True, source="frontier",
                          compile=[COMPILED])
        job_queue.record_trial(s, job["id"], "w-1", number=1, strategy="split_fused", config=None, time_ms=None,
                          error="too much shared memory", state="pruned", predicted=False, source="tpe")
    view = client.get(f"/v1/jobs/{job['id']}").json()
    assert view["status"] == "running" and view["progress"]["trials_done"] == 2 and view["best"]["time_ms"] == 0.5
    trials = client.get(f"/v1/jobs/{job['id']}/trials").json()["trials"]
    assert [(t["number"], t["state"], t["worker_id"]) for t in trials] == [(0, "complete", "w-1"), (1, "pruned", "w-1")]
    assert trials[1]["error"] == "too much shared memory" and trials[0]["source"] == "frontier"
    assert trials[0]["compile"] == [COMPILED] and trials[1]["compile"] is None  # the compile gate's facts

    r = client.post(f"/v1/jobs/{job['id']}/cancel")  # running: the worker is asked to stop
    assert r.status_code == 202 and r.json()["cancel_requested"] and r.json()["status"] == "running"
    with sessions() as s:
        assert not job_queue.renew_lease(s, job["id"], "w-1", 60)

    workers = client.get("/v1/workers").json()["workers"]
    assert [(w["id"], w["alive"], w["current_job_id"]) for w in workers] == [("w-1", True, job["id"])]
    # a worker whose heartbeats stopped is dead: it works on nothing (its lease runs out, another takes the job)
    from datetime import timedelta

    from service.store.models import WorkerRecord, utcnow

    with sessions() as s:
        s.execute(sa.update(WorkerRecord).where(WorkerRecord.id == "w-1")
                  .values(last_heartbeat=utcnow() - timedelta(hours=1)))
        s.commit()
    workers = client.get("/v1/workers").json()["workers"]
    assert [(w["id"], w["alive"], w["current_job_id"]) for w in workers] == [("w-1", False, None)]


# ----------------------------------------------------------------------------- kernels and bundles


@pytest.mark.parametrize("fast_path", [True, False])
def test_kernel_lookup_bundle_etag_and_304(db_url, sessions, fast_path) -> None:
    kernel_id = store_kernel(sessions)
    shash = compute_spec_hash(load_spec(SOFTMAX))
    with make_client(db_url, fast_path=fast_path) as client:
        exact = client.get("/v1/kernels", params={"spec_hash": shash, "shape": "d0=4,d1=64", "dtype": "float32",
                                                  "target": "h100"}).json()
        assert exact["id"] == kernel_id and exact["exact_match"] is True and exact["shape"] == {"d0": 4, "d1": 64}
        assert exact["bundle_url"] == f"/v1/kernels/{kernel_id}/bundle" and exact["predicted"] is True
        assert client.get("/v1/kernels", params={"spec_hash": shash, "shape": "m=4,n=64"}).json()["exact_match"]
        near = client.get("/v1/kernels", params={"spec_hash": shash, "shape": "d0=8,d1=100"}).json()
        assert near["id"] == kernel_id and near["exact_match"] is False
        assert client.get("/v1/kernels", params={"spec_hash": shash}).json()["exact_match"] is False
        assert client.get(f"/v1/kernels/{kernel_id}").json()["id"] == kernel_id
        assert_problem(client.get("/v1/kernels", params={"spec_hash": shash, "dtype": "float16"}), 404)
        assert_problem(client.get("/v1/kernels", params={"spec_hash": "0" * 64}), 404)
        assert_problem(client.get("/v1/kernels", params={"spec_hash": shash, "shape": "d0=4,d1"}), 422, "shape")
        assert_problem(client.get("/v1/kernels", params={"spec_hash": shash, "shape": "q=4"}), 422, "shape.q")
        assert_problem(client.get("/v1/kernels", params={"spec_hash": shash, "dtype": "int8"}), 422, "dtype")
        assert_problem(client.get("/v1/kernels"), 422, "spec_hash")

        r = client.get(exact["bundle_url"])
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        with sessions() as s:
            stored = kernel_cache.get_bundle_bytes(s, kernel_cache.get_kernel(s, kernel_id))
        assert r.content == stored  # byte for byte as stored
        bundle = json.loads(r.content)
        assert r.headers["etag"] == f'"{bundle["sha256"]}"' == f'"{exact["bundle_sha256"]}"'
        assert bundle_sha256(bundle) == bundle["sha256"]
        assert hashlib.sha256(json.dumps({k: v for k, v in bundle.items() if k != "sha256"}, sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest() == bundle["sha256"]
        for tag in (r.headers["etag"], f'W/{r.headers["etag"]}', f'"nope", {r.headers["etag"]}', "*"):
            not_modified = client.get(exact["bundle_url"], headers={"If-None-Match": tag})
            assert not_modified.status_code == 304 and not_modified.content == b""
            assert not_modified.headers["etag"] == r.headers["etag"]
        assert client.get(exact["bundle_url"], headers={"If-None-Match": '"0000"'}).status_code == 200
        assert_problem(client.get(f"/v1/kernels/{'f' * 32}/bundle"), 404)
        downloads = [line for line in client.get("/metrics").text.splitlines()
                     if line.startswith("foldwise_bundle_downloads_total")]
        assert 'foldwise_bundle_downloads_total{result="200"} 2.0' in downloads
        assert 'foldwise_bundle_downloads_total{result="304"} 4.0' in downloads


def test_a_corrupted_bundle_is_never_served(client, sessions) -> None:
    kernel_id = store_kernel(sessions)
    with sessions() as s:
        kernel = kernel_cache.get_kernel(s, kernel_id)
        s.execute(sa.text("UPDATE bundles SET content = :c WHERE sha256 = :h"),
                  {"c": b'{"sha256": "x"}', "h": kernel.bundle_sha256})
        s.commit()
    assert_problem(client.get(f"/v1/kernels/{kernel_id}/bundle"), 500, text="hash mismatch")


BAD_PATHS = [
    "/v1/jobs/XYZ", "/v1/jobs/" + "A" * 32, "/v1/jobs/" + "a" * 33, "/v1/jobs/" + "a" * 31 + "/trials",
    "/v1/kernels/" + "g" * 32, "/v1/kernels/" + "a" * 31 + "/bundle", "/v1/specs/" + "a" * 11, "/v1/specs/" + "a" * 65,
    "/v1/kernels/" + "a" * 32 + "0/bundle", "/v1/specs/" + "a" * 64 + "'; DROP TABLE jobs; --",
]


def test_path_identifiers_are_validated_before_any_query(client) -> None:
    ctx = client.app.state.ctx
    statements: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    engines = {ctx.engine, ctx.read_engine}
    for engine in engines:
        sa.event.listen(engine, "before_cursor_execute", count)
    try:
        for path in BAD_PATHS:
            body = assert_problem(client.get(path), 422)
            assert body["errors"][0]["in"] == "path", path
            assert body["errors"][0]["field"] in ("job_id", "kernel_id", "spec_hash"), path
        assert_problem(client.post("/v1/jobs/nope/cancel"), 422, "job_id")
    finally:
        for engine in engines:
            sa.event.remove(engine, "before_cursor_execute", count)
    assert statements == []


def test_unknown_ids_are_404(client) -> None:
    assert_problem(client.get("/v1/jobs/" + "a" * 32), 404)
    assert_problem(client.get("/v1/jobs/" + "a" * 32 + "/trials"), 404)
    assert_problem(client.post("/v1/jobs/" + "a" * 32 + "/cancel"), 404)
    assert_problem(client.get("/v1/kernels/" + "a" * 32), 404)
    assert_problem(client.get("/v1/specs/" + "a" * 64), 404)


# ----------------------------------------------------------------------------- auth


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def test_auth_matrix(db_url, sessions) -> None:
    kernel_id = store_kernel(sessions, shape={"m": 4, "n": 32})
    with make_client(db_url) as client:
        # open mode: loopback bind and no token in the database
        assert client.post("/v1/jobs", json=job_body()).status_code == 202
        assert client.get(f"/v1/kernels/{kernel_id}/bundle").status_code == 200

        with sessions() as s:
            _, writer = create_token(s, "ci", "jobs:write")
            _, reader = create_token(s, "inference", ["kernels:read"])
            _, admin = create_token(s, "ops", "admin")
            _, gone = create_token(s, "old", "jobs:write,kernels:read")
            revoke_token(s, name="old")
            stored = [t.token_hash for t in s.scalars(sa.select(ApiToken))]
        assert all(len(h) == 64 for h in stored) and writer not in stored  # only hashes are kept
        assert hashlib.sha256(writer.encode()).hexdigest() in stored

        def submit(headers):
            return client.post("/v1/jobs", json=job_body(shape={"m": 4, "n": 96}), headers=headers)

        def bundle(headers):
            return client.get(f"/v1/kernels/{kernel_id}/bundle", headers=headers)

        def lookup(headers):
            return client.get("/v1/kernels/" + kernel_id, headers=headers)

        r = submit({})
        assert_problem(r, 401, text="jobs:write")
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert_problem(submit(bearer("fw_wrong")), 401, text="invalid token")
        assert_problem(submit({"Authorization": "Basic dXNlcjpwdw=="}), 401)
        assert_problem(submit({"Authorization": "Bearer"}), 401)
        assert_problem(submit(bearer(gone)), 401, text="revoked")
        r = submit(bearer(reader))
        assert_problem(r, 403, text="jobs:write")
        assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
        assert submit(bearer(writer)).status_code == 202
        assert submit(bearer(admin)).status_code == 202

        for fetch in (bundle, lookup):
            assert_problem(fetch({}), 401)
            assert_problem(fetch(bearer(writer)), 403, text="kernels:read")
            assert_problem(fetch(bearer(gone)), 401)
            assert fetch(bearer(reader)).status_code == 200
            assert fetch(bearer(admin)).status_code == 200
        job_id = client.get("/v1/jobs").json()["jobs"][0]["id"]
        assert_problem(client.post(f"/v1/jobs/{job_id}/cancel"), 401)
        assert_problem(client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(reader)), 403)
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(writer)).status_code in (200, 202)

        # status reads stay open on loopback, but a presented token is always checked
        assert client.get("/v1/jobs").status_code == 200 and client.get(f"/v1/jobs/{job_id}").status_code == 200
        assert client.get("/v1/workers").status_code == 200
        assert_problem(client.get("/v1/jobs", headers=bearer("fw_wrong")), 401)
        assert client.get("/metrics").status_code == 200 and client.get("/healthz").status_code == 200

        with sessions() as s:
            revoke_token(s, name="inference")
        assert_problem(bundle(bearer(reader)), 401, text="revoked")  # at once

    # bound to anything but loopback: status reads need a token (any scope) too
    with make_client(db_url, host="0.0.0.0") as remote:
        assert_problem(remote.get("/v1/jobs"), 401)
        assert_problem(remote.post("/v1/derivations", json={"spec": SOFTMAX}), 401)
        assert remote.get("/v1/jobs", headers=bearer(writer)).status_code == 200
        assert remote.get("/v1/jobs", headers=bearer(admin)).status_code == 200
        assert remote.get("/healthz").status_code == 200 and remote.get("/openapi.json").status_code == 200


def test_non_loopback_app_without_tokens_refuses_everything_but_health(db_url) -> None:
    with make_client(db_url, host="0.0.0.0") as remote:
        assert_problem(remote.post("/v1/jobs", json=job_body()), 401)
        assert_problem(remote.get("/v1/jobs"), 401)
        assert remote.get("/healthz").status_code == 200


@pytest.mark.parametrize("service_db_url", ["sqlite"], indirect=True)
def test_token_cli_and_serve_refusing_a_public_bind_without_tokens(db_url, capsys) -> None:
    from service.cli import main

    assert main(["serve", "--db", db_url, "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "needs API tokens" in capsys.readouterr().err
    assert main(["token", "create", "--db", db_url, "--name", "ci", "--scopes", "jobs:write,kernels:read"]) == 0
    captured = capsys.readouterr()
    secret = captured.out.strip()
    assert secret.startswith("fw_") and "shown only now" in captured.err
    assert main(["token", "create", "--db", db_url, "--name", "x", "--scopes", "root"]) == 2
    assert "unknown scope 'root'" in capsys.readouterr().err
    assert main(["token", "list", "--db", db_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["scopes"], t["revoked"]) for t in listed] == [("ci", ["jobs:write", "kernels:read"], False)]
    assert secret not in json.dumps(listed)
    with make_client(db_url) as client:
        assert client.post("/v1/jobs", json=job_body(), headers=bearer(secret)).status_code == 202
        assert main(["token", "revoke", "--db", db_url, "--name", "ci"]) == 0
        assert_problem(client.post("/v1/jobs", json=job_body(), headers=bearer(secret)), 401, text="revoked")
    assert main(["token", "revoke", "--db", db_url, "--name", "ci"]) == 2  # nothing active left


# ----------------------------------------------------------------------------- metrics and logs


def test_metrics_count_requests_and_read_jobs_from_the_database(client, sessions) -> None:
    client.post("/v1/jobs", json=job_body())
    client.get("/v1/jobs")
    with sessions() as s:
        s.execute(sa.update(Job).values(status="failed", dedupe_key=None))
        s.commit()
    text = client.get("/metrics").text
    assert 'foldwise_jobs{status="failed"} 1.0' in text and 'foldwise_jobs{status="queued"} 0.0' in text
    assert 'foldwise_http_request_duration_seconds_count{method="POST",route="/v1/jobs",status="2xx"} 1.0' in text
    assert 'route="/v1/jobs/{job_id}"' not in text or "route=\"/v1/jobs/" + "a" not in text  # templates, not ids
    assert "foldwise_trials{state=\"complete\"} 0.0" in text and "foldwise_workers_alive 0.0" in text


def test_request_logs_are_json_lines(client) -> None:
    from service.logs import configure_logging

    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        client.get("/v1/jobs", params={"status": "queued"})
        client.get("/v1/jobs/" + "b" * 32)
    finally:
        logging.getLogger("foldwise").handlers.clear()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    requests = [x for x in lines if x["msg"] == "request"]
    assert [(x["method"], x["route"], x["status"]) for x in requests] == [
        ("GET", "/v1/jobs", 200), ("GET", "/v1/jobs/{job_id}", 404)]
    assert all(x["level"] == "info" and x["duration_ms"] >= 0 and len(x["request_id"]) == 16 for x in requests)


def test_concurrent_reads_while_a_writer_holds_the_database(db_url, sessions) -> None:
    """API reads go through their own connections: a long write transaction (SQLite's write
    lock) does not stall them."""
    kernel_id = store_kernel(sessions)
    with make_client(db_url) as client:
        holder = sessions()
        holder.execute(sa.update(Job).values(error="x"))  # takes the write lock (SQLite) / row locks
        try:
            done = threading.Event()

            def read() -> None:
                assert client.get("/v1/jobs").status_code == 200
                assert client.get(f"/v1/kernels/{kernel_id}/bundle").status_code == 200
                done.set()

            t = threading.Thread(target=read)
            t.start()
            assert done.wait(10), "reads waited for a writer"
            t.join()
        finally:
            holder.rollback()
            holder.close()


def test_a_spec_whose_certificate_fails_is_refused_unless_the_request_allows_it(client, sessions) -> None:
    """A stored derivation whose certificate failed (here: softmax with den's correction dropped, a
    wrong fused form) answers 422 naming the reduction, unless ``allow_uncertified``; a later request
    without the flag is refused even though a job exists."""
    import dataclasses

    import sympy as sp

    from fuser_core.canonical import canonical_json
    from fuser_core.certificate import certify
    from fuser_core.derive import derive_cascade
    from fuser_core.present import present
    from service.store.models import SpecRecord

    spec = load_spec(SOFTMAX)
    wrong = derive_cascade(spec)
    wrong.forms["den"] = dataclasses.replace(wrong.forms["den"], corrections=(sp.Integer(1),))
    wrong.realise("den")
    report = present(wrong, certify(wrong, trials=4))
    assert report["certificate"]["holds"] is False and report["certificate"]["failed"] == ["den"]
    shash = compute_spec_hash(spec)
    with sessions() as s:
        s.add(SpecRecord(spec_hash=shash, name=spec.name, canonical=canonical_json(spec), source=json.dumps(SOFTMAX),
                         derivation=report))
        s.commit()
    den = [st["name"] for st in SOFTMAX["steps"]].index("den")
    body = assert_problem(client.post("/v1/jobs", json=job_body()), 422, f"spec.steps[{den}]", "allow_uncertified")
    assert "den" in body["detail"] and body["errors"][0]["step"] == "den"
    assert client.get("/v1/jobs").json()["jobs"] == []  # nothing queued
    allowed = client.post("/v1/jobs", json=job_body(allow_uncertified=True))
    assert allowed.status_code == 202 and allowed.json()["status"] == "queued"
    assert_problem(client.post("/v1/jobs", json=job_body()), 422, f"spec.steps[{den}]")  # the job exists: still refused
    assert client.get(f"/v1/specs/{shash}").json()["derivation"]["certificate"]["holds"] is False
