"""Kernels for shape ranges (issue 24, item 3): the ``kernel_ranges`` table.

A range job (service/shape_ranges.py) tunes one kernel per bucket; each is an ordinary
``kernels`` row keyed by its bucket's shape, and this table maps the range's key (spec, range
shape, dtype, target, versions) to those kernels, so a lookup for any shape inside the range
finds them (service.store.kernel_cache.find_range). Nothing existing changes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "kernel_ranges",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("shape", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("shape_key", sa.String(2048), nullable=False),
        sa.Column("dtype", sa.String(2048), nullable=False),
        sa.Column("target", sa.String(32), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("generator_version", sa.String(64), nullable=False),
        sa.Column("buckets", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["spec_hash"], ["specs.spec_hash"], name="fk_kernel_ranges_spec_hash_specs"),
        sa.PrimaryKeyConstraint("id", name="pk_kernel_ranges"),
        sa.UniqueConstraint("spec_hash", "shape_key", "dtype", "target", "triton_version", "generator_version",
                            name="uq_kernel_ranges_key"),
    )
    op.create_index("ix_kernel_ranges_lookup", "kernel_ranges", ["spec_hash", "target", "dtype"])


def downgrade() -> None:
    op.drop_index("ix_kernel_ranges_lookup", table_name="kernel_ranges")
    op.drop_table("kernel_ranges")
