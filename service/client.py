"""The kernel client inference servers use: fetch a tuned kernel by spec + shape, verify, cache, run.

Example::

    from service.client import KernelCache

    cache = KernelCache("https://foldwise.example", token="...")
    kernel = cache.get("attention", {"b": 8, "h": 16, "m": 1024, "n": 1024, "d": 64, "e": 64},
                       dtype="float16", target="h100")
    out = kernel(q=q, k=k, v=v)["o"]

How ``get`` works, the first time a request is asked in a process (a *cold* call):

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

**The hot path: an in-process memo.** Every answer is remembered, keyed by ``get``'s arguments
as given (the spec argument: text or bytes as is, a path by its text, a dict by its JSON text,
a loaded Spec by identity, the object held; the shape and dtype dicts' items, or their text;
target; ``allow_nearest``). A *warm* call, the same request again, is one dict lookup: no
HTTP, no disk access, no parsing or hashing (about 1-2 µs on a 2-core x86 host with the spec
as a name, text or Spec, 10-30 µs as a dict, which is serialised to make its key:
``benchmarks/client_warm_call.py``). A spec argument is parsed and hashed once per distinct
argument, whatever the shapes asked with it (and once more per bundle loaded for it, by
:meth:`service.bundle.BundleKernel.for_spec`'s check that the spec is the bundle's). Spelling
the same request differently (another dim order, the shape as text) costs one more cold call,
never a wrong answer. A catalog name or
a path is read once per ``KernelCache``: a spec file edited while the process runs is not
seen (a new ``KernelCache`` sees it). At most ``MEMO_LIMIT`` requests are remembered, the
oldest forgotten first.

**Revalidation.** ``KernelCache(..., revalidate_after=60.0)``: a remembered answer older than
that many seconds is still returned at once, and the call hands a revalidation to a
background thread (one at a time per request): the lookup again, and, only if the server now
names another kernel or bundle, its download, verification, storage and loading as in a cold
call. The memo entry is swapped only for a kernel that passed all of it; on any failure
(unreachable, refused, integrity) the kernel in hand stays, with a warning on
``foldwise.client``, and is asked about again after the same interval. So a better kernel on
the server reaches a running process within about ``revalidate_after`` seconds of its next
calls. ``revalidate_after=0``: no memo, every call asks the server on the caller's thread (the
behaviour before the memo); ``None``: never ask again in this process. An answer from the disk
cache while the server was unreachable is remembered too (so a warm call never waits on a
network timeout) and revalidated the same way. Thread-safe: any number of threads may call
``get``; the memo's reads take no lock.

**Tuning.** ``tune(spec, shape, dtype, target, trials=..., seconds=..., measurer=...,
wait=True, timeout=None)`` submits ``POST /v1/jobs`` (an identical request joins the queued,
running or succeeded job: the server's idempotency, docs/API.md), polls ``GET /v1/jobs/{id}``,
shows progress (on a terminal one line on stderr, rewritten in place: ``foldwise: tuning
safe_softmax m=4,n=64 float32 h100: job 1f3c... running, 5/40 trials, best 0.0123 ms``;
otherwise INFO lines on ``foldwise.client``; ``progress=False``: neither), and returns the
kernel, remembered. ``wait=False`` returns the :class:`TuningJob` at once. A job that fails or
is cancelled raises :class:`KernelTuningError` with the server's reason; ``timeout`` raises
:class:`KernelTuningTimeout` and leaves the job running. ``get(..., tune_if_missing=True)``
does the same when the server has no kernel for the request (never when it is unreachable).
``prefetch([(spec, shape, dtype, target), ...])`` warms the memo in background threads and
returns a :class:`Prefetch` at once (``wait()`` gives the kernels).

**A job on its way.** When the server has no kernel for the request, ``get`` asks
``GET /v1/jobs?spec_hash=&target=&shape=&dtype=`` for a job of exactly that key; a running (else
queued) one is named in the :class:`KernelNotFound` (``job 1f3c... for it is queued, 0/40
trials``, and ``err.job``), instead of the advice to submit one.

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
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import quote

import httpx

from fuser_core import (
    CatalogError, Spec, SpecError, canonical_json, canonical_shape, load_spec, normalize_dtype, spec_hash, spec_source,
)
from service import cubin_loader
from service.bundle import (
    BundleError,
    BundleKernel,
    bundle_v1,
    canonical_bytes,
    choose_binary,
    device_arch,
    dtype_text,
    install_variant,
    load_bundle,
    parse_shape_text,
    shape_text,
    user_names,
    variant_kind,
    verify_bundle,
)
from service.range_kernel import RangeKernel
from service.shape_ranges import pick_bucket
from service.tuning_request import check_target

if TYPE_CHECKING:
    from service.torch_ops import FoldwiseOp

log = logging.getLogger("foldwise.client")
BINARIES_FORMAT = 3  # asked for: every Triton version's binaries; 2 from a server that predates it

MAX_BUNDLE_BYTES = 32 * 1024 * 1024  # a bundle is tens of KiB; refuse anything absurd
MEMO_LIMIT = 4096  # requests (and spec arguments) remembered in-process; the oldest go first
LIVE_JOBS = ("running", "queued")  # a job in these states will still produce the kernel
FINISHED_JOBS = ("succeeded", "failed", "cancelled")
BACKGROUND_THREADS = 4  # revalidations and prefetches run here, never on the caller's thread


class KernelCacheError(Exception):
    """Base of the client's errors."""


