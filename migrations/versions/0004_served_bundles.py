"""Format-2 bundles precomputed (issue 16): ``served_bundles``, one row per (bundle, view).

A new table, filled here for the bundles stored before it (service.served_bundles.served_views:
the same function the writers use): every bundle whose bytes verify gets its views ``"2"``,
``"2:none"`` and one ``"2:<arch>"`` per stored binary whose bytes verify. A bundle that does
not verify gets none (it is not served in either format). Existing rows are kept as they are.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

bundles = sa.table("bundles", sa.column("sha256", sa.String), sa.column("content", sa.LargeBinary))
binaries = sa.table("kernel_binaries", sa.column("bundle_sha256", sa.String), sa.column("arch", sa.String),
                    sa.column("content", sa.LargeBinary), sa.column("sha256", sa.String))


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
    _backfill(op.get_bind())


def _backfill(conn: sa.Connection) -> None:
    from service.bundle import BundleError, verify_variant
    from service.models import UTCDateTime
    from service.served_bundles import bundle_intact, served_views

    served = sa.table("served_bundles", *(sa.column(c) for c in ("bundle_sha256", "view", "sha256", "content", "size")),
                      sa.column("created_at", UTCDateTime()))
    now = datetime.now(UTC)
    for sha, content in conn.execute(sa.select(bundles.c.sha256, bundles.c.content)).all():
        if not bundle_intact(content, sha):
            continue
        variants = {}
        for arch, raw, raw_sha in conn.execute(sa.select(binaries.c.arch, binaries.c.content, binaries.c.sha256)
                                               .where(binaries.c.bundle_sha256 == sha)).all():
            try:
                if hashlib.sha256(raw).hexdigest() != raw_sha:
                    continue
                variant = json.loads(raw)
                verify_variant(variant)
            except (ValueError, BundleError):
                continue
            variants[arch] = variant
        rows = [{"bundle_sha256": sha, "view": view, "sha256": digest, "content": body, "size": len(body),
                 "created_at": now} for view, (digest, body) in served_views(json.loads(content), variants).items()]
        conn.execute(sa.insert(served), rows)


def downgrade() -> None:
    op.drop_table("served_bundles")
