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
are handed to Triton's JIT directly (:mod:`service.client.cubin_loader`: a ``CompiledKernel`` built
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
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from fuser_core import Spec
from service.bundle import BundleError, BundleKernel, dtype_text, load_bundle
from service.bundle.signing import TrustedKeys
from service.client.binary import prepare_binary
from service.client.disk import DiskCache, default_cache_dir
from service.client.errors import (
    KernelAuthError, KernelCacheError, KernelIntegrityError, KernelNotFound, KernelServiceError, KernelTuningError,
    KernelTuningTimeout, ServerUnavailable,
)
from service.client.http import KernelServer
from service.client.jobs import Prefetch, ProgressLine, TuningJob, positive_seconds, tuning_budget
from service.client.request import (
    Found, KernelRequest, MemoEntry, SpecFacts, as_spec, bounded_put, memo_key, parse_shape, spec_key,
)
from service.client.range_kernel import RangeKernel
from service.shape_ranges import one_kernel, pick_bucket

if TYPE_CHECKING:
    from service.client.autograd import TrainableOp
    from service.client.torch_ops import FoldwiseOp

__all__ = [
    "KernelAuthError", "KernelCache", "KernelCacheError", "KernelIntegrityError", "KernelNotFound",
    "KernelServiceError", "KernelTuningError", "KernelTuningTimeout", "Prefetch", "TuningJob", "as_spec",
    "default_cache_dir", "parse_shape",
]

log = logging.getLogger("foldwise.client")
BACKGROUND_THREADS = 4  # revalidations and prefetches run here, never on the caller's thread


