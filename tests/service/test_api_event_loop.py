"""What the API's event loop is spared per request (issue 26: a cheap GET stays fast while
derivations are refused; benchmarks/derivation_flood.py measures it):

- no dependency of these routes runs in the thread pool (FastAPI runs a plain ``def``
  dependency there: a thread hop, and a wait for the GIL back while another thread computes,
  on every request);
- ``POST /v1/derivations`` parses its spec in a child process (service/api/spec_child.py), not
  in the API's (ten large specs at once held the GIL against the event loop): still 422 naming
  the field and step for an invalid spec, without a derivation's slot; within the one deadline;
- ``POST /v1/jobs`` checks its request (the spec parsed, every field bound) in that child too
  (issue 37, 2: a flood of new jobs held a cheap GET's p99 at 2.0-3.1x idle), and storing the spec
  does not parse it again;
- the derivations' CPU-bound children leave a core free by default (two on a 2-core machine
  kept both busy, and the API's threads waited behind them on every wake-up).
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import time

import fastapi.dependencies.utils
import fuser_core.spec
from fastapi.testclient import TestClient

from fuser_core.report import clear_cache, derivation_report
from fuser_core.spec import load_spec
from service.api import create_app
from service.settings import default_derive_workers, get_settings
from tests.support.catalog import load_catalog
from tests.support.slow_specs import slow_spec

SOFTMAX = load_catalog()["safe_softmax"]


def _renamed(raw: dict, names: dict[str, str]) -> dict:
    """``raw`` with its names replaced (the same canonical spec: one cache entry)."""
    text = json.dumps(raw)
    for old, new in names.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return json.loads(text)


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _counting_parses(deriver, monkeypatch) -> list[int]:
    """The derivations' forkserver started (its children import fuser_core before the count begins),
    then a list that grows by one for each spec parsed in this process, in any thread."""
    deriver.warm_up(wait=True)
    parses: list[int] = []
    real = fuser_core.spec._Loader.load
    monkeypatch.setattr(fuser_core.spec._Loader, "load", lambda self: parses.append(1) or real(self))
    return parses


def test_no_dependency_runs_in_the_thread_pool(db_url, monkeypatch) -> None:
    hops: list[str] = []
    real = fastapi.dependencies.utils.run_in_threadpool

    async def counted(call, *args, **kwargs):
        hops.append(getattr(call, "__qualname__", repr(call)))
        return await real(call, *args, **kwargs)

    monkeypatch.setattr(fastapi.dependencies.utils, "run_in_threadpool", counted)
    with TestClient(create_app(get_settings(db_url=db_url))) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/jobs").status_code == 200
        assert c.get("/v1/workers").status_code == 200
        assert c.post("/v1/derivations", json={"spec": load_catalog()["safe_softmax"]}).status_code == 200
    assert hops == [], hops


def test_a_derivation_request_parses_its_spec_in_a_child_process(db_url, monkeypatch) -> None:
    """Nothing parses a spec in the API's process for POST /v1/derivations (counted at the
    parser's entry, in every thread): the answers are those of an in-process parse, a renamed
    spec hits the cached report in its own names, and errors name the field and the step."""
    clear_cache()
    renamed = _renamed(SOFTMAX, {"mx": "peak", "den": "total"})
    expected = derivation_report(load_spec(SOFTMAX)), derivation_report(load_spec(renamed))
    assert expected[1]["spec_hash"] == expected[0]["spec_hash"] and "peak" in json.dumps(expected[1])
    assert "peak" not in json.dumps(expected[0])
    bad = copy.deepcopy(SOFTMAX)
    bad["steps"][1]["expr"] = "exp(x - q)"
    clear_cache()
    with TestClient(create_app(get_settings(db_url=db_url))) as c:
        deriver = c.app.state.ctx.deriver
        parses = _counting_parses(deriver, monkeypatch)
        first = c.post("/v1/derivations", json={"spec": SOFTMAX})
        assert first.status_code == 200 and first.json() == expected[0], first.text[:300]
        other = c.post("/v1/derivations", json={"spec": renamed})  # cached: a rename here, no derivation
        assert other.status_code == 200 and other.json() == expected[1], other.text[:300]
        r = c.post("/v1/derivations", json={"spec": bad})
        assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
        error = r.json()["errors"][0]
        assert error["field"] == "spec.steps[1].expr" and error["step"] == "den" and "'q'" in error["message"]
        assert c.post("/v1/derivations", json={"spec": json.dumps(SOFTMAX)}).json() == expected[0]  # JSON text
        assert c.post("/v1/derivations", json={"spec": "safe_softmax"}).json() == expected[0]  # a catalog name
        assert parses == [], "a spec was parsed in the API's process"
        assert deriver.parser.started == 1 and deriver.killed == 0


def test_a_job_request_is_checked_in_a_child_process(db_url, monkeypatch) -> None:
    """POST /v1/jobs parses nothing in the API's process, for a new spec and an identical request;
    a bad field and a bad spec are still 422 naming them; a catalog name is read each time."""
    clear_cache()
    body = {"spec": slow_spec(3, tag=37), "shape": {"m": 4, "n": 64}, "budget": {"trials": 2}, "measurer": "model"}
    with TestClient(create_app(get_settings(db_url=db_url))) as c:
        deriver = c.app.state.ctx.deriver
        parses = _counting_parses(deriver, monkeypatch)
        first = c.post("/v1/jobs", json=body)
        assert first.status_code == 202, first.text[:300]
        again = c.post("/v1/jobs", json=body)  # the same request: the same job
        assert again.status_code in (200, 202) and again.json()["id"] == first.json()["id"]
        r = c.post("/v1/jobs", json={**body, "shape": {"m": 4}})
        assert r.status_code == 422 and any(e["field"].startswith("shape") for e in r.json()["errors"]), r.text[:300]
        bad = copy.deepcopy(body)
        bad["spec"]["steps"][1]["expr"] = "exp(x - q)"
        r = c.post("/v1/jobs", json=bad)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.steps[1].expr", r.text[:300]
        named = c.post("/v1/jobs", json={**body, "spec": "safe_softmax", "shape": {"m": 4, "n": 64}})
        assert named.status_code == 202, named.text[:300]
        listed = c.get("/v1/jobs")  # the jobs' specs as stored, read without a parse
        assert listed.status_code == 200 and len(listed.json()["jobs"]) == 2, listed.text[:300]
        assert parses == [], "a job's spec was parsed in the API's process"
        assert deriver.parser.started == 1


def test_the_server_keeps_its_startup_heap_out_of_full_collections(db_url, monkeypatch) -> None:
    """A full collection of the API's startup heap (sympy, the derivation: 130k objects) takes ~80 ms on
    the event loop on this machine; ``foldwise serve`` freezes it before serving (service.serve)."""
    import gc

    import service.serve as serve

    ran: list[int] = []

    class NoServer:
        def __init__(self, config) -> None:
            pass

        def run(self) -> None:
            ran.append(gc.get_freeze_count())

    monkeypatch.setattr(serve, "_Server", NoServer)
    monkeypatch.setattr(serve, "_shutdown_on_signals", lambda server, tuning=None: {})
    gc.unfreeze()
    try:
        serve._serve_here(get_settings(db_url=db_url), "warning")
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert ran and ran[0] > 10_000, ran


def test_an_invalid_spec_is_answered_422_while_every_derivation_slot_is_taken(db_url) -> None:
    """The parse needs no derivation slot: with the pool (1) busy and no queue, a bad spec is
    still 422 naming the field, at once (a valid new spec would be 429)."""
    clear_cache()
    settings = get_settings(db_url=db_url, derive_workers=1, derive_queue=0)
    with TestClient(create_app(settings, derive_timeout_s=3.0)) as c:
        deriver = c.app.state.ctx.deriver
        deriver.warm_up(wait=True)
        first: list = []
        t = threading.Thread(target=lambda: first.append(c.post("/v1/derivations", json={"spec": slow_spec(45)})))
        t.start()
        deadline = time.monotonic() + 10
        while not deriver.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert deriver.running
        bad = copy.deepcopy(SOFTMAX)
        bad["steps"][0]["expr"] = "x.__class__"
        t0 = time.monotonic()
        r = c.post("/v1/derivations", json={"spec": bad})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.steps[0].expr", r.text
        assert time.monotonic() - t0 < 1.5 and deriver.running  # not after the slow one's deadline
        busy = c.post("/v1/derivations", json={"spec": slow_spec(45, tag=1)})
        assert busy.status_code == 429, busy.text[:300]
        t.join(30)
        assert first[0].status_code == 503, first[0].text[:300]  # ~10 s of derivation: stopped at 3 s


def test_a_parse_past_its_deadline_answers_503_and_its_child_is_replaced(db_url) -> None:
    """The parse counts against the request's one deadline: past it the parsing child is killed
    (its late answer must not be the next request's) and the next request starts another."""
    clear_cache()
    with TestClient(create_app(get_settings(db_url=db_url))) as c:
        deriver = c.app.state.ctx.deriver
        deriver.warm_up(wait=True)
        assert c.post("/v1/derivations", json={"spec": SOFTMAX}).status_code == 200
        old = deriver.parser._proc.pid
        deriver.timeout_s = 0.0  # this request's deadline has passed when its parse is asked for
        r = c.post("/v1/derivations", json={"spec": slow_spec(45)})
        assert r.status_code == 503 and r.json()["type"].endswith("derivation-timeout"), r.text
        assert int(r.headers["retry-after"]) >= 1 and _gone(old)
        deriver.timeout_s = 30.0
        bad = copy.deepcopy(SOFTMAX)
        bad["stpes"] = []
        r = c.post("/v1/derivations", json={"spec": bad})  # answered by the new child, not the old one's late answer
        assert r.status_code == 422 and "stpes" in r.text, r.text
        assert deriver.parser.started == 2 and deriver.parser._proc.pid != old


def test_derivations_leave_a_core_free_by_default(monkeypatch) -> None:
    monkeypatch.delenv("FOLDWISE_DERIVE_WORKERS", raising=False)
    for cores, workers in ((1, 1), (2, 1), (3, 2), (64, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert default_derive_workers() == workers, cores
        assert get_settings().derive_workers == workers
    monkeypatch.setenv("FOLDWISE_DERIVE_WORKERS", "4")  # the operator's choice stands
    assert get_settings().derive_workers == 4


def _answer_after(conn, size: int, delay_s: float) -> None:  # a child process: one large answer
    time.sleep(delay_s)
    conn.send("x" * size)


def _child_answer(run, size: int, delay_s: float = 0.1, within_s: float = 20.0):
    import multiprocessing

    from service.api.child_pipe import receive

    context = multiprocessing.get_context("spawn")
    conn, theirs = context.Pipe(duplex=False)
    child = context.Process(target=_answer_after, args=(theirs, size, delay_s), daemon=True)
    child.start()
    theirs.close()
    try:
        return run(receive(conn, time.monotonic() + within_s))
    finally:
        child.kill()
        child.join(10)
        conn.close()


def test_a_child_answer_larger_than_the_pipe_is_read_whole_under_uvloop() -> None:
    """Issue 37, 1: uvloop's add_reader leaves the pipe non-blocking, and Connection.recv() of a
    message over the pipe's 64 KB raised BlockingIOError halfway (a 500 on ``foldwise serve``; the
    TestClient's asyncio loop never showed it). Read through service.api.child_pipe, a 1 MB answer
    arrives whole on uvloop and on asyncio's loop."""
    import asyncio

    import uvloop

    for run in (uvloop.run, asyncio.run):
        assert _child_answer(run, 1 << 20) == "x" * (1 << 20)


def test_a_child_answer_past_its_deadline_raises_timeout() -> None:
    import uvloop

    started = time.monotonic()
    try:
        _child_answer(uvloop.run, 10, delay_s=30, within_s=0.5)
    except TimeoutError:
        pass
    else:
        raise AssertionError("no TimeoutError")
    assert time.monotonic() - started < 10
