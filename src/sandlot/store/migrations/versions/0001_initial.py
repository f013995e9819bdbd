"""Sandboxes and snapshots.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("owner", sa.String(256)),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("record", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("last_active_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float),
        sa.Column("transition_deadline", sa.Float),
        sa.Column("hidden", sa.Boolean, nullable=False),
    )
    op.create_index("ix_sandboxes_tenant_created", "sandboxes", ["tenant", "created_at"])
    op.create_index("ix_sandboxes_status", "sandboxes", ["status"])
    op.create_index("ix_sandboxes_backend", "sandboxes", ["backend"])
    op.create_index("ix_sandboxes_expires", "sandboxes", ["expires_at"])
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("record", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_snapshots_sandbox", "snapshots", ["sandbox_id"])


def downgrade() -> None:
    op.drop_table("snapshots")
    op.drop_table("sandboxes")