class KernelCache:
    """Fetches, verifies, caches on disk and in memory, and loads kernel bundles; asks for
    tuning jobs (module docstring).

    ``transport``: an ``httpx.BaseTransport`` (e.g. ``httpx.MockTransport``) or an ASGI app (run
    through Starlette's TestClient, without its lifespan); ``http_client``: a ready
    ``httpx.Client`` (e.g. an entered ``fastapi.testclient.TestClient``) used as is.

    ``revalidate_after``: seconds a remembered kernel is served before the next ``get`` for it
    asks the server again, in a background thread (default 60); ``0``: no memo, every ``get``
    asks the server on the caller's thread; ``None``: never ask again in this process.

    ``trusted_keys``: public keys (base64, ``foldwise signing-key``); with them (or
    ``FOLDWISE_TRUSTED_KEYS``, comma-separated) only bundles signed by one of them are loaded,
    downloaded or from disk (service.bundle.signing); an unsigned one raises KernelIntegrityError.
    """

    def __init__(self, base_url: str, token: str | None = None, cache_dir: str | os.PathLike | None = None,
                 timeout: float = 30, transport: Any = None, *, http_client: httpx.Client | None = None,
                 binaries: bool = True, revalidate_after: float | None = 60.0,
                 trusted_keys: Sequence[str] | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r:.80}")
        if revalidate_after is not None and (isinstance(revalidate_after, bool)
                                             or not isinstance(revalidate_after, int | float)
                                             or not math.isfinite(revalidate_after) or revalidate_after < 0):
            raise ValueError(f"revalidate_after: expected seconds >= 0 or None, got {revalidate_after!r:.40}")
        self.base_url = base_url.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        keys = trusted_keys if trusted_keys is not None else [
            k for k in os.environ.get("FOLDWISE_TRUSTED_KEYS", "").split(",") if k.strip()]
        # run only bundles a trusted key signed (service.bundle.signing); none given: the sha256 is the check
        self.trust = TrustedKeys(keys) if keys else None
        self._disk = DiskCache(self.cache_dir, self.trust)
        self._server = KernelServer(self.base_url, token, timeout, transport, http_client)
        self.binaries = binaries  # ask for compiled binaries (format 3, else 2); False: format 1, source only
        self._kernels: dict[str, BundleKernel] = {}
        self._lock = threading.Lock()  # loading bundles (self._kernels)
        self.revalidate_after = revalidate_after
        self._ops: dict[int, FoldwiseOp] = {}  # id(kernel) -> its torch operator (op())
        self._memo: dict[Hashable, MemoEntry] = {}  # get()'s arguments as given -> the kernel (module docstring)
        self._specs: dict[Hashable, SpecFacts] = {}  # a spec argument -> what it means, hashed once
        # (spec_hash, dtype, target, id(spec), batch_invariant) -> (range shape, its Found, the spec held):
        # the tuned ranges loaded
        self._ranges: dict[tuple, tuple[dict, Found, Spec]] = {}
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
        self._server.close()

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- public
    def get(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
            target: str = "h100", *, allow_nearest: bool = False, tune_if_missing: bool = False,
            tune_budget: Mapping[str, Any] | None = None, batch_invariant: bool = False) -> BundleKernel:
        """The best kernel for (spec, shape, dtype, target), as a callable over torch tensors.

        ``batch_invariant``: only a range that one kernel serves whole (a job with
        ``"batch_invariant": true``, :mod:`service.shape_ranges`), so the same row gives the same
        bits at every size of the range; a kernel for one shape, or a range of several buckets,
        is never used for it (KernelNotFound instead).

        A request answered before is answered from memory: no HTTP, no disk (see the module
        docstring for when the server is asked again). ``tune_if_missing``: when the server has
        no kernel for it, tune one as :meth:`tune` does (joining a queued or running job) and
        wait for it; ``tune_budget`` is that job's budget (``{"trials": 8, "seconds": 60}``; the
        server's defaults where absent).

        Raises SpecError (a ValueError) for a bad spec/shape/dtype, KernelNotFound (naming the
        queued or running job for the request, if any), KernelAuthError, KernelServiceError,
        KernelIntegrityError, and with ``tune_if_missing`` KernelTuningError.
        """
        key = (memo_key(spec, shape, dtype, target, allow_nearest, batch_invariant)
               if self.revalidate_after != 0 else None)
        entry = self._remembered(key)
        if entry is not None:
            if entry.fresh_until <= self._now():
                self._revalidate_later(key, entry)
            return entry.found.kernel
        req = self._request(spec, shape, dtype, target, batch_invariant)
        found = self._in_known_range(req)
        if found is not None:  # a range loaded by an earlier get() holds this shape: no request
            self._remember(key, req, allow_nearest, found)
            return found.kernel
        try:
            found = self._fetch(req, allow_nearest)
        except KernelNotFound as err:
            if not tune_if_missing or err.offline:  # offline: no server to tune on
                raise
            self._run_job(req, budget=dict(tune_budget or {}), measurer=None, timeout=None, progress=True, poll=1.0)
            found = self._fetch(req, allow_nearest)
        self._remember(key, req, allow_nearest, found)
        return found.kernel

    def torch_op(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
                 target: str = "h100", **get_options: Any) -> FoldwiseOp:
        """:meth:`get`'s kernel as a torch operator (:func:`service.client.torch_ops.foldwise_op`): callable with
        ``out=``, on meta tensors, and inside ``torch.compile(fullgraph=True)``. One operator per kernel,
        kept with it, so a warm call costs the memo's lookup and nothing more. A shape inside a tuned
        range gives the range's operator: each call runs the bucket its sizes fall in."""
        from service.client.torch_ops import foldwise_op  # torch only for callers of torch_op()

        kernel = self.get(spec, shape, dtype, target, **get_options)
        op = self._ops.get(id(kernel))
        if op is None or op.kernel is not kernel:  # an id reused after a revalidation swapped the kernel
            op = foldwise_op(kernel)
            with self._lock:
                bounded_put(self._ops, id(kernel), op)
        return op

    def trainable_op(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
                     target: str = "h100", **get_options: Any) -> TrainableOp:
        """:meth:`torch_op` with the spec's derived backward (issue 39; :mod:`service.client.autograd`):
        ``loss.backward()`` runs Foldwise kernels. Fetches (with :meth:`prefetch`, in parallel, and
        ``get_options``: ``allow_nearest``, ``tune_if_missing``, ``tune_budget``) the forward that saves its statistics
        and each backward spec's kernel."""
        from service.client.autograd import fetch_trainable
        from service.client.request import parse_shape

        user = self._request(spec, shape, dtype, target).user
        return fetch_trainable(lambda requests: self.prefetch([(*r, target) for r in requests], **get_options).wait(),
                               user, parse_shape(shape), dtype)

    def cached(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
               target: str = "h100", *, allow_nearest: bool = False) -> BundleKernel | None:
        """The disk cache's kernel for this request, without asking the server (None if none)."""
        req = self._request(spec, shape, dtype, target)
        bundle = self._disk.from_index(req.key, allow_nearest)
        return self._load(bundle).for_spec(req.user) if bundle is not None else None

    def tune(self, spec: Any, shape: Mapping[str, int] | str, dtype: str | Mapping[str, str] = "float32",
             target: str = "h100", *, trials: int | None = None, seconds: float | None = None,
             measurer: str | None = None, wait: bool = True, timeout: float | None = None, progress: bool = True,
             poll: float = 1.0, batch_invariant: bool = False) -> BundleKernel | TuningJob:
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
        scope once the server has tokens. ``shape`` may give dims as ranges, as a job does
        (``{"t": {"min": 1, "max": 4096}, "c": 4096}``): the range is tuned and its kernel for the
        largest sizes returned (a :class:`service.client.range_kernel.RangeKernel` serving every size);
        ``batch_invariant`` as :meth:`get` (one kernel for the whole range)."""
        budget = tuning_budget(trials, seconds)
        positive_seconds("poll", poll)
        if timeout is not None:
            positive_seconds("timeout", timeout)
        req = self._request(spec, shape, dtype, target, batch_invariant)
        if not wait:
            return self._server.submit(req, budget, measurer)
        self._run_job(req, budget=budget, measurer=measurer, timeout=timeout, progress=progress, poll=poll)
        found = self._fetch(req, allow_nearest=False)
        self._remember(memo_key(spec, shape, dtype, target, False, batch_invariant), req, False, found)
        return found.kernel

    def prefetch(self, requests: Iterable[tuple], *, allow_nearest: bool = False,
                 tune_if_missing: bool = False, tune_budget: Mapping[str, Any] | None = None) -> Prefetch:
        """Warm the memo for ``requests`` (each ``(spec, shape)``, ``(spec, shape, dtype)`` or
        ``(spec, shape, dtype, target)``) in background threads; returns at once with a
        :class:`Prefetch` whose ``wait()`` gives the kernels (or raises the first error)."""
        items = list(requests)
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or not 2 <= len(item) <= 4:
                raise ValueError(f"requests[{i}]: expected (spec, shape[, dtype[, target]]), got {str(item)[:80]}")
        pool = self._background()
        return Prefetch([pool.submit(self.get, *item, allow_nearest=allow_nearest, tune_if_missing=tune_if_missing,
                                     tune_budget=tune_budget) for item in items])

    # ------------------------------------------------------------------------- the memo
    def _request(self, spec: Any, shape: Any, dtype: Any, target: Any, batch_invariant: bool = False) -> KernelRequest:
        """The validated request; the spec argument is parsed and hashed once per distinct one."""
        skey = spec_key(spec)
        facts = self._specs.get(skey) if skey is not None else None
        if facts is None:
            facts = SpecFacts.of(spec)
            if skey is not None:
                with self._memo_lock:
                    bounded_put(self._specs, skey, facts)
        return KernelRequest.of(facts, shape, dtype, target, batch_invariant)

    def _remembered(self, key: Hashable | None) -> MemoEntry | None:
        # one dict read, atomic under the GIL: the hot path takes no lock
        return self._memo.get(key) if key is not None else None

    def _remember(self, key: Hashable | None, req: KernelRequest, allow_nearest: bool, found: Found) -> None:
        if key is None or self.revalidate_after == 0:
            return
        entry = MemoEntry(found, req, allow_nearest, self._fresh_until())
        with self._memo_lock:
            bounded_put(self._memo, key, entry)

    def _fresh_until(self) -> float:
        return math.inf if self.revalidate_after is None else self._now() + self.revalidate_after

    def _background(self) -> ThreadPoolExecutor:
        if self._closed.is_set():
            raise KernelCacheError("this KernelCache is closed")
        with self._memo_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="foldwise-client")
            return self._pool

    def _revalidate_later(self, key: Hashable, entry: MemoEntry) -> None:
        """Schedule one revalidation of a stale entry (not one per call while it runs)."""
        with self._memo_lock:
            if entry.revalidating or self._memo.get(key) is not entry:
                return
            entry.revalidating = True
        try:
            self._background().submit(self._revalidate, key, entry)
        except (KernelCacheError, RuntimeError):  # closed, or shutting down: keep serving what we have
            entry.revalidating = False

    def _revalidate(self, key: Hashable, entry: MemoEntry) -> None:
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
        fresh = MemoEntry(found, entry.req, entry.allow_nearest, self._fresh_until())
        with self._memo_lock:
            if self._memo.get(key) is entry:
                self._memo[key] = fresh

    # ------------------------------------------------------------------------- one request
    def _fetch(self, req: KernelRequest, allow_nearest: bool) -> Found:
        """The server's kernel for ``req`` (:meth:`_resolve`), else the disk cache's when the
        server cannot be reached. A KernelNotFound from the server names the live job for the
        request, if it has one."""
        try:
            return self._resolve(req, allow_nearest)
        except ServerUnavailable as err:
            return Found(self._offline(req, allow_nearest, str(err)), None, None)
        except KernelNotFound:
            job = self._server.live_job(req)
            if job is None:
                raise
            raise KernelNotFound(
                f"no kernel yet for {req.what}: job {job.id} for it is {job.state} on {self.base_url}; "
                "wait for it with KernelCache.tune(...) (it joins the job) or get(..., tune_if_missing=True)",
                job) from None

    def _resolve(self, req: KernelRequest, allow_nearest: bool, known: Found | None = None) -> Found:
        """Ask the server for ``req``'s kernel: look it up, download (or revalidate the disk copy
        of) its bundle, verify, store, load. ``known``: the kernel in hand, kept as is (no
        download) when the server names the same kernel and bundle. Raises ServerUnavailable."""
        view = self._server.lookup(req)
        if isinstance(view.get("range"), Mapping):  # a tuned range holds the shape: load every bucket
            return self._resolve_range(req, view, known)
        if req.batch_invariant:
            raise KernelIntegrityError(f"the server answered {req.what} with a kernel for one shape, not a range")
        if view.get("exact_match") is False and not allow_nearest:
            raise KernelNotFound(self._nearest_message(req, view.get("shape")))
        kernel_id, want = str(view["id"]), view.get("bundle_sha256")
        if known is not None and (known.kernel_id, known.bundle_sha256) == (kernel_id, want):
            return known
        bundle = self._server.fetch_bundle(view, req, self._disk, binaries=self.binaries)
        exact = bundle["shape"] == req.cshape
        if view.get("exact_match") is True and not exact:
            raise KernelIntegrityError(f"the server marked a kernel for shape {req.show(bundle['shape'])} "
                                       f"as an exact match for {req.what}")
        if not exact and not allow_nearest:
            raise KernelNotFound(self._nearest_message(req, bundle["shape"]))
        self._check_request(bundle, req)
        self._disk.store(bundle, req.key, {"spec_hash": req.shash, "shape": req.cshape, "dtype": req.ndtype,
                                      "target": req.target, "kernel_id": view.get("id"), "exact": exact})
        return Found(self._load(bundle).for_spec(req.user), want if isinstance(want, str) else None, kernel_id)

    def _resolve_range(self, req: KernelRequest, view: dict, known: Found | None) -> Found:
        """A lookup answered by a tuned range (service.shape_ranges): download (or revalidate) and
        verify every bucket's bundle, check each is for the request and its bucket's shape, and
        wrap them in one :class:`service.client.range_kernel.RangeKernel`, remembered for every shape of
        the range. ``known`` is kept when the server names the same range and bundles."""
        rng = view["range"]
        buckets = rng.get("buckets")
        shape = rng.get("shape")
        if not isinstance(buckets, list) or not buckets or not isinstance(shape, Mapping):
            raise KernelServiceError(f"GET /v1/kernels: a range without buckets: {str(rng)[:200]}")
        if pick_bucket(shape, req.cshape) is None:
            raise KernelIntegrityError(f"the server answered {req.what} with a range {req.show(shape)} "
                                       "that does not hold it")
        if req.batch_invariant and not one_kernel(shape):
            raise KernelIntegrityError(f"the server answered {req.what} with a range of several buckets "
                                       f"{req.show(shape)}")
        ident = hashlib.sha256(json.dumps([rng.get("id"), [b.get("bundle_sha256") for b in buckets]])
                               .encode()).hexdigest()
        if known is not None and (known.kernel_id, known.bundle_sha256) == (f"range:{rng.get('id')}", ident):
            return known
        loaded = []
        for b in buckets:
            bundle = self._server.fetch_bundle({"id": b.get("kernel_id"), "bundle_sha256": b.get("bundle_sha256")}, req,
                                               self._disk, binaries=self.binaries)
            self._check_request_fields(bundle, req)
            if bundle["shape"] != b.get("shape"):
                raise KernelIntegrityError(f"the server sent a bundle for {req.show(bundle['shape'])} as the "
                                           f"range's bucket {req.show(b.get('shape'))}")
            self._disk.store_bundle(bundle)
            loaded.append((bundle["shape"], self._load(bundle).for_spec(req.user)))
        try:
            kernel = RangeKernel(shape, loaded)
        except BundleError as err:
            raise KernelIntegrityError(f"the range for {req.what}: {err}") from None
        self._disk.store_range(req, shape, [(b["shape"], k.sha256) for b, (_, k) in zip(buckets, loaded)])
        found = Found(kernel, ident, f"range:{rng.get('id')}")
        with self._memo_lock:  # every later get() inside this range is answered without a request
            self._ranges[self._range_key(req)] = (shape, found, req.user)
        return found

    def _in_known_range(self, req: KernelRequest) -> Found | None:
        """A range already loaded in this process that holds ``req``'s shape (no request)."""
        hit = self._ranges.get(self._range_key(req))
        if hit is None or pick_bucket(hit[0], req.cshape) is None:
            return None
        return hit[1]

    @staticmethod
    def _range_key(req: KernelRequest) -> tuple:
        return req.shash, dtype_text(req.ndtype), req.target, id(req.user), req.batch_invariant

    # ------------------------------------------------------------------------- tuning jobs
    def _run_job(self, req: KernelRequest, *, budget: dict, measurer: str | None, timeout: float | None, progress: bool,
                 poll: float) -> TuningJob:
        """Submit (or join) ``req``'s job and wait for it to succeed, showing its progress."""
        job = self._server.submit(req, budget, measurer)
        deadline = None if timeout is None else time.monotonic() + timeout
        line = ProgressLine(f"{req.user.name} {req.show(req.cshape)} {dtype_text(req.ndtype)} {req.target}", progress)
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
                    job = self._server.job(job.id)
                except ServerUnavailable as err:  # a blip on a long wait: ask again at the next poll
                    log.debug("polling job %s: %s", job.id, err)
        finally:
            line.close()
        if job.status != "succeeded":
            raise KernelTuningError(f"job {job.id} for {req.what} {job.status}"
                                    f"{': ' + job.error if job.error else ''}")
        return job

    # ------------------------------------------------------------------------- checks, offline, loading
    @staticmethod
    def _nearest_message(req: KernelRequest, shape: Any) -> str:
        return (f"no kernel tuned for {req.what}; the server has one for the nearest shape {req.show(shape)} "
                "(pass allow_nearest=True to use it, or submit a tuning job)")

    def _check_request(self, bundle: dict, req: KernelRequest) -> None:
        """The server must have answered the question asked (a nearest shape must fit the request)."""
        self._check_request_fields(bundle, req)
        limits = bundle["size_limits"]
        too_big = [(d, n, limits[d]) for d, n in req.cshape.items() if d in limits and n > limits[d]]
        if too_big:
            d, n, limit = too_big[0]
            raise KernelNotFound(f"the nearest kernel for {req.what} (tuned for {req.show(bundle['shape'])}) holds "
                                 f"dim {req.names.user(d)} in a block of {limit} and cannot take {n}; "
                                 "submit a tuning job")

    @staticmethod
    def _check_request_fields(bundle: dict, req: KernelRequest) -> None:
        for field, expected in (("spec_hash", req.shash), ("target", req.target), ("dtype", req.ndtype)):
            if bundle[field] != expected:
                raise KernelIntegrityError(f"the server sent a bundle for {field} {bundle[field]!r:.80}, "
                                           f"not {expected!r:.80}, when asked for {req.what}")

    def _offline(self, req: KernelRequest, allow_nearest: bool, reason: str) -> BundleKernel | RangeKernel:
        bundle = None if req.batch_invariant else self._disk.from_index(req.key, allow_nearest)
        if bundle is not None:
            return self._load(bundle).for_spec(req.user)
        in_range = self._range_from_disk(req)
        if in_range is None:
            raise KernelNotFound(f"{reason}; and the disk cache {self.cache_dir} has no kernel for {req.what}",
                                 offline=True)
        return in_range

    def _range_from_disk(self, req: KernelRequest) -> RangeKernel | None:
        """A range on disk holding ``req``'s shape, every bucket's bundle verified and for the
        request, as a :class:`RangeKernel`; None otherwise (a damaged entry is skipped)."""
        for shape, bundles in self._disk.ranges_holding(req):
            if req.batch_invariant and not one_kernel(shape):
                continue
            try:
                loaded = []
                for bundle in bundles:
                    self._check_request_fields(bundle, req)
                    loaded.append((bundle["shape"], self._load(bundle).for_spec(req.user)))
                return RangeKernel(shape, loaded)
            except (ValueError, KeyError, TypeError, AttributeError, KernelIntegrityError, BundleError):
                continue
        return None

    def _load(self, bundle: dict) -> BundleKernel:
        with self._lock:
            kernel = self._kernels.get(bundle["sha256"])
            if kernel is None:
                kernel = load_bundle(bundle)
                kernel.info = prepare_binary(bundle, kernel)
                self._kernels[bundle["sha256"]] = kernel
            return kernel
