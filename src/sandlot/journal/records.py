"""The journal's records: intent states, the rows it returns, and the error for a stale lease.

Plain data and the state sets the transitions are checked against; the SQL that reads and
writes them is in :mod:`sandlot.journal.statements`. Imports nothing of sandlot but its errors,
the journal's schema and canonical JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Final

from sandlot.errors import Conflict
from sandlot.journal.schema import (
    intents,
    provider_allocations,
)
from sandlot.receipts.canonical import JsonValue

if TYPE_CHECKING:
    from sqlalchemy import RowMapping


class IntentState(StrEnum):
    """Where an intent is. Values are the strings stored in the database."""

    PREPARED = "PREPARED"
    AUTHORIZED = "AUTHORIZED"
    ALLOCATING = "ALLOCATING"
    ALLOCATED = "ALLOCATED"
    RUNNING = "RUNNING"
    RESULT_RECORDED = "RESULT_RECORDED"
    CLEANING = "CLEANING"
    CLEANED = "CLEANED"
    DENIED = "DENIED"
    FAILED = "FAILED"
    NEEDS_RECONCILE = "NEEDS_RECONCILE"


S = IntentState

#: States a worker is in the middle of: they hold a lease, and an expired one means the worker
#: died (or stalled) and recovery must look at what it left.
LEASED_STATES: Final = frozenset({S.AUTHORIZED, S.ALLOCATING, S.ALLOCATED, S.RUNNING, S.CLEANING})
#: States nothing moves out of on its own. NEEDS_RECONCILE leaves only by :meth:`Journal.resolve`.
FINAL_STATES: Final = frozenset({S.CLEANED, S.DENIED, S.FAILED, S.NEEDS_RECONCILE})
# Where someone works on the intent while its lease (for PREPARED: its claim) holds.
_CLAIMED_STATES: Final = LEASED_STATES | {S.PREPARED}
# Where a worker may take a lease: mid-work states (after expiry) and a recorded result (whose
# allocation may later be cleaned up).
_TAKEABLE: Final = LEASED_STATES | {S.RESULT_RECORDED}
# Reached through advance(); the other edges have their own method because they write more
# than the intent row (an authorization, an allocation) or take no lease (deny, reconcile).
_ADVANCE: Final[Mapping[IntentState, frozenset[IntentState]]] = {
    S.AUTHORIZED: frozenset({S.RUNNING, S.RESULT_RECORDED, S.CLEANING, S.FAILED}),
    S.ALLOCATING: frozenset({S.FAILED}),
    S.ALLOCATED: frozenset({S.RUNNING, S.RESULT_RECORDED, S.CLEANING, S.FAILED}),
    S.RUNNING: frozenset({S.RESULT_RECORDED, S.FAILED}),
    S.RESULT_RECORDED: frozenset({S.CLEANING}),
    S.CLEANING: frozenset({S.CLEANED, S.FAILED}),
}


class StaleLease(Conflict):
    """This worker's lease was taken over (or the intent moved on): stop, with no side effects.

    Its code is ``conflict``, so it crosses HTTP and MCP as :class:`~sandlot.errors.Conflict`.
    """


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _text(value: str) -> str:
    """Free text as PostgreSQL can store it (a text column refuses NUL characters)."""
    return value.replace("\x00", "\ufffd")


def allocation_name(intent_id: str, *, prefix: str = "sl-") -> str:
    """The deterministic backend-side name for the resource ``intent_id`` allocates.

    A retry, a replay and crash recovery all derive the same name, so they find the resource
    instead of creating a second one. 24 hex digits (96 bits) of the intent id keep it short
    enough for container and VM names; ``UNIQUE (deterministic_name)`` catches a collision.
    """
    digest = intent_id.removeprefix("sha256:")
    return f"{prefix}{digest[:24]}"


@dataclass(frozen=True)
class Allocation:
    """The backend resource an intent allocated (at most one per intent)."""

    backend: str
    deterministic_name: str
    provider_ref: str | None
    """None while ALLOCATING: the backend had not answered when this was recorded."""
    fence: int
    created_at: datetime
    allocated_at: datetime | None
    released_at: datetime | None


@dataclass(frozen=True)
class Intent:
    """The durable state of one operation, as stored."""

    intent_id: str
    request_hash: str
    tenant: str
    principal: str
    op: str
    idempotency_key: str | None
    request: dict[str, JsonValue]
    state: IntentState
    fence: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    sandbox_id: str | None
    result: JsonValue
    result_hash: str | None
    receipt_seq: int | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    allocation: Allocation | None

    @property
    def final(self) -> bool:
        """Whether nothing will move this intent on its own."""
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class Lease:
    """The right to move one intent on: valid while ``fence`` is still the intent's fence."""

    intent_id: str
    fence: int
    owner: str
    state: IntentState
    expires_at: datetime | None
    """When others may take over (database clock); None once the intent rests."""


@dataclass(frozen=True)
class Begun:
    """What :meth:`Journal.begin` found: a new intent, or the existing one for the same key."""

    intent: Intent
    replay: bool
    """True when the key was seen before with the same request: ``intent`` is its durable
    state (any state, a finished result included), and nothing was inserted."""


@dataclass(frozen=True)
class JournalEvent:
    """One transition in an intent's history."""

    event_id: int
    intent_id: str
    from_state: IntentState | None
    to_state: IntentState
    fence: int
    actor: str
    receipt_seq: int | None
    note: str | None
    at: datetime


_INTENT_COLUMNS = (
    *intents.c,
    provider_allocations.c.backend.label("a_backend"),
    provider_allocations.c.deterministic_name.label("a_name"),
    provider_allocations.c.provider_ref.label("a_ref"),
    provider_allocations.c.fence.label("a_fence"),
    provider_allocations.c.created_at.label("a_created"),
    provider_allocations.c.allocated_at.label("a_allocated"),
    provider_allocations.c.released_at.label("a_released"),
)
_INTENT_FROM = intents.outerjoin(
    provider_allocations, provider_allocations.c.intent_id == intents.c.intent_id
)


def _intent(row: RowMapping) -> Intent:
    allocation = None
    if row.get("a_backend") is not None:  # absent from an INSERT … RETURNING row
        allocation = Allocation(
            backend=row["a_backend"],
            deterministic_name=row["a_name"],
            provider_ref=row["a_ref"],
            fence=int(row["a_fence"]),
            created_at=datetime.fromtimestamp(row["a_created"], UTC),
            allocated_at=_dt(row["a_allocated"]),
            released_at=_dt(row["a_released"]),
        )
    return Intent(
        intent_id=row["intent_id"],
        request_hash=row["request_hash"],
        tenant=row["tenant"],
        principal=row["principal"],
        op=row["op"],
        idempotency_key=row["idempotency_key"],
        request=json.loads(row["request_json"]),
        state=IntentState(row["state"]),
        fence=int(row["fence"]),
        lease_owner=row["lease_owner"],
        lease_expires_at=_dt(row["lease_expires_at"]),
        sandbox_id=row["sandbox_id"],
        result=None if row["result_json"] is None else json.loads(row["result_json"]),
        result_hash=row["result_hash"],
        receipt_seq=row["receipt_seq"],
        error=row["error"],
        created_at=datetime.fromtimestamp(row["created_at"], UTC),
        updated_at=datetime.fromtimestamp(row["updated_at"], UTC),
        allocation=allocation,
    )
