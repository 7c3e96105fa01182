"""Where a search's studies live: the RDB storage, study names, and trials orphaned by a lost worker.

Contract: :func:`make_storage` opens (and on a fresh database creates) Optuna's tables for a
URL, with heartbeats and retry of trials whose worker died; :func:`open_storage` does the same
for a URL and passes a storage object through; :func:`study_name_for` names a job's study;
:func:`fail_orphaned_trials` fails the RUNNING trials of a study whose worker lost the job.
Nothing here reads what a trial measured (:mod:`tuner.search.trials` does).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.trial import TrialState


def make_storage(
    url: str,
    *,
    heartbeat_interval: int | None = 10,
    grace_period: int | None = None,
    max_retry: int | None = 2,
    schema: str | None = "optuna",
) -> optuna.storages.RDBStorage:
    """An RDB storage for a shared study, with heartbeats and retry of trials whose worker died.

    ``url`` is an SQLAlchemy URL: ``sqlite:///tune.db`` or
    ``postgresql+psycopg://user@host:5432/db``. Every ``heartbeat_interval`` seconds a running
    trial records a heartbeat; one silent for ``grace_period`` seconds (default twice the
    interval) is failed by the next worker that starts a trial, and re-enqueued with the same
    parameters up to ``max_retry`` times. ``heartbeat_interval=None`` turns heartbeats off.

    On PostgreSQL Optuna's tables live in their own ``schema`` (created when missing), so its
    table names (``studies``, ``trials``) and its ``alembic_version`` never meet the service's
    own tables and migrations. SQLite has no schemas: use a file of its own.

    Example::

        storage = make_storage("sqlite:///tune.db", heartbeat_interval=5)
        study = optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    """
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # several processes write one file: wait for the lock rather than fail at once
        engine_kwargs["connect_args"] = {"timeout": 60}
    elif url.startswith("postgresql") and schema:
        _ensure_schema(url, schema)
        engine_kwargs["connect_args"] = {"options": f"-csearch_path={schema}"}
        engine_kwargs["pool_pre_ping"] = True
    kwargs: dict[str, Any] = {"engine_kwargs": engine_kwargs}
    if heartbeat_interval is not None:
        kwargs["heartbeat_interval"] = heartbeat_interval
        kwargs["grace_period"] = grace_period or 2 * heartbeat_interval
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
            if retry_cls is not None:  # optuna >= 4.9
                kwargs["heartbeat_stale_trial_callback"] = retry_cls(max_retry=max_retry)
            else:
                kwargs["failed_trial_callback"] = optuna.storages.RetryFailedTrialCallback(max_retry=max_retry)
    storage = _open_rdb_storage(url, kwargs)
    if url.startswith("sqlite"):
        _sqlite_wal(storage)
    return storage


def _open_rdb_storage(url: str, kwargs: dict[str, Any], attempts: int = 5) -> optuna.storages.RDBStorage:
    """Open (and on a fresh database create) Optuna's tables. Several workers starting at once
    race on creating them (PostgreSQL: a unique violation on Optuna's enum type): retry."""
    import sqlalchemy as sa

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except sa.exc.IntegrityError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _sqlite_wal(storage: optuna.storages.RDBStorage) -> None:
    """Make an SQLite storage safe and quicker for several processes.

    Python's sqlite3 driver starts a transaction only at the first write, so Optuna's
    read-then-update of a trial's state (``SELECT ... FOR UPDATE`` on PostgreSQL) is not atomic
    there: two workers could both take the same enqueued trial and one then fails with "Cannot
    tell a COMPLETE trial". Every transaction therefore begins with ``BEGIN IMMEDIATE`` (one
    writer at a time, from its first read). The write-ahead log and normal sync make each
    commit (Optuna commits every attribute) cheap.
    """
    import sqlalchemy as sa

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver no longer opens transactions itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    def on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    sa.event.listen(storage.engine, "connect", on_connect)
    sa.event.listen(storage.engine, "begin", on_begin)
    storage.engine.dispose()


def _ensure_schema(url: str, schema: str) -> None:
    import sqlalchemy as sa

    if not schema.isidentifier():
        raise ValueError(f"schema name {schema!r} is not a plain identifier")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    except sa.exc.IntegrityError:
        pass  # another process created it at the same moment
    finally:
        engine.dispose()


def study_name_for(spec_hash: str, shape: Mapping[str, int], dtypes: str | Mapping[str, str], target: str,
                   measurer: str) -> str:
    """The study name of one tuning job: ``foldwise:<hash16>:m=4,n=300:float16:h100:model``.

    A map of dtypes that gives every input the same dtype is written as that one dtype.
    """
    shape_text = ",".join(f"{k}={v}" for k, v in sorted(shape.items()))
    if isinstance(dtypes, str):
        dtype_text = dtypes
    else:
        distinct = set(dtypes.values())
        dtype_text = (next(iter(distinct)) if len(distinct) == 1
                      else ",".join(f"{k}={v}" for k, v in sorted(dtypes.items())))
    return f"foldwise:{spec_hash[:16]}:{shape_text}:{dtype_text}:{target}:{measurer}"


def fail_orphaned_trials(storage: optuna.storages.BaseStorage, study_name: str, reason: str) -> int:
    """Mark the study's RUNNING trials FAIL (with ``reason`` as user attr ``orphaned``); returns how many.

    For the holder of a job's lease, whose own trials have finished: every trial still RUNNING
    belongs to a worker that lost the job (killed before Optuna's heartbeat grace period ran
    out, or cut off by a takeover). They carry no result, so they use none of the trial budget.

    Example::

        fail_orphaned_trials(storage, job.study_name, "its worker lost the job")
    """
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return 0
    failed = 0
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
        try:
            storage.set_trial_user_attr(t._trial_id, "orphaned", reason)
            # a result its worker set before dying (even a failed measurement) must not count
            storage.set_trial_user_attr(t._trial_id, "result", {"outcome": "orphaned", "error": reason})
            failed += bool(storage.set_trial_state_values(t._trial_id, TrialState.FAIL))
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            continue  # its worker finished it meanwhile
    return failed



def open_storage(storage: str | optuna.storages.BaseStorage) -> optuna.storages.BaseStorage:
    """A URL opened with :func:`make_storage` (its schema, heartbeats, SQLite settings), or the storage as given."""
    return make_storage(storage) if isinstance(storage, str) else storage
