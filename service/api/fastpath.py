"""The bundle download hot path: ``GET /v1/kernels/{id}/bundle`` without the framework's
per-request machinery.

Inference servers download bundles at start-up, all at once; this path is what
``benchmarks/load_service.py`` measures. It answers before FastAPI's routing and dependency
injection (a pure ASGI middleware, :class:`BundleFastPath`), with the same semantics as the
documented route in routes_kernels.py, which calls the same :func:`bundle_answer`:

1. the auth check (:meth:`service.auth.AuthPolicy.require` with scope ``kernels:read``);
2. the kernel's current bundle hash: one primary-key lookup (a kernel is replaced in place
   when a better one is found, so this is read every time, never cached); for ``?format=2``,
   ``?format=3`` or ``?arch=``, the same lookup joined to the bundle's precomputed view
   (service.store.served_bundles: built when the bundle or a binary was stored, never per request);
3. ``If-None-Match`` -> 304; else the bytes from the in-memory cache by sha256 (content
   addressed: never stale), or from the database, re-hashed, then cached.

Steps 1-2 are two indexed reads. On an SQLite file they run on the event loop itself, on a
connection of their own (autocommit, ``query_only``, WAL: a read never waits for a writer;
``busy_timeout`` is short, and a busy database falls back to the thread pool): a thread-pool
hop costs more than the reads. On PostgreSQL (a network round trip) they run in the thread
pool.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool

from service import errors
from service.api import ops
from service.api.deps import AppContext, auth_problem
from service.api.problems import HttpProblem, not_found
from service.auth import _ANY_TOKEN, _TOKEN_ROW, AuthError, TokenLookup
from service.bundle import ARCH_PATTERN
from service.bundle.signing import SIGNATURE_HEADER
from service.store.models import KernelRecord, ServedBundle
from service.store.served_bundles import no_binaries, served_bytes, view_of

log = logging.getLogger("foldwise.api")
BUNDLE_PATH = re.compile(r"/v1/kernels/([0-9a-f]{32})/bundle")
ARCH = re.compile(ARCH_PATTERN.encode())  # the route's pattern for ?arch=
ROUTE = SimpleNamespace(path="/v1/kernels/{kernel_id}/bundle")  # the metrics label
_SHA_QUERY = sa.select(KernelRecord.bundle_sha256).where(KernelRecord.id == sa.bindparam("kernel_id"))
# formats 2 and 3: the kernel's bundle joined to its precomputed views (service.store.served_bundles), one indexed read
_SERVED_QUERY = (sa.select(KernelRecord.bundle_sha256, ServedBundle.view, ServedBundle.sha256)
                 .outerjoin(ServedBundle, sa.and_(ServedBundle.bundle_sha256 == KernelRecord.bundle_sha256,
                                                  ServedBundle.view.in_([sa.bindparam("view"),
                                                                         sa.bindparam("fallback")])))
                 .where(KernelRecord.id == sa.bindparam("kernel_id")))


class _Raw:
    """A SQLAlchemy statement compiled once for SQLite, run on the raw sqlite3 connection."""

    def __init__(self, stmt: Any):
        from sqlalchemy.dialects import sqlite

        compiled = stmt.compile(dialect=sqlite.dialect())
        self.sql, self.names = str(compiled), list(compiled.positiontup or [])
        self.defaults = compiled.construct_params({b.key: None for b in compiled.binds.values() if b.required})

    def first(self, conn: Any, **values: Any) -> Any:
        return conn.execute(self.sql, [values.get(n, self.defaults.get(n)) for n in self.names]).fetchone()

    def all(self, conn: Any, **values: Any) -> list[Any]:
        return conn.execute(self.sql, [values.get(n, self.defaults.get(n)) for n in self.names]).fetchall()


_RAW_SHA = _Raw(_SHA_QUERY)
_RAW_SERVED = _Raw(_SERVED_QUERY)


class RawTokenLookup(TokenLookup):
    """service.auth's token reads through a raw sqlite3 connection (the same statements)."""

    any_sql = _Raw(_ANY_TOKEN)
    row_sql = _Raw(_TOKEN_ROW)

    def any_token(self) -> bool:
        return self.any_sql.first(self.db) is not None

    def token_row(self, digest: str) -> Any:
        return self.row_sql.first(self.db, digest=digest)


