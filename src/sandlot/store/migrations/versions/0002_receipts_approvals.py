"""Signed receipts, their checkpoints and keys; approvals of HOLD decisions.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_HASH = 71


def upgrade() -> None:
    op.create_table(
        "receipts",
        sa.Column("log_id", sa.String(128), primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("lamport", sa.BigInteger, nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("entry_hash", sa.String(_HASH), nullable=False),
        sa.Column("leaf_hash", sa.String(64), nullable=False),
        sa.Column("prev_hash", sa.String(_HASH), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String),
        sa.Column("principal", sa.String),
        sa.Column("sandbox_id", sa.String),
        sa.Column("op", sa.String),
        sa.Column("request_hash", sa.String(_HASH)),
        sa.Column("decision", sa.String(8)),
        sa.Column("reason_code", sa.String),
        sa.Column("decision_ref", sa.String(_HASH)),
        sa.Column("consumes", sa.String(_HASH)),
        sa.Column("envelope", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("log_id", "entry_hash", name="uq_receipts_entry_hash"),
    )
    op.create_index(
        "uq_receipts_consumes",
        "receipts",
        ["log_id", "consumes"],
        unique=True,
        sqlite_where=sa.text("consumes IS NOT NULL"),
        postgresql_where=sa.text("consumes IS NOT NULL"),
    )
    op.create_table(
        "receipt_checkpoints",
        sa.Column("log_id", sa.String(128), primary_key=True),
        sa.Column("tree_size", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("root_hash", sa.String(64), nullable=False),
        sa.Column("compact_range", sa.Text, nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "receipt_keys",
        sa.Column("log_id", sa.String(128), primary_key=True),
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("valid_from_seq", sa.BigInteger, nullable=False),
        sa.Column("valid_to_seq", sa.BigInteger),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "approvals",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("principal", sa.String(256), nullable=False),
        sa.Column("sandbox_id", sa.String(64)),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("question", sa.Text, nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("hold_seq", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("decided_by", sa.String(256)),
        sa.Column("decided_at", sa.Float),
        sa.Column("answer_seq", sa.BigInteger),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_index("ix_approvals_tenant_status", "approvals", ["tenant", "status"])


def downgrade() -> None:
    op.drop_table("approvals")
    op.drop_table("receipt_keys")
    op.drop_table("receipt_checkpoints")
    op.drop_table("receipts")
