"""The FastAPI app: ``create_app(settings)`` wires the database, auth, metrics, logs, routes
and the dashboard. ``foldwise serve`` runs it with uvicorn; tests use it through TestClient.

Also usable as a uvicorn factory, configured from ``FOLDWISE_*`` variables::

    FOLDWISE_DB_URL=postgresql+psycopg://... uvicorn --factory service.api:create_app
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from fuser_core import MAX_SPEC_BYTES, SpecError
from service import errors
from service.api import routes_jobs, routes_kernels, routes_misc
from service.api.cache import BundleCache, SpecCache
from service.api.deps import AppContext
from service.api.derive import DerivationPool
from service.api.fastpath import BundleFastPath, LoopReader
from service.api.middleware import AccessLog, BodyLimit, NoNulBytes, OneAuthorization
from service.api.schemas import ProblemView
from service.api.problems import (
    HttpProblem,
    http_error_handler,
    problem_handler,
    spec_problem,
    unhandled_handler,
    validation_handler,
)
from service.auth import AuthPolicy, is_loopback
from service.bundle.signing import Signer
from service.store.db import check_current, make_engine, session_factory
from service.metrics import Metrics
from service.settings import Settings, get_settings

log = logging.getLogger("foldwise.api")
# a request body holds one spec (at most MAX_SPEC_BYTES, maybe as an escaped JSON string) and small fields
MAX_BODY_BYTES = 2 * MAX_SPEC_BYTES + 16 * 1024


def read_engine_for(url: str, engine: sa.Engine) -> sa.Engine:
    """An engine for the API's reads (see service.api.deps): on an SQLite file, connections in
    autocommit with ``query_only`` (no ``BEGIN IMMEDIATE``, so reads never take the write
    lock); otherwise ``engine`` itself."""
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") or "mode=memory" in url:
        return engine
    reader = sa.create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30},
                              pool_size=16, max_overflow=16)

    @sa.event.listens_for(reader, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # autocommit: a read holds no transaction open
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA query_only=ON")
        cursor.close()

    return reader


def load_signer(path: str | None) -> Signer | None:
    """The server's signing key (``FOLDWISE_SIGNING_KEY_FILE``), read once at start; a key that
    cannot be read stops the start, naming the setting: a server meant to sign never serves unsigned."""
    if not path:
        return None
    try:
        pem = open(path, "rb").read()  # noqa: SIM115 - a few hundred bytes, read once
    except OSError as err:
        raise ValueError(f"FOLDWISE_SIGNING_KEY_FILE: cannot read {path!r}: {err.strerror}") from None
    return Signer.from_pem(pem, where=f"FOLDWISE_SIGNING_KEY_FILE ({path})")


def create_app(settings: Settings | None = None, *, check_db: bool = True, dashboard: bool = True,
               derive_timeout_s: float | None = None, fast_path: bool = True) -> FastAPI:
    """The API for ``settings`` (default: from the environment).

    ``check_db``: refuse (``service.store.db.DatabaseBehind``) a database that is not migrated to
    this code's head. The server's bind address (``settings.host``) decides the auth policy
    (service.auth). ``fast_path``: answer bundle downloads before the framework's routing
    (service.api.fastpath; same answers).
    """
    settings = settings or get_settings()
    engine = make_engine(settings.db_url)
    if check_db:
        try:
            check_current(engine)
        except Exception:
            engine.dispose()
            raise
    reader = read_engine_for(settings.db_url, engine)
    sessions, read_sessions = session_factory(engine), session_factory(reader)
    alive_s = max(settings.lease_seconds, 3 * settings.heartbeat_seconds)
    ctx = AppContext(
        settings=settings, engine=engine, read_engine=reader, sessions=sessions, read_sessions=read_sessions,
        auth=AuthPolicy(loopback=is_loopback(settings.host), writer=sessions),
        metrics=Metrics(read_sessions, alive_within_s=alive_s), bundles=BundleCache(), specs=SpecCache(),
        deriver=DerivationPool(derive_timeout_s or settings.derive_timeout_seconds, workers=settings.derive_workers,
                        queue=settings.derive_queue),
        # an SQLite file: the hot path reads on the event loop (service.api.fastpath)
        loop_reader=LoopReader(reader) if reader is not engine else None,
        signer=load_signer(settings.signing_key_file),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.deriver.warm_up()
        yield
        if ctx.loop_reader is not None:
            ctx.loop_reader.close()
        ctx.deriver.close()
        if reader is not engine:
            reader.dispose()
        engine.dispose()

    app = FastAPI(
        title="Foldwise", version=_version(), lifespan=lifespan,
        description="Derive, tune and serve fused kernels for cascaded reductions. Errors are "
                    "application/problem+json naming the field; see service/auth.py for who may do what.",
    )
    app.state.ctx = ctx
    # what the dashboard (service.dashboard) reads
    app.state.settings, app.state.sessions, app.state.auth = settings, sessions, ctx.auth
    app.state.engine = engine

    app.add_exception_handler(HttpProblem, problem_handler)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(SpecError, _spec_error)
    app.add_exception_handler(errors.JobError, _job_error)
    app.add_exception_handler(sa.exc.OperationalError, _database_error)
    app.add_exception_handler(Exception, unhandled_handler)

    app.include_router(routes_jobs.router)
    app.include_router(routes_kernels.router)
    app.include_router(routes_misc.router)
    if dashboard:
        from service.dashboard import mount_dashboard

        mount_dashboard(app)
    if fast_path:
        app.add_middleware(BundleFastPath, ctx=ctx)
    app.add_middleware(OneAuthorization)  # before the fast path and every route read the header
    app.add_middleware(NoNulBytes)  # before any text parameter reaches a route (or a database filter)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(AccessLog, metrics=ctx.metrics)
    _document_problems(app)
    return app


def _document_problems(app: FastAPI) -> None:
    """Make the OpenAPI document say what the API answers on errors: every error response is
    ``application/problem+json`` with the ProblemView schema (FastAPI's generated 422 says
    ``application/json`` with its own validation schema, which we never send), and every
    operation has a ``default`` problem response for the errors any route can give (400 for a
    body that is not UTF-8 JSON, 401 for a presented bad token, 413, 500, 503). Checked by
    tests/service/test_api_fuzz.py (schemathesis: status codes, content types and bodies)."""
    from fastapi.openapi.utils import get_openapi

    from service.api.problems import PROBLEM_JSON

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            components["ProblemView"] = ProblemView.model_json_schema(ref_template="#/components/schemas/{model}")
            problem = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/ProblemView"}}}
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    for code, response in responses.items():
                        if code[:1] in ("4", "5"):
                            response["content"] = dict(problem)
                    responses["default"] = {"description": "an error (RFC 9457 problem+json naming the field)",
                                            "content": dict(problem)}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("foldwise")
    except metadata.PackageNotFoundError:
        return "0"


async def _spec_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SpecError)
    return spec_problem(exc).response()


async def _job_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, errors.NotFound):
        return HttpProblem(404, "Not found", str(exc), kind="not-found").response()
    if isinstance(exc, errors.BundleCorrupted):
        log.error("corrupted bundle refused", extra={"path": request.url.path, "error": str(exc)})
        return HttpProblem(500, "Stored bundle corrupted", str(exc), kind="bundle-corrupted").response()
    return HttpProblem(503, "Try again", str(exc), kind="conflict", headers={"Retry-After": "1"}).response()


async def _database_error(request: Request, exc: Exception) -> Response:
    log.warning("database unavailable", extra={"path": request.url.path, "error": str(exc)[:300]})
    return HttpProblem(503, "Database unavailable", "the database did not answer; try again",
                       kind="database", headers={"Retry-After": "2"}).response()
