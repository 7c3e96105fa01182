"""Per-request dependencies: the database session (with the auth check) and the app context.

**One session per request, one thread hop.** A route takes a :class:`Db` (``Depends(database(...))``)
and calls ``await db.run(fn, ...)``: ``fn(session, ...)`` is a plain function (a store's or
this package's logic) run in the thread pool, so the event loop never waits on the database.
The request's token is checked in the same thread, with the same session, before the first
``fn``, so a request costs one hop to the thread pool rather than three (a sync dependency's
enter and exit, and a sync route, would each take one). The session is closed (its connection
back in the pool) at the end of each ``run``, in the thread that used it.

Reads use a *read* session: on SQLite an engine without ``BEGIN IMMEDIATE`` (service/store/db.py
starts every transaction with it, which takes the write lock) and with ``query_only``, so
concurrent reads in WAL mode neither wait for each other nor for a worker's write; on
PostgreSQL the same engine as writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.api.cache import BundleCache, SpecCache
from service.api.derive import DerivationPool
from service.api.problems import HttpProblem
from service.auth import AuthError, AuthPolicy, Principal
from service.bundle.signing import Signer
from service.metrics import Metrics
from service.settings import Settings

if TYPE_CHECKING:
    from service.api.fastpath import LoopReader

T = TypeVar("T")
bearer = HTTPBearer(auto_error=False, description="an API token: `foldwise token create`")
BearerDep = Depends(bearer)  # documents the scheme in OpenAPI; the check itself is AuthPolicy's


@dataclass
class AppContext:
    """Everything the routes share; one per app (``app.state.ctx``), given to a route by the
    typed dependency :data:`Context`."""

    settings: Settings
    engine: Engine
    read_engine: Engine
    sessions: sessionmaker[Session]
    read_sessions: sessionmaker[Session]
    auth: AuthPolicy
    metrics: Metrics
    bundles: BundleCache  # bundle bytes by sha256
    specs: SpecCache  # stored specs, parsed (service.api.ops.SpecInfo)
    deriver: DerivationPool  # derivations off the event loop, with a time limit
    loop_reader: LoopReader | None = None  # an SQLite file's hot-path reads on the event loop (fastpath)
    signer: Signer | None = None  # signs every served bundle's sha256 (settings.signing_key_file)


def context(request: Request) -> AppContext:
    return request.app.state.ctx


async def _context(request: Request) -> AppContext:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and a
    # wait for the GIL back while another thread computes) on every request for an attribute read
    return request.app.state.ctx


Context = Annotated[AppContext, Depends(_context)]  # a route's typed handle on the app's shared state


def auth_problem(err: AuthError) -> HttpProblem:
    return HttpProblem(err.status, "Unauthorized" if err.status == 401 else "Forbidden", err.message, kind="auth",
                       headers={"WWW-Authenticate": err.www_authenticate})


class Db:
    """The request's database access; see the module docstring."""

    def __init__(self, ctx: AppContext, authorization: str | None, scope: str | None, *, write: bool):
        self.ctx, self.authorization, self.scope, self.write = ctx, authorization, scope, write
        self.principal: Principal | None = None
        self._session: Session | None = None
        self._read_session: Session | None = None
        self._checked = False

    def _needs_check(self) -> bool:
        """Whether the auth check must look at the database (open loopback status reads need not)."""
        return not (self.authorization is None and self.scope is None and self.ctx.auth.loopback)

    def _check(self, session: Session) -> None:
        if not self._checked:
            try:
                self.principal = self.ctx.auth.require(session, self.authorization, self.scope)
            except AuthError as err:
                raise auth_problem(err) from None
            self._checked = True

    def call(self, fn: Callable[..., T], *args: Any, read: bool = False, **kwargs: Any) -> T:
        """Run ``fn(session, ...)`` here (in the calling thread), after the auth check.

        ``read=True``: on a read session even in a writing request (a lookup that may spare
        the write)."""
        if read or not self.write:
            session = self._read_session = self._read_session or self.ctx.read_sessions()
        else:
            session = self._session = self._session or self.ctx.sessions()
        try:
            if self._needs_check():
                self._check(session)
            else:
                self._checked = True
            return fn(session, *args, **kwargs)
        finally:
            session.close()

    async def run(self, fn: Callable[..., T], *args: Any, read: bool = False, **kwargs: Any) -> T:
        """``fn(session, ...)`` in the thread pool, after the auth check."""
        return await run_in_threadpool(self.call, fn, *args, read=read, **kwargs)

    async def authorize(self) -> Principal | None:
        """The auth check alone (for routes that need no database otherwise)."""
        if self._needs_check():
            await self.run(lambda session: None)
        return self.principal


def database(scope: str | None, *, write: bool = False) -> Callable[..., Any]:
    """A dependency giving a :class:`Db` that requires ``scope`` (None: a status read)."""

    async def dependency(request: Request, _credentials: HTTPAuthorizationCredentials | None = BearerDep) -> Db:
        return Db(request.app.state.ctx, request.headers.get("authorization"), scope, write=write)

    return dependency
