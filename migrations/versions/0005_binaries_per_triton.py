"""Binaries per Triton version (issue 21): ``kernel_binaries`` keyed (bundle, arch, Triton
version), and format-3 bundles among the precomputed views.

A cubin belongs to the Triton that compiled it (its launcher, its cache key, its ptxas: Triton
3.6's and 3.9's give different registers for most kernels), and a GPU worker's Triton (the
inference image's) is often not the server's. So each Triton version's variant of a bundle is
kept: the primary key gains ``triton_version`` (the column exists since 0003, filled for every
row, so every existing row keeps its key). Then every bundle's served views are rebuilt
(service.store.served_bundles.rebuild_views, what the writers compute): the format-2 views are
unchanged for one variant per arch, and the format-3 views are added.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    from service.store.served_bundles import rebuild_views

    with op.batch_alter_table("kernel_binaries", recreate="auto") as batch:
        batch.drop_constraint("pk_kernel_binaries", type_="primary")
        batch.create_primary_key("pk_kernel_binaries", ["bundle_sha256", "arch", "triton_version"])
    rebuild_views(op.get_bind())


def downgrade() -> None:
    """Back to one variant per (bundle, arch): the newest Triton's is kept, as format 2 serves."""
    import sqlalchemy as sa

    from service.bundle import triton_version_key
    from service.store.served_bundles import rebuild_views

    conn = op.get_bind()
    table = sa.table("kernel_binaries", sa.column("bundle_sha256", sa.String), sa.column("arch", sa.String),
                     sa.column("triton_version", sa.String))
    rows = conn.execute(sa.select(table.c.bundle_sha256, table.c.arch, table.c.triton_version)).all()
    newest: dict[tuple[str, str], str] = {}
    for sha, arch, version in rows:
        have = newest.get((sha, arch))
        if have is None or triton_version_key(version) > triton_version_key(have):
            newest[(sha, arch)] = version
    for sha, arch, version in rows:
        if newest[(sha, arch)] != version:
            conn.execute(sa.delete(table).where(table.c.bundle_sha256 == sha, table.c.arch == arch,
                                                table.c.triton_version == version))
    with op.batch_alter_table("kernel_binaries", recreate="auto") as batch:
        batch.drop_constraint("pk_kernel_binaries", type_="primary")
        batch.create_primary_key("pk_kernel_binaries", ["bundle_sha256", "arch"])
    rebuild_views(conn)
