"""Settings, engines, migrations and the models-vs-migrations check (service/settings.py, db.py, models.py).

Database tests run on an empty SQLite file and a fresh PostgreSQL database (``service_db_url``).
"""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import ValidationError

from service.store import db
from service.store.models import Base, WorkerRecord
from service.settings import Settings, get_settings

TABLES = {"specs", "bundles", "kernels", "jobs", "trials", "workers", "api_tokens", "kernel_binaries", "served_bundles"}


@pytest.fixture()
def engine(service_db_url):
    eng = db.make_engine(service_db_url)
    yield eng
    eng.dispose()


def diff(engine) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)


# ----------------------------------------------------------------------------- settings


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("FOLDWISE_DB_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("FOLDWISE_LEASE_SECONDS", "30")
    monkeypatch.setenv("FOLDWISE_MEASURER", "")
    s = get_settings(port=9000, workers=None)  # None: not given on the command line
    assert (s.db_url, s.lease_seconds, s.port, s.workers, s.measurer) == (
        "postgresql+psycopg://u@h/db", 30.0, 9000, 1, None)
    assert Settings().db_url == "postgresql+psycopg://u@h/db"
    monkeypatch.delenv("FOLDWISE_DB_URL")
    assert Settings().db_url == "sqlite:///foldwise.db" and Settings().max_trials == 1000


@pytest.mark.parametrize("overrides,field", [
    ({"measurer": "stopwatch"}, "measurer"),
    ({"lease_seconds": 4, "heartbeat_seconds": 5}, "heartbeat_seconds"),
    ({"port": 70000}, "port"),
    ({"max_trials": 0}, "max_trials"),
])
def test_settings_reject_bad_values(overrides, field):
    with pytest.raises(ValidationError, match=field):
        get_settings(**overrides)


# ----------------------------------------------------------------------------- migrations


def test_migrate_from_empty(service_db_url, engine):
    with pytest.raises(db.DatabaseBehind, match=r"revision none .*code expects 0007: run `foldwise db upgrade --db "):
        db.check_current(engine)
    db.upgrade(service_db_url)
    db.check_current(engine)
    assert db.current_revision(engine) == db.head_revision() == "0007"
    assert TABLES <= set(sa.inspect(engine).get_table_names())
    db.upgrade(service_db_url)  # already at head: nothing to do
    db.check_current(engine)


def test_models_match_migrations(service_db_url, engine):
    db.upgrade(service_db_url)
    assert diff(engine) == []
    # the comparison is not vacuous: a model change shows up
    extra = sa.Column("extra", sa.Integer)
    Base.metadata.tables["jobs"].append_column(extra)
    try:
        assert any(d[0] == "add_column" and d[3].name == "extra" for d in diff(engine))
    finally:
        Base.metadata.tables["jobs"]._columns.remove(extra)
    assert diff(engine) == []


def test_downgrade_to_base_is_behind(service_db_url, engine):
    db.upgrade(service_db_url)
    db.downgrade(service_db_url, "base")
    assert not TABLES & set(sa.inspect(engine).get_table_names())
    with pytest.raises(db.DatabaseBehind, match="never migrated"):
        db.check_current(engine)
    db.upgrade(service_db_url)
    db.check_current(engine)


def test_database_behind_a_newer_migration(service_db_url, engine, tmp_path, monkeypatch):
    """Code with a newer migration (0099) refuses a database at the current head until it is upgraded."""
    db.upgrade(service_db_url)
    newer = tmp_path / "migrations"
    shutil.copytree(db.MIGRATIONS_DIR, newer, ignore=shutil.ignore_patterns("__pycache__"))
    (newer / "versions" / "0099_extra.py").write_text(
        'import sqlalchemy as sa\nfrom alembic import op\n\nrevision = "0099"\ndown_revision = "0007"\n'
        'branch_labels = None\ndepends_on = None\n\n\n'
        'def upgrade():\n    op.create_table("extra", sa.Column("id", sa.Integer, primary_key=True))\n\n\n'
        'def downgrade():\n    op.drop_table("extra")\n')
    monkeypatch.setattr(db, "MIGRATIONS_DIR", newer)
    assert db.head_revision() == "0099"
    with pytest.raises(db.DatabaseBehind) as info:
        db.check_current(engine)
    assert not isinstance(info.value, db.DatabaseAhead)
    assert "database at revision 0007, code expects 0099: run `foldwise db upgrade --db" in str(info.value)
    db.upgrade(service_db_url)
    db.check_current(engine)
    assert "extra" in sa.inspect(engine).get_table_names()
    # ... and the older code then refuses the newer database
    monkeypatch.undo()
    with pytest.raises(db.DatabaseAhead, match="revision 0099, which this code does not know"):
        db.check_current(engine)


def test_behind_message_hides_password():
    engine = sa.create_engine("postgresql+psycopg://fw:s3cret@db.example:5432/foldwise")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(db, "current_revision", lambda _engine: None)
        with pytest.raises(db.DatabaseBehind) as info:
            db.check_current(engine)
    assert "s3cret" not in str(info.value) and "db.example:5432/foldwise" in str(info.value)


def test_concurrent_upgrades(service_db_url, engine):
    """Several `foldwise db upgrade` processes at once: one migrates, the others wait and find it done."""
    import os
    import subprocess
    import sys

    code = "import sys; from service.store.db import upgrade; upgrade(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(db.MIGRATIONS_DIR.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", code, service_db_url], env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    db.check_current(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM alembic_version").scalar() == 1


def test_upgrades_in_threads_of_one_process(service_db_url, engine):
    import threading

    errors: list[BaseException] = []

    def run():
        try:
            db.upgrade(service_db_url)
        except BaseException as err:  # re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    db.check_current(engine)


# ----------------------------------------------------------------------------- engines and types


def test_sqlite_engine_settings(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    # BEGIN IMMEDIATE: an open transaction holds the write lock, so a second writer waits
    other = db.make_engine(f"sqlite:///{tmp_path / 'x.db'}", connect_args={"timeout": 0.2})
    with engine.begin() as conn:
        conn.exec_driver_sql("SELECT 1")
        with pytest.raises(sa.exc.OperationalError, match="locked"), other.begin() as conn2:
            conn2.exec_driver_sql("SELECT 1")
    engine.dispose()
    other.dispose()


def test_sqlite_foreign_keys_enforced(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with pytest.raises(sa.exc.IntegrityError, match="FOREIGN KEY"), engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO trials (job_id, number, state, predicted, created_at) "
                             "VALUES ('nojob', 0, 'complete', 0, '2026-01-01 00:00:00.000000')"))
    engine.dispose()


def test_memory_sqlite_shares_one_database():
    engine = db.make_engine("sqlite://")
    Base.metadata.create_all(engine)
    with db.session_factory(engine)() as s:
        s.add(WorkerRecord(id="w", hostname="h", target="h100", measurer="model", versions={}))
        s.commit()
    with db.session_factory(engine)() as s:
        assert s.get(WorkerRecord, "w").hostname == "h"
    engine.dispose()


def test_datetimes_are_utc_and_naive_refused(service_db_url, engine):
    db.upgrade(service_db_url)
    Session = db.session_factory(engine)
    plus2 = timezone(timedelta(hours=2))
    beat = datetime(2026, 3, 1, 14, 30, 5, 123456, tzinfo=plus2)  # 12:30:05 UTC
    with Session() as s:
        s.add(WorkerRecord(id="w", hostname="h", target="h100", measurer="model", versions={}, last_heartbeat=beat))
        s.add(WorkerRecord(id="v", hostname="h", target="h100", measurer="model", versions={},
                           last_heartbeat=datetime(2026, 3, 1, 12, 30, 6, tzinfo=UTC)))
        s.commit()
    with Session() as s:
        row = s.get(WorkerRecord, "w")
        assert row.last_heartbeat == beat and row.last_heartbeat.tzinfo == UTC
        assert row.last_heartbeat.hour == 12 and row.last_heartbeat.microsecond == 123456
        # compared in SQL as instants: 12:30:05.123 UTC < 12:30:05.5 UTC < 12:30:06 UTC
        cut = datetime(2026, 3, 1, 14, 30, 5, 500000, tzinfo=plus2)
        earlier = s.scalars(sa.select(WorkerRecord.id).where(WorkerRecord.last_heartbeat < cut)).all()
        assert earlier == ["w"]
        s.commit()
    with Session() as s, pytest.raises(sa.exc.StatementError, match="naive datetime"):
        s.add(WorkerRecord(id="x", hostname="h", target="h100", measurer="model", versions={},
                           last_heartbeat=datetime(2026, 1, 1)))
        s.commit()


def test_study_storage_url():
    assert db.study_storage_url("sqlite:///foldwise.db") == "sqlite:///foldwise.optuna.sqlite"
    assert db.study_storage_url("sqlite:////var/lib/fw/prod.db") == "sqlite:////var/lib/fw/prod.optuna.sqlite"
    pg = "postgresql+psycopg://fw:pw@db:5432/foldwise"
    assert db.study_storage_url(pg) == pg
    assert db.study_storage_url("sqlite://") == "sqlite://"


def test_migrations_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'cwd.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    db.check_current(engine)
    engine.dispose()


def test_upgrade_0002_to_0003_keeps_bundles_and_adds_kernel_binaries(service_db_url, engine):
    """Issue 15's migration is a new table: bundles stored before it are kept byte for byte."""
    db.upgrade(service_db_url, "0002")
    now = "2026-11-30 12:00:00"
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO bundles (sha256, content, size, created_at) VALUES (:s, :c, 3, :t)"),
                     {"s": "a" * 64, "c": b"abc", "t": now})
    db.upgrade(service_db_url, "0003")
    assert db.current_revision(engine) == "0003"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT content FROM bundles")).scalar() == b"abc"
        assert conn.execute(sa.text("SELECT count(*) FROM kernel_binaries")).scalar() == 0


