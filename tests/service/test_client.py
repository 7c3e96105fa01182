"""service/client/__init__.py's KernelCache against a fake kernel server (httpx.MockTransport).

The fake server follows docs/API.md: ``GET /v1/kernels?spec_hash=&target=&shape=&dtype=`` answers
a kernel view (exact match, else the nearest shape, marked), ``GET /v1/kernels/{id}/bundle`` the
bundle bytes with ``ETag`` = sha256 and ``304`` for a matching ``If-None-Match``. Bundles are
real ones from make_bundle; kernels run through Triton's interpreter.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tests.support.catalog import CATALOG_DIR, load_catalog

from fuser_core.canonical import spec_hash
from fuser_core.problem import make_problem
from fuser_core.reference import evaluate, random_inputs
from fuser_core.runner import bind_dtypes, to_torch
from fuser_core.spec import load_spec
from service.bundle import bundle_v1, canonical_bytes, shape_text
from service.bundle_maker import make_bundle
from service.client import (
    KernelAuthError,
    KernelCache,
    KernelIntegrityError,
    KernelNotFound,
    KernelServiceError,
    KernelTuningError,
    KernelTuningTimeout,
    TuningJob,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RAW = load_catalog()["safe_softmax"]
SPEC = load_spec(RAW)
SHAPE = {"m": 3, "n": 37}
BASE = "http://kernels.test"


def softmax_bundle(shape=SHAPE, time_ms=0.01) -> dict:
    return make_bundle(make_problem(SPEC, shape, "float32"), target="h100", strategy="streaming_fused",
                       config={"blocks": {"n": 8}}, measured={"time_ms": time_ms, "measurer": "model",
                                                              "date": "2025-01-01T00:00:00+00:00"})


BUNDLE = softmax_bundle()
OTHER_SHAPE_BUNDLE = softmax_bundle({"m": 2, "n": 16})


class FakeServer:
    """The two kernel endpoints over a dict of bundles, with switches for failures."""

    def __init__(self, *bundles: dict):
        self.kernels = {f"k{i}": b for i, b in enumerate(bundles)}
        self.served: dict[str, bytes] = {}  # kernel id -> bytes to serve instead (tampering)
        self.etags: dict[str, str] = {}  # kernel id -> ETag to send instead
        self.status: int | None = None  # answer every request with this status
        self.offline = False
        self.requests: list[httpx.Request] = []
        self.bodies_sent = 0
        self.gate: threading.Event | None = None  # set: requests wait for it (a slow server)
        self.entered = threading.Event()  # a request reached the gate
        self.gate_timed_out = False  # a request waited for the gate in vain (10 s)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.gate is not None:
            self.entered.set()
            self.gate_timed_out |= not self.gate.wait(10)
        if self.offline:
            raise httpx.ConnectError("connection refused", request=request)
        if self.status is not None:
            return httpx.Response(self.status, json={"detail": f"status {self.status}"})
        parts = request.url.path.strip("/").split("/")
        if parts == ["v1", "kernels"]:
            return self.lookup(dict(request.url.params))
        if len(parts) == 4 and parts[:2] == ["v1", "kernels"] and parts[3] == "bundle" and parts[2] in self.kernels:
            return self.bundle(parts[2], request)
        return httpx.Response(404, json={"detail": "not found"})

    def lookup(self, q: dict) -> httpx.Response:
        same = [(kid, b) for kid, b in self.kernels.items()
                if (b["spec_hash"], b["target"], b["dtype"]) == (q.get("spec_hash"), q.get("target"), q.get("dtype"))]
        if not same:
            return httpx.Response(404, json={"detail": "no kernel for this spec, target and dtype"})
        want = dict(item.split("=") for item in q["shape"].split(","))
        exact = [(kid, b) for kid, b in same if shape_text(b["shape"]) == q["shape"]]

        def distance(item):
            return sum(abs(math.log2(item[1]["shape"][d] / int(want[d]))) for d in want)

        kid, b = exact[0] if exact else min(same, key=distance)
        return httpx.Response(200, json={"id": kid, "spec_hash": b["spec_hash"], "shape": b["shape"],
                                         "dtype": b["dtype"], "target": b["target"], "exact_match": bool(exact),
                                         "bundle_sha256": b["sha256"], "bundle_url": f"/v1/kernels/{kid}/bundle"})

    def bundle(self, kid: str, request: httpx.Request) -> httpx.Response:
        b = self.kernels[kid]
        etag = self.etags.get(kid, b["sha256"])
        if request.headers.get("if-none-match") == f'"{etag}"':
            return httpx.Response(304, headers={"ETag": f'"{etag}"'})
        self.bodies_sent += 1
        return httpx.Response(200, content=self.served.get(kid, canonical_bytes(b)),
                              headers={"ETag": f'"{etag}"', "Content-Type": "application/json"})


@pytest.fixture()
def server():
    return FakeServer(BUNDLE, OTHER_SHAPE_BUNDLE)


def client(server: FakeServer, cache_dir: Path, **kwargs) -> KernelCache:
    return KernelCache(BASE, cache_dir=cache_dir, transport=httpx.MockTransport(server), **kwargs)


def assert_runs(kernel, shape=SHAPE, spec=SPEC):
    dtypes = bind_dtypes(spec, "float32")
    arrays = random_inputs(spec, shape, np.random.default_rng(0), dtypes)
    out = kernel(to_torch(arrays, dtypes, "cpu"))
    ref = evaluate(spec, shape, arrays)
    for part, r in ref.items():
        np.testing.assert_allclose(out[part].numpy(), r, rtol=1e-4, atol=1e-7)


def cached_files(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.rglob("*.json"))


def test_fetch_verifies_caches_and_runs(server, tmp_path):
    with client(server, tmp_path, token="s3cret") as cache:
        kernel = cache.get(RAW, SHAPE)
    assert kernel.sha256 == BUNDLE["sha256"] and kernel.shape == SHAPE
    assert_runs(kernel)
    lookup, fetch = server.requests
    assert lookup.url.path == "/v1/kernels"
    assert dict(lookup.url.params) == {"spec_hash": spec_hash(SPEC), "target": "h100", "shape": "d0=3,d1=37",
                                       "dtype": "float32"}
    assert fetch.url.path == "/v1/kernels/k0/bundle" and "if-none-match" not in fetch.headers
    assert all(r.headers["authorization"] == "Bearer s3cret" for r in server.requests)
    assert (tmp_path / f"{BUNDLE['sha256']}.json").read_bytes() == canonical_bytes(BUNDLE)
    assert len(list((tmp_path / "index").glob("*.json"))) == 1


def test_spec_as_path_text_or_catalog_name_and_shape_as_text(server, tmp_path):
    with client(server, tmp_path) as cache:
        k1 = cache.get(str(CATALOG_DIR / "safe_softmax.json"), "m=3,n=37")
        k2 = cache.get(json.dumps(RAW), SHAPE, dtype={"x": "float32"}, target="H100")
        k3 = cache.get(CATALOG_DIR / "safe_softmax.json", SHAPE)
        k4 = cache.get("safe_softmax", SHAPE)  # a catalog name
    assert k1.sha256 == k2.sha256 == k3.sha256 == k4.sha256 == BUNDLE["sha256"]


def test_bad_request_is_refused_before_asking(server, tmp_path):
    with client(server, tmp_path) as cache:
        with pytest.raises(ValueError, match="shape.n"):
            cache.get(RAW, {"m": 3})
        with pytest.raises(ValueError, match="unknown dtype"):
            cache.get(RAW, SHAPE, dtype="float128")
        with pytest.raises(ValueError, match="no such file, and no catalog spec of that name"):
            cache.get("/nonexistent/spec.json", SHAPE)
        with pytest.raises(ValueError, match="no catalog spec.*catalog names: attention,"):
            cache.get("safe_softmaxx", SHAPE)
        with pytest.raises(ValueError, match="target: unknown target 'tpu'"):
            cache.get(RAW, SHAPE, target="tpu")
    assert server.requests == []


def test_etag_304_uses_the_disk_copy(server, tmp_path):
    with client(server, tmp_path) as cache:
        cache.get(RAW, SHAPE)
    with client(server, tmp_path) as cache:  # a new process: nothing in memory
        kernel = cache.get(RAW, SHAPE)
    assert server.bodies_sent == 1
    fetch = server.requests[-1]
    assert fetch.headers["if-none-match"] == f'"{BUNDLE["sha256"]}"'
    assert_runs(kernel)


def test_new_bundle_replaces_the_cached_one(server, tmp_path):
    with client(server, tmp_path, revalidate_after=0) as cache:  # 0: every get asks the server
        cache.get(RAW, SHAPE)
        newer = softmax_bundle(time_ms=0.005)  # the server found a better kernel
        server.kernels["k0"] = newer
        kernel = cache.get(RAW, SHAPE)
    assert kernel.sha256 == newer["sha256"] and server.bodies_sent == 2
    assert (tmp_path / f"{newer['sha256']}.json").exists()


@pytest.mark.parametrize("how", ["source", "measured", "not_json", "etag", "other_spec"])
def test_tampered_bundle_is_refused_and_not_cached(server, tmp_path, how):
    if how == "source":
        bad = dict(BUNDLE, triton_source=BUNDLE["triton_source"].replace("num_warps=4", "num_warps=2"))
        server.served["k0"] = canonical_bytes(bad)
    elif how == "measured":
        server.served["k0"] = canonical_bytes(dict(BUNDLE, measured={**BUNDLE["measured"], "time_ms": 1e-9}))
    elif how == "not_json":
        server.served["k0"] = b"<html>proxy error</html>"
    elif how == "etag":
        server.etags["k0"] = "0" * 64
    else:  # a valid bundle, but not for the spec asked for
        server.served["k0"] = canonical_bytes(make_bundle(
            make_problem(load_spec(load_catalog()["logsumexp"]), {"m": 3, "n": 37}, "float32"), target="h100",
            strategy="streaming_fused", config={"blocks": {"n": 8}}, measured={"measurer": "model"}))
    with client(server, tmp_path) as cache, pytest.raises(KernelIntegrityError):
        cache.get(RAW, SHAPE)
    assert cached_files(tmp_path) == []


def test_offline_uses_the_disk_cache(server, tmp_path):
    with client(server, tmp_path) as cache:
        cache.get(RAW, SHAPE)
    server.offline = True
    with client(server, tmp_path) as cache:
        kernel = cache.get(RAW, SHAPE)
        assert_runs(kernel)
        assert cache.cached(RAW, SHAPE).sha256 == kernel.sha256
        with pytest.raises(KernelNotFound, match="cannot reach .* no kernel for spec safe_softmax"):
            cache.get(RAW, {"m": 4, "n": 37})
    server.offline, server.status = False, 503  # a failing server counts as unreachable
    with client(server, tmp_path) as cache:
        assert cache.get(RAW, SHAPE).sha256 == BUNDLE["sha256"]


def test_offline_with_a_corrupted_disk_copy_finds_nothing(server, tmp_path):
    with client(server, tmp_path) as cache:
        cache.get(RAW, SHAPE)
    path = tmp_path / f"{BUNDLE['sha256']}.json"
    path.write_bytes(path.read_bytes().replace(b"num_warps=4", b"num_warps=2"))
    server.offline = True
    with client(server, tmp_path) as cache, pytest.raises(KernelNotFound):
        cache.get(RAW, SHAPE)
    assert not path.exists()


def test_not_found(server, tmp_path):
    with client(server, tmp_path) as cache:
        with pytest.raises(KernelNotFound, match="no kernel for spec safe_softmax"):
            cache.get(RAW, SHAPE, target="a100")  # the server has h100 kernels only
        with pytest.raises(KernelNotFound):
            cache.get(load_catalog()["logsumexp"], SHAPE)
    assert cached_files(tmp_path) == []


@pytest.mark.parametrize(("status", "token", "message"), [
    (401, None, "requires a token"),
    (401, "wrong", "refused the token"),
    (403, "weak", "refused the token"),
])
def test_auth_errors_are_clear(server, tmp_path, status, token, message):
    server.status = status
    with client(server, tmp_path, token=token) as cache, pytest.raises(KernelAuthError, match=message):
        cache.get(RAW, SHAPE)


def test_unexpected_answers(server, tmp_path):
    server.status = 418
    with client(server, tmp_path) as cache, pytest.raises(KernelServiceError, match="unexpected status 418"):
        cache.get(RAW, SHAPE)


def test_nearest_shape_only_when_allowed(server, tmp_path):
    shape = {"m": 2, "n": 20}  # no exact kernel: the nearest is OTHER_SHAPE_BUNDLE (m=2, n=16)
    with client(server, tmp_path) as cache:
        with pytest.raises(KernelNotFound, match="allow_nearest=True"):
            cache.get(RAW, shape)
        assert server.bodies_sent == 0  # refused from the view, nothing downloaded
        kernel = cache.get(RAW, shape, allow_nearest=True)
    assert kernel.sha256 == OTHER_SHAPE_BUNDLE["sha256"] and kernel.shape == {"m": 2, "n": 16}
    assert_runs(kernel, shape)  # it runs the requested sizes
    server.offline = True
    with client(server, tmp_path) as cache:
        with pytest.raises(KernelNotFound):
            cache.get(RAW, shape)  # the disk entry is a nearest one
        assert cache.get(RAW, shape, allow_nearest=True).sha256 == OTHER_SHAPE_BUNDLE["sha256"]


def test_nearest_kernel_that_cannot_take_the_sizes_is_refused(tmp_path):
    resident = make_bundle(make_problem(SPEC, {"m": 2, "n": 16}, "float32"), target="h100", strategy="row_resident",
                           config={"blocks": {"n": 16}}, measured={"measurer": "model"})
    server = FakeServer(resident)
    with client(server, tmp_path) as cache, pytest.raises(KernelNotFound, match="block of 16 and cannot take 37"):
        cache.get(RAW, SHAPE, allow_nearest=True)
    assert cached_files(tmp_path) == []


def test_renamed_spec_gets_its_own_names(server, tmp_path):
    renamed = {"foldwise": 1, "name": "softmax_rows", "inputs": {"x": {"dims": ["rows", "cols"]}},
               "steps": [{"name": "m", "reduce": "max", "over": "cols", "expr": "x"},
                         {"name": "z", "reduce": "sum", "over": "cols", "expr": "exp(x - m)"},
                         {"name": "p", "expr": "exp(x - m) / z"}], "outputs": ["p"]}
    with client(server, tmp_path) as cache:
        kernel = cache.get(renamed, {"rows": 3, "cols": 37})
    assert kernel.sha256 == BUNDLE["sha256"] and kernel.output_parts == ("p",)
    assert_runs(kernel, {"rows": 3, "cols": 37}, load_spec(renamed))


def test_asgi_app_as_transport(tmp_path):
    """An ASGI app works as the transport (how the service's own tests can use the client)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def kernels(request):
        return JSONResponse({"id": "abc", "exact_match": True, "bundle_sha256": BUNDLE["sha256"]})

    async def bundle(request):
        return Response(canonical_bytes(BUNDLE), headers={"ETag": f'"{BUNDLE["sha256"]}"'},
                        media_type="application/json")

    app = Starlette(routes=[Route("/v1/kernels", kernels), Route("/v1/kernels/{kid}/bundle", bundle)])
    with KernelCache(BASE, cache_dir=tmp_path, transport=app) as cache:
        assert cache.get(RAW, SHAPE).sha256 == BUNDLE["sha256"]


def test_the_client_imports_neither_sympy_nor_scipy():
    """An inference server imports service.client on its start-up path: no derivation (sympy),
    no reference evaluator (scipy), no NumPy."""
    code = ("import sys; from service.client import KernelCache; "
            "print(sorted(m for m in ('sympy', 'scipy', 'numpy') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- the hot path
#
# A warm get() answers from the in-process memo: no HTTP, no disk. Disk access is counted by an
# audit hook ("open", and the os.* events that list, remove or rename files) and by wrapping
# os.stat (Path.stat, exists and is_file go through it, and it raises no audit event).

DISK_EVENTS = {"open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.replace", "os.mkdir", "os.unlink"}
_disk_events: list[str] | None = None  # None: not counting


def _audit(event: str, args: tuple) -> None:
    if _disk_events is not None and event in DISK_EVENTS:
        _disk_events.append(f"{event} {args[0] if args else ''}")


sys.addaudithook(_audit)  # hooks cannot be removed: it counts only while a test sets _disk_events


@pytest.fixture()
def disk_access(monkeypatch):
    """A list that collects every file access while the test runs, from any thread."""
    global _disk_events
    events: list[str] = []
    real_stat = os.stat

    def counted_stat(path, *args, **kwargs):
        events.append(f"stat {path}")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    _disk_events = events
    try:
        yield events
    finally:
        _disk_events = None


class Clock:
    """The memo's clock, stepped by the test."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def with_clock(cache: KernelCache) -> Clock:
    clock = Clock()
    cache._now = clock
    return clock


def wait_until(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def client_log_records():
    """Records of the foldwise.client logger (a handler of its own: an app's logging set-up in
    the same session may stop foldwise loggers propagating to pytest's)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("foldwise.client")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    return records, lambda: (logger.removeHandler(handler), logger.setLevel(old_level))


@pytest.mark.parametrize("spec_form", ["dict", "json", "name", "path", "spec"])
def test_a_warm_get_does_no_http_and_no_disk_access(server, tmp_path, disk_access, monkeypatch, spec_form):
    spec = {"dict": RAW, "json": json.dumps(RAW), "name": "safe_softmax",
            "path": CATALOG_DIR / "safe_softmax.json", "spec": SPEC}[spec_form]
    with client(server, tmp_path) as cache:
        cold = cache.get(spec, SHAPE)
        assert len(server.requests) == 2 and disk_access  # the cold call asked and stored
        hashed = []
        monkeypatch.setattr("service.client.request.spec_hash", lambda s: hashed.append(s) or spec_hash(s))
        requests_before, disk_access[:] = len(server.requests), []
        warm = [cache.get(spec, SHAPE) for _ in range(100)]
        assert len(server.requests) == requests_before
        assert disk_access == []
        assert hashed == []
        assert all(k is cold for k in warm)
    assert_runs(cold)


def test_a_warm_torch_op_call_does_no_http_and_no_disk_access(server, tmp_path, disk_access):
    """What a forward pass does per layer: torch_op() (the memo) and the operator's call, kernel
    launched (the interpreter runs the module already loaded): no request, no file touched, the
    same operator each time (benchmarks/client_warm_call.py times it with the launch stubbed)."""
    import torch

    with client(server, tmp_path) as cache:
        op = cache.torch_op(RAW, SHAPE)
        x = torch.randn(SHAPE["m"], SHAPE["n"])
        want = op(x=x)["y"]
        requests_before, disk_access[:] = len(server.requests), []
        for _ in range(20):
            again = cache.torch_op(RAW, SHAPE)
            assert again is op and torch.equal(again(x=x)["y"], want)
        assert len(server.requests) == requests_before
        assert disk_access == []
    np.testing.assert_allclose(want.numpy(), torch.softmax(x.double(), -1).numpy(), rtol=1e-5, atol=1e-7)


def test_the_spec_is_parsed_and_hashed_once_per_distinct_argument(server, tmp_path, monkeypatch):
    hashed = []
    monkeypatch.setattr("service.client.request.spec_hash", lambda s: hashed.append(s) or spec_hash(s))
    with client(server, tmp_path) as cache:
        cache.get(RAW, SHAPE)
        cache.get(RAW, {"m": 2, "n": 16})  # another shape of the same spec: a new request, no new hash
        cache.get(dict(RAW), "m=3,n=37")  # an equal dict, the shape as text
        assert len(hashed) == 1
        cache.get(SPEC, SHAPE)  # another argument (a loaded Spec): hashed once more
        cache.get(SPEC, {"m": 2, "n": 16})
        assert len(hashed) == 2
        with pytest.raises(ValueError, match="shape.n"):  # a float size is refused, never served from the memo
            cache.get(RAW, {"m": 3, "n": 37.0})


def test_revalidation_picks_up_a_new_kernel_after_the_interval_and_not_before(server, tmp_path):
    with client(server, tmp_path, revalidate_after=60) as cache:
        clock = with_clock(cache)
        old = cache.get(RAW, SHAPE)
        newer = softmax_bundle(time_ms=0.005)  # the server found a better kernel
        server.kernels["k0"] = newer
        asked = len(server.requests)
        clock.now += 59.9
        assert cache.get(RAW, SHAPE) is old
        time.sleep(0.2)  # a revalidation scheduled by mistake would have asked by now
        assert len(server.requests) == asked
        clock.now += 0.2  # past the interval: this call still answers at once, and revalidates behind it
        assert cache.get(RAW, SHAPE) is old
        new = wait_until(lambda: (k := cache.get(RAW, SHAPE)).sha256 == newer["sha256"] and k, "the new kernel")
        assert [r.url.path for r in server.requests[asked:]] == ["/v1/kernels", "/v1/kernels/k0/bundle"]
        assert server.bodies_sent == 2 and (tmp_path / f"{newer['sha256']}.json").exists()
        assert_runs(new)
        assert cache.get(RAW, SHAPE) is new and len(server.requests) == asked + 2  # fresh again: no request
        clock.now += 61  # unchanged on the server: one lookup, and no download
        cache.get(RAW, SHAPE)
        wait_until(lambda: len(server.requests) == asked + 3, "the second revalidation")
        time.sleep(0.1)
        assert len(server.requests) == asked + 3 and cache.get(RAW, SHAPE) is new


def test_revalidation_never_blocks_the_caller_and_keeps_the_kernel_when_it_fails(server, tmp_path):
    records, unhook = client_log_records()
    try:
        with client(server, tmp_path, revalidate_after=60) as cache:
            clock = with_clock(cache)
            old = cache.get(RAW, SHAPE)
            server.gate = threading.Event()  # the server now hangs until the test lets it go
            clock.now += 61
            assert cache.get(RAW, SHAPE) is old
            assert server.entered.wait(10)  # the revalidation is waiting on the server, not the caller
            assert not server.gate_timed_out
            assert cache.get(RAW, SHAPE) is old
            server.served["k0"] = b"<html>proxy error</html>"  # and what it answers is refused
            server.kernels["k0"] = softmax_bundle(time_ms=0.005)
            server.gate.set()
            wait_until(lambda: any("keeping kernel" in r.getMessage() for r in records), "the failure's log line")
            assert cache.get(RAW, SHAPE) is old  # the verified kernel stays
    finally:
        unhook()


def test_revalidate_after_none_never_asks_again_and_0_always_does(server, tmp_path):
    with client(server, tmp_path, revalidate_after=None) as cache:
        clock = with_clock(cache)
        cache.get(RAW, SHAPE)
        asked = len(server.requests)
        clock.now += 1e9
        cache.get(RAW, SHAPE)
        time.sleep(0.1)
        assert len(server.requests) == asked
    with client(server, tmp_path, revalidate_after=0) as cache:
        cache.get(RAW, SHAPE)
        asked = len(server.requests)
        cache.get(RAW, SHAPE)
        assert len(server.requests) == asked + 2  # lookup, and the bundle (304)
    for bad in (-1, float("nan"), "60", True):
        with pytest.raises(ValueError, match="revalidate_after"):
            client(server, tmp_path, revalidate_after=bad)


def test_an_offline_answer_is_remembered_and_revalidated_later(server, tmp_path):
    with client(server, tmp_path) as cache:
        cache.get(RAW, SHAPE)
    server.offline = True
    with client(server, tmp_path, revalidate_after=60) as cache:
        clock = with_clock(cache)
        disk = cache.get(RAW, SHAPE)  # from the disk cache
        asked = len(server.requests)
        assert cache.get(RAW, SHAPE) is disk and len(server.requests) == asked  # not a timeout per call
        server.offline = False
        server.kernels["k0"] = newer = softmax_bundle(time_ms=0.005)
        clock.now += 61
        wait_until(lambda: cache.get(RAW, SHAPE).sha256 == newer["sha256"], "the server's kernel")


def test_concurrent_gets_from_many_threads(server, tmp_path):
    with client(server, tmp_path, revalidate_after=60) as cache:
        clock = with_clock(cache)
        shapes = [SHAPE, {"m": 2, "n": 16}]
        errors, seen = [], set()

        def hammer(i: int) -> None:
            try:
                for j in range(200):
                    if j % 50 == 0:
                        clock.now += 30  # stale now and then: revalidations run beside the calls
                    seen.add(cache.get(RAW, shapes[(i + j) % 2], allow_nearest=True).sha256)
            except Exception as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == [] and seen == {BUNDLE["sha256"], OTHER_SHAPE_BUNDLE["sha256"]}


def test_prefetch_warms_the_memo_without_blocking(server, tmp_path):
    with client(server, tmp_path) as cache:
        server.gate = threading.Event()
        handle = cache.prefetch([(RAW, SHAPE), ("safe_softmax", {"m": 2, "n": 16}, "float32", "h100")])
        assert not handle.done()  # returned while the server still holds the requests
        server.gate.set()
        kernels = handle.wait(timeout=60)
        assert [k.sha256 for k in kernels] == [BUNDLE["sha256"], OTHER_SHAPE_BUNDLE["sha256"]]
        asked = len(server.requests)
        assert cache.get(RAW, SHAPE) is kernels[0]
        assert cache.get("safe_softmax", {"m": 2, "n": 16}) is kernels[1]
        assert len(server.requests) == asked  # warm
        failing = cache.prefetch([(RAW, SHAPE, "float32", "a100")])
        with pytest.raises(KernelNotFound, match="target a100"):
            failing.wait(timeout=60)
        with pytest.raises(ValueError, match=r"requests\[1\]"):
            cache.prefetch([(RAW, SHAPE), (RAW,)])


def test_tune_arguments_are_checked_before_asking(server, tmp_path):
    with client(server, tmp_path) as cache:
        for kwargs, name in (({"trials": 0}, "trials"), ({"trials": 2.5}, "trials"), ({"seconds": -1}, "seconds"),
                             ({"timeout": 0}, "timeout"), ({"poll": float("inf")}, "poll")):
            with pytest.raises(ValueError, match=name):
                cache.tune(RAW, SHAPE, **kwargs)
    assert server.requests == []


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def sqlite_db(tmp_path):
    """A migrated SQLite service database (the client's behaviour does not depend on the backend,
    which test_api.py and test_worker.py cover)."""
    from service.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'foldwise.db'}"
    upgrade(url)
    return url


def test_tune_and_tune_if_missing_against_a_real_server_with_a_worker(sqlite_db, tmp_path, monkeypatch):
    """The service's app in-process (TestClient) and a worker thread (model measurer): a queued
    job is named in the "no kernel" error; tune() joins it, shows its progress and returns the
    kernel; get(tune_if_missing=True) tunes another shape."""
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.settings import get_settings
    from service.worker import run_worker

    db_url = sqlite_db
    settings = get_settings(db_url=db_url, lease_seconds=10.0, heartbeat_seconds=0.2, compile_binaries=False)
    stop = threading.Event()
    shape, other = {"m": 4, "n": 64}, {"m": 2, "n": 32}
    with TestClient(create_app(settings)) as http:
        cache = KernelCache("http://testserver", cache_dir=tmp_path / "client", http_client=http)
        queued = cache.tune(RAW, shape, trials=2, wait=False)
        assert isinstance(queued, TuningJob) and queued.status == "queued" and queued.trials_budget == 2
        with pytest.raises(KernelNotFound, match=f"job {queued.id} for it is queued, 0/2 trials") as err:
            cache.get(RAW, shape)
        assert err.value.job == queued and "submit a tuning job" not in str(err.value)
        with pytest.raises(KernelNotFound, match="submit a tuning job") as err:  # no job for this one
            cache.get(RAW, other)
        assert "shape m=2,n=32" in str(err.value) and "d0=" not in str(err.value)  # the caller's dim names

        worker = threading.Thread(target=run_worker, args=(db_url,), daemon=True,
                                  kwargs={"measurer": "model", "target": "h100", "stop": stop, "poll_s": 0.05,
                                          "settings": settings})
        worker.start()
        try:
            tty = FakeTTY()
            monkeypatch.setattr(sys, "stderr", tty)
            kernel = cache.tune(RAW, shape, trials=2, timeout=300, poll=0.05)
            monkeypatch.undo()
            written = tty.getvalue()  # one line, rewritten in place, ended once
            assert written.count("\n") == 1 and written.endswith("\n")
            states = written.rstrip("\n").split("\r\x1b[2K")[1:]
            head = f"foldwise: tuning safe_softmax m=4,n=64 float32 h100: job {queued.id} "
            assert len(states) >= 2 and all(state.startswith(head) for state in states)
            assert re.fullmatch(r"succeeded, 2/2 trials, best [0-9.e+-]+ ms", states[-1][len(head):]), states
            job = http.get(f"/v1/jobs/{queued.id}").json()  # tune() joined the queued job
            assert job["status"] == "succeeded"
            assert http.get(f"/v1/kernels/{job['kernel_id']}").json()["bundle_sha256"] == \
                bundle_v1(kernel.bundle)["sha256"]
            assert kernel.shape == shape
            assert_runs(kernel, shape)
            assert cache.get(RAW, shape) is kernel  # remembered

            records, unhook = client_log_records()  # not a terminal: log lines
            try:
                tuned = cache.get(RAW, other, tune_if_missing=True)
            finally:
                unhook()
            assert tuned.shape == other
            assert_runs(tuned, other)
            assert any("tuning safe_softmax m=2,n=32" in r.getMessage() and "succeeded" in r.getMessage()
                       for r in records)
        finally:
            stop.set()
            worker.join(30)
            cache.close()


@pytest.mark.parametrize(("spec", "sent_shape"), [(RAW, SHAPE), (SPEC, {"d0": 3, "d1": 37})])
def test_a_failed_job_raises_with_the_server_s_reason(tmp_path, spec, sent_shape):
    """tune() against a fake job API: the job fails; the error carries the server's reason. The
    job names the spec as the caller wrote it; a loaded Spec, which has no text, canonically."""
    views = iter([{"status": "queued", "trials_done": 0}, {"status": "running", "trials_done": 1},
                  {"status": "failed", "trials_done": 2, "error": "no configuration compiled"}])

    def job_api(request: httpx.Request) -> httpx.Response:
        state = next(views)
        view = {"id": "a" * 32, "status": state["status"], "progress": {"trials_done": state["trials_done"],
                                                                         "trials_budget": 2},
                "best": None, "kernel_id": None, "error": state.get("error")}
        if request.method == "POST":
            body = json.loads(request.content)
            assert body["budget"] == {"trials": 2} and body["shape"] == sent_shape
            assert spec_hash(load_spec(body["spec"])) == spec_hash(SPEC)
        return httpx.Response(202 if request.method == "POST" else 200, json=view)

    with KernelCache(BASE, cache_dir=tmp_path, transport=httpx.MockTransport(job_api)) as cache:
        with pytest.raises(KernelTuningError, match="job a{32} for spec safe_softmax .* failed: no configuration"):
            cache.tune(spec, SHAPE, trials=2, poll=0.01, progress=False)


def test_a_tune_timeout_leaves_the_job_running(tmp_path):
    polls = []

    def job_api(request: httpx.Request) -> httpx.Response:
        polls.append(request.method)
        return httpx.Response(202 if request.method == "POST" else 200, json={
            "id": "b" * 32, "status": "running", "progress": {"trials_done": 1, "trials_budget": 40},
            "best": {"time_ms": 0.5}, "kernel_id": None, "error": None})

    with KernelCache(BASE, cache_dir=tmp_path, transport=httpx.MockTransport(job_api)) as cache:
        with pytest.raises(KernelTuningTimeout, match=r"job b{32} .* is still running, 1/40 trials, best 0.5 ms "
                                                      r"after 0.2 s; it goes on on the server"):
            cache.tune(RAW, SHAPE, timeout=0.2, poll=0.05, progress=False)
    assert polls[0] == "POST" and polls.count("POST") == 1 and "GET" in polls  # polled, never cancelled


def test_a_server_trickling_bytes_cannot_hold_a_get_past_its_timeout(tmp_path):
    """httpx's timeouts are per read: a server sending one byte a second never trips them. The
    client's timeout is a total per request (service.client.http.KernelServer.send): past it
    the server counts as unreachable (the disk cache answers, here: nothing)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 600\r\n\r\n")
                for _ in range(600):  # ten minutes, a byte a second
                    if stop.wait(1.0):
                        return
                    try:
                        conn.sendall(b" ")
                    except OSError:
                        break

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    try:
        t0 = time.monotonic()
        with KernelCache(f"http://127.0.0.1:{port}", cache_dir=tmp_path, timeout=2) as cache:
            with pytest.raises(KernelNotFound, match="longer than 2 s in all"):
                cache.get(RAW, SHAPE)
        assert time.monotonic() - t0 < 10  # 2 s and a read, not 600 s
    finally:
        stop.set()
        listener.close()


def test_a_full_disk_costs_the_cache_not_the_call(server, tmp_path, monkeypatch):
    """Issue 37, 5: a client whose cache cannot be written (a full disk) still serves the kernel,
    from memory, logs why, and leaves no partial file behind."""
    import errno
    import logging
    import pathlib

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the client's logger as it is configured (the service's JSON logs may own it)
    logger = logging.getLogger("foldwise.client")
    monkeypatch.setattr(logger, "level", logging.WARNING)
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "handlers", [*logger.handlers])  # restored after the test

    real = pathlib.Path.write_bytes

    def full(self, data):
        if tmp_path not in self.parents:  # the cache's disk is full, not the one kernel modules load from
            return real(self, data)
        real(self, data[: len(data) // 2])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    kernel = client(server, tmp_path).get(SPEC, SHAPE)
    assert_runs(kernel)
    text = "\n".join(r.getMessage() for r in records)
    assert "not written (" in text and "No space left on device" in text
    assert not [p.name for p in tmp_path.rglob("*") if p.is_file()]  # nothing partial kept