class KernelNotFound(KernelCacheError, LookupError):
    """No kernel for this request: the server has none (or only another shape), or it is
    unreachable and the disk cache has none (``offline``). ``job`` is the queued or running
    job that will make it, when the server has one (:class:`TuningJob`), else None."""

    def __init__(self, message: str, job: TuningJob | None = None, *, offline: bool = False):
        super().__init__(message)
        self.job, self.offline = job, offline


class KernelAuthError(KernelCacheError, PermissionError):
    """The server refused the token (401 missing/invalid, 403 lacking the kernels:read scope)."""


class KernelServiceError(KernelCacheError):
    """The server answered something this client cannot use (unexpected status or body)."""


class KernelIntegrityError(KernelCacheError, BundleError):
    """A downloaded bundle failed verification; it was not cached."""


class KernelTuningError(KernelCacheError):
    """A tuning job was refused (422: e.g. a spec whose certificate fails), failed or was cancelled."""


class KernelTuningTimeout(KernelTuningError, TimeoutError):
    """``tune(..., timeout=...)`` ran out before the job finished; the job goes on on the server."""


class _Unavailable(Exception):
    """The server could not be asked (network, timeout, 5xx): fall back to the disk cache."""


def default_cache_dir() -> Path:
    root = os.environ.get("FOLDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldwise")
    return Path(root) / "client"


def as_spec(spec: Spec | Mapping[str, Any] | str | bytes | os.PathLike) -> Spec:
    """A spec from a loaded Spec, a dict, JSON text/bytes, a path to a JSON file or a catalog
    name (``"safe_softmax"``, :mod:`fuser_core.catalog`)."""
    return _spec_and_source(spec)[0]


def _spec_and_source(spec: Any) -> tuple[Spec, str | None]:
    """(the spec, its JSON text as a job submits it): the caller's own text where there is one,
    so the server shows the caller's names; None for a loaded Spec (its canonical JSON is sent)."""
    if isinstance(spec, Spec):
        return spec, None
    if isinstance(spec, Mapping):
        return load_spec(spec), json.dumps(spec)
    if isinstance(spec, bytes):
        return load_spec(spec), spec.decode("utf-8")
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return load_spec(spec), spec
    if isinstance(spec, str | os.PathLike):
        try:
            text = spec_source(spec)
        except CatalogError as err:
            raise SpecError(str(err), loc=("spec",)) from None
        return load_spec(text), text.decode("utf-8")
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
class _SpecFacts:
    """What a spec argument means, worked out once per distinct argument (it is hashed once)."""

    user: Spec  # the caller's spec (for a Spec argument, the object itself: memo keys hold it by id)
    shash: str
    back: dict[str, str]  # canonical dim -> the caller's name
    source: str | None  # the caller's JSON text, for a tuning job (None: a loaded Spec, sent canonical)

    @staticmethod
    def of(spec: Any) -> _SpecFacts:
        user, source = _spec_and_source(spec)
        return _SpecFacts(user, spec_hash(user), user_names(user), source)


@dataclass(frozen=True)
class _Request:
    """One validated request: the caller's spec, and shape/dtype/target in canonical form."""

    user: Spec
    shash: str
    cshape: dict[str, int]
    ndtype: str | dict[str, str]
    target: str
    back: dict[str, str]  # canonical dim -> the caller's name
    source: str | None = None  # the caller's JSON text, for a tuning job (None: send the canonical form)

    @staticmethod
    def make(spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str], target: str) -> _Request:
        return _Request.of(_SpecFacts.of(spec), shape, dtype, target)

    @staticmethod
    def of(facts: _SpecFacts, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str], target: str) -> _Request:
        user = facts.user
        return _Request(user, facts.shash, canonical_shape(user, parse_shape(shape)), normalize_dtype(user, dtype),
                        check_target(target), facts.back, facts.source)

    @property
    def key(self) -> str:
        """The disk index key of (spec_hash, shape, dtype, target)."""
        text = "|".join([self.shash, shape_text(self.cshape), dtype_text(self.ndtype), self.target])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def query(self) -> dict[str, str]:
        """The request key as ``GET /v1/kernels`` and ``GET /v1/jobs`` take it."""
        return {"spec_hash": self.shash, "target": self.target, "shape": shape_text(self.cshape),
                "dtype": dtype_text(self.ndtype)}

    def job_fields(self) -> dict[str, Any]:
        """The spec and shape of ``POST /v1/jobs``, in the caller's names when their text is at
        hand; a loaded Spec has none to send, so its canonical form and the canonical shape."""
        if self.source is None:
            return {"spec": canonical_json(self.user), "shape": self.cshape}
        return {"spec": self.source, "shape": {self.back.get(d, d): n for d, n in self.cshape.items()}}

    def show(self, shape: Any) -> str:
        """A canonical shape in the caller's dim names, for messages."""
        if not isinstance(shape, Mapping):
            return str(shape)
        return shape_text({self.back.get(d, d): n for d, n in shape.items()})

    @property
    def what(self) -> str:
        return (f"spec {self.user.name} ({self.shash[:16]}), shape {self.show(self.cshape)}, "
                f"dtype {dtype_text(self.ndtype)}, target {self.target}")


