"""Database engines, sessions and migrations.

SQLite (a file; the default) and PostgreSQL (production) behave the same for the job queue:

- **SQLite**: write-ahead log, ``busy_timeout`` 30 s, foreign keys on, and every transaction
  starts with ``BEGIN IMMEDIATE``. Python's sqlite3 driver would otherwise open a transaction
  only at the first write, so a read-then-write (claim a job, check a lease, upsert a trial)
  would not be atomic between processes, and a stale read snapshot would fail at its first
  write with "database is locked" instead of waiting. The price: one writer at a time, and
  every open transaction holds the write lock, so **keep sessions short** (commit or close
  them; never hold one across a tuning run).
- **PostgreSQL**: ``pool_pre_ping`` (a restarted server does not break the pool); row locks
  (``FOR UPDATE [SKIP LOCKED]``) in :mod:`service.store.job_queue` do the rest.

Migrations are Alembic's, in ``migrations/`` next to the ``service`` package; the config is
built here, so they run from any working directory. A shared database is migrated with
``foldwise db upgrade`` (:func:`upgrade`); the server and workers call :func:`check_current`
and refuse to run against a database that is behind.

Example:
    >>> upgrade("sqlite:///foldwise.db")                         # doctest: +SKIP
    >>> engine = make_engine("sqlite:///foldwise.db"); check_current(engine)   # doctest: +SKIP
    >>> Session = session_factory(engine)                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30
# Alembic's `context` and `op` are module-level proxies: two migrations running in threads of one
# process would share them (and each other's connection). Processes are kept apart by locks in
# the database (migrations/env.py).
_ALEMBIC_LOCK = threading.RLock()
T = TypeVar("T")


# ----------------------------------------------------------------------------- engines


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """An engine for ``url`` with the settings described in the module docstring.

    Extra ``kwargs`` go to :func:`sqlalchemy.create_engine` (e.g. ``pool_size``)."""
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, **kwargs)
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(parsed, **kwargs)


def _is_memory(url: sa.URL) -> bool:
    return url.database in (None, "", ":memory:") or "mode=memory" in str(url)


def _sqlite_engine(url: sa.URL, **kwargs: Any) -> sa.Engine:
    connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False, **kwargs.pop("connect_args", {})}
    busy_ms = int(float(connect_args["timeout"]) * 1000)
    memory = _is_memory(url)
    if memory:  # one shared connection, or every connection would see its own empty database
        kwargs.setdefault("poolclass", StaticPool)
    engine = sa.create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver no longer opens transactions itself
        cursor = dbapi_connection.cursor()
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a commit is not an fsync
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (API views are built after it)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


# ----------------------------------------------------------------------------- migrations


class DatabaseBehind(RuntimeError):
    """The database is not at the migration this code expects (empty, or behind)."""


class DatabaseAhead(DatabaseBehind):
    """The database was migrated by newer code: its revision is unknown here.

    A subclass of :class:`DatabaseBehind` so that one ``except`` refuses both."""


def alembic_config(url: str | None = None):
    """An Alembic ``Config`` for ``migrations/``, independent of the working directory.

    The URL travels in ``config.attributes`` (not the ini options, whose ``%`` interpolation
    would mangle URL-encoded passwords)."""
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise RuntimeError(f"the migrations directory {MIGRATIONS_DIR} is missing; "
                           "is foldwise installed from its source tree (pip install -e .)?")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["url"] = url
    return config


@contextlib.contextmanager
def _migration_file_lock(url: str) -> Iterator[None]:
    """On an SQLite file, an exclusive lock on ``<db>.migrate.lock`` while migrating: concurrent
    ``upgrade`` runs in several processes otherwise may each read the old revision before the
    other commits and add the same column twice (seen under load: "duplicate column"). PostgreSQL
    serialises them with an advisory lock (migrations/env.py)."""
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        yield
        return
    import fcntl

    with open(f"{parsed.database}.migrate.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def upgrade(url: str, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` (``alembic upgrade head``)."""
    from alembic import command

    with _ALEMBIC_LOCK, _migration_file_lock(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Undo migrations down to ``revision`` (``"base"``: drop every table)."""
    from alembic import command

    with _ALEMBIC_LOCK:
        command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    """The newest migration this code has."""
    from alembic.script import ScriptDirectory

    with _ALEMBIC_LOCK:
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    with _ALEMBIC_LOCK:
        return {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database is at; None when it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_current(engine: sa.Engine) -> None:
    """Raise :class:`DatabaseBehind` unless the database is at :func:`head_revision`."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    where = engine.url.render_as_string(hide_password=True)
    if current is not None and current not in known_revisions():
        raise DatabaseAhead(f"database at revision {current}, which this code does not know (it was migrated "
                            f"by a newer foldwise); code expects {head}: upgrade foldwise, or use another "
                            f"database than {where}")
    shown = current if current is not None else "none (never migrated)"
    raise DatabaseBehind(f"database at revision {shown}, code expects {head}: "
                         f"run `foldwise db upgrade --db {where}`")


# ----------------------------------------------------------------------------- Optuna


def study_storage_url(db_url: str) -> str:
    """Where Optuna's study tables live for the service database ``db_url``.

    PostgreSQL: the same database (``tuner.search.storage.make_storage`` puts Optuna's tables in the
    schema ``optuna``, beside the service's tables in ``public``). SQLite has no schemas and
    Optuna keeps its own ``alembic_version`` table, so its tables go to a sibling file:
    ``foldwise.db`` -> ``foldwise.optuna.sqlite``. An in-memory SQLite URL is returned as is.
    """
    url = sa.engine.make_url(db_url)
    if url.get_backend_name() != "sqlite" or _is_memory(url):
        return db_url
    path = Path(url.database)  # type: ignore[arg-type]
    return url.set(database=str(path.with_name(f"{path.stem}.optuna.sqlite"))).render_as_string(hide_password=False)


MAX_LIST = 1000  # rows one listing answers at most


def page(session: Session, query: sa.Select, limit: int, offset: int) -> list[Any]:
    """One page of a listing query's rows (``limit`` clipped to MAX_LIST); ends the transaction."""
    query = query.limit(max(0, min(int(limit), MAX_LIST))).offset(max(0, int(offset)))
    rows = list(session.execute(query.execution_options(populate_existing=True)).scalars())
    session.commit()
    return rows


def newest_first(session: Session, model: Any, limit: int, offset: int, **equal: Any) -> list[Any]:
    """A page of ``model`` rows (jobs, kernels), newest first, where each given column equals its
    value (None: not filtered on)."""
    query = sa.select(model).order_by(model.created_at.desc(), model.id)
    for column, value in equal.items():
        if value is not None:
            query = query.where(getattr(model, column) == value)
    return page(session, query, limit, offset)


def get_row(session: Session, model: Any, key: str, what: str) -> Any:
    """The ``model`` row with primary key ``key``, read afresh; :class:`service.errors.NotFound`
    saying "no {what} {key}" otherwise. Ends the transaction."""
    from service.errors import NotFound

    row = session.get(model, key, populate_existing=True)
    session.commit()
    if row is None:
        raise NotFound(f"no {what} {key!r:.80}")
    return row


RETRIES = 5  # attempts of a write that lost a race (IntegrityError) before giving up


def committed(session: Session) -> bool:
    """Commit; False, rolled back, when a concurrent writer took a unique key first
    (IntegrityError): the caller reads the winner's row and tries again."""
    try:
        session.commit()
        return True
    except sa.exc.IntegrityError:
        session.rollback()
        return False


# ----------------------------------------------------------------------------- transient errors

_last_outage = {"at": float("-inf")}  # time.monotonic() of this process's last transient database error


def is_transient(err: BaseException) -> bool:
    """A database error that says the server could not be reached, not that the request was
    wrong: connection refused or reset, the server shutting down or restarting, a dropped
    connection, a pool timeout, a lock or serialisation conflict (all OperationalError on
    psycopg and sqlite3). Optuna's storage wraps such errors (``StorageInternalError``), and its
    ``_run_trial`` can hide one behind an ``UnboundLocalError`` (its ``finally`` reads a name
    the failed storage call never set): the chain of causes is searched."""
    return database_error(err) is not None


def database_error(err: BaseException) -> BaseException | None:
    """The transient database error in ``err``'s chain of causes (:func:`is_transient`), else None."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, sa.exc.DBAPIError) and err.connection_invalidated:
            return err
        if isinstance(err, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError,
                            sa.exc.TimeoutError)):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def note_outage() -> None:
    """Remember that the database was unreachable just now (see :func:`seconds_since_outage`)."""
    _last_outage["at"] = time.monotonic()


def seconds_since_outage() -> float:
    """Seconds since this process last met a transient database error (infinite: never)."""
    return time.monotonic() - _last_outage["at"]


def retry_transient(fn: Callable[[], T], *, what: str, stop: threading.Event | None = None,
                    give_up_after_stop_s: float = 3.0, first_delay_s: float = 0.25, max_delay_s: float = 8.0,
                    logger: Any = None) -> T:
    """``fn()``, retried while it raises a transient database error (:func:`is_transient`), with
    jittered exponential backoff (``first_delay_s`` doubling up to ``max_delay_s``). Other
    errors are raised at once. Without ``stop`` it retries until the database answers; once
    ``stop`` is set it gives up (raising the last error) ``give_up_after_stop_s`` later, so a
    process asked to stop during an outage still stops."""
    delay, stopping_since = first_delay_s, None
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_transient(err):
                raise
            note_outage()
            if stop is not None and stop.is_set():
                stopping_since = stopping_since or time.monotonic()
                if time.monotonic() - stopping_since >= give_up_after_stop_s:
                    raise
            if logger is not None:
                logger.warning(f"database unreachable ({what}); retrying", extra={"error": str(err)[:300],
                                                                                "retry_in_s": round(delay, 2)})
            wait = delay * random.uniform(0.5, 1.5)
            if stop is None:
                time.sleep(wait)
            elif stop.is_set():
                time.sleep(min(wait, give_up_after_stop_s / 3))
            else:
                stop.wait(wait)  # a stop cuts the wait short: the next try is the last few
            delay = min(2 * delay, max_delay_s)
