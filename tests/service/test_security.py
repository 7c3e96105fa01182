"""Security of the HTTP API beyond test_api.py's auth matrix:

- **every route, from the app's own route table**: each ``/v1`` route declares the auth scope
  the policy gives it (a write: ``jobs:write``; a kernel read: ``kernels:read``; else a status
  read), and answers missing, wrong, revoked and under-scoped tokens accordingly; a new route
  without its scope check fails here without anyone remembering to add it;
- tokens are stored hashed (the secret is nowhere in the database file), looked up by hash and
  compared with ``hmac.compare_digest``;
- path and query identifiers: traversal, SQL-ish, NUL, non-ASCII and over-long values answer
  404/422 (problem+json), never 500, on every route with a path parameter;
- resource limits: a body over the limit answers 413 at once (declared length, and chunked
  without a length) from a live server; a slow derivation runs in a child process, so
  ``/healthz`` answers at once meanwhile, the request gets 503 at its deadline (the child
  killed), and a client that leaves stops its derivation;
- headers: two ``Authorization`` headers are 400 on every route; every answer has ``nosniff``;
  JSON nested 5,000 deep is 422 naming ``body``.
"""

from __future__ import annotations

import hmac
import inspect
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from service import auth
from service.api import create_app
from service.api.app import MAX_BODY_BYTES
from service.auth import create_token, revoke_token
from service.store.db import upgrade
from service.store.models import ApiToken
from service.settings import get_settings
from tests.support.catalog import load_catalog
from tests.support.servers import LiveServer
from tests.support.slow_specs import slow_spec

SOFTMAX = load_catalog()["safe_softmax"]
PROBLEM = "application/problem+json"
HEX32, HEX64 = "a" * 32, "a" * 64


def make_app(db_url: str, **kwargs):
    settings = get_settings(db_url=db_url, host=kwargs.pop("host", "127.0.0.1"))
    return create_app(settings, **kwargs)


# ----------------------------------------------------------------------------- the route table


def policy_scope(method: str, path: str) -> str | None:
    """The scope the auth policy (service/auth.py) gives a route: what this test expects."""
    if method != "GET" and path not in ("/v1/derivations", "/v1/backward"):  # these compute and store nothing
        return "jobs:write"
    if path.startswith(("/v1/kernels", "/v1/dashboard/kernels")) or path == "/v1/specs/{spec_hash}/source":
        return "kernels:read"  # the source route serves tuned kernels' source
    return None


def declared_scope(route: APIRoute) -> tuple[bool, str | None]:
    """(has the auth dependency, its scope) from the route's dependency tree."""
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        call = dep.call
        if getattr(call, "__qualname__", "") == "database.<locals>.dependency":
            return True, inspect.getclosurevars(call).nonlocals["scope"]
        stack.extend(dep.dependencies)
    return False, None


