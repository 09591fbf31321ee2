"""Volumes carry labels; publications may share a block volume read-write.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
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
    with op.batch_alter_table("volumes") as batch:
        batch.add_column(sa.Column("labels", sa.JSON(), nullable=True))
    with op.batch_alter_table("publications") as batch:
        batch.add_column(
            sa.Column("multi_writer", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("publications") as batch:
        batch.drop_column("multi_writer")
    with op.batch_alter_table("volumes") as batch:
        batch.drop_column("labels")
