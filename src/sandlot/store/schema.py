"""The database schema: every table sandlot keeps, on one SQLAlchemy ``MetaData``.

Tables of other packages (receipts, journal, API keys) register on :data:`metadata` from their
own ``schema`` modules, which :func:`load_all` imports, so that Alembic sees one schema. This
module must not import backends or front ends.
"""

from __future__ import annotations

import importlib

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    MetaData,
    String,
    Table,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

__all__ = ["load_all", "metadata", "sandboxes", "snapshots"]

metadata = MetaData()

# Labels are JSONB on PostgreSQL, so a GIN index serves label filters. The record stays JSON
# (text) there: JSONB cannot hold the string "\u0000", and a record carries free text (errors,
# the last lines of output) that may contain it.
_LABELS = JSON().with_variant(JSONB(), "postgresql")

# Times are stored as float seconds since the epoch: portable across SQLite and PostgreSQL,
# cheap to compare for TTL sweeps, and free of timezone surprises.
sandboxes = Table(
    "sandboxes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, default="default"),
    Column("backend", String(64), nullable=False),
    Column("status", String(32), nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("owner", String(256)),
    Column("labels", _LABELS, nullable=False),
    Column("record", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("last_active_at", Float, nullable=False),
    Column("expires_at", Float),
    Column("transition_deadline", Float),
    Column("hidden", Boolean, nullable=False, default=False),
    Index("ix_sandboxes_tenant_created", "tenant", "created_at"),
    Index("ix_sandboxes_status", "status"),
    Index("ix_sandboxes_backend", "backend"),
    Index("ix_sandboxes_expires", "expires_at"),
    # Label filters are `labels @> {...}` on PostgreSQL, which this GIN index serves
    # (jsonb_path_ops: smaller and faster than the default, and containment is all we ask).
    # SQLite filters with json_extract and cannot use it, so there it is an empty partial
    # index (WHERE 0): one table definition for both, at no cost to SQLite writes.
    Index(
        "ix_sandboxes_labels",
        "labels",
        postgresql_using="gin",
        postgresql_ops={"labels": "jsonb_path_ops"},
        sqlite_where=text("0"),
    ),
)

snapshots = Table(
    "snapshots",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, default="default"),
    Column("sandbox_id", String(64), nullable=False),
    Column("backend", String(64), nullable=False),
    Column("record", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_snapshots_sandbox", "sandbox_id"),
)

# Packages whose tables live on this metadata; imported for their side effect.
_TABLE_MODULES = (
    "sandlot.receipts.schema",
    "sandlot.gate.schema",
    "sandlot.journal.schema",
    "sandlot.server.schema",
)


def load_all() -> MetaData:
    """Import every module that defines tables, then return the shared metadata."""
    for name in _TABLE_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Absent from this build (the module or its package): its tables are not needed.
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise
    return metadata
