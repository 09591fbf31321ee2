"""Initial schema: volumes, snapshots, publications, operations.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

State and kind columns are plain VARCHARs here: the models map them to
``StrEnum`` members without a database enum or CHECK, so a new state needs no
migration.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("fs_type", sa.String(length=16), nullable=True),
        sa.Column("squash", sa.String(length=32), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("source_snapshot_id", sa.String(length=32), nullable=True),
        sa.Column("source_volume_id", sa.String(length=32), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_volumes")),
        sa.UniqueConstraint("name", name=op.f("uq_volumes_name")),
    )
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("source_volume_id", sa.String(length=32), nullable=False),
        sa.Column("volume_type", sa.String(length=16), nullable=False),
        sa.Column("fs_type", sa.String(length=16), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshots")),
        sa.UniqueConstraint("name", name=op.f("uq_snapshots_name")),
    )
    op.create_index(
        op.f("ix_snapshots_source_volume_id"), "snapshots", ["source_volume_id"], unique=False
    )
    op.create_table(
        "publications",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("volume_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("node_address", sa.String(length=64), nullable=False),
        sa.Column("read_only", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["volume_id"], ["volumes.id"], name=op.f("fk_publications_volume_id_volumes")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_publications")),
        sa.UniqueConstraint("volume_id", "node_id", name=op.f("uq_publications_volume_id_node_id")),
    )
    op.create_table(
        "operations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
    )
    op.create_index(op.f("ix_operations_state"), "operations", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_operations_state"), table_name="operations")
    op.drop_table("operations")
    op.drop_table("publications")
    op.drop_index(op.f("ix_snapshots_source_volume_id"), table_name="snapshots")
    op.drop_table("snapshots")
    op.drop_table("volumes")
