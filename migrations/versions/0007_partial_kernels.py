"""Partial kernels (issue 26): a job that fails keeps its best kernel so far, marked partial.

``kernels.partial`` (false for every existing row) says a kernel is the best of a failed job
(service.store.job_queue.keep_partial); lookups and submissions never see one (service.store.kernel_cache).
It joins the cache key ``uq_kernels_key``, so a key holds one finished and one partial kernel
at most and a failed job's kernel never takes the place of a finished one.

The downgrade deletes the partial kernels (the old schema cannot tell them from finished ones,
which lookups would then serve) and unlinks the failed jobs that kept them; their bundles stay.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ["spec_hash", "shape_key", "dtype", "target", "triton_version", "generator_version"]


class _JobKernelsSetAside:
    """SQLite changes a unique constraint by recreating the table (batch mode), and dropping the
    old ``kernels`` breaks ``jobs.kernel_id``'s foreign key (SQLite counts that violation when the
    table is dropped, and nothing discounts it, even once the new table holds the same ids). So,
    on SQLite only, the jobs' kernel ids are set aside in a temporary table and restored after."""

    def __enter__(self) -> None:
        self.sqlite = op.get_bind().dialect.name == "sqlite"
        if self.sqlite:
            op.execute("CREATE TEMPORARY TABLE _job_kernels AS "
                       "SELECT id, kernel_id FROM jobs WHERE kernel_id IS NOT NULL")
            op.execute("UPDATE jobs SET kernel_id = NULL WHERE kernel_id IS NOT NULL")

    def __exit__(self, *exc: object) -> None:
        if self.sqlite and exc[0] is None:
            op.execute("UPDATE jobs SET kernel_id = (SELECT t.kernel_id FROM _job_kernels t WHERE t.id = jobs.id) "
                       "WHERE id IN (SELECT id FROM _job_kernels)")
            op.execute("DROP TABLE _job_kernels")


def upgrade() -> None:
    with _JobKernelsSetAside(), op.batch_alter_table("kernels", recreate="auto") as batch:
        batch.add_column(sa.Column("partial", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.drop_constraint("uq_kernels_key", type_="unique")
        batch.create_unique_constraint("uq_kernels_key", [*KEY, "partial"])


def downgrade() -> None:
    kernels = sa.table("kernels", sa.column("id", sa.String), sa.column("partial", sa.Boolean))
    jobs = sa.table("jobs", sa.column("kernel_id", sa.String))
    partial = sa.select(kernels.c.id).where(kernels.c.partial == sa.true())
    op.execute(sa.update(jobs).where(jobs.c.kernel_id.in_(partial)).values(kernel_id=None))
    op.execute(sa.delete(kernels).where(kernels.c.partial == sa.true()))
    with _JobKernelsSetAside(), op.batch_alter_table("kernels", recreate="auto") as batch:
        batch.drop_constraint("uq_kernels_key", type_="unique")
        batch.create_unique_constraint("uq_kernels_key", KEY)
        batch.drop_column("partial")
