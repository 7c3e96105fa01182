"""Fixtures shared by every test folder: the packaged catalog of specs (fuser_core/catalog, the
one the package ships; helpers in tests/support/catalog.py), a per-session kernel cache directory
(generated kernels never land in ~/.cache/foldwise), databases and the GPU compiler's pool."""

from __future__ import annotations

import os

# Kernels run on the CPU through Triton's interpreter: set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

# tests/support's helpers assert too (tests.support.cascades.every_strategy_passes): their failures get
# pytest's detailed messages, as a test's own asserts do.
pytest.register_assert_rewrite("tests.support")

from fuser_core.catalog import CATALOG_ENV  # noqa: E402
from tests.support.catalog import CATALOG_DIR, load_catalog  # noqa: E402

# Tests read the packaged catalog only: a user's $FOLDWISE_CATALOG_DIR must not change what they see
# (tests of that variable set it themselves).
os.environ.pop(CATALOG_ENV, None)


@pytest.fixture(scope="session")
def catalog_dir() -> Path:
    return CATALOG_DIR


@pytest.fixture()
def catalog_specs() -> dict[str, dict]:
    """A fresh copy per test, so tests may mutate it."""
    return load_catalog()


LOGGERS = ("foldwise", "uvicorn", "uvicorn.error", "uvicorn.access")  # what service.logs.configure_logging sets


@pytest.fixture(autouse=True)
def restored_logging():
    """The loggers' handlers, levels, propagation as they were before the test: a test that runs the
    CLI configures JSON logs to stderr and stops propagation, which would follow the next test in the
    process (its caplog would see nothing; a stderr it captures would get the JSON lines)."""
    import logging

    before = {name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
              for name, lg in ((n, logging.getLogger(n)) for n in LOGGERS)}
    yield
    for name, (handlers, level, propagate, disabled) in before.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """FOLDWISE_CACHE_DIR for the whole session: a fresh temporary directory (subprocesses inherit it)."""
    path = tmp_path_factory.mktemp("foldwise-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOLDWISE_CACHE_DIR", str(path))
        yield path


# --- databases -------------------------------------------------------------------------------

POSTGRES_URL = os.environ.get("FOLDWISE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def postgres_unreachable_reason() -> str | None:
    """None when the PostgreSQL server of FOLDWISE_TEST_POSTGRES_URL answers, else why not."""
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as err:  # any failure to connect means: no server for these tests
        return f"no PostgreSQL server at FOLDWISE_TEST_POSTGRES_URL ({POSTGRES_URL}): {type(err).__name__}"
    return None


@pytest.fixture()
def fresh_postgres_url():
    """A new, empty PostgreSQL database for one test (created from FOLDWISE_TEST_POSTGRES_URL's
    server and dropped afterwards), so concurrent test runs and migrations never meet."""
    import uuid

    import sqlalchemy as sa

    reason = postgres_unreachable_reason()
    if reason:
        pytest.skip(reason)
    name = f"fw_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def service_db_url(request, tmp_path):
    """An empty database URL for the service: an SQLite file, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'foldwise.db'}"
    return request.getfixturevalue("fresh_postgres_url")


@pytest.fixture()
def db_url(service_db_url):
    """A migrated service database (both backends, as ``service_db_url``)."""
    from service.store.db import upgrade

    upgrade(service_db_url)
    return service_db_url


@pytest.fixture()
def sessions(db_url):
    """A session factory on the migrated database ``db_url``."""
    from service.store.db import make_engine, session_factory

    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


# --- the GPU compiler ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def compile_pool(kernel_cache_dir):
    """Worker processes that run Triton's GPU compiler (interpreter off in them), shared by every
    test of the session; they inherit the session's FOLDWISE_CACHE_DIR."""
    from fuser_core.codegen.gpu_compile import CompilePool

    with CompilePool() as pool:
        yield pool
