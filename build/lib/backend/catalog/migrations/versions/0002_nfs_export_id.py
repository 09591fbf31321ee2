"""Volumes carry the ganesha Export_Id of their NFS export.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
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
    with op.batch_alter_table("volumes") as batch:
        batch.add_column(sa.Column("nfs_export_id", sa.Integer(), nullable=True))
        batch.create_unique_constraint(op.f("uq_volumes_nfs_export_id"), ["nfs_export_id"])


def downgrade() -> None:
    with op.batch_alter_table("volumes") as batch:
        batch.drop_constraint(op.f("uq_volumes_nfs_export_id"), type_="unique")
        batch.drop_column("nfs_export_id")
