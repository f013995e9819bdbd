"""The receipt tables, registered on the shared :data:`sandlot.store.schema.metadata`.

``receipts`` holds one row per signed receipt: the full envelope (the JSONL line, byte for
byte) plus the body fields that queries filter on. Rows are immutable once written; the log's
integrity rests on two constraints: ``(log_id, seq)`` is the primary key, so no seq is ever
written twice, and ``(log_id, consumes)`` is unique, so no decision is executed twice.
``receipt_checkpoints`` holds the signed checkpoints and the compact Merkle range at each, and
``receipt_keys`` the public keys that signed each log and the seqs each was valid for (what the
trust root is exported from). Portable types only (SQLite and PostgreSQL). This module imports
only SQLAlchemy and the store's metadata.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Float,
    Index,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from sandlot.store.schema import metadata

__all__ = ["create_tables", "receipt_checkpoints", "receipt_keys", "receipts"]

# Hash columns hold "sha256:" + 64 hex digits; free-form names are unbounded String.
_HASH = 71

receipts = Table(
    "receipts",
    metadata,
    Column("log_id", String(128), primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("lamport", BigInteger, nullable=False),
    Column("type", String(64), nullable=False),
    Column("entry_hash", String(_HASH), nullable=False),
    Column("leaf_hash", String(64), nullable=False),
    Column("prev_hash", String(_HASH), nullable=False),
    Column("key_id", String(64), nullable=False),
    Column("tenant", String),
    Column("principal", String),
    Column("sandbox_id", String),
    Column("op", String),
    Column("request_hash", String(_HASH)),
    Column("decision", String(8)),
    Column("reason_code", String),
    Column("decision_ref", String(_HASH)),
    # Set (to decision_ref) only on receipts that use up what they reference: an execution its
    # ALLOW, an approval its HOLD. Unique, so nothing is used twice; NULLs never collide on
    # SQLite or PostgreSQL.
    Column("consumes", String(_HASH)),
    Column("envelope", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("log_id", "entry_hash", name="uq_receipts_entry_hash"),
    # Partial, so the many receipts that consume nothing cost no index entry (both SQLite and
    # PostgreSQL support partial unique indexes). No index on sandbox_id yet: nothing on a hot
    # path filters by it, and every index costs each append (~20 µs on SQLite here).
    Index(
        "uq_receipts_consumes",
        "log_id",
        "consumes",
        unique=True,
        sqlite_where=text("consumes IS NOT NULL"),
        postgresql_where=text("consumes IS NOT NULL"),
    ),
)

receipt_checkpoints = Table(
    "receipt_checkpoints",
    metadata,
    Column("log_id", String(128), primary_key=True),
    Column("tree_size", BigInteger, primary_key=True, autoincrement=False),
    Column("root_hash", String(64), nullable=False),
    # The compact range (hex hashes, JSON list) lets the next checkpoint extend this one
    # instead of rehashing the whole log.
    Column("compact_range", Text, nullable=False),
    Column("note", Text, nullable=False),
    Column("key_id", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
)

receipt_keys = Table(
    "receipt_keys",
    metadata,
    Column("log_id", String(128), primary_key=True),
    Column("key_id", String(64), primary_key=True),
    Column("public_key", String(64), nullable=False),
    Column("valid_from_seq", BigInteger, nullable=False),
    Column("valid_to_seq", BigInteger),
    Column("created_at", Float, nullable=False),
)


def create_tables(engine: Engine) -> None:
    """Create the receipt tables if missing (tests, benchmarks; migrations do it in production)."""
    metadata.create_all(engine, tables=[receipts, receipt_checkpoints, receipt_keys])
