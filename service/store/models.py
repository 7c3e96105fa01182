"""The service's tables (SQLAlchemy 2, typed): specs, jobs, trials, kernels, bundles, workers, tokens.

Migrations in ``migrations/versions`` are written by hand to match these classes; a test
(``tests/service/test_db.py``) checks that Alembic's autogenerate finds no difference, on SQLite and
PostgreSQL.

Conventions, decided here:

- ids are uuid4 hex strings (32 characters), except trials (an integer) and bundles (their
  sha256) and workers (the id the worker chose);
- every datetime is timezone-aware UTC in Python. PostgreSQL stores ``timestamptz``; SQLite
  has no time zones, so :class:`UTCDateTime` stores the UTC wall time (one fixed text format,
  so comparisons in SQL such as ``lease_expires_at < :now`` order correctly) and reads it
  back as UTC. A naive datetime is refused rather than guessed at;
- shapes are stored in the dim names of the spec as first stored (``SpecRecord.source``), see
  :mod:`service.store.spec_store`; ``shape_key`` is ``"m=4,n=300"`` sorted by dim name;
- constraint and index names follow :data:`NAMING`, so migrations name them identically on
  every backend.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")
TRIAL_STATES = ("complete", "failed", "pruned")
SCOPES = ("jobs:write", "kernels:read", "admin")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (see the module docstring)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()}: pass a timezone-aware datetime (UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _json() -> sa.JSON:
    # None is SQL NULL, not the JSON text 'null' (so `IS NULL` finds it)
    return sa.JSON(none_as_null=True)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: _json()}


class SpecRecord(Base):
    """A spec, once per ``spec_hash``: its canonical form, the JSON first submitted, the derivation."""

    __tablename__ = "specs"

    spec_hash: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64))
    canonical: Mapped[str] = mapped_column(sa.Text)
    source: Mapped[str] = mapped_column(sa.Text)
    derivation: Mapped[dict[str, Any]] = mapped_column(_json())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Bundle(Base):
    """A kernel bundle's bytes exactly as served; ``sha256`` is the hash the bundle names (its ETag)."""

    __tablename__ = "bundles"

    sha256: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    content: Mapped[bytes] = mapped_column(sa.LargeBinary)
    size: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class KernelBinary(Base):
    """One compiled variant of a bundle for one GPU arch and one Triton version (issues 15, 21):
    the canonical JSON of :func:`service.bundle.make_variant` (every kernel's cubin, PTX and
    Triton metadata) and its sha256. Keyed by the bundle it was compiled from (the binary is a
    function of that source), the arch, and the Triton that compiled it (its launcher, cache
    key and ptxas: another Triton's client cannot load it; migration 0005)."""

    __tablename__ = "kernel_binaries"

    bundle_sha256: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("bundles.sha256"), primary_key=True)
    arch: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    triton_version: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    content: Mapped[bytes] = mapped_column(sa.LargeBinary)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    size: Mapped[int] = mapped_column(sa.Integer)
    ptxas_version: Mapped[str] = mapped_column(sa.String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ServedBundle(Base):
    """A format-2 or -3 bundle as served, precomputed when its bundle or a binary is stored
    (service/store/served_bundles.py), so a ``?format=2|3`` download is one indexed read: ``view``
    ``"F"`` (every stored arch, F the format), ``"F:<arch>"`` (one arch) or ``"F:none"`` (no
    binaries, the answer for an arch without one); ``sha256`` is the served bytes' hash and their ETag."""

    __tablename__ = "served_bundles"

    bundle_sha256: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("bundles.sha256"), primary_key=True)
    view: Mapped[str] = mapped_column(sa.String(24), primary_key=True)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    content: Mapped[bytes] = mapped_column(sa.LargeBinary)
    size: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class KernelRecord(Base):
    """The best kernel found for one cache key (spec, shape, dtype, target, Triton and generator versions).

    ``partial`` (migration 0007): the best kernel of a job that failed before it finished
    (:func:`service.store.job_queue.keep_partial`), kept for that job's view and never served by a
    lookup or a submission (:mod:`service.store.kernel_cache`). It is part of the key: one finished and
    one partial kernel per key at most."""

    __tablename__ = "kernels"
    __table_args__ = (
        sa.UniqueConstraint("spec_hash", "shape_key", "dtype", "target", "triton_version", "generator_version",
                            "partial", name="uq_kernels_key"),
        sa.Index("ix_kernels_lookup", "spec_hash", "target", "dtype"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True, default=new_id)
    spec_hash: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("specs.spec_hash"))
    shape: Mapped[dict[str, Any]] = mapped_column(_json())
    shape_key: Mapped[str] = mapped_column(sa.String(2048))
    dtype: Mapped[str] = mapped_column(sa.String(2048))
    target: Mapped[str] = mapped_column(sa.String(32))
    triton_version: Mapped[str] = mapped_column(sa.String(64))
    generator_version: Mapped[str] = mapped_column(sa.String(64))
    strategy: Mapped[str] = mapped_column(sa.String(64))
    config: Mapped[dict[str, Any]] = mapped_column(_json())
    time_ms: Mapped[float] = mapped_column(sa.Float)
    measurer: Mapped[str] = mapped_column(sa.String(16))
    predicted: Mapped[bool] = mapped_column(sa.Boolean)
    bundle_sha256: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("bundles.sha256"))
    job_id: Mapped[str | None] = mapped_column(sa.String(32))  # the job that found it (no FK: jobs point here)
    baselines: Mapped[dict[str, Any] | None] = mapped_column(_json())
    partial: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class KernelRange(Base):
    """A range job's result (:mod:`service.shape_ranges`, migration 0006): for one key (spec,
    range shape, dtype, target, Triton and generator versions), the kernel of each bucket.

    ``shape`` is the canonical range shape (``{"d0": {"min", "max", "buckets"}, "d1": 64}``),
    ``shape_key`` its :func:`service.shape_ranges.range_key`. ``buckets`` lists, smallest first,
    ``{"shape": <the bucket's full canonical shape>, "kernel_id"}``: each bucket's kernel is an
    ordinary :class:`KernelRecord` row keyed by that shape (so its bundle, binaries and exact lookups are
    those of any kernel, and a better kernel found later for that shape serves the range too)."""

    __tablename__ = "kernel_ranges"
    __table_args__ = (
        sa.UniqueConstraint("spec_hash", "shape_key", "dtype", "target", "triton_version", "generator_version",
                            name="uq_kernel_ranges_key"),
        sa.Index("ix_kernel_ranges_lookup", "spec_hash", "target", "dtype"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True, default=new_id)
    spec_hash: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("specs.spec_hash"))
    shape: Mapped[dict[str, Any]] = mapped_column(_json())
    shape_key: Mapped[str] = mapped_column(sa.String(2048))
    dtype: Mapped[str] = mapped_column(sa.String(2048))
    target: Mapped[str] = mapped_column(sa.String(32))
    triton_version: Mapped[str] = mapped_column(sa.String(64))
    generator_version: Mapped[str] = mapped_column(sa.String(64))
    buckets: Mapped[list[dict[str, Any]]] = mapped_column(_json())
    job_id: Mapped[str | None] = mapped_column(sa.String(32))  # the job that tuned it (no FK: jobs point at kernels)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    """One tuning request. ``dedupe_key`` makes identical live submissions one job (see service.store.job_queue)."""

    __tablename__ = "jobs"
    __table_args__ = (
        sa.CheckConstraint(_in("status", JOB_STATUSES), name="status"),
        sa.Index("ix_jobs_status_target", "status", "target"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True, default=new_id)
    spec_hash: Mapped[str] = mapped_column(sa.String(64), sa.ForeignKey("specs.spec_hash"), index=True)
    shape: Mapped[dict[str, Any]] = mapped_column(_json())
    shape_key: Mapped[str] = mapped_column(sa.String(2048))
    dtype: Mapped[str] = mapped_column(sa.String(2048))  # one dtype, or a JSON map per input
    target: Mapped[str] = mapped_column(sa.String(32))
    measurer: Mapped[str] = mapped_column(sa.String(16))
    budget_trials: Mapped[int] = mapped_column(sa.Integer)
    budget_seconds: Mapped[float] = mapped_column(sa.Float)
    status: Mapped[str] = mapped_column(sa.String(16), default="queued")
    error: Mapped[str | None] = mapped_column(sa.Text)
    dedupe_key: Mapped[str | None] = mapped_column(sa.String(64), unique=True)
    cancel_requested: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    worker_id: Mapped[str | None] = mapped_column(sa.String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column()
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    trials_done: Mapped[int] = mapped_column(sa.Integer, default=0)
    best: Mapped[dict[str, Any] | None] = mapped_column(_json())
    # a succeeded job's kernel; a failed job's partial kernel (KernelRecord.partial), if it kept one
    kernel_id: Mapped[str | None] = mapped_column(sa.String(32), sa.ForeignKey("kernels.id"))
    study_name: Mapped[str] = mapped_column(sa.String(4096))
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    @property
    def dtype_value(self) -> str | dict[str, str]:
        """``dtype`` as the tuner takes it: one dtype name, or the per-input map."""
        return json.loads(self.dtype) if self.dtype.startswith("{") else self.dtype

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES


class TrialRecord(Base):
    """One trial of a job, as the worker reported it (Optuna's storage stays the source of truth)."""

    __tablename__ = "trials"
    __table_args__ = (
        sa.UniqueConstraint("job_id", "number"),
        sa.CheckConstraint(_in("state", TRIAL_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.String(32), sa.ForeignKey("jobs.id"), index=True)
    number: Mapped[int] = mapped_column(sa.Integer)
    worker_id: Mapped[str | None] = mapped_column(sa.String(128))
    strategy: Mapped[str | None] = mapped_column(sa.String(64))
    config: Mapped[dict[str, Any] | None] = mapped_column(_json())
    time_ms: Mapped[float | None] = mapped_column(sa.Float)
    error: Mapped[str | None] = mapped_column(sa.Text)
    state: Mapped[str] = mapped_column(sa.String(16))
    predicted: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    source: Mapped[str | None] = mapped_column(sa.String(512))
    # the compile gate's facts per kernel: kernel, ok, registers, spill_bytes, shared_bytes, ...
    compile: Mapped[list[dict[str, Any]] | None] = mapped_column(_json())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerRecord(Base):
    """A worker process: what it can measure, and what it is doing."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(sa.String(255))
    gpu_name: Mapped[str | None] = mapped_column(sa.String(255))
    target: Mapped[str] = mapped_column(sa.String(32))
    measurer: Mapped[str] = mapped_column(sa.String(16))
    versions: Mapped[dict[str, Any]] = mapped_column(_json())
    current_job_id: Mapped[str | None] = mapped_column(sa.String(32))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A bearer token: only the sha256 of its secret is stored, with space-separated scopes."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(sa.String(200))
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    scopes: Mapped[str] = mapped_column(sa.String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()
    last_used_at: Mapped[datetime | None] = mapped_column()
