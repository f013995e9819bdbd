"""The journal's tables, registered on the shared :data:`sandlot.store.schema.metadata`.

``intents`` holds one row per operation the Manager was asked to do, keyed by a hash of the
canonical request; ``authorizations`` the one-use grant bound to the ALLOW decision that lets an
intent run; ``provider_allocations`` the backend resource an intent created (its primary key
*is* the intent, so the database cannot hold two); ``journal_events`` the append-only history
of every transition. ``exec_runs`` and ``exec_chunks`` keep exec output so a reader on any
process can resume it, and so a run whose process died is reported ``unknown``.

The integrity of the journal rests on these constraints, not on code paths:

- ``UNIQUE (tenant, idempotency_key)``: one intent per key (NULL keys never collide);
- ``authorizations``: ``UNIQUE (intent_id)`` and ``UNIQUE (decision)``, so an intent is
  authorized once and a decision authorizes one intent;
- ``provider_allocations``: ``PRIMARY KEY (intent_id)``, ``UNIQUE (deterministic_name)``,
  ``UNIQUE (backend, provider_ref)``.

Times are float seconds since the epoch, as in the rest of the store. An intent's request and
result are kept as their RFC 8785 canonical JSON text: exactly the bytes that were hashed, so
``request_hash`` and ``result_hash`` can be re-checked, and free of JSONB's one gap (it cannot
hold the string ``"\\u0000"``, which command output may contain). Nothing queries inside these
documents, so JSONB would buy nothing. This module imports only SQLAlchemy and the store's
metadata.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from sandlot.store.schema import metadata

__all__ = [
    "authorizations",
    "exec_chunks",
    "exec_runs",
    "intents",
    "journal_events",
    "provider_allocations",
]

# Intent ids are "sha256:" + 64 hex digits; room for a longer scheme later without a migration.
_ID = 80
_HASH = 71

intents = Table(
    "intents",
    metadata,
    Column("intent_id", String(_ID), primary_key=True),
    Column("request_hash", String(_HASH), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("principal", String(256), nullable=False),
    Column("op", String(64), nullable=False),
    Column("idempotency_key", String(256)),
    Column("request_json", Text, nullable=False),
    Column("state", String(24), nullable=False),
    # Bumped on every lease grant (authorize, take_over, needs_reconcile): the fencing token.
    Column("fence", BigInteger, nullable=False),
    Column("lease_owner", String(256)),
    Column("lease_expires_at", Float),
    Column("sandbox_id", String(64)),
    Column("result_json", Text),
    Column("result_hash", String(_HASH)),
    Column("receipt_seq", BigInteger),
    Column("error", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("tenant", "idempotency_key", name="uq_intents_tenant_key"),
    # Recovery scans non-final states for expired leases.
    Index("ix_intents_state_lease", "state", "lease_expires_at"),
    Index("ix_intents_tenant_created", "tenant", "created_at"),
)

authorizations = Table(
    "authorizations",
    metadata,
    Column("auth_id", String(32), primary_key=True),
    Column(
        "intent_id",
        String(_ID),
        ForeignKey("intents.intent_id", ondelete="CASCADE"),
        nullable=False,
    ),
    # The entry_hash of the ALLOW decision receipt this grant is bound to.
    Column("decision", String(128), nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("consumed_at", Float),
    Column("consumed_by", String(256)),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("intent_id", name="uq_authorizations_intent"),
    UniqueConstraint("decision", name="uq_authorizations_decision"),
)

provider_allocations = Table(
    "provider_allocations",
    metadata,
    Column(
        "intent_id",
        String(_ID),
        ForeignKey("intents.intent_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("backend", String(64), nullable=False),
    # The name/label the backend was given; derived from the intent, so a retry finds it.
    Column("deterministic_name", String(128), nullable=False),
    # NULL while ALLOCATING: the backend has not answered yet (or we crashed before it did).
    Column("provider_ref", String(256)),
    Column("fence", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("allocated_at", Float),
    Column("released_at", Float),
    UniqueConstraint("deterministic_name", name="uq_allocations_name"),
    UniqueConstraint("backend", "provider_ref", name="uq_allocations_ref"),
)

journal_events = Table(
    "journal_events",
    metadata,
    # INTEGER PRIMARY KEY on SQLite is the rowid (autoincrementing); BIGINT identity elsewhere.
    Column(
        "event_id",
        BigInteger().with_variant(Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column(
        "intent_id",
        String(_ID),
        ForeignKey("intents.intent_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("from_state", String(24)),
    Column("to_state", String(24), nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("actor", String(256), nullable=False),
    Column("receipt_seq", BigInteger),
    Column("note", Text),
    Column("at", Float, nullable=False),
    Index("ix_journal_events_intent", "intent_id", "event_id"),
)

exec_runs = Table(
    "exec_runs",
    metadata,
    Column("exec_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("sandbox_id", String(64), nullable=False),
    Column("intent_id", String(_ID)),
    # The process that streams the run's output; a run it left "running" after dying is unknown.
    Column("owner", String(256), nullable=False),
    Column("state", String(16), nullable=False),  # running | finished | unknown
    Column("exit_code", Integer),
    # JSON, not JSONB, on PostgreSQL: an ExecResult carries output text ("\u0000" and all).
    Column("result", JSON),
    Column("error", JSON),
    # Chunks [first_seq, chunk_count) are kept; older ones were dropped by the byte limit.
    Column("first_seq", BigInteger, nullable=False),
    Column("chunk_count", BigInteger),  # set when the run ends: readers are done at this seq
    Column("kept_bytes", BigInteger, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float),
    Index("ix_exec_runs_state_owner", "state", "owner"),
    Index("ix_exec_runs_finished", "finished_at"),
)

exec_chunks = Table(
    "exec_chunks",
    metadata,
    Column(
        "exec_id",
        String(64),
        ForeignKey("exec_runs.exec_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("seq", BigInteger, nullable=False, autoincrement=False),
    Column("stream", String(8), nullable=False),
    # Byte offset of this chunk within its stream (stdout and stderr count separately);
    # not "offset", which is an SQL keyword.
    Column("stream_offset", BigInteger, nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("exec_id", "seq", name="pk_exec_chunks"),
)
