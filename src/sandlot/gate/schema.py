"""The approvals table: HOLD decisions waiting for a human or another agent.

A row is written when the gate decides HOLD and is answered by ``approve``/``deny`` from any
process (the CLI in another terminal, the HTTP API); the waiting request polls it. Portable
types only. This module imports only SQLAlchemy and the store's metadata.
"""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Column, Float, Index, String, Table, Text

from sandlot.store.schema import metadata

__all__ = ["approvals"]

approvals = Table(
    "approvals",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("principal", String(256), nullable=False),
    Column("sandbox_id", String(64)),
    Column("action", String(64), nullable=False),
    Column("summary", Text, nullable=False),
    Column("question", Text, nullable=False),
    Column("request", JSON, nullable=False),
    Column("hold_seq", BigInteger, nullable=False),
    # pending -> approved | denied | expired; only a pending row changes, by compare-and-set.
    Column("status", String(16), nullable=False),
    Column("decided_by", String(256)),
    Column("decided_at", Float),
    Column("answer_seq", BigInteger),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Index("ix_approvals_tenant_status", "tenant", "status"),
)
