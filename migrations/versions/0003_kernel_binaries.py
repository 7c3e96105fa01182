"""Compiled kernels (issue 15): ``kernel_binaries``, one row per (bundle, GPU arch).

A new table; existing bundles and kernels are kept as they are (they have no binaries until a
worker compiles them, and are served as format 1 bundles meanwhile).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "kernel_binaries",
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("arch", sa.String(16), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("ptxas_version", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["bundle_sha256"], ["bundles.sha256"], name="fk_kernel_binaries_bundle_sha256_bundles"),
        sa.PrimaryKeyConstraint("bundle_sha256", "arch", name="pk_kernel_binaries"),
    )


def downgrade() -> None:
    op.drop_table("kernel_binaries")