def all_routes(routes) -> list:
    """The app's routes, through included routers (FastAPI >= 0.16x keeps them nested)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        out.extend(all_routes(inner.routes) if inner is not None else [route])
    return out


def v1_routes(app) -> list[tuple[str, str, APIRoute]]:
    out = []
    for route in all_routes(app.routes):
        if isinstance(route, APIRoute) and route.path.startswith("/v1"):
            for method in sorted(route.methods - {"HEAD"}):
                out.append((method, route.path, route))
    return out


def fill(path: str) -> str:
    return (path.replace("{job_id}", HEX32).replace("{kernel_id}", HEX32).replace("{spec_hash}", HEX64)
            .replace("{arch}", "sm_90a").replace("{filename}", "kernel.cubin"))


def request_for(method: str, path: str) -> dict:
    """A well-formed request for the route (so only auth can refuse it)."""
    kwargs: dict = {}
    if path == "/v1/jobs" and method == "POST":
        kwargs["json"] = {"spec": SOFTMAX, "shape": {"m": 4, "n": 64}, "dtype": "float32", "target": "h100",
                          "measurer": "model", "budget": {"trials": 4, "seconds": 60}}
    elif path in ("/v1/derivations", "/v1/backward"):
        kwargs["json"] = {"spec": SOFTMAX}
    if path == "/v1/kernels":
        kwargs["params"] = {"spec_hash": HEX64}
    return kwargs


def test_every_v1_route_declares_the_scope_the_policy_gives_it(tmp_path) -> None:
    db_url = f"sqlite:///{tmp_path / 'f.db'}"
    upgrade(db_url)
    app = make_app(db_url)
    routes = v1_routes(app)
    assert len(routes) >= 15
    for method, path, route in routes:
        has_auth, scope = declared_scope(route)
        assert has_auth, f"{method} {path} has no auth dependency (service.api.deps.database)"
        assert scope == policy_scope(method, path), (method, path, scope)


def test_missing_wrong_revoked_and_underscoped_tokens_on_every_route(db_url, sessions) -> None:
    with sessions() as s:
        _, writer = create_token(s, "writer", "jobs:write")
        _, reader = create_token(s, "reader", "kernels:read")
        _, admin = create_token(s, "admin", "admin")
        _, gone = create_token(s, "gone", "admin")
        revoke_token(s, name="gone")
    scoped = {"jobs:write": (writer, reader), "kernels:read": (reader, writer)}  # (enough, not enough)
    with TestClient(make_app(db_url)) as client:
        checked = 0
        for method, path, _ in v1_routes(client.app):
            url, kwargs, scope = fill(path), request_for(method, path), policy_scope(method, path)

            def send(secret: str | None, method=method, url=url, kwargs=kwargs):
                headers = {"Authorization": f"Bearer {secret}"} if secret else {}
                return client.request(method, url, headers=headers, **kwargs)

            where = f"{method} {path}"
            for secret, why in ((f"fw_{'x' * 43}", "invalid token"), (gone, "revoked")):
                r = send(secret)
                assert r.status_code == 401 and why in r.text, (where, r.status_code, r.text)
                assert r.headers["content-type"].startswith(PROBLEM) and r.headers["www-authenticate"]
            if scope is None:  # a status read: open on loopback, any valid token works
                for secret in (None, writer, reader):
                    assert send(secret).status_code not in (401, 403), where
            else:
                enough, not_enough = scoped[scope]
                r = send(None)
                assert r.status_code == 401 and scope in r.text, (where, r.status_code, r.text)
                r = send(not_enough)
                assert r.status_code == 403 and scope in r.text, (where, r.status_code, r.text)
                assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
                for secret in (enough, admin):
                    assert send(secret).status_code not in (401, 403, 500), where
            checked += 1
        assert checked >= 15

    # bound to anything but loopback: every /v1 route needs a valid token
    with TestClient(make_app(db_url, host="0.0.0.0")) as remote:
        for method, path, _ in v1_routes(remote.app):
            r = remote.request(method, fill(path), **request_for(method, path))
            assert r.status_code == 401, (method, path, r.status_code)


# ----------------------------------------------------------------------------- token storage


@pytest.mark.parametrize("service_db_url", ["sqlite"], indirect=True)
def test_tokens_are_stored_hashed_and_compared_in_constant_time(db_url, sessions, monkeypatch) -> None:
    with sessions() as s:
        _, secret = create_token(s, "ci", "jobs:write,kernels:read")
        row = s.scalars(sa.select(ApiToken)).one()
        values = [str(getattr(row, c.key)) for c in ApiToken.__table__.columns]
    assert secret.startswith("fw_") and len(secret) > 40
    assert not any(secret in v or secret[3:] in v for v in values)  # no column holds the secret
    assert row.token_hash == auth.hash_token(secret)
    # nor does any byte of the database file (or its WAL)
    path = Path(sa.engine.make_url(db_url).database)
    for f in [path, *path.parent.glob(path.name + "-*")]:
        assert secret[3:].encode() not in f.read_bytes(), f

    # looked up by hash (an index lookup), then compared with hmac.compare_digest
    assert "token_hash" in str(auth._TOKEN_ROW.whereclause)
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    with TestClient(make_app(db_url)) as client:
        assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
        assert client.get("/v1/kernels/" + HEX32 + "/bundle",
                          headers={"Authorization": f"Bearer {secret}"}).status_code == 404  # the fast path too
    assert len(compared) >= 2 and all(a == b == auth.hash_token(secret) for a, b in compared)


# ----------------------------------------------------------------------------- identifiers


NASTY = ["..", "../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f", "a" * 31 + "%00",
         "' OR '1'='1", "1;DROP TABLE jobs;--", "%27%20OR%201=1--", "\u00e9" * 32, "A" * 32, "a" * 10_000,
         "%C0%AE%C0%AE", "a" * 32 + "%0a", "*", "%", "%25", "~", "a" * 64 + "/../" + "a" * 32]


def test_path_identifiers_never_reach_the_database_or_500(db_url, sessions) -> None:
    with TestClient(make_app(db_url)) as client:
        with sessions() as s:
            before = s.execute(sa.text("SELECT count(*) FROM jobs")).scalar()
        n = 0
        for method, path, _ in v1_routes(client.app):
            if "{" not in path:
                continue
            name = path[path.index("{") + 1:path.index("}")]
            for value in NASTY:
                url = path.replace("{" + name + "}", value)
                r = client.request(method, url, **request_for(method, path))
                assert r.status_code in (404, 405, 422), (method, url[:120], r.status_code, r.text[:300])
                assert r.headers["content-type"].startswith(PROBLEM), (method, url[:120])
                n += 1
        for key, value in (("spec_hash", "' OR 1=1--"), ("spec_hash", HEX64 * 100), ("shape", "m=1," * 5000),
                           ("dtype", "{" * 3000), ("target", "x" * 5000), ("shape", "m=99999999999999999999")):
            r = client.get("/v1/kernels", params={"spec_hash": HEX64, key: value})
            assert r.status_code in (404, 422), (key, r.status_code, r.text[:300])
        assert n > 100
        # a NUL byte in any query parameter (issue 37, 6: target=h1%0000 answered 500 on PostgreSQL)
        for path, params in (("/v1/kernels", {"spec_hash": HEX64, "target": "h1\x0000"}),
                             ("/v1/jobs", {"target": "h\x00100"}), ("/v1/jobs", {"status": "qu\x00eued"}),
                             ("/v1/dashboard/kernels", {"target": "h\x00100"}),
                             ("/v1/dashboard/kernels", {"dtype": "float\x0032"}),
                             ("/v1/dashboard/specs", {"hash": "ab\x00cd"})):
            r = client.get(path, params=params)
            assert r.status_code == 422, (path, params, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith(PROBLEM)
        r = client.get("/v1/jobs", params={"target": "h1\x0000"})
        assert r.json()["errors"][0]["loc"] == ["query"], r.text
        with sessions() as s:
            assert s.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == before


# ----------------------------------------------------------------------------- resource limits


def test_a_huge_body_is_refused_at_once_by_a_live_server(tmp_path) -> None:
    from tests.support.servers import LiveServer

    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path)
    try:
        # a declared length over the limit: answered before any body byte is sent
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(b"POST /v1/derivations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000000\r\n\r\n")
            head = sock.recv(4096)
            assert time.monotonic() - t0 < 2
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert PROBLEM.encode() in head

        # chunked, no length: refused once the limit is passed, while the client is still sending
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            block = b" " * 65536
            t0 = time.monotonic()
            for _ in range(MAX_BODY_BYTES // len(block) + 2):  # just past the limit; the body never ends
                sock.sendall(b"%x\r\n" % len(block) + block + b"\r\n")
            head = sock.recv(4096)
            assert time.monotonic() - t0 < 2
        assert head.startswith(b"HTTP/1.1 413"), head[:300]
        # a chunked body under the limit still works
        r = httpx.post(server.base + "/v1/derivations", content=iter([b'{"spec": ', json.dumps(SOFTMAX).encode(), b"}"]),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert httpx.get(server.base + "/healthz", timeout=5).status_code == 200
        assert MAX_BODY_BYTES < 1024 * 1024
    finally:
        server.stop()


def test_a_slow_derivation_leaves_the_server_responsive(db_url) -> None:
    """Slow derivations (tests/support/slow_specs.py: seconds of sympy and certificate) run in
    child processes, not in the API's threads: /healthz and a job list answer meanwhile, and
    each request gets 503 at its deadline, not when its derivation would have ended."""
    settings = get_settings(db_url=db_url, derive_workers=2)  # not the default: one on a 2-core machine
    with TestClient(create_app(settings, derive_timeout_s=2.5)) as client:
        client.app.state.ctx.deriver.warm_up(wait=True)  # the forkserver's imports: not within the deadline
        results: list = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            (time.monotonic(), client.post("/v1/derivations", json={"spec": slow_spec(30, tag=i)}))))
            for i in range(3)]  # more than the derivation pool's two children
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.3)
        for _ in range(10):
            assert client.get("/healthz").status_code == 200
            assert client.get("/v1/jobs").status_code == 200
            time.sleep(0.1)
        for t in threads:
            t.join(30)
        assert len(results) == 3
        for done, r in results:
            assert r.status_code == 503 and r.headers["content-type"].startswith(PROBLEM), r.text
            assert r.json()["type"].endswith("derivation-timeout") and r.headers["retry-after"]
            assert done - t0 < 15  # at the deadline (2.5 s), not after the ~5 s derivation
        deriver = client.app.state.ctx.deriver
        assert deriver.killed >= 2 and not deriver.running  # the queued third may never have started


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.add(child)
            stack.append(child)
    return out


def test_a_derivation_stops_when_its_client_leaves(tmp_path, monkeypatch) -> None:
    """A live server: a client posts a slow spec and disconnects; its derivation's child
    process is killed at once (not at the 60 s deadline), and the access log says 499."""
    monkeypatch.setenv("FOLDWISE_DERIVE_TIMEOUT_SECONDS", "60")
    server = LiveServer(f"sqlite:///{tmp_path / 'gone.db'}", tmp_path)
    try:
        httpx.post(server.base + "/v1/derivations", json={"spec": SOFTMAX}, timeout=60)  # the forkserver is up
        before = _descendants(server.proc.pid)
        body = json.dumps({"spec": slow_spec(45)}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/derivations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 20
            while not _descendants(server.proc.pid) - before and time.monotonic() < deadline:
                time.sleep(0.05)
            child = _descendants(server.proc.pid) - before
            assert child, "no derivation process started"
        left = time.monotonic()  # the client has gone
        while _descendants(server.proc.pid) & child and time.monotonic() < left + 10:
            time.sleep(0.05)
        assert not _descendants(server.proc.pid) & child, "the derivation went on after its client left"
        assert time.monotonic() - left < 10
        deadline = time.monotonic() + 10
        while '"status": 499' not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "a derivation's client has gone" in server.log() and "derivation stopped" in server.log()
        assert '"status": 499' in server.log()
        assert httpx.get(server.base + "/healthz", timeout=5).status_code == 200
    finally:
        server.stop()


# ----------------------------------------------------------------------------- headers


@pytest.mark.parametrize("fast_path", [True, False])
def test_two_authorization_headers_are_refused_on_every_route(db_url, sessions, fast_path) -> None:
    """A wrong token then a valid one (or the reverse) is 400 naming the header on every route,
    the bundle download's fast path included: no route may pick one of the two."""
    with sessions() as s:
        _, admin = create_token(s, "admin", "admin")
    app = make_app(db_url, fast_path=fast_path)
    with TestClient(app) as client:
        paths = [(m, p) for m, p, _ in v1_routes(app)] + [("GET", "/healthz"), ("GET", "/metrics"),
                                                           ("GET", "/v1/kernels/" + HEX32 + "/bundle")]
        for method, path in paths:
            for pair in ((f"fw_{'x' * 43}", admin), (admin, f"fw_{'x' * 43}"), (admin, admin)):
                headers = [("Authorization", f"Bearer {pair[0]}"), ("Authorization", f"Bearer {pair[1]}")]
                r = client.request(method, fill(path), headers=headers, **request_for(method, path))
                assert r.status_code == 400, (method, path, r.status_code, r.text[:200])
                assert r.headers["content-type"].startswith(PROBLEM)
                assert r.json()["errors"][0]["field"] == "Authorization", r.text
        one = client.get("/v1/kernels/" + HEX32 + "/bundle", headers={"Authorization": f"Bearer {admin}"})
        assert one.status_code == 404  # one header: read as usual


def test_answers_carry_nosniff(client_app) -> None:
    client = client_app
    for method, path, kwargs in (("GET", "/healthz", {}), ("GET", "/v1/jobs", {}), ("GET", "/nowhere", {}),
                                 ("POST", "/v1/derivations", {"json": {"spec": 42}}),
                                 ("GET", "/v1/kernels/" + HEX32 + "/bundle", {}), ("GET", "/metrics", {})):
        r = client.request(method, path, **kwargs)
        assert r.headers["x-content-type-options"] == "nosniff", (method, path, r.status_code)


@pytest.fixture()
def client_app(db_url):
    with TestClient(make_app(db_url)) as c:
        yield c


def test_json_nested_5000_deep_names_the_body(client_app) -> None:
    for path in ("/v1/derivations", "/v1/jobs"):
        deep = b'{"spec": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        r = client_app.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.headers["content-type"].startswith(PROBLEM), r.text[:300]
        assert r.json()["errors"][0]["field"] == "body" and "nested too deeply" in r.json()["detail"]