def _spec_key(spec: Any) -> Hashable | None:
    """A cheap hashable stand-in for a spec argument (None: there is none, take the slow path).
    Text and bytes are their own key; a loaded Spec is keyed by identity (the memo entry holds
    the object, so its id is not reused while the entry lives); a dict by its JSON text."""
    kind = type(spec)
    if kind is str or kind is bytes:
        return spec
    if isinstance(spec, Spec):
        return ("spec", id(spec))
    if isinstance(spec, os.PathLike):
        return ("path", os.fspath(spec))
    if isinstance(spec, Mapping):
        try:
            return ("json", json.dumps(spec, sort_keys=True))
        except (TypeError, ValueError):
            return None
    return None


def _sizes_key(value: Any) -> Hashable | None:
    """A shape or dtype argument as a memo key: text as is, a dict as its items in order (an
    order the caller varies only costs one more slow call). Sizes must be exact ints (a float
    or a bool goes the slow way, which refuses it), dtypes text."""
    kind = type(value)
    if kind is str:
        return value
    if kind is dict:
        items = tuple(value.items())
        for _, v in items:
            if type(v) is not int and type(v) is not str:
                return None
        return items
    return None


def _memo_key(spec: Any, shape: Any, dtype: Any, target: Any, allow_nearest: bool) -> Hashable | None:
    """The in-process memo's key of a ``get`` call, from its arguments as given (no parsing)."""
    skey = _spec_key(spec)
    shape_key = _sizes_key(shape)
    dtype_key = _sizes_key(dtype)
    if skey is None or shape_key is None or dtype_key is None or type(target) is not str:
        return None
    return (skey, shape_key, dtype_key, target, bool(allow_nearest))


def _bounded_put(memo: dict, key: Hashable, value: Any) -> None:
    """``memo[key] = value``, the oldest entries dropped past MEMO_LIMIT (hold the memo's lock)."""
    memo.pop(key, None)  # re-inserted last: eviction follows insertion order
    memo[key] = value
    while len(memo) > MEMO_LIMIT:
        del memo[next(iter(memo))]


@dataclass(frozen=True)
class _Found:
    """A loaded kernel and where it came from (None for both: the disk cache, offline)."""

    kernel: BundleKernel
    bundle_sha256: str | None  # the kernel view's (format-1) bundle_sha256
    kernel_id: str | None


@dataclass
class _MemoEntry:
    found: _Found
    req: _Request
    allow_nearest: bool
    fresh_until: float  # time.monotonic() after which a call schedules a revalidation
    revalidating: bool = False


@dataclass(frozen=True)
class TuningJob:
    """A tuning job as the server reports it (``GET /v1/jobs/{id}``)."""

    id: str
    status: str  # queued, running, succeeded, failed, cancelled
    trials_done: int
    trials_budget: int
    best_ms: float | None
    kernel_id: str | None
    error: str | None

    @staticmethod
    def of(view: Any, what: str) -> TuningJob:
        """From a job view; KernelServiceError naming ``what`` when it is not one."""
        try:
            progress, best = view["progress"], view.get("best") or {}
            job = TuningJob(str(view["id"]), str(view["status"]), int(progress["trials_done"]),
                            int(progress["trials_budget"]), best.get("time_ms"), view.get("kernel_id"),
                            view.get("error"))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise KernelServiceError(f"{what}: expected a job view, got {str(view)[:200]}") from None
        return job

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_JOBS

    @property
    def state(self) -> str:
        """``running, 5/40 trials, best 0.0123 ms``."""
        best = f", best {self.best_ms:.4g} ms" if isinstance(self.best_ms, int | float) else ""
        return f"{self.status}, {self.trials_done}/{self.trials_budget} trials{best}"


