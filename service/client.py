"""The kernel client inference servers use: fetch a tuned kernel by spec + shape, verify, cache, run.

Example::

    from service.client import KernelCache

    cache = KernelCache("https://foldwise.example", token="...")
    kernel = cache.get("attention", {"b": 8, "h": 16, "m": 1024, "n": 1024, "d": 64, "e": 64},
                       dtype="float16", target="h100")
    out = kernel(q=q, k=k, v=v)["o"]

How ``get`` works:

1. the spec (a catalog name, a path, a dict, JSON text or a loaded Spec) is validated and hashed *locally*;
   shape and dtype are validated and put in canonical form (bundles speak the canonical
   spec's dim names, see :mod:`service.bundle`), so the query is
   ``GET /v1/kernels?spec_hash=...&target=h100&shape=d0=4,d1=300&dtype=float32``;
2. the answer (a kernel view with ``id``, ``bundle_sha256``, ``exact_match``) names the bundle,
   fetched with ``GET /v1/kernels/{id}/bundle`` and ``If-None-Match`` when a copy is on disk
   (``304``: the disk copy is used);
3. a downloaded bundle must hash to its own ``sha256``, to the ``ETag`` and to the view's
   ``bundle_sha256``, and be for the spec, target and dtype asked for; only then is it stored,
   atomically, as ``<cache_dir>/<sha256>.json`` with an index entry
   ``<cache_dir>/index/<key>.json`` for (spec_hash, shape, dtype, target);
4. the kernel is loaded (:func:`service.bundle.load_bundle`) and speaks the caller's own names.

**Nearest shapes.** By default only a kernel tuned for exactly the requested shape is
accepted: a kernel tuned for another shape runs correctly (within its ``size_limits``) but may
be far from the best for this one. ``allow_nearest=True`` accepts the server's nearest tuned
shape of the same spec, target and dtype when no exact one exists.

**Offline.** When the server cannot be reached (connection error, timeout, or a 5xx answer),
``get`` answers from the disk index for the same (spec_hash, shape, dtype, target), re-verifying
the stored bundle's hash; a nearest-shape entry is used only with ``allow_nearest=True``. With
nothing on disk it raises :class:`KernelNotFound` saying the server was unreachable.

**Compiled kernels (format 3).** ``get`` asks for ``foldwise-bundle/3`` (``?format=3``): the
bundle plus the cubins the server's workers compiled, per arch and Triton version (a server
older than format 3 answers 422; the client then asks for format 2, one variant per arch). A
format-2 or -3 bundle is checked like a format-1 one, and more: every cubin must decode to its
recorded ``cubin_sha256`` (else :class:`KernelIntegrityError`, nothing cached or loaded), its
``sha256`` must be the ETag, and its format-1 projection (:func:`service.bundle.bundle_v1`) must
hash to the kernel view's ``bundle_sha256``. On a CUDA device with a stored binary for its arch,
built by this Triton version with the same cache-invalidating environment, the stored cubins
are handed to Triton's JIT directly (:mod:`service.cubin_loader`: a ``CompiledKernel`` built
from the stored metadata and cubin, kept in the JIT's device cache under the key Triton computes
for the bundle's tuned shape), so the first launch at that shape loads the stored cubin and compiles nothing, and
start-up pays neither Triton's cache files nor its cache key (which hashes Triton itself once
per process); a Triton version that loader does not know gets them through Triton's own cache
instead (:func:`service.bundle.install_variant`). Otherwise (no binary of this Triton version,
for one) the source is compiled at the first launch as before.
Either way ``kernel.info`` says which (``{"loaded": "cubin"|"source", "reason": ...}``) and a
log line on ``foldwise.client`` says why. The disk cache keeps the bundle with its binaries,
so an offline restart needs neither the network nor a compile.

**Trust.** The bundle carries Python source that is executed. Its hash proves it is the bundle
the server stored and that it arrived intact, not who wrote it: use HTTPS and a server you trust.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from fuser_core import (
    CatalogError, Spec, SpecError, canonical_shape, load_spec, normalize_dtype, spec_hash, spec_source,
)
from service import cubin_loader
from service.bundle import (
    BundleError,
    BundleKernel,
    bundle_v1,
    canonical_bytes,
    choose_binary,
    dtype_text,
    install_variant,
    load_bundle,
    parse_shape_text,
    shape_text,
    user_names,
    verify_bundle,
)
from service.tuning_request import check_target

log = logging.getLogger("foldwise.client")
BINARIES_FORMAT = 3  # asked for: every Triton version's binaries; 2 from a server that predates it

MAX_BUNDLE_BYTES = 32 * 1024 * 1024  # a bundle is tens of KiB; refuse anything absurd


class KernelCacheError(Exception):
    """Base of the client's errors."""