def test_upgrade_0003_to_0004_precomputes_the_format_2_views_of_stored_bundles(service_db_url, engine):
    """Issue 16's migration: every stored bundle that verifies gets its served format-2 (and,
    since issue 21, format-3) views (the function the writers use); a damaged bundle, or a binary
    whose bytes do not hash to its row, gets none; the bundles themselves are kept byte for byte."""
    import json

    from fuser_core.spec import load_spec
    from service.bundle import canonical_bytes, canonical_spec
    from service.bundle_maker import make_bundle
    from fuser_core.problem import make_problem
    from service.store.served_bundles import served_views
    from tests.support.catalog import load_catalog

    db.upgrade(service_db_url, "0003")
    problem = make_problem(canonical_spec(load_spec(load_catalog()["safe_softmax"])), {"d0": 4, "d1": 64}, "float32")
    bundle = make_bundle(problem, target="h100", strategy="streaming_fused", config={},
                         measured={"time_ms": 0.01, "measurer": "model", "predicted": True})
    good = canonical_bytes(bundle)
    now = "2026-11-30 12:00:00"
    with engine.begin() as conn:
        insert = sa.text("INSERT INTO bundles (sha256, content, size, created_at) VALUES (:s, :c, :n, :t)")
        conn.execute(insert, {"s": bundle["sha256"], "c": good, "n": len(good), "t": now})
        conn.execute(insert, {"s": "a" * 64, "c": b"abc", "n": 3, "t": now})
        conn.execute(sa.text("INSERT INTO kernel_binaries VALUES (:b, 'sm_90a', :c, :h, 3, 't', 'p', :t)"),
                     {"b": bundle["sha256"], "c": b"xyz", "h": "0" * 64, "t": now})  # its hash does not hold
    db.upgrade(service_db_url, "0004")
    assert db.current_revision(engine) == "0004"
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT bundle_sha256, view, sha256, content FROM served_bundles")).all()
        assert conn.execute(sa.text("SELECT content FROM bundles WHERE sha256 = :s"), {"s": bundle["sha256"]}).scalar() == good
    assert {r[1]: (r[2], r[3]) for r in rows} == served_views(bundle, [])
    assert {r[0] for r in rows} == {bundle["sha256"]} and {r[1] for r in rows} == {"2", "2:none", "3", "3:none"}
    assert all(json.loads(r[3])["binaries"] == {} for r in rows)


