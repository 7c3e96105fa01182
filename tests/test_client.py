"""service/client.py's KernelCache against a fake kernel server (httpx.MockTransport).

The fake server follows docs/API.md: ``GET /v1/kernels?spec_hash=&target=&shape=&dtype=`` answers
a kernel view (exact match, else the nearest shape, marked), ``GET /v1/kernels/{id}/bundle`` the
bundle bytes with ``ETag`` = sha256 and ``304`` for a matching ``If-None-Match``. Bundles are
real ones from make_bundle; kernels run through Triton's interpreter.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import CATALOG_DIR, load_catalog

from fuser_core.canonical import spec_hash
from fuser_core.problem import make_problem
from fuser_core.reference import evaluate, random_inputs
from fuser_core.runner import bind_dtypes, to_torch
from fuser_core.spec import load_spec
from service.bundle import canonical_bytes, shape_text
from service.bundle_maker import make_bundle
from service.client import (
    KernelAuthError,
    KernelCache,
    KernelIntegrityError,
    KernelNotFound,
    KernelServiceError,
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

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
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
            cache.get(RAW, SHAPE, dtype="float64")
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
    with client(server, tmp_path) as cache:
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
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
