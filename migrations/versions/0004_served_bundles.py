"""Format-2 bundles precomputed (issue 16): ``served_bundles``, one row per (bundle, view).

A new table, filled here for the bundles stored before it (service.store.served_bundles.rebuild_views:
the views the writers compute): every bundle whose bytes verify gets its views ``"2"``,
``"2:none"`` and one ``"2:<arch>"`` per stored binary whose bytes verify (since issue 21, also
format 3's). A bundle that does not verify gets none (it is not served in either format).
Existing rows are kept as they are.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "served_bundles",
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("view", sa.String(24), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["bundle_sha256"], ["bundles.sha256"], name="fk_served_bundles_bundle_sha256_bundles"),
        sa.PrimaryKeyConstraint("bundle_sha256", "view", name="pk_served_bundles"),
    )
    # the views as the writers compute them today (formats 2 and 3; 0005 rebuilds them again)
    from service.store.served_bundles import rebuild_views

    rebuild_views(op.get_bind())


def downgrade() -> None:
    op.drop_table("served_bundles")
