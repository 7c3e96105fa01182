"""The kernel client's HTTP side: one server and its token, every answer checked
(:mod:`service.client`, module docstring: steps 2 and 3, "Tuning", "A job on its way").

Network trouble and 5xx answers raise :class:`service.client.errors.ServerUnavailable` (the
client then answers from its disk cache); anything else unexpected is a
:class:`~service.client.errors.KernelServiceError`, a refused token a
:class:`~service.client.errors.KernelAuthError`.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import httpx

from service.bundle import BundleError, bundle_v1, verify_bundle
from service.bundle.signing import SIGNATURE_HEADER
from service.client.disk import MAX_BUNDLE_BYTES, DiskCache
from service.client.errors import (
    KernelAuthError, KernelIntegrityError, KernelNotFound, KernelServiceError, KernelTuningError, ServerUnavailable,
)
from service.client.jobs import LIVE_JOBS, TuningJob
from service.client.request import KernelRequest

BINARIES_FORMAT = 3  # asked for: every Triton version's binaries; 2 from a server that predates it


class KernelServer:
    """A Foldwise server as the client asks it: kernel lookups, bundle downloads, jobs.

    ``transport``: an ``httpx.BaseTransport`` (e.g. ``httpx.MockTransport``) or an ASGI app (run
    through Starlette's TestClient, without its lifespan); ``http_client``: a ready
    ``httpx.Client`` used as is (not closed by :meth:`close`)."""

    def __init__(self, base_url: str, token: str | None, timeout: float, transport: Any = None,
                 http_client: httpx.Client | None = None):
        self.base_url = base_url
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._own_client = http_client is None
        if http_client is not None:
            self._http = http_client
        elif transport is not None and not isinstance(transport, httpx.BaseTransport) and callable(transport):
            import warnings

            with warnings.catch_warnings():  # Starlette 1.x nudges towards httpx2; plain httpx still works
                warnings.filterwarnings("ignore", message=".*httpx2")
                from starlette.testclient import TestClient

            self._http = TestClient(transport, base_url=self.base_url)
        else:
            self._http = httpx.Client(timeout=timeout, transport=transport)
        self._timeout = timeout
        self._binaries_format = BINARIES_FORMAT

    def close(self) -> None:
        if self._own_client:
            self._http.close()

    def send(self, path: str, *, params: dict | None = None, headers: dict | None = None, method: str = "GET",
             json_body: Any = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a request; ServerUnavailable for network trouble, 5xx, and
        an answer not complete within the client's timeout *in all*: httpx's timeouts are per
        read, so a server trickling a byte a second would never trip them; the total is checked
        after every read here (so it holds to within one read of a server that still sends)."""
        deadline = time.monotonic() + self._timeout
        try:
            with self._http.stream(method, self.base_url + path, params=params, json=json_body,
                                   headers={**self._headers, **(headers or {})}, timeout=self._timeout) as resp:
                if resp.status_code >= 500:
                    raise ServerUnavailable(f"the server answered {resp.status_code} for {path}")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > MAX_BUNDLE_BYTES:
                    raise KernelServiceError(f"{path}: answer of {declared} bytes is larger than {MAX_BUNDLE_BYTES}")
                body = bytearray()
                for chunk in resp.iter_bytes():
                    body += chunk
                    if time.monotonic() > deadline:
                        raise ServerUnavailable(f"{path}: the answer took longer than {self._timeout:g} s in all "
                                                f"({len(body)} bytes so far)")
                    if len(body) > MAX_BUNDLE_BYTES:
                        raise KernelServiceError(f"{path}: answer larger than {MAX_BUNDLE_BYTES} bytes")
                return resp.status_code, dict(resp.headers), bytes(body)
        except httpx.TransportError as err:
            raise ServerUnavailable(f"cannot reach {self.base_url}: {type(err).__name__}: {err}") from None

    def check_auth(self, status: int, body: bytes, scope: str | None) -> None:
        """KernelAuthError for 401/403, saying which scope the request needs (None: any token)."""
        if status not in (401, 403):
            return
        detail = f" ({status}{': ' + _detail(body) if _detail(body) else ''})"
        needs = f"the {scope} scope" if scope else "a valid token"
        if "Authorization" not in self._headers:
            raise KernelAuthError(f"the server requires a token{detail}: pass KernelCache(..., token=...) "
                                  f"with {needs}")
        raise KernelAuthError(f"the server refused the token{detail}: it must be valid, not revoked, "
                              f"and have {needs}")

    def _check_status(self, status: int, body: bytes, path: str, req: KernelRequest) -> None:
        self.check_auth(status, body, "kernels:read")
        if status == 404:  # the server's detail repeats the key in the canonical names sent (d0=...): say it in the caller's
            raise KernelNotFound(f"no kernel for {req.what} on {self.base_url}: submit a tuning job with "
                                 "KernelCache.tune(...) or get(..., tune_if_missing=True)")
        if status not in (200, 304):
            raise KernelServiceError(f"GET {path}: unexpected status {status}: {_detail(body) or body[:200]!r}")

    # ------------------------------------------------------------------------- kernels
    def lookup(self, req: KernelRequest) -> dict:
        """The kernel view ``GET /v1/kernels`` answers for ``req``."""
        path = "/v1/kernels"
        status, _, body = self.send(path, params=req.query)
        self._check_status(status, body, path, req)
        view = _json(body, f"GET {path}")
        if isinstance(view, list):  # tolerate a list of views, best first
            if not view:
                raise KernelNotFound(f"no kernel for {req.what} on {self.base_url}")
            view = view[0]
        if not isinstance(view, dict) or not isinstance(view.get("id"), str | int):
            raise KernelServiceError(f"GET {path}: expected a kernel view with an 'id', got {str(view)[:200]}")
        return view

    def fetch_bundle(self, view: dict, req: KernelRequest, disk: DiskCache, *, binaries: bool) -> dict:
        """The verified bundle the kernel ``view`` names: downloaded, or the ``disk`` copy when the
        server answers 304 to it; with ``binaries``, asked for with its compiled binaries."""
        want = view.get("bundle_sha256")
        path = f"/v1/kernels/{quote(str(view['id']), safe='')}/bundle"
        have = None
        if isinstance(want, str):
            # the view names the format-1 bundle; the disk copy may be its bundle with binaries
            have = disk.v2_of(want) if binaries else None
            have = have or (want if disk.read(want) is not None else None)
        conditional = {"If-None-Match": f'"{have}"'} if have else None
        fmt = self._binaries_format if binaries else None
        status, headers, body = self.send(path, params={"format": str(fmt)} if fmt else None, headers=conditional)
        if status == 422 and fmt == 3:  # a server from before format 3: one variant per arch
            self._binaries_format = 2
            status, headers, body = self.send(path, params={"format": "2"}, headers=conditional)
        self._check_status(status, body, path, req)
        etag = _etag_value(headers.get("etag"))
        if status == 304:
            if have is None or (etag is not None and etag != have):
                raise KernelServiceError(f"GET {path}: 304 Not Modified for a bundle this client did not offer")
            bundle = disk.read(have)
            if bundle is None:  # removed between the two reads
                raise KernelServiceError(f"GET {path}: 304, but the cached bundle {have} has gone")
            return bundle
        try:
            bundle = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise KernelIntegrityError(f"GET {path}: the bundle is not JSON") from None
        try:
            verify_bundle(bundle)
            if disk.trust is not None:  # who served it (service.bundle.signing): a trusted key, or nothing runs
                signature = headers.get(SIGNATURE_HEADER.lower())
                disk.trust.verify(bundle["sha256"], signature)
                disk.store_signature(bundle["sha256"], signature)
        except BundleError as err:
            raise KernelIntegrityError(f"GET {path}: the bundle failed verification, not cached: {err}") from None
        if etag is None and not isinstance(want, str):
            raise KernelIntegrityError(f"GET {path}: no ETag and no bundle_sha256 to check the bundle's hash against")
        v1_sha = bundle_v1(bundle)["sha256"]  # the view names the format-1 bundle
        for name, expected, actual in (("ETag", etag, bundle["sha256"]), ("kernel view's bundle_sha256", want, v1_sha)):
            if isinstance(expected, str) and expected != actual:
                raise KernelIntegrityError(f"GET {path}: the bundle's sha256 {actual} is not the "
                                           f"{name} {expected}; not cached")
        return bundle

    # ------------------------------------------------------------------------- tuning jobs
    def submit(self, req: KernelRequest, budget: dict, measurer: str | None) -> TuningJob:
        """``POST /v1/jobs`` for ``req``: a new job, or the queued, running or succeeded one of an
        identical request."""
        body: dict[str, Any] = {**req.job_fields(), "dtype": req.ndtype, "target": req.target, "budget": budget}
        if measurer is not None:
            body["measurer"] = measurer
        path = "/v1/jobs"
        try:
            status, _, answer = self.send(path, method="POST", json_body=body)
        except ServerUnavailable as err:
            raise KernelTuningError(f"cannot submit a tuning job for {req.what}: {err}") from None
        self.check_auth(status, answer, "jobs:write")
        if status == 422:
            raise KernelTuningError(f"the server refused a tuning job for {req.what}: {_detail(answer)}")
        if status not in (200, 202):
            raise KernelServiceError(f"POST {path}: unexpected status {status}: {_detail(answer) or answer[:200]!r}")
        return TuningJob.of(_json(answer, f"POST {path}"), f"POST {path}")

    def job(self, job_id: str) -> TuningJob:
        path = f"/v1/jobs/{quote(job_id, safe='')}"
        status, _, body = self.send(path)
        self.check_auth(status, body, None)
        if status != 200:
            raise KernelServiceError(f"GET {path}: unexpected status {status}: {_detail(body) or body[:200]!r}")
        return TuningJob.of(_json(body, f"GET {path}"), f"GET {path}")

    def live_job(self, req: KernelRequest) -> TuningJob | None:
        """The running (else queued) job for exactly ``req``'s key, if the server has one.
        Best effort: any trouble asking means None, and the caller's own error stands."""
        path = "/v1/jobs"
        try:
            status, _, body = self.send(path, params={**req.query, "limit": "50"})
            if status != 200:
                return None
            jobs = [TuningJob.of(view, f"GET {path}") for view in json.loads(body)["jobs"]]
        except (ServerUnavailable, KernelServiceError, ValueError, KeyError, TypeError):
            return None
        live = sorted((j for j in jobs if j.status in LIVE_JOBS), key=lambda j: LIVE_JOBS.index(j.status))
        return live[0] if live else None


def _etag_value(header: str | None) -> str | None:
    """``W/"abc"`` / ``"abc"`` / ``abc`` -> ``abc``."""
    if header is None:
        return None
    value = header.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise KernelServiceError(f"{what}: the answer is not JSON") from None


def _detail(body: bytes) -> str:
    """The ``detail``/``title`` of a problem+json or FastAPI error body, if any."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if isinstance(data, dict):
        for key in ("detail", "title", "error"):
            if isinstance(data.get(key), str):
                return data[key][:300]
    return ""
