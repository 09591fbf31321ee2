"""Group snapshots: several volumes captured at one point in time.

Downgrading to 0004 refuses while a group snapshot operation is pending
(start the storage node at this revision once: it finishes them); the
journal's finished group operations are deleted (0004's code cannot load
their kinds), and the members of every group become ordinary snapshots,
named ``GROUP_ID:VOLUME_ID``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "group_snapshots",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("source_volume_ids", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_group_snapshots")),
        sa.UniqueConstraint("name", name=op.f("uq_group_snapshots_name")),
    )
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("group_snapshot_id", sa.String(32), nullable=True))
    op.create_index(
        op.f("ix_snapshots_group_snapshot_id"), "snapshots", ["group_snapshot_id"], unique=False
    )


_GROUP_KINDS = ("create_group_snapshot", "delete_group_snapshot")


def downgrade() -> None:
    operations = sa.table("operations", sa.column("kind", sa.String), sa.column("state", sa.String))
    of_groups = operations.c.kind.in_(_GROUP_KINDS)
    bind = op.get_bind()
    pending = bind.execute(
        sa.select(sa.func.count())
        .select_from(operations)
        .where(of_groups, operations.c.state == "pending")
    ).scalar_one()
    if pending:
        raise RuntimeError(
            f"{pending} group snapshot operations are pending: start the storage node at "
            "this version once (it finishes them), then downgrade"
        )
    bind.execute(sa.delete(operations).where(of_groups))
    op.drop_index(op.f("ix_snapshots_group_snapshot_id"), table_name="snapshots")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("group_snapshot_id")
    op.drop_table("group_snapshots")