class KernelNotFound(KernelCacheError, LookupError):
    """No kernel for this request: the server has none (or only another shape), or it is
    unreachable and the disk cache has none."""


class KernelAuthError(KernelCacheError, PermissionError):
    """The server refused the token (401 missing/invalid, 403 lacking the kernels:read scope)."""


class KernelServiceError(KernelCacheError):
    """The server answered something this client cannot use (unexpected status or body)."""


class KernelIntegrityError(KernelCacheError, BundleError):
    """A downloaded bundle failed verification; it was not cached."""


class _Unavailable(Exception):
    """The server could not be asked (network, timeout, 5xx): fall back to the disk cache."""


def default_cache_dir() -> Path:
    root = os.environ.get("FOLDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldwise")
    return Path(root) / "client"


def as_spec(spec: Spec | Mapping[str, Any] | str | bytes | os.PathLike) -> Spec:
    """A spec from a loaded Spec, a dict, JSON text/bytes, a path to a JSON file or a catalog
    name (``"safe_softmax"``, :mod:`fuser_core.catalog`)."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, Mapping | bytes):
        return load_spec(spec)
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return load_spec(spec)
    if isinstance(spec, str | os.PathLike):
        try:
            return load_spec(spec_source(spec))
        except CatalogError as err:
            raise SpecError(str(err), loc=("spec",)) from None
    raise SpecError(f"expected a spec dict, JSON text, a path or a catalog name, got {type(spec).__name__}",
                    loc=("spec",))


def parse_shape(shape: Mapping[str, int] | str) -> dict[str, int]:
    """A shape dict, or ``"m=4,n=300"`` (:func:`service.bundle.parse_shape_text`)."""
    if isinstance(shape, Mapping):
        return dict(shape)
    return parse_shape_text(shape)


def _etag_value(header: str | None) -> str | None:
    """``W/"abc"`` / ``"abc"`` / ``abc`` -> ``abc``."""
    if header is None:
        return None
    value = header.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


@dataclass(frozen=True)
class _Request:
    """One validated request: the caller's spec, and shape/dtype/target in canonical form."""

    user: Spec
    shash: str
    cshape: dict[str, int]
    ndtype: str | dict[str, str]
    target: str
    back: dict[str, str]  # canonical dim -> the caller's name

    @staticmethod
    def make(spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str], target: str) -> _Request:
        user = as_spec(spec)
        return _Request(user, spec_hash(user), canonical_shape(user, parse_shape(shape)), normalize_dtype(user, dtype),
                        check_target(target), user_names(user))

    @property
    def key(self) -> str:
        """The disk index key of (spec_hash, shape, dtype, target)."""
        text = "|".join([self.shash, shape_text(self.cshape), dtype_text(self.ndtype), self.target])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def show(self, shape: Any) -> str:
        """A canonical shape in the caller's dim names, for messages."""
        if not isinstance(shape, Mapping):
            return str(shape)
        return shape_text({self.back.get(d, d): n for d, n in shape.items()})

    @property
    def what(self) -> str:
        return (f"spec {self.user.name} ({self.shash[:16]}), shape {self.show(self.cshape)}, "
                f"dtype {dtype_text(self.ndtype)}, target {self.target}")