class Prefetch:
    """The handle :meth:`KernelCache.prefetch` returns: one future per request, in order."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout: float | None = None) -> list[BundleKernel]:
        """The kernels, in the order asked for, once all are loaded; raises the first request's
        error (each future has its own), or TimeoutError after ``timeout`` seconds."""
        _, pending = wait_futures(self.futures, timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(self.futures)} prefetches still running after {timeout} s")
        return [f.result() for f in self.futures]


class _ProgressLine:
    """A job's progress: one line rewritten in place on a terminal, else a log line per change."""

    def __init__(self, what: str, enabled: bool, stream: TextIO | None = None):
        self.what, self.enabled = what, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.last: str | None = None

    def show(self, job: TuningJob) -> None:
        text = f"job {job.id} {job.state}"
        if not self.enabled or text == self.last:
            return
        self.last = text
        if self.tty:
            self.stream.write(f"\r\x1b[2Kfoldwise: tuning {self.what}: {text}")
            self.stream.flush()
        else:
            log.info("tuning %s: %s", self.what, text, extra={"job_id": job.id, "status": job.status,
                                                               "trials_done": job.trials_done})

    def close(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


class KernelCache:
    """Fetches, verifies, caches on disk and in memory, and loads kernel bundles; asks for
    tuning jobs (module docstring).

    ``transport``: an ``httpx.BaseTransport`` (e.g. ``httpx.MockTransport``) or an ASGI app (run
    through Starlette's TestClient, without its lifespan); ``http_client``: a ready
    ``httpx.Client`` (e.g. an entered ``fastapi.testclient.TestClient``) used as is.

    ``revalidate_after``: seconds a remembered kernel is served before the next ``get`` for it
    asks the server again, in a background thread (default 60); ``0``: no memo, every ``get``
    asks the server on the caller's thread; ``None``: never ask again in this process.
    """

    def __init__(self, base_url: str, token: str | None = None, cache_dir: str | os.PathLike | None = None,
                 timeout: float = 30, transport: Any = None, *, http_client: httpx.Client | None = None,
                 binaries: bool = True, revalidate_after: float | None = 60.0):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r:.80}")
        if revalidate_after is not None and (isinstance(revalidate_after, bool)
                                             or not isinstance(revalidate_after, int | float)
                                             or not math.isfinite(revalidate_after) or revalidate_after < 0):
            raise ValueError(f"revalidate_after: expected seconds >= 0 or None, got {revalidate_after!r:.40}")
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
        self._lock = threading.Lock()  # loading bundles (self._kernels)
        self.revalidate_after = revalidate_after
        self._ops: dict[int, FoldwiseOp] = {}  # id(kernel) -> its torch operator (op())
        self._memo: dict[Hashable, _MemoEntry] = {}  # get()'s arguments as given -> the kernel (module docstring)
        self._specs: dict[Hashable, _SpecFacts] = {}  # a spec argument -> what it means, hashed once
        # (spec_hash, dtype, target, id(spec)) -> (range shape, its _Found, the spec held): tuned ranges loaded
        self._ranges: dict[tuple, tuple[dict, _Found, Spec]] = {}
        self._memo_lock = threading.Lock()  # writes to both memos; reads are single dict lookups
        self._now = time.monotonic  # the memo's clock (tests step it)
        self._pool: ThreadPoolExecutor | None = None
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop the background work (queued prefetches are cancelled; a tune waiting in one
        stops at its next poll), then the HTTP client."""
        self._closed.set()
        with self._memo_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._own_client:
            self._http.close()

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- public
    def get(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
            target: str = "h100", *, allow_nearest: bool = False, tune_if_missing: bool = False) -> BundleKernel:
        """The best kernel for (spec, shape, dtype, target), as a callable over torch tensors.

        A request answered before is answered from memory: no HTTP, no disk (see the module
        docstring for when the server is asked again). ``tune_if_missing``: when the server has
        no kernel for it, tune one as :meth:`tune` does (joining a queued or running job) and
        wait for it.

        Raises SpecError (a ValueError) for a bad spec/shape/dtype, KernelNotFound (naming the
        queued or running job for the request, if any), KernelAuthError, KernelServiceError,
        KernelIntegrityError, and with ``tune_if_missing`` KernelTuningError.
        """
        key = _memo_key(spec, shape, dtype, target, allow_nearest) if self.revalidate_after != 0 else None
        entry = self._remembered(key)
        if entry is not None:
            if entry.fresh_until <= self._now():
                self._revalidate_later(key, entry)
            return entry.found.kernel
        req = self._request(spec, shape, dtype, target)
        found = self._in_known_range(req)
        if found is not None:  # a range loaded by an earlier get() holds this shape: no request
            self._remember(key, req, allow_nearest, found)
            return found.kernel
        try:
            found = self._fetch(req, allow_nearest)
        except KernelNotFound as err:
            if not tune_if_missing or err.offline:  # offline: no server to tune on
                raise
            self._run_job(req, budget={}, measurer=None, timeout=None, progress=True, poll=1.0)
            found = self._fetch(req, allow_nearest)
        self._remember(key, req, allow_nearest, found)
        return found.kernel

    def torch_op(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
                 target: str = "h100", **get_options: Any) -> FoldwiseOp:
        """:meth:`get`'s kernel as a torch operator (:func:`service.torch_ops.foldwise_op`): callable with
        ``out=``, on meta tensors, and inside ``torch.compile(fullgraph=True)``. One operator per kernel,
        kept with it, so a warm call costs the memo's lookup and nothing more. A shape inside a tuned
        range gives the range's operator: each call runs the bucket its sizes fall in."""
        from service.torch_ops import foldwise_op  # torch only for callers of torch_op()

        kernel = self.get(spec, shape, dtype, target, **get_options)
        op = self._ops.get(id(kernel))
        if op is None or op.kernel is not kernel:  # an id reused after a revalidation swapped the kernel
            op = foldwise_op(kernel)
            with self._lock:
                _bounded_put(self._ops, id(kernel), op)
        return op

    def cached(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
               target: str = "h100", *, allow_nearest: bool = False) -> BundleKernel | None:
        """The disk cache's kernel for this request, without asking the server (None if none)."""
        req = self._request(spec, shape, dtype, target)
        bundle = self._from_index(req.key, allow_nearest)
        return self._load(bundle).for_spec(req.user) if bundle is not None else None

    def tune(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
             target: str = "h100", *, trials: int | None = None, seconds: float | None = None,
             measurer: str | None = None, wait: bool = True, timeout: float | None = None, progress: bool = True,
             poll: float = 1.0) -> BundleKernel | TuningJob:
        """Tune a kernel for (spec, shape, dtype, target) on the server and return it.

        Submits ``POST /v1/jobs`` (which joins the queued or running job of an identical
        request, or answers at once when a kernel exists), then, with ``wait``, polls the job
        every ``poll`` seconds, showing its progress (``progress``: a line rewritten on stderr
        when it is a terminal, else INFO log lines on ``foldwise.client``), and returns the
        kernel, remembered as :meth:`get` remembers it. ``wait=False`` returns the
        :class:`TuningJob` as submitted. ``trials``, ``seconds`` and ``measurer`` default to the
        server's (40 trials, 3,600 s); ``timeout`` (seconds, None: until the job ends) raises
        :class:`KernelTuningTimeout`, leaving the job running. A failed or cancelled job
        raises :class:`KernelTuningError` with the server's reason. Needs the ``jobs:write``
        scope once the server has tokens."""
        budget = _budget(trials, seconds)
        _positive("poll", poll)
        if timeout is not None:
            _positive("timeout", timeout)
        req = self._request(spec, shape, dtype, target)
        if not wait:
            return self._submit(req, budget, measurer)
        self._run_job(req, budget=budget, measurer=measurer, timeout=timeout, progress=progress, poll=poll)
        found = self._fetch(req, allow_nearest=False)
        self._remember(_memo_key(spec, shape, dtype, target, False), req, False, found)
        return found.kernel

    def prefetch(self, requests: Iterable[tuple], *, allow_nearest: bool = False,
                 tune_if_missing: bool = False) -> Prefetch:
        """Warm the memo for ``requests`` (each ``(spec, shape)``, ``(spec, shape, dtype)`` or
        ``(spec, shape, dtype, target)``) in background threads; returns at once with a
        :class:`Prefetch` whose ``wait()`` gives the kernels (or raises the first error)."""
        items = list(requests)
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or not 2 <= len(item) <= 4:
                raise ValueError(f"requests[{i}]: expected (spec, shape[, dtype[, target]]), got {str(item)[:80]}")
        pool = self._background()
        return Prefetch([pool.submit(self.get, *item, allow_nearest=allow_nearest, tune_if_missing=tune_if_missing)
                         for item in items])

    # ------------------------------------------------------------------------- the memo
    def _request(self, spec: Any, shape: Any, dtype: Any, target: Any) -> _Request:
        """The validated request; the spec argument is parsed and hashed once per distinct one."""
        skey = _spec_key(spec)
        facts = self._specs.get(skey) if skey is not None else None
        if facts is None:
            facts = _SpecFacts.of(spec)
            if skey is not None:
                with self._memo_lock:
                    _bounded_put(self._specs, skey, facts)
        return _Request.of(facts, shape, dtype, target)

    def _remembered(self, key: Hashable | None) -> _MemoEntry | None:
        # one dict read, atomic under the GIL: the hot path takes no lock
        return self._memo.get(key) if key is not None else None

    def _remember(self, key: Hashable | None, req: _Request, allow_nearest: bool, found: _Found) -> None:
        if key is None or self.revalidate_after == 0:
            return
        entry = _MemoEntry(found, req, allow_nearest, self._fresh_until())
        with self._memo_lock:
            _bounded_put(self._memo, key, entry)

    def _fresh_until(self) -> float:
        return math.inf if self.revalidate_after is None else self._now() + self.revalidate_after

    def _background(self) -> ThreadPoolExecutor:
        if self._closed.is_set():
            raise KernelCacheError("this KernelCache is closed")
        with self._memo_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="foldwise-client")
            return self._pool

    def _revalidate_later(self, key: Hashable, entry: _MemoEntry) -> None:
        """Schedule one revalidation of a stale entry (not one per call while it runs)."""
        with self._memo_lock:
            if entry.revalidating or self._memo.get(key) is not entry:
                return
            entry.revalidating = True
        try:
            self._background().submit(self._revalidate, key, entry)
        except (KernelCacheError, RuntimeError):  # closed, or shutting down: keep serving what we have
            entry.revalidating = False

    def _revalidate(self, key: Hashable, entry: _MemoEntry) -> None:
        """Ask the server again for a remembered request; the entry is replaced only by a kernel
        fully verified and loaded (:meth:`_resolve`). On any failure the verified kernel in hand
        stays, and is asked about again after ``revalidate_after``."""
        try:
            found = self._resolve(entry.req, entry.allow_nearest, known=entry.found)
        except Exception as err:  # noqa: BLE001  (a background thread: nothing above it would see it)
            log.warning("revalidating %s failed; keeping kernel %s: %s", entry.req.what,
                        entry.found.kernel.sha256[:12], err, extra={"error": str(err)[:300]})
            found = entry.found
        if found is not entry.found:
            log.info("kernel for %s replaced: %s -> %s", entry.req.what, entry.found.kernel.sha256[:12],
                     found.kernel.sha256[:12])
        fresh = _MemoEntry(found, entry.req, entry.allow_nearest, self._fresh_until())
        with self._memo_lock:
            if self._memo.get(key) is entry:
                self._memo[key] = fresh

    # ------------------------------------------------------------------------- one request
    def _fetch(self, req: _Request, allow_nearest: bool) -> _Found:
        """The server's kernel for ``req`` (:meth:`_resolve`), else the disk cache's when the
        server cannot be reached. A KernelNotFound from the server names the live job for the
        request, if it has one."""
        try:
            return self._resolve(req, allow_nearest)
        except _Unavailable as err:
            return _Found(self._offline(req, allow_nearest, str(err)), None, None)
        except KernelNotFound as err:
            job = self._live_job(req)
            if job is None:
                raise
            raise KernelNotFound(
                f"no kernel yet for {req.what}: job {job.id} for it is {job.state} on {self.base_url}; "
                "wait for it with KernelCache.tune(...) (it joins the job) or get(..., tune_if_missing=True)",
                job) from None

    def _resolve(self, req: _Request, allow_nearest: bool, known: _Found | None = None) -> _Found:
        """Ask the server for ``req``'s kernel: look it up, download (or revalidate the disk copy
        of) its bundle, verify, store, load. ``known``: the kernel in hand, kept as is (no
        download) when the server names the same kernel and bundle. Raises _Unavailable."""
        view = self._lookup(req)
        if isinstance(view.get("range"), Mapping):  # a tuned range holds the shape: load every bucket
            return self._resolve_range(req, view, known)
        if view.get("exact_match") is False and not allow_nearest:
            raise KernelNotFound(self._nearest_message(req, view.get("shape")))
        kernel_id, want = str(view["id"]), view.get("bundle_sha256")
        if known is not None and (known.kernel_id, known.bundle_sha256) == (kernel_id, want):
            return known
        bundle = self._fetch_bundle(view, req)
        exact = bundle["shape"] == req.cshape
        if view.get("exact_match") is True and not exact:
            raise KernelIntegrityError(f"the server marked a kernel for shape {req.show(bundle['shape'])} "
                                       f"as an exact match for {req.what}")
        if not exact and not allow_nearest:
            raise KernelNotFound(self._nearest_message(req, bundle["shape"]))
        self._check_request(bundle, req)
        self._store(bundle, req.key, {"spec_hash": req.shash, "shape": req.cshape, "dtype": req.ndtype,
                                      "target": req.target, "kernel_id": view.get("id"), "exact": exact})
        return _Found(self._load(bundle).for_spec(req.user), want if isinstance(want, str) else None, kernel_id)

    def _resolve_range(self, req: _Request, view: dict, known: _Found | None) -> _Found:
        """A lookup answered by a tuned range (service.shape_ranges): download (or revalidate) and
        verify every bucket's bundle, check each is for the request and its bucket's shape, and
        wrap them in one :class:`service.range_kernel.RangeKernel`, remembered for every shape of
        the range. ``known`` is kept when the server names the same range and bundles."""
        rng = view["range"]
        buckets = rng.get("buckets")
        shape = rng.get("shape")
        if not isinstance(buckets, list) or not buckets or not isinstance(shape, Mapping):
            raise KernelServiceError(f"GET /v1/kernels: a range without buckets: {str(rng)[:200]}")
        if pick_bucket(shape, req.cshape) is None:
            raise KernelIntegrityError(f"the server answered {req.what} with a range {req.show(shape)} "
                                       "that does not hold it")
        ident = hashlib.sha256(json.dumps([rng.get("id"), [b.get("bundle_sha256") for b in buckets]])
                               .encode()).hexdigest()
        if known is not None and (known.kernel_id, known.bundle_sha256) == (f"range:{rng.get('id')}", ident):
            return known
        loaded = []
        for b in buckets:
            bundle = self._fetch_bundle({"id": b.get("kernel_id"), "bundle_sha256": b.get("bundle_sha256")}, req)
            self._check_request_fields(bundle, req)
            if bundle["shape"] != b.get("shape"):
                raise KernelIntegrityError(f"the server sent a bundle for {req.show(bundle['shape'])} as the "
                                           f"range's bucket {req.show(b.get('shape'))}")
            self._store_bundle(bundle)
            loaded.append((bundle["shape"], self._load(bundle).for_spec(req.user)))
        try:
            kernel = RangeKernel(shape, loaded)
        except BundleError as err:
            raise KernelIntegrityError(f"the range for {req.what}: {err}") from None
        self._store_range(req, shape, [(b["shape"], k.sha256) for b, (_, k) in zip(buckets, loaded)])
        found = _Found(kernel, ident, f"range:{rng.get('id')}")
        with self._memo_lock:  # every later get() inside this range is answered without a request
            self._ranges[(req.shash, dtype_text(req.ndtype), req.target, id(req.user))] = (shape, found, req.user)
        return found

    def _in_known_range(self, req: _Request) -> _Found | None:
        """A range already loaded in this process that holds ``req``'s shape (no request)."""
        hit = self._ranges.get((req.shash, dtype_text(req.ndtype), req.target, id(req.user)))
        if hit is None or pick_bucket(hit[0], req.cshape) is None:
            return None
        return hit[1]

    # ------------------------------------------------------------------------- tuning jobs
    def _submit(self, req: _Request, budget: dict, measurer: str | None) -> TuningJob:
        """``POST /v1/jobs`` for ``req``: a new job, or the queued, running or succeeded one of an
        identical request."""
        body: dict[str, Any] = {**req.job_fields(), "dtype": req.ndtype, "target": req.target, "budget": budget}
        if measurer is not None:
            body["measurer"] = measurer
        path = "/v1/jobs"
        try:
            status, _, answer = self._send(path, method="POST", json_body=body)
        except _Unavailable as err:
            raise KernelTuningError(f"cannot submit a tuning job for {req.what}: {err}") from None
        self._check_auth(status, answer, "jobs:write")
        if status == 422:
            raise KernelTuningError(f"the server refused a tuning job for {req.what}: {_detail(answer)}")
        if status not in (200, 202):
            raise KernelServiceError(f"POST {path}: unexpected status {status}: {_detail(answer) or answer[:200]!r}")
        return TuningJob.of(_json(answer, f"POST {path}"), f"POST {path}")

    def _job(self, job_id: str) -> TuningJob:
        path = f"/v1/jobs/{quote(job_id, safe='')}"
        status, _, body = self._send(path)
        self._check_auth(status, body, None)
        if status != 200:
            raise KernelServiceError(f"GET {path}: unexpected status {status}: {_detail(body) or body[:200]!r}")
        return TuningJob.of(_json(body, f"GET {path}"), f"GET {path}")

    def _run_job(self, req: _Request, *, budget: dict, measurer: str | None, timeout: float | None, progress: bool,
                 poll: float) -> TuningJob:
        """Submit (or join) ``req``'s job and wait for it to succeed, showing its progress."""
        job = self._submit(req, budget, measurer)
        deadline = None if timeout is None else time.monotonic() + timeout
        line = _ProgressLine(f"{req.user.name} {req.show(req.cshape)} {dtype_text(req.ndtype)} {req.target}", progress)
        try:
            while True:
                line.show(job)
                if job.finished:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise KernelTuningTimeout(f"job {job.id} for {req.what} is still {job.state} after {timeout} s; "
                                              "it goes on on the server (tune() again joins it)")
                if self._closed.wait(poll if left is None else min(poll, left)):
                    raise KernelCacheError(f"this KernelCache was closed while waiting for job {job.id}")
                try:
                    job = self._job(job.id)
                except _Unavailable as err:  # a blip on a long wait: ask again at the next poll
                    log.debug("polling job %s: %s", job.id, err)
        finally:
            line.close()
        if job.status != "succeeded":
            raise KernelTuningError(f"job {job.id} for {req.what} {job.status}"
                                    f"{': ' + job.error if job.error else ''}")
        return job

    def _live_job(self, req: _Request) -> TuningJob | None:
        """The running (else queued) job for exactly ``req``'s key, if the server has one.
        Best effort: any trouble asking means None, and the caller's own error stands."""
        path = "/v1/jobs"
        try:
            status, _, body = self._send(path, params={**req.query, "limit": "50"})
            if status != 200:
                return None
            jobs = [TuningJob.of(view, f"GET {path}") for view in json.loads(body)["jobs"]]
        except (_Unavailable, KernelServiceError, ValueError, KeyError, TypeError):
            return None
        live = sorted((j for j in jobs if j.status in LIVE_JOBS), key=lambda j: LIVE_JOBS.index(j.status))
        return live[0] if live else None

    # ------------------------------------------------------------------------- HTTP
    def _url(self, path: str) -> str:
        return self.base_url + path

    def _send(self, path: str, *, params: dict | None = None, headers: dict | None = None, method: str = "GET",
              json_body: Any = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a request; _Unavailable for network trouble and 5xx."""
        try:
            with self._http.stream(method, self._url(path), params=params, json=json_body,
                                   headers={**self._headers, **(headers or {})}, timeout=self._timeout) as resp:
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

    def _check_auth(self, status: int, body: bytes, scope: str | None) -> None:
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

    def _check_status(self, status: int, body: bytes, path: str, req: _Request) -> None:
        self._check_auth(status, body, "kernels:read")
        if status == 404:
            detail = _detail(body)
            raise KernelNotFound(f"no kernel for {req.what} on {self.base_url}{' (' + detail + ')' if detail else ''}")
        if status not in (200, 304):
            raise KernelServiceError(f"GET {path}: unexpected status {status}: {_detail(body) or body[:200]!r}")

    def _lookup(self, req: _Request) -> dict:
        path = "/v1/kernels"
        status, _, body = self._send(path, params=req.query)
        self._check_status(status, body, path, req)
        view = _json(body, f"GET {path}")
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
        self._check_request_fields(bundle, req)
        limits = bundle["size_limits"]
        too_big = [(d, n, limits[d]) for d, n in req.cshape.items() if d in limits and n > limits[d]]
        if too_big:
            d, n, limit = too_big[0]
            raise KernelNotFound(f"the nearest kernel for {req.what} (tuned for {req.show(bundle['shape'])}) holds "
                                 f"dim {req.back.get(d, d)} in a block of {limit} and cannot take {n}; "
                                 "submit a tuning job")

    @staticmethod
    def _check_request_fields(bundle: dict, req: _Request) -> None:
        for field, expected in (("spec_hash", req.shash), ("target", req.target), ("dtype", req.ndtype)):
            if bundle[field] != expected:
                raise KernelIntegrityError(f"the server sent a bundle for {field} {bundle[field]!r:.80}, "
                                           f"not {expected!r:.80}, when asked for {req.what}")

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
        self._store_bundle(bundle)
        entry = {**entry, "sha256": bundle["sha256"], "tuned_shape": bundle["shape"]}
        self._write_atomic(self.cache_dir / "index" / f"{key}.json", json.dumps(entry, sort_keys=True).encode())

    def _store_bundle(self, bundle: dict) -> None:
        """The verified bundle on disk under its sha256 (a bundle with binaries linked from its
        format-1 hash), so a later download is a 304."""
        path = self._bundle_path(bundle["sha256"])
        if self._read_disk(bundle["sha256"]) is None:
            self._write_atomic(path, canonical_bytes(bundle))
        if bundle["format"] != bundle_v1(bundle)["format"]:  # with binaries: link it from its format-1 hash
            (self.cache_dir / "v2").mkdir(exist_ok=True)
            self._write_atomic(self.cache_dir / "v2" / bundle_v1(bundle)["sha256"], bundle["sha256"].encode())

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

    def _offline(self, req: _Request, allow_nearest: bool, reason: str) -> BundleKernel | RangeKernel:
        bundle = self._from_index(req.key, allow_nearest)
        if bundle is not None:
            return self._load(bundle).for_spec(req.user)
        in_range = self._range_from_disk(req)
        if in_range is None:
            raise KernelNotFound(f"{reason}; and the disk cache {self.cache_dir} has no kernel for {req.what}",
                                 offline=True)
        return in_range

    # A tuned range on disk: ranges/<spec, dtype, target digest>-<range digest>.json lists the range's
    # shape and each bucket's shape and bundle sha256, so a restart without the server serves every
    # shape of the range from the stored bundles (the index above is per exact request).
    def _range_prefix(self, req: _Request) -> str:
        return hashlib.sha256(json.dumps([req.shash, dtype_text(req.ndtype), req.target]).encode()).hexdigest()[:16]

    def _store_range(self, req: _Request, shape: Mapping[str, Any], buckets: list[tuple[Any, str]]) -> None:
        folder = self.cache_dir / "ranges"
        folder.mkdir(exist_ok=True)
        entry = {"spec_hash": req.shash, "dtype": req.ndtype, "target": req.target, "shape": dict(shape),
                 "buckets": [{"shape": b, "sha256": sha} for b, sha in buckets]}
        digest = hashlib.sha256(json.dumps(dict(shape), sort_keys=True).encode()).hexdigest()[:16]
        path = folder / f"{self._range_prefix(req)}-{digest}.json"
        self._write_atomic(path, json.dumps(entry, sort_keys=True).encode())

    def _range_from_disk(self, req: _Request) -> RangeKernel | None:
        """A stored range holding ``req``'s shape whose every bucket's bundle is on disk and
        verifies, as a :class:`RangeKernel`; None otherwise (a damaged entry is skipped)."""
        for path in sorted((self.cache_dir / "ranges").glob(f"{self._range_prefix(req)}-*.json")):
            try:
                entry = json.loads(path.read_bytes())
                if (entry["spec_hash"], entry["target"]) != (req.shash, req.target) or entry["dtype"] != req.ndtype:
                    continue
                if pick_bucket(entry["shape"], req.cshape) is None:
                    continue
                loaded = []
                for b in entry["buckets"]:
                    bundle = self._read_disk(b["sha256"])
                    if bundle is None or bundle["shape"] != b["shape"]:
                        break
                    self._check_request_fields(bundle, req)
                    loaded.append((bundle["shape"], self._load(bundle).for_spec(req.user)))
                else:
                    return RangeKernel(entry["shape"], loaded)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, KernelIntegrityError, BundleError):
                continue
        return None

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
        """Hand the stored binary for this device to Triton when it can be used
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
                variant, reason = None, f"the stored binary does not fit the module's launches: {err}"
            except OSError as err:
                variant, reason = None, f"the binary could not be put in Triton's cache: {err}"
        info = {"loaded": variant_kind(variant).name if variant is not None else "source", "reason": reason}
        log.info("kernel %s loaded from %s: %s", bundle["sha256"][:12], info["loaded"], reason,
                 extra={"bundle_sha256": bundle["sha256"], **info})
        return info


def _device_facts() -> dict[str, Any]:
    """What :func:`service.bundle.choose_binary` decides on, from this process: the GPU's arch
    (None without one), Triton's version, the interpreter flag, and Triton's cache-invalidating
    variables."""
    import torch
    import triton

    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    arch = None
    if torch.cuda.is_available():  # a ROCm build of torch answers here too: its GPU is named by its gfx arch
        arch = device_arch(torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
                           if torch.version.hip else tuple(torch.cuda.get_device_capability()))
    env_vars = None
    if arch is not None:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env_vars = get_cache_invalidating_env_vars()
    return {"arch": arch, "triton_version": triton.__version__, "interpreted": interpreted, "env_vars": env_vars}


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise KernelServiceError(f"{what}: the answer is not JSON") from None


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r:.40}")
    return float(value)


def _budget(trials: int | None, seconds: float | None) -> dict[str, Any]:
    """A job's ``budget`` (what is left out, the server's default)."""
    budget: dict[str, Any] = {}
    if trials is not None:
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials: expected a positive integer, got {trials!r:.40}")
        budget["trials"] = trials
    if seconds is not None:
        budget["seconds"] = _positive("seconds", seconds)
    return budget


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