def test_upgrade_0004_to_0005_keys_binaries_by_triton_version_and_adds_format_3(service_db_url, engine):
    """Issue 21's migration: a stored binary keeps its row (its Triton version joins the key, so
    another Triton's variant of the same bundle and arch can be stored beside it); every
    bundle's views are rebuilt: format 2 unchanged, format 3 added. A downgrade keeps the newest
    Triton's variant per arch."""
    import copy
    import json

    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from service.bundle import BUNDLE_FORMAT_3, bundle_v2, canonical_bytes, canonical_spec, make_variant
    from service.bundle_maker import make_bundle
    from service.store.served_bundles import served_views
    from tests.support.catalog import load_catalog

    db.upgrade(service_db_url, "0004")
    problem = make_problem(canonical_spec(load_spec(load_catalog()["safe_softmax"])), {"d0": 4, "d1": 64}, "float32")
    bundle = make_bundle(problem, target="h100", strategy="streaming_fused", config={},
                         measured={"time_ms": 0.01, "measurer": "model", "predicted": True})
    cubin = b"\x7fELF not a real cubin"
    variant = make_variant({"arch": "sm_90a", "capability": 90, "triton_version": "3.6.0", "ptxas_version": "p",
                            "kernels": [{"name": "k", "cubin": cubin, "ptx": "", "metadata": {"name": "k"},
                                         "triton_hash": "h"}]})
    raw = canonical_bytes(variant)
    now = "2026-11-30 12:00:00"
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO bundles (sha256, content, size, created_at) VALUES (:s, :c, :n, :t)"),
                     {"s": bundle["sha256"], "c": canonical_bytes(bundle), "n": 1, "t": now})
        conn.execute(sa.text("INSERT INTO kernel_binaries (bundle_sha256, arch, content, sha256, size, triton_version, "
                             "ptxas_version, created_at) VALUES (:b, 'sm_90a', :c, :h, 1, '3.6.0', 'p', :t)"),
                     {"b": bundle["sha256"], "c": raw, "h": hashlib.sha256(raw).hexdigest(), "t": now})
    db.upgrade(service_db_url, "0005")
    newer = copy.deepcopy(variant)
    newer["triton_version"] = "3.9.0"
    raw9 = canonical_bytes(newer)
    with engine.begin() as conn:
        views = dict(conn.execute(sa.text("SELECT view, content FROM served_bundles")).all())
        conn.execute(sa.text("INSERT INTO kernel_binaries (bundle_sha256, arch, content, sha256, size, triton_version, "
                             "ptxas_version, created_at) VALUES (:b, 'sm_90a', :c, :h, 1, '3.9.0', 'p', :t)"),
                     {"b": bundle["sha256"], "c": raw9, "h": hashlib.sha256(raw9).hexdigest(), "t": now})
    assert views == {view: body for view, (_, body) in served_views(bundle, [variant]).items()}
    assert views["2"] == canonical_bytes(bundle_v2(bundle, {"sm_90a": variant}))
    assert json.loads(views["3"])["format"] == BUNDLE_FORMAT_3
    assert json.loads(views["3"])["binaries"] == {"sm_90a": {"3.6.0": variant}}
    db.downgrade(service_db_url, "0004")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT triton_version FROM kernel_binaries")).scalars().all() == ["3.9.0"]
        v2 = conn.execute(sa.text("SELECT content FROM served_bundles WHERE view = '2'")).scalar()
    assert json.loads(v2)["binaries"] == {"sm_90a": newer}