class KernelCache:
    """Fetches, verifies, caches on disk and loads kernel bundles (module docstring).

    ``transport``: an ``httpx.BaseTransport`` (e.g. ``httpx.MockTransport``) or an ASGI app (run
    through Starlette's TestClient, without its lifespan); ``http_client``: a ready
    ``httpx.Client`` (e.g. an entered ``fastapi.testclient.TestClient``) used as is.
    """

    def __init__(self, base_url: str, token: str | None = None, cache_dir: str | os.PathLike | None = None,
                 timeout: float = 30, transport: Any = None, *, http_client: httpx.Client | None = None,
                 binaries: bool = True):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r:.80}")
        self.base_url = base_url.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        (self.cache_dir / "index").mkdir(exist_ok=True)
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
        self.binaries = binaries  # ask for compiled binaries (format 3, else 2); False: format 1, source only
        self._binaries_format = BINARIES_FORMAT
        self._kernels: dict[str, BundleKernel] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._own_client:
            self._http.close()

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- public
    def get(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
            target: str = "h100", *, allow_nearest: bool = False) -> BundleKernel:
        """The best kernel for (spec, shape, dtype, target), as a callable over torch tensors.

        Raises SpecError (a ValueError) for a bad spec/shape/dtype, KernelNotFound,
        KernelAuthError, KernelServiceError or KernelIntegrityError.
        """
        req = _Request.make(spec, shape, dtype, target)
        try:
            view = self._lookup(req)
            if view.get("exact_match") is False and not allow_nearest:
                raise KernelNotFound(self._nearest_message(req, view.get("shape")))
            bundle = self._fetch_bundle(view, req)
        except _Unavailable as err:
            return self._offline(req, allow_nearest, str(err))
        exact = bundle["shape"] == req.cshape
        if view.get("exact_match") is True and not exact:
            raise KernelIntegrityError(f"the server marked a kernel for shape {req.show(bundle['shape'])} "
                                       f"as an exact match for {req.what}")
        if not exact and not allow_nearest:
            raise KernelNotFound(self._nearest_message(req, bundle["shape"]))
        self._check_request(bundle, req)
        self._store(bundle, req.key, {"spec_hash": req.shash, "shape": req.cshape, "dtype": req.ndtype,
                                      "target": req.target, "kernel_id": view.get("id"), "exact": exact})
        return self._load(bundle).for_spec(req.user)

    def cached(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
               target: str = "h100", *, allow_nearest: bool = False) -> BundleKernel | None:
        """The disk cache's kernel for this request, without asking the server (None if none)."""
        req = _Request.make(spec, shape, dtype, target)
        bundle = self._from_index(req.key, allow_nearest)
        return self._load(bundle).for_spec(req.user) if bundle is not None else None

    # ------------------------------------------------------------------------- HTTP
    def _url(self, path: str) -> str:
        return self.base_url + path

    def _send(self, path: str, *, params: dict | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a GET; _Unavailable for network trouble and 5xx."""
        try:
            with self._http.stream("GET", self._url(path), params=params, headers={**self._headers, **(headers or {})},
                                   timeout=self._timeout) as resp:
                if resp.status_code >= 500:
                    raise _Unavailable(f"the server answered {resp.status_code} for {path}")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > MAX_BUNDLE_BYTES:
                    raise KernelServiceError(f"{path}: answer of {declared} bytes is larger than {MAX_BUNDLE_BYTES}")
                body = bytearray()
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > MAX_BUNDLE_BYTES:
                        raise KernelServiceError(f"{path}: answer larger than {MAX_BUNDLE_BYTES} bytes")
                return resp.status_code, dict(resp.headers), bytes(body)
        except httpx.TransportError as err:
            raise _Unavailable(f"cannot reach {self.base_url}: {type(err).__name__}: {err}") from None

    def _check_status(self, status: int, body: bytes, path: str, req: _Request) -> None:
        if status in (401, 403):
            detail = f" ({status}{': ' + _detail(body) if _detail(body) else ''})"
            if "Authorization" not in self._headers:
                raise KernelAuthError(f"the server requires a token{detail}: pass KernelCache(..., token=...) "
                                      "with the kernels:read scope")
            raise KernelAuthError(f"the server refused the token{detail}: it must be valid, not revoked, "
                                  "and have the kernels:read scope")
        if status == 404:
            detail = _detail(body)
            raise KernelNotFound(f"no kernel for {req.what} on {self.base_url}{' (' + detail + ')' if detail else ''}")
        if status not in (200, 304):
            raise KernelServiceError(f"GET {path}: unexpected status {status}: {_detail(body) or body[:200]!r}")

    def _lookup(self, req: _Request) -> dict:
        path = "/v1/kernels"
        params = {"spec_hash": req.shash, "target": req.target, "shape": shape_text(req.cshape),
                  "dtype": dtype_text(req.ndtype)}
        status, _, body = self._send(path, params=params)
        self._check_status(status, body, path, req)
        try:
            view = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise KernelServiceError(f"GET {path}: the answer is not JSON") from None
        if isinstance(view, list):  # tolerate a list of views, best first
            if not view:
                raise KernelNotFound(f"no kernel for {req.what} on {self.base_url}")
            view = view[0]
        if not isinstance(view, dict) or not isinstance(view.get("id"), str | int):
            raise KernelServiceError(f"GET {path}: expected a kernel view with an 'id', got {str(view)[:200]}")
        return view

    def _fetch_bundle(self, view: dict, req: _Request) -> dict:
        want = view.get("bundle_sha256")
        path = f"/v1/kernels/{quote(str(view['id']), safe='')}/bundle"
        have = None
        if isinstance(want, str):
            # the view names the format-1 bundle; the disk copy may be its bundle with binaries
            have = self._v2_of(want) if self.binaries else None
            have = have or (want if self._read_disk(want) is not None else None)
        conditional = {"If-None-Match": f'"{have}"'} if have else None
        fmt = self._binaries_format if self.binaries else None
        status, headers, body = self._send(path, params={"format": str(fmt)} if fmt else None, headers=conditional)
        if status == 422 and fmt == 3:  # a server from before format 3: one variant per arch
            self._binaries_format = 2
            status, headers, body = self._send(path, params={"format": "2"}, headers=conditional)
        self._check_status(status, body, path, req)
        etag = _etag_value(headers.get("etag"))
        if status == 304:
            if have is None or (etag is not None and etag != have):
                raise KernelServiceError(f"GET {path}: 304 Not Modified for a bundle this client did not offer")
            bundle = self._read_disk(have)
            if bundle is None:  # removed between the two reads
                raise KernelServiceError(f"GET {path}: 304, but the cached bundle {have} has gone")
            return bundle
        try:
            bundle = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise KernelIntegrityError(f"GET {path}: the bundle is not JSON") from None
        try:
            verify_bundle(bundle)
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

    # ------------------------------------------------------------------------- checks and disk
    @staticmethod
    def _nearest_message(req: _Request, shape: Any) -> str:
        return (f"no kernel tuned for {req.what}; the server has one for the nearest shape {req.show(shape)} "
                "(pass allow_nearest=True to use it, or submit a tuning job)")

    def _check_request(self, bundle: dict, req: _Request) -> None:
        """The server must have answered the question asked (a nearest shape must fit the request)."""
        for field, expected in (("spec_hash", req.shash), ("target", req.target), ("dtype", req.ndtype)):
            if bundle[field] != expected:
                raise KernelIntegrityError(f"the server sent a bundle for {field} {bundle[field]!r:.80}, "
                                           f"not {expected!r:.80}, when asked for {req.what}")
        limits = bundle["size_limits"]
        too_big = [(d, n, limits[d]) for d, n in req.cshape.items() if d in limits and n > limits[d]]
        if too_big:
            d, n, limit = too_big[0]
            raise KernelNotFound(f"the nearest kernel for {req.what} (tuned for {req.show(bundle['shape'])}) holds "
                                 f"dim {req.back.get(d, d)} in a block of {limit} and cannot take {n}; "
                                 "submit a tuning job")

    def _bundle_path(self, sha: str) -> Path:
        if not (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise KernelServiceError(f"not a sha256: {sha!r:.80}")
        return self.cache_dir / f"{sha}.json"

    def _read_disk(self, sha: str) -> dict | None:
        """The verified bundle stored under ``sha``, or None (a corrupt file is removed)."""
        try:
            path = self._bundle_path(sha)
        except KernelServiceError:
            return None
        try:
            if path.stat().st_size > MAX_BUNDLE_BYTES:
                raise BundleError("too large")
            bundle = json.loads(path.read_bytes())
            verify_bundle(bundle)
            if bundle["sha256"] != sha:
                raise BundleError("stored under another hash")
            return bundle
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError):  # BundleError is a ValueError
            path.unlink(missing_ok=True)
            return None

    def _v2_of(self, v1_sha: str) -> str | None:
        """The sha256 of the bundle with binaries (format 2 or 3) stored for a format-1 one, when
        it is on disk (linked from ``v2/<format-1 sha256>``, the folder's name since format 2)."""
        try:
            self._bundle_path(v1_sha)
            v2 = (self.cache_dir / "v2" / v1_sha).read_text().strip()
        except (OSError, KernelServiceError):
            return None
        return v2 if self._read_disk(v2) is not None else None

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _store(self, bundle: dict, key: str, entry: dict) -> None:
        path = self._bundle_path(bundle["sha256"])
        if self._read_disk(bundle["sha256"]) is None:
            self._write_atomic(path, canonical_bytes(bundle))
        if bundle["format"] != bundle_v1(bundle)["format"]:  # with binaries: link it from its format-1 hash
            (self.cache_dir / "v2").mkdir(exist_ok=True)
            self._write_atomic(self.cache_dir / "v2" / bundle_v1(bundle)["sha256"], bundle["sha256"].encode())
        entry = {**entry, "sha256": bundle["sha256"], "tuned_shape": bundle["shape"]}
        self._write_atomic(self.cache_dir / "index" / f"{key}.json", json.dumps(entry, sort_keys=True).encode())

    def _from_index(self, key: str, allow_nearest: bool) -> dict | None:
        try:
            entry = json.loads((self.cache_dir / "index" / f"{key}.json").read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return None
        if not entry.get("exact", False) and not allow_nearest:
            return None
        return self._read_disk(entry["sha256"])

    def _offline(self, req: _Request, allow_nearest: bool, reason: str) -> BundleKernel:
        bundle = self._from_index(req.key, allow_nearest)
        if bundle is None:
            raise KernelNotFound(f"{reason}; and the disk cache {self.cache_dir} has no kernel for {req.what}")
        return self._load(bundle).for_spec(req.user)

    def _load(self, bundle: dict) -> BundleKernel:
        with self._lock:
            kernel = self._kernels.get(bundle["sha256"])
            if kernel is None:
                kernel = load_bundle(bundle)
                kernel.info = self._prepare_binary(bundle, kernel)
                self._kernels[bundle["sha256"]] = kernel
            return kernel

    @staticmethod
    def _prepare_binary(bundle: dict, kernel: BundleKernel) -> dict:
        """Hand the stored cubin for this device to Triton when it can be used
        (:func:`service.bundle.choose_binary`); the kernel's ``info`` either way."""
        variant, reason = choose_binary(bundle, **_device_facts())
        if variant is not None:
            try:
                if cubin_loader.supports(variant["triton_version"]):
                    cubin_loader.seed_jit_caches(kernel._module, bundle, variant)
                    reason += "; in Triton's JIT cache, nothing to compile"
                else:
                    install_variant(variant)
                    reason += "; in Triton's kernel cache (this Triton is not one service.cubin_loader knows)"
            except BundleError as err:  # verified on download and from disk; a change since is refused
                raise KernelIntegrityError(f"bundle {bundle['sha256']}: {err}") from None
            except cubin_loader.CubinLoadError as err:
                variant, reason = None, f"the stored cubin does not fit the module's launches: {err}"
            except OSError as err:
                variant, reason = None, f"the cubin could not be put in Triton's cache: {err}"
        info = {"loaded": "cubin" if variant is not None else "source", "reason": reason}
        log.info("kernel %s loaded from %s: %s", bundle["sha256"][:12], info["loaded"], reason,
                 extra={"bundle_sha256": bundle["sha256"], **info})
        return info


def _device_facts() -> dict[str, Any]:
    """What :func:`service.bundle.choose_binary` decides on, from this process: the CUDA
    device's capability (None without one), Triton's version, the interpreter flag, and
    Triton's cache-invalidating variables."""
    import torch
    import triton

    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    capability = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    env_vars = None
    if capability is not None:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env_vars = get_cache_invalidating_env_vars()
    return {"capability": capability, "triton_version": triton.__version__, "interpreted": interpreted,
            "env_vars": env_vars}


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
