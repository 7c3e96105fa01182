"""Trials keep the compile gate's facts per kernel (issue 12): ``trials.compile``, JSON, nullable.

Existing trials (tuned without a compile check) keep null.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:  # SQLite: batch mode; PostgreSQL: a plain ALTER TABLE
        batch.add_column(sa.Column("compile", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("compile")