def test_upgrade_0006_to_0007_marks_kernels_finished_and_keys_them_by_partial(service_db_url, engine):
    """Issue 26's migration: existing kernels are finished (partial false) and keep their rows;
    ``partial`` joins the key, so a key may hold one finished and one partial kernel, not two of
    either. A downgrade deletes the partial kernels (the old schema would serve them) and unlinks
    the failed jobs that kept them."""
    db.upgrade(service_db_url, "0006")
    now = "2026-11-30 12:00:00"
    key = {"sh": "a" * 64, "sk": "d0=4", "dt": "float32", "tg": "h100", "tv": "3.6.0", "gv": "g1", "t": now}
    kernel = ("INSERT INTO kernels (id, spec_hash, shape, shape_key, dtype, target, triton_version, generator_version, "
              "strategy, config, time_ms, measurer, predicted, bundle_sha256, created_at, updated_at{extra}) VALUES "
              "(:id, :sh, '{{}}', :sk, :dt, :tg, :tv, :gv, 's', '{{}}', 1.0, 'model', :p, :b, :t, :t{values})")
    job = ("INSERT INTO jobs (id, spec_hash, shape, shape_key, dtype, target, measurer, budget_trials, budget_seconds, "
           "status, cancel_requested, attempts, trials_done, kernel_id, study_name, created_at, updated_at) VALUES "
           "(:id, :sh, '{}', :sk, :dt, :tg, 'model', 1, 1.0, :status, :f, 1, 1, :k, 's', :t, :t)")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO specs (spec_hash, name, canonical, source, derivation, created_at) "
                             "VALUES (:sh, 'x', '{}', '{}', '{}', :t)"), key)
        conn.execute(sa.text("INSERT INTO bundles (sha256, content, size, created_at) VALUES (:b, :c, 3, :t)"),
                     {"b": "b" * 64, "c": b"abc", "t": now})
        conn.execute(sa.text(kernel.format(extra="", values="")), {**key, "id": "1" * 32, "p": True, "b": "b" * 64})
        conn.execute(sa.text(job), {**key, "id": "j1" + "0" * 30, "status": "succeeded", "f": False, "k": "1" * 32})
    db.upgrade(service_db_url, "0007")
    assert db.current_revision(engine) == "0007"
    with_partial = kernel.format(extra=", partial", values=", :partial")
    with engine.begin() as conn:
        assert conn.execute(sa.text("SELECT id, partial FROM kernels")).all() == [("1" * 32, False)]
        conn.execute(sa.text(with_partial), {**key, "id": "2" * 32, "p": True, "b": "b" * 64, "partial": True})
        conn.execute(sa.text(job), {**key, "id": "j2" + "0" * 30, "status": "failed", "f": False, "k": "2" * 32})
    for partial in (False, True):  # a second finished, or a second partial, kernel for the key is refused
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text(with_partial), {**key, "id": "3" * 32, "p": True, "b": "b" * 64, "partial": partial})
    db.downgrade(service_db_url, "0006")
    assert db.current_revision(engine) == "0006"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM kernels")).scalars().all() == ["1" * 32]
        assert dict(conn.execute(sa.text("SELECT id, kernel_id FROM jobs")).all()) == {
            "j1" + "0" * 30: "1" * 32, "j2" + "0" * 30: None}
        assert "partial" not in {c["name"] for c in sa.inspect(conn).get_columns("kernels")}
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:  # the old key holds again
        conn.execute(sa.text(kernel.format(extra="", values="")), {**key, "id": "4" * 32, "p": True, "b": "b" * 64})
    db.upgrade(service_db_url)
    assert diff(engine) == []