class LoopReader:
    """One SQLite connection used only from the event loop thread (see the module docstring):
    the raw sqlite3 connection of a read-engine connection (autocommit, ``query_only``)."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self._conn: sa.Connection | None = None
        self._lock = threading.Lock()  # only the loop thread uses it; the lock makes misuse safe

    def run(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = self.engine.connect()
                self._conn.exec_driver_sql("PRAGMA busy_timeout=50")
                self._conn.commit()
            try:
                return fn(self._conn.connection.driver_connection, *args)
            except sqlite3.OperationalError as err:  # busy, or a broken connection: take a new one next time
                self._conn.invalidate()
                self._conn = None
                raise sa.exc.OperationalError("loop reader", None, err) from err

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _served(rows: list[Any], kernel_id: str, view: str | None) -> tuple[str, str]:
    """(ETag sha256, the view served: "" for format 1, else the view asked for or, for an arch
    without a binary, its format's one without binaries) from the rows of a lookup; HttpProblem 404
    for an unknown kernel, 500 for a bundle without its format-2/-3 copies (not migrated)."""
    if not rows:
        raise not_found("kernel", kernel_id)
    if view is None:
        return rows[0][0], ""
    found = {r[1]: r[2] for r in rows if r[1] is not None}
    for v in (view, no_binaries(view)):
        if v in found:
            return found[v], v
    raise HttpProblem(500, "Stored bundle incomplete", f"kernel {kernel_id}: bundle {rows[0][0]} has no stored "
                      f"format-{view.split(':')[0]} copy (run `foldwise db upgrade`)", kind="bundle-corrupted")


def _lookup(conn: Any, ctx: AppContext, kernel_id: str, authorization: str | None,
            view: str | None) -> tuple[str, str, str]:
    """Auth check, then (etag, bundle sha256, view) of the request (HttpProblem 401/403/404), on a raw
    sqlite3 connection. ``view`` None: format 1 (the bundle itself)."""
    try:
        ctx.auth.require(RawTokenLookup(conn), authorization, "kernels:read")
    except AuthError as err:
        raise auth_problem(err) from None
    if view is None:
        rows = [(r[0], None, None) for r in [_RAW_SHA.first(conn, kernel_id=kernel_id)] if r is not None]
    else:
        rows = _RAW_SERVED.all(conn, kernel_id=kernel_id, view=view, fallback=no_binaries(view))
    etag, chosen = _served(rows, kernel_id, view)
    return etag, rows[0][0], chosen


def _lookup_sa(conn: Any, ctx: AppContext, kernel_id: str, authorization: str | None,
               view: str | None) -> tuple[str, str, str]:
    """The same through SQLAlchemy (any database)."""
    try:
        ctx.auth.require(conn, authorization, "kernels:read")
    except AuthError as err:
        raise auth_problem(err) from None
    if view is None:
        rows = [(sha, None, None) for sha in [conn.execute(_SHA_QUERY, {"kernel_id": kernel_id}).scalar_one_or_none()]
                if sha is not None]
    else:
        rows = conn.execute(_SERVED_QUERY, {"kernel_id": kernel_id, "view": view, "fallback": no_binaries(view)}).all()
    etag, chosen = _served(rows, kernel_id, view)
    return etag, rows[0][0], chosen


def _lookup_pooled(ctx: AppContext, kernel_id: str, authorization: str | None, view: str | None) -> tuple[str, str, str]:
    with ctx.read_engine.connect() as conn:
        return _lookup_sa(conn, ctx, kernel_id, authorization, view)


def _bytes(ctx: AppContext, kernel_id: str, bundle_sha: str, view: str) -> tuple[str, bytes]:
    with ctx.read_sessions() as session:
        if not view:
            return ops.bundle_bytes(session, kernel_id)
        return served_bytes(session, bundle_sha, view)


def etag_matches(if_none_match: str | None, sha: str) -> bool:
    if if_none_match is None:
        return False
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/").strip('"') == sha:
            return True
    return False


async def bundle_answer(ctx: AppContext, kernel_id: str, authorization: str | None, if_none_match: str | None,
                        *, format: int = 1, arch: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a bundle request; raises HttpProblem for errors. ``format`` 2 or 3,
    or an ``arch`` (format 2 unless 3 is asked for): the precomputed view (service.store.served_bundles)."""
    view = view_of(arch, 3 if format == 3 else 2) if (format in (2, 3) or arch is not None) else None
    reader = ctx.loop_reader
    found = None
    if reader is not None:
        try:
            found = reader.run(_lookup, ctx, kernel_id, authorization, view)
        except sa.exc.OperationalError:
            found = None  # busy: ask again from the thread pool, which may wait
    if found is None:
        found = await run_in_threadpool(_lookup_pooled, ctx, kernel_id, authorization, view)
    sha, bundle_sha, chosen = found
    headers = {"ETag": f'"{sha}"', "Cache-Control": "no-cache"}
    if ctx.signer is not None:  # who served it (service.bundle.signing): the sha256 covers every field
        headers[SIGNATURE_HEADER] = ctx.signer.header(sha)
    if etag_matches(if_none_match, sha):
        ctx.metrics.bundle_downloads.labels("304").inc()
        return 304, headers, b""
    content = ctx.bundles.get(sha)
    if content is None:
        try:
            sha, content = await run_in_threadpool(_bytes, ctx, kernel_id, bundle_sha, chosen)
        except errors.NotFound:  # removed since the lookup
            raise not_found("kernel", kernel_id) from None
        except errors.BundleCorrupted as err:
            log.error("corrupted bundle refused", extra={"kernel_id": kernel_id, "error": str(err)})
            raise HttpProblem(500, "Stored bundle corrupted", str(err), kind="bundle-corrupted") from None
        ctx.bundles.put(sha, content)
        headers["ETag"] = f'"{sha}"'
        if ctx.signer is not None:
            headers[SIGNATURE_HEADER] = ctx.signer.header(sha)
    ctx.metrics.bundle_downloads.labels("200").inc()
    headers["Content-Type"] = "application/json"
    return 200, headers, content


def bundle_query(query_string: bytes) -> dict[str, Any] | None:
    """``format``/``arch`` of a bundle URL's query when they are what the documented route
    accepts (format 1, 2 or 3, an arch like sm_90a, each at most once); None otherwise (the
    route then answers, with its 422)."""
    out: dict[str, Any] = {}
    for pair in query_string.split(b"&"):
        name, _, value = pair.partition(b"=")
        if name == b"format" and value in (b"1", b"2", b"3") and "format" not in out:
            out["format"] = int(value)
        elif name == b"arch" and ARCH.fullmatch(value) and "arch" not in out:
            out["arch"] = value.decode("ascii")
        else:
            return None
    return out


class BundleFastPath:
    """ASGI middleware answering bundle downloads directly (module docstring)."""

    def __init__(self, app: Any, ctx: AppContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        match = BUNDLE_PATH.fullmatch(scope["path"])
        query = bundle_query(scope["query_string"]) if scope.get("query_string") else {}
        if match is None or query is None:  # not a bundle, or a query the route must refuse (422)
            await self.app(scope, receive, send)
            return
        scope["route"] = ROUTE
        authorization = if_none_match = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"if-none-match":
                if_none_match = value.decode("latin-1")[:1024]
        try:
            status, headers, body = await bundle_answer(self.ctx, match.group(1), authorization, if_none_match, **query)
        except HttpProblem as problem:
            await problem.response()(scope, receive, send)
            return
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if status == 200:
            raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})
