"""The durable journal (intents, authorizations, allocations, events, exec output) and, on
PostgreSQL, sandbox labels as JSONB with a GIN index.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_ID = 80
_HASH = 71


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Only labels: records stay JSON (see sandlot.store.schema).
        op.alter_column(
            "sandboxes",
            "labels",
            type_=JSONB(),
            existing_type=sa.JSON(),
            existing_nullable=False,
            postgresql_using="labels::jsonb",
        )
    # On SQLite this is an empty partial index (WHERE 0) that nothing maintains; see
    # sandlot.store.schema for why it exists there at all.
    op.create_index(
        "ix_sandboxes_labels",
        "sandboxes",
        ["labels"],
        postgresql_using="gin",
        postgresql_ops={"labels": "jsonb_path_ops"},
        sqlite_where=sa.text("0"),
    )

    op.create_table(
        "intents",
        sa.Column("intent_id", sa.String(_ID), primary_key=True),
        sa.Column("request_hash", sa.String(_HASH), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("principal", sa.String(256), nullable=False),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(256)),
        sa.Column("request_json", sa.Text, nullable=False),
        sa.Column("state", sa.String(24), nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("lease_owner", sa.String(256)),
        sa.Column("lease_expires_at", sa.Float),
        sa.Column("sandbox_id", sa.String(64)),
        sa.Column("result_json", sa.Text),
        sa.Column("result_hash", sa.String(_HASH)),
        sa.Column("receipt_seq", sa.BigInteger),
        sa.Column("error", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_intents_tenant_key"),
    )
    op.create_index("ix_intents_state_lease", "intents", ["state", "lease_expires_at"])
    op.create_index("ix_intents_tenant_created", "intents", ["tenant", "created_at"])

    op.create_table(
        "authorizations",
        sa.Column("auth_id", sa.String(32), primary_key=True),
        sa.Column(
            "intent_id",
            sa.String(_ID),
            sa.ForeignKey("intents.intent_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("decision", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("consumed_at", sa.Float),
        sa.Column("consumed_by", sa.String(256)),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint("intent_id", name="uq_authorizations_intent"),
        sa.UniqueConstraint("decision", name="uq_authorizations_decision"),
    )

    op.create_table(
        "provider_allocations",
        sa.Column(
            "intent_id",
            sa.String(_ID),
            sa.ForeignKey("intents.intent_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("deterministic_name", sa.String(128), nullable=False),
        sa.Column("provider_ref", sa.String(256)),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("allocated_at", sa.Float),
        sa.Column("released_at", sa.Float),
        sa.UniqueConstraint("deterministic_name", name="uq_allocations_name"),
        sa.UniqueConstraint("backend", "provider_ref", name="uq_allocations_ref"),
    )

    op.create_table(
        "journal_events",
        sa.Column(
            "event_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column(
            "intent_id",
            sa.String(_ID),
            sa.ForeignKey("intents.intent_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("from_state", sa.String(24)),
        sa.Column("to_state", sa.String(24), nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("receipt_seq", sa.BigInteger),
        sa.Column("note", sa.Text),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_index("ix_journal_events_intent", "journal_events", ["intent_id", "event_id"])

    op.create_table(
        "exec_runs",
        sa.Column("exec_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("intent_id", sa.String(_ID)),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("exit_code", sa.Integer),
        sa.Column("result", sa.JSON),
        sa.Column("error", sa.JSON),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sa.Column("chunk_count", sa.BigInteger),
        sa.Column("kept_bytes", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
    )
    op.create_index("ix_exec_runs_state_owner", "exec_runs", ["state", "owner"])
    op.create_index("ix_exec_runs_finished", "exec_runs", ["finished_at"])
    op.create_table(
        "exec_chunks",
        sa.Column(
            "exec_id",
            sa.String(64),
            sa.ForeignKey("exec_runs.exec_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("seq", sa.BigInteger, nullable=False, autoincrement=False),
        sa.Column("stream", sa.String(8), nullable=False),
        sa.Column("stream_offset", sa.BigInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("exec_id", "seq", name="pk_exec_chunks"),
    )


def downgrade() -> None:
    op.drop_table("exec_chunks")
    op.drop_table("exec_runs")
    op.drop_table("journal_events")
    op.drop_table("provider_allocations")
    op.drop_table("authorizations")
    op.drop_table("intents")
    op.drop_index("ix_sandboxes_labels", table_name="sandboxes")
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "sandboxes",
            "labels",
            type_=sa.JSON(),
            existing_type=JSONB(),
            existing_nullable=False,
            postgresql_using="labels::json",
        )
