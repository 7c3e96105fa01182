"""A new user's first hour against the API (issue 26, items 7, 10-12): a job nobody can run says
so, spec hash prefixes, catalog names in ``spec``, and the caller's own dim names in what
people read (``display_shape``, ``best.config.blocks``, trial configs).

Same set-up as test_api.py: TestClient over a migrated database (SQLite and PostgreSQL).
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import sqlalchemy as sa

from fuser_core.canonical import spec_hash as compute_spec_hash
from fuser_core.spec import load_spec
from service.store import job_queue, spec_store
from service.store.models import Job, SpecRecord, WorkerRecord, utcnow
from tests.service.test_api import SOFTMAX, assert_problem, client, job_body  # noqa: F401  (client: the fixture)


def _register(sessions, worker_id: str, target: str, measurer: str = "model") -> None:
    with sessions() as s:
        job_queue.register_worker(s, worker_id, hostname="h", gpu_name=None, target=target, measurer=measurer,
                                  versions={"python": "3"})


# ----------------------------------------------------------------------------- a job nobody can run


def test_a_job_for_a_target_no_live_worker_serves_warns_until_one_registers(client, sessions) -> None:
    _register(sessions, "w-h100", "h100")  # a live worker, for another target
    r = client.post("/v1/jobs", json=job_body(target="a100"))
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued"
    assert len(job["warnings"]) == 1 and "no live worker takes target a100" in job["warnings"][0], job["warnings"]
    assert "--targets a100" in job["warnings"][0]  # says how to start one
    assert client.get(job["url"]).json()["warnings"] == job["warnings"]
    listed = {j["id"]: j for j in client.get("/v1/jobs").json()["jobs"]}
    assert listed[job["id"]]["warnings"] == job["warnings"]

    # a job that a live worker takes: no warning
    served = client.post("/v1/jobs", json=job_body(target="h100")).json()
    assert served["warnings"] == []

    # a worker for a100 but another measurer still cannot take it, and says which measurer is missing
    _register(sessions, "w-a100-cuda", "a100", measurer="cuda")
    assert "with measurer model" in client.get(job["url"]).json()["warnings"][0]

    _register(sessions, "w-a100", "a100")  # computed when read: the warning goes once a worker registers
    assert client.get(job["url"]).json()["warnings"] == []

    # a worker whose heartbeat is older than the lease is not live: the warning comes back
    with sessions() as s:
        s.execute(sa.update(WorkerRecord).where(WorkerRecord.target == "a100")
                  .values(last_heartbeat=utcnow() - timedelta(hours=1)))
        s.commit()
    assert "no live worker takes target a100" in client.get(job["url"]).json()["warnings"][0]


# ----------------------------------------------------------------------------- hash prefixes


def test_spec_hash_prefixes_of_12_or_more_hex_characters_are_accepted(client) -> None:
    job = client.post("/v1/jobs", json=job_body()).json()
    full = job["spec_hash"]
    for n in (12, 16, 40):
        prefix = full[:n]
        assert client.get(f"/v1/specs/{prefix}").json()["spec_hash"] == full
        assert [j["id"] for j in client.get("/v1/jobs", params={"spec_hash": prefix}).json()["jobs"]] == [job["id"]]
        assert client.get(f"/v1/specs/{prefix}/math").json()["spec_hash"] == full  # the dashboard's own routes
        assert client.get("/v1/dashboard/kernels", params={"spec_hash": prefix}).status_code == 200
    # with the shape filter too (read against the resolved spec)
    listed = client.get("/v1/jobs", params={"spec_hash": full[:16], "shape": "m=4,n=64"}).json()["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]
    # a kernel lookup by prefix: 404 names the prefix asked for (nothing tuned yet), not a pattern error
    assert_problem(client.get("/v1/kernels", params={"spec_hash": full[:16], "shape": "m=4,n=64"}), 404)
    # too short, or not hex: 422 naming the field
    assert_problem(client.get("/v1/jobs", params={"spec_hash": full[:11]}), 422, "spec_hash")
    assert_problem(client.get(f"/v1/specs/{full[:11]}"), 422, "spec_hash")
    # a prefix no stored spec has: no jobs, and 404 for the spec
    other = "0" * 16 if not full.startswith("0" * 16) else "1" * 16
    assert client.get("/v1/jobs", params={"spec_hash": other}).json()["jobs"] == []
    assert_problem(client.get(f"/v1/specs/{other}"), 404)


def test_an_ambiguous_prefix_is_409_naming_the_field(client, sessions) -> None:
    stored = json.dumps(SOFTMAX)
    with sessions() as s:  # two specs whose hashes share 16 characters (made up: no sha256 collision needed)
        for tail in ("a" * 48, "b" * 48):
            s.add(SpecRecord(spec_hash="abcdef0123456789" + tail, name="x", canonical=stored, source=stored,
                             derivation={}))
        s.commit()
    body = assert_problem(client.get("/v1/specs/abcdef0123456789"), 409, "spec_hash", "ambiguous")
    assert body["errors"][0]["in"] == "path"
    assert_problem(client.get("/v1/jobs", params={"spec_hash": "abcdef012345"}), 409, "spec_hash", "ambiguous")
    assert_problem(client.get("/v1/specs/abcdef0123456789/math"), 409, "spec_hash", "ambiguous")
    # one more character decides it
    assert client.get("/v1/specs/abcdef0123456789a").json()["spec_hash"] == "abcdef0123456789" + "a" * 48
    with sessions() as s:  # the one resolver (the CLI's too), called directly
        assert spec_store.resolve_hash(s, "abcdef0123456789b") == "abcdef0123456789" + "b" * 48
        assert spec_store.resolve_hash(s, "f" * 64) == "f" * 64  # a full hash is taken as is, without a read
        assert spec_store.resolve_hash(s, "fedcba987654") is None


# ----------------------------------------------------------------------------- catalog names


def test_a_catalog_name_in_spec_is_the_catalog_spec(client) -> None:
    r = client.post("/v1/jobs", json=job_body(spec="safe_softmax"))
    assert r.status_code == 202, r.text
    assert r.json()["spec_hash"] == compute_spec_hash(load_spec(SOFTMAX))
    assert r.json()["display_shape"] == {"m": 4, "n": 64}  # the catalog spec's own names
    stored = client.get(f"/v1/specs/{r.json()['spec_hash']}").json()
    assert stored["spec"]["name"] == "safe_softmax"
    assert client.post("/v1/derivations", json={"spec": "safe_softmax"}).status_code == 200
    body = assert_problem(client.post("/v1/jobs", json=job_body(spec="safe_softmaks")), 422, "spec", "catalog names")
    assert "safe_softmax" in body["detail"]  # the list of names to choose from
    # a name is never a path on the server
    assert_problem(client.post("/v1/derivations", json={"spec": "/etc/passwd"}), 422, "spec")
    assert_problem(client.post("/v1/derivations", json={"spec": "../fuser_core/catalog/safe_softmax"}), 422, "spec")


def test_one_job_binds_a_dtype_per_input_and_index_inputs_take_int32_or_int64(client) -> None:
    """bf16 logits with int32 labels is one job (issue 24); int64 labels are another kernel, so
    another job; a float dtype for the labels is refused naming the input."""
    shape = {"t": 64, "v": 128}
    jobs = {}
    for labels in ("int32", "int64"):
        r = client.post("/v1/jobs", json=job_body(spec="cross_entropy_ignore", shape=shape,
                                                  dtype={"logits": "bfloat16", "target": labels}))
        assert r.status_code == 202, r.text
        jobs[labels] = r.json()
    assert jobs["int32"]["id"] != jobs["int64"]["id"]
    assert "int32" in json.dumps(jobs["int32"]["dtype"]) and "bfloat16" in json.dumps(jobs["int32"]["dtype"])
    body = assert_problem(client.post("/v1/jobs", json=job_body(spec="cross_entropy_ignore", shape=shape,
                                                               dtype={"logits": "bfloat16", "target": "float32"})),
                          422, "dtype.target")
    assert "index input 'target'" in body["detail"] and "int32, int64" in body["detail"]


# ----------------------------------------------------------------------------- the caller's names


def _renamed(raw: dict, names: dict[str, str]) -> dict:
    """``raw`` with its dims renamed (the same spec_hash: hashes are of the canonical form)."""
    text = json.dumps(raw)
    for old, new in names.items():
        text = text.replace(f'"{old}"', f'"{new}"')
    return json.loads(text)


def test_people_read_the_callers_dim_names(client, sessions) -> None:
    first = client.post("/v1/jobs", json=job_body()).json()  # safe_softmax: dims m, n
    assert first["display_shape"] == {"m": 4, "n": 64} and first["shape"] == {"d0": 4, "d1": 64}

    # a second caller spells the same spec with other names: their answer speaks theirs
    other = _renamed(copy.deepcopy(SOFTMAX), {"m": "rows", "n": "cols"})
    assert compute_spec_hash(load_spec(other)) == first["spec_hash"]
    second = client.post("/v1/jobs", json=job_body(spec=other, shape={"rows": 4, "cols": 64}))
    assert second.json()["id"] == first["id"]  # one job
    assert second.json()["display_shape"] == {"rows": 4, "cols": 64}
    assert client.get(first["url"]).json()["display_shape"] == {"m": 4, "n": 64}  # reads: the first stored names

    # best.config.blocks and trial configs: stored canonical (d0, d1), read in the spec's names
    with sessions() as s:
        job_queue.register_worker(s, "w-1", hostname="h", gpu_name=None, target="h100", measurer="model",
                                  versions={"python": "3"})
        job_queue.claim_job(s, "w-1", target="h100", measurer="model", lease_seconds=60)
        job_queue.record_trial(s, first["id"], "w-1", number=0, strategy="split_fused",
                               config={"blocks": {"d0": 1, "d1": 64}, "num_warps": 4}, time_ms=0.5, error=None,
                               state="complete", predicted=True, source="tpe", compile=None)
        assert s.get(Job, first["id"]).best["config"]["blocks"] == {"d0": 1, "d1": 64}  # stored canonical
    view = client.get(first["url"]).json()
    assert view["best"]["config"] == {"blocks": {"m": 1, "n": 64}, "num_warps": 4}
    trials = client.get(f"{first['url']}/trials").json()["trials"]
    assert trials[0]["config"] == {"blocks": {"m": 1, "n": 64}, "num_warps": 4}
    again = client.post("/v1/jobs", json=job_body(spec=other, shape={"rows": 4, "cols": 64})).json()
    assert again["best"]["config"]["blocks"] == {"rows": 1, "cols": 64}
