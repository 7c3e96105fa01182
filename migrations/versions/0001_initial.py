"""Initial schema: specs, bundles, kernels, jobs, trials, workers, api_tokens.

Written by hand to match service/store/models.py (tests/service/test_db.py checks that Alembic's
autogenerate finds no difference). Datetimes are ``DateTime(timezone=True)``: ``timestamptz``
on PostgreSQL; on SQLite, service.store.models.UTCDateTime stores UTC wall time.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _json() -> sa.JSON:
    return sa.JSON(none_as_null=True)


def upgrade() -> None:
    op.create_table(
        "specs",
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("canonical", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("derivation", _json(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("spec_hash", name="pk_specs"),
    )
    op.create_table(
        "bundles",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name="pk_bundles"),
    )
    op.create_table(
        "kernels",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("shape", _json(), nullable=False),
        sa.Column("shape_key", sa.String(2048), nullable=False),
        sa.Column("dtype", sa.String(2048), nullable=False),
        sa.Column("target", sa.String(32), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("generator_version", sa.String(64), nullable=False),
        sa.Column("strategy", sa.String(64), nullable=False),
        sa.Column("config", _json(), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=False),
        sa.Column("measurer", sa.String(16), nullable=False),
        sa.Column("predicted", sa.Boolean(), nullable=False),
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("baselines", _json(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_kernels"),
        sa.ForeignKeyConstraint(["spec_hash"], ["specs.spec_hash"], name="fk_kernels_spec_hash_specs"),
        sa.ForeignKeyConstraint(["bundle_sha256"], ["bundles.sha256"], name="fk_kernels_bundle_sha256_bundles"),
        sa.UniqueConstraint("spec_hash", "shape_key", "dtype", "target", "triton_version", "generator_version",
                            name="uq_kernels_key"),
    )
    op.create_index("ix_kernels_lookup", "kernels", ["spec_hash", "target", "dtype"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("shape", _json(), nullable=False),
        sa.Column("shape_key", sa.String(2048), nullable=False),
        sa.Column("dtype", sa.String(2048), nullable=False),
        sa.Column("target", sa.String(32), nullable=False),
        sa.Column("measurer", sa.String(16), nullable=False),
        sa.Column("budget_trials", sa.Integer(), nullable=False),
        sa.Column("budget_seconds", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("dedupe_key", sa.String(64), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", _utc(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.Column("best", _json(), nullable=True),
        sa.Column("kernel_id", sa.String(32), nullable=True),
        sa.Column("study_name", sa.String(4096), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("started_at", _utc(), nullable=True),
        sa.Column("finished_at", _utc(), nullable=True),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.ForeignKeyConstraint(["spec_hash"], ["specs.spec_hash"], name="fk_jobs_spec_hash_specs"),
        sa.ForeignKeyConstraint(["kernel_id"], ["kernels.id"], name="fk_jobs_kernel_id_kernels"),
        sa.UniqueConstraint("dedupe_key", name="uq_jobs_dedupe_key"),
        sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                           name="ck_jobs_status"),
    )
    op.create_index("ix_jobs_spec_hash", "jobs", ["spec_hash"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_status_target", "jobs", ["status", "target"])
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=True),
        sa.Column("strategy", sa.String(64), nullable=True),
        sa.Column("config", _json(), nullable=True),
        sa.Column("time_ms", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("predicted", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(512), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_trials"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_trials_job_id_jobs"),
        sa.UniqueConstraint("job_id", "number", name="uq_trials_job_id_number"),
        sa.CheckConstraint("state IN ('complete', 'failed', 'pruned')", name="ck_trials_state"),
    )
    op.create_index("ix_trials_job_id", "trials", ["job_id"])
    op.create_table(
        "workers",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("gpu_name", sa.String(255), nullable=True),
        sa.Column("target", sa.String(32), nullable=False),
        sa.Column("measurer", sa.String(16), nullable=False),
        sa.Column("versions", _json(), nullable=False),
        sa.Column("current_job_id", sa.String(32), nullable=True),
        sa.Column("started_at", _utc(), nullable=False),
        sa.Column("last_heartbeat", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("scopes", sa.String(200), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("revoked_at", _utc(), nullable=True),
        sa.Column("last_used_at", _utc(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
    op.drop_table("workers")
    op.drop_index("ix_trials_job_id", table_name="trials")
    op.drop_table("trials")
    op.drop_index("ix_jobs_status_target", table_name="jobs")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_index("ix_jobs_spec_hash", table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_kernels_lookup", table_name="kernels")
    op.drop_table("kernels")
    op.drop_table("bundles")
    op.drop_table("specs")
