"""Alembic environment for the service database (see service/store/db.py for how it is invoked).

The URL comes from ``config.attributes["url"]`` (set by :func:`service.store.db.alembic_config`),
or an open connection from ``config.attributes["connection"]``. Engines are made by
:func:`service.store.db.make_engine`, so SQLite migrations run with the same pragmas and
``BEGIN IMMEDIATE`` as the service. On PostgreSQL a transaction-level advisory lock makes
concurrent ``foldwise db upgrade`` runs wait for each other instead of both creating tables.
Only the default schema is compared and migrated: Optuna's tables live in the ``optuna``
schema with their own ``alembic_version``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from service.store.db import make_engine
from service.store.models import Base

config = context.config
target_metadata = Base.metadata
MIGRATION_LOCK_ID = 0x466F6C64  # "Fold": pg_advisory_xact_lock key for migrations


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: use service.store.db.upgrade(url) or `foldwise db upgrade --db URL`")
    return url


def _configure(**kwargs) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: sa.Connection) -> None:
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
