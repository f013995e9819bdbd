"""The journal's connection plumbing and its read-only queries.

:class:`~sandlot.journal.journal.Journal` adds the transitions on top; this part never changes
an intent. Must not import the Manager, backends, the gate or front ends.
"""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NoReturn

import anyio
import anyio.to_thread
from sqlalchemy import (
    Engine,
    Float,
    and_,
    literal,
    select,
)

from sandlot.errors import InvalidRequest, NotFound
from sandlot.journal.records import (
    _CLAIMED_STATES,
    _INTENT_COLUMNS,
    _INTENT_FROM,
    LEASED_STATES,
    Intent,
    IntentState,
    JournalEvent,
    Lease,
    StaleLease,
    _intent,
)
from sandlot.journal.schema import (
    intents,
    journal_events,
)
from sandlot.journal.statements import (
    _SQL,
    _database_errors,
    _Params,
    _Sql,
)

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.sql.elements import ColumnElement


class JournalReader:
    """One database's intents, read: the plumbing every journal operation shares and the
    queries that change nothing (see :class:`~sandlot.journal.journal.Journal` for its
    arguments)."""

    def __init__(self, engine: Engine, *, owner: str, lease_seconds: float = 60.0) -> None:
        if lease_seconds <= 0:
            msg = f"lease_seconds must be positive, got {lease_seconds}"
            raise InvalidRequest(msg)
        self.engine = engine
        self.owner = owner
        self.lease_seconds = lease_seconds
        self._writer = engine.execution_options(sandlot_write=True)
        self._pg = engine.dialect.name == "postgresql"
        if self._pg not in _SQL:
            _SQL[self._pg] = _Sql(self._pg)
        self._q = _SQL[self._pg]

    # -- plumbing -----------------------------------------------------------------------------

    def _clock(self) -> _Params:
        """The ``now`` parameter for one transaction (PostgreSQL reads its own clock)."""
        return {} if self._pg else {"now": time.time()}

    @contextlib.contextmanager
    def _write(self) -> Iterator[tuple[Connection, _Params]]:
        with _database_errors(), self._writer.begin() as conn:
            yield conn, self._clock()

    @contextlib.contextmanager
    def _read(self) -> Iterator[tuple[Connection, _Params]]:
        with _database_errors(), self.engine.connect() as conn:
            yield conn, self._clock()

    def _event(
        self,
        conn: Connection,
        clock: _Params,
        intent_id: str,
        from_state: IntentState | None,
        to_state: IntentState,
        fence: int,
        *,
        receipt_seq: int | None = None,
        note: str | None = None,
    ) -> None:
        conn.execute(
            self._q.insert_event,
            {
                **clock,
                "v_id": intent_id,
                "v_from": None if from_state is None else from_state.value,
                "v_to": to_state.value,
                "v_fence": fence,
                "v_actor": self.owner,
                "v_receipt_seq": receipt_seq,
                "v_note": note,
            },
        )

    def _load(self, conn: Connection, intent_id: str, *, lock: bool = False) -> Intent:
        stmt = self._q.lock_intent if lock else self._q.select_intent
        row = conn.execute(stmt, {"v_id": intent_id}).mappings().first()
        if row is None:
            msg = f"no intent {intent_id!r}"
            raise NotFound(msg, intent_id=intent_id)
        return _intent(row)

    def _stale(self, conn: Connection, lease: Lease, action: str) -> NoReturn:
        current = self._load(conn, lease.intent_id)
        msg = (
            f"cannot {action} intent {lease.intent_id}: the lease with fence {lease.fence} "
            f"(state {lease.state}) is stale; the intent is {current.state} at fence "
            f"{current.fence}, held by {current.lease_owner}"
        )
        raise StaleLease(
            msg, intent_id=lease.intent_id, fence=lease.fence, current_fence=current.fence
        )

    def stale(self, *, now: datetime | None = None) -> builtins.list[Intent]:
        """Intents in a leased state whose lease expired: their worker died or stalled.

        PREPARED intents are not stale: nothing was done for them yet, and a replay of their
        key carries on (a HOLD may keep one PREPARED for a long time, legitimately).

        Args:
            now: The time to compare with (default: the database's clock).
        """
        clock: ColumnElement[float] = (
            self._q.now if now is None else literal(now.timestamp(), Float)
        )
        stmt = (
            select(*_INTENT_COLUMNS)
            .select_from(_INTENT_FROM)
            .where(
                intents.c.state.in_(sorted(s.value for s in LEASED_STATES)),
                intents.c.lease_expires_at <= clock,
            )
            .order_by(intents.c.lease_expires_at, intents.c.intent_id)
        )
        with self._read() as (conn, params):
            return [_intent(r) for r in conn.execute(stmt, params).mappings()]

    # -- reading --------------------------------------------------------------------------------

    def get(self, intent_id: str) -> Intent:
        """The intent's durable state.

        Raises:
            NotFound: No such intent.
        """
        with self._read() as (conn, _):
            return self._load(conn, intent_id)

    def find(self, tenant: str, idempotency_key: str) -> Intent | None:
        """The tenant's intent for ``idempotency_key``, if any."""
        stmt = (
            select(*_INTENT_COLUMNS)
            .select_from(_INTENT_FROM)
            .where(intents.c.tenant == tenant, intents.c.idempotency_key == idempotency_key)
        )
        with self._read() as (conn, _):
            row = conn.execute(stmt).mappings().first()
        return None if row is None else _intent(row)

    def list(
        self,
        *,
        tenant: str | None = None,
        states: Sequence[IntentState | str] | None = None,
        sandbox_id: str | None = None,
        limit: int | None = None,
    ) -> builtins.list[Intent]:
        """Intents, oldest first, filtered (for ``sandlot doctor`` and ``get``)."""
        conds: builtins.list[ColumnElement[bool]] = []
        if tenant is not None:
            conds.append(intents.c.tenant == tenant)
        if states is not None:
            conds.append(intents.c.state.in_(sorted(IntentState(s).value for s in states)))
        if sandbox_id is not None:
            conds.append(intents.c.sandbox_id == sandbox_id)
        stmt = (
            select(*_INTENT_COLUMNS)
            .select_from(_INTENT_FROM)
            .where(and_(True, *conds))
            .order_by(intents.c.created_at, intents.c.intent_id)
        )
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as (conn, _):
            return [_intent(r) for r in conn.execute(stmt).mappings()]

    def events(self, intent_id: str) -> builtins.list[JournalEvent]:
        """The intent's history, oldest first."""
        stmt = (
            select(journal_events)
            .where(journal_events.c.intent_id == intent_id)
            .order_by(journal_events.c.event_id)
        )
        with self._read() as (conn, _):
            return [
                JournalEvent(
                    event_id=int(r.event_id),
                    intent_id=r.intent_id,
                    from_state=None if r.from_state is None else IntentState(r.from_state),
                    to_state=IntentState(r.to_state),
                    fence=int(r.fence),
                    actor=r.actor,
                    receipt_seq=r.receipt_seq,
                    note=r.note,
                    at=datetime.fromtimestamp(r.at, UTC),
                )
                for r in conn.execute(stmt)
            ]

    def _working(self, intent_id: str) -> bool:
        busy = select(
            select(intents.c.intent_id)
            .where(
                intents.c.intent_id == intent_id,
                intents.c.state.in_(sorted(s.value for s in _CLAIMED_STATES)),
                intents.c.lease_expires_at > self._q.now,
            )
            .exists()
        )
        with self._read() as (conn, clock):
            return bool(conn.execute(busy, clock).scalar())

    async def wait(
        self,
        intent_id: str,
        *,
        timeout: float,
        wake: anyio.Event | None = None,
        poll: float = 0.01,
        max_poll: float = 0.25,
    ) -> Intent:
        """Wait until nobody is working on the intent: it rests, its worker's lease expired,
        or (PREPARED) its claim was released or expired.

        For a repeat that arrives while the first call is still running: it returns the
        finished state when the first call ends within ``timeout``, else the state then.
        Asynchronous, and holding no worker thread between polls: any number of repeats may
        wait without starving the threads every other request needs. Polling (from ``poll``
        up to ``max_poll`` seconds apart) sees an outcome whichever process records it;
        ``wake`` (see :class:`~sandlot.journal.wakeups.Wakeups`) cuts a pause short when this
        process records it.
        """
        deadline = anyio.current_time() + timeout
        while True:
            working = await anyio.to_thread.run_sync(self._working, intent_id)
            left = deadline - anyio.current_time()
            if not working or left <= 0:
                return await anyio.to_thread.run_sync(self.get, intent_id)
            with anyio.move_on_after(min(poll, left)):
                if wake is None:
                    await anyio.sleep_forever()
                else:
                    await wake.wait()
                    wake = None  # set for good: later pauses are plain polls
            poll = min(poll * 2, max_poll)
