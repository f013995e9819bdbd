"""The durable intent journal: idempotent intents, one-use authorizations, fenced transitions.

Every operation the Manager runs for an agent becomes an *intent*, written before anything
happens and moved through a state machine by fenced updates::

    PREPARED ─authorize─► AUTHORIZED ─allocating─► ALLOCATING ─allocated─► ALLOCATED
    PREPARED ─deny─► DENIED
    AUTHORIZED, ALLOCATED ─advance─► RUNNING | RESULT_RECORDED | CLEANING
    RUNNING ─► RESULT_RECORDED ─► CLEANING ─► CLEANED
    AUTHORIZED, ALLOCATING, ALLOCATED, RUNNING, CLEANING ─fail─► FAILED
    any state but CLEANED, DENIED, FAILED ─needs_reconcile─► NEEDS_RECONCILE
    NEEDS_RECONCILE ─resolve (an operator)─► FAILED | CLEANED

What the database guarantees, whatever the callers do (these are constraints and conditional
updates, not code paths):

- **Idempotency.** ``UNIQUE (tenant, idempotency_key)``: the first ``begin`` with a key wins
  the insert; every later one reads the winner back and either replays it (same request) or is
  refused with ``Conflict`` (another request).
- **One caller at the gate per key.** A PREPARED intent is *claimed* (``lease_owner``,
  ``lease_expires_at``) by whoever began it; a repeat takes the claim only with
  ``UPDATE … WHERE state = 'PREPARED' AND the claim is free``, so concurrent repeats wait for
  the one deciding instead of racing it for the authorization.
- **One-use authorization.** An authorization is consumed by
  ``UPDATE … WHERE consumed_at IS NULL AND expires_at > now``; exactly one caller sees a row
  changed, and it moves the intent to AUTHORIZED with ``fence + 1`` in the same transaction.
- **Fencing.** Every later transition is ``UPDATE … WHERE intent_id = :id AND fence = :fence
  AND state = :expected``. A worker whose lease was taken over (the fence moved on) changes
  nothing and gets :class:`StaleLease`, before it can touch the backend again.
- **At most one allocation per intent.** ``provider_allocations`` is keyed by the intent and
  ALLOCATING is recorded (with the deterministic name the backend will be given) *before* the
  backend is called, so recovery looks that name up instead of allocating a second time.

Lease expiry is measured on the database's clock on PostgreSQL (``now()``), which every host
sharing the database agrees on. On SQLite the client's clock is the database's clock: SQLite is
embedded, and every process that opens the file (WAL needs shared memory) runs on this host.

The journal is synchronous SQLAlchemy Core (the Manager calls it from a worker thread), except
:meth:`Journal.wait`, which is async so that waiting holds no worker thread. Give it
an engine from :func:`sandlot.store.sql.open_engine` (on SQLite, writers then take the write
lock at ``BEGIN``) whose schema is current. This module must not import the Manager, backends,
the policy gate or front ends.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Literal, final

from sqlalchemy import (
    delete,
    exists,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from sandlot.errors import Conflict, InvalidRequest, InvalidState, NotFound
from sandlot.journal.reader import JournalReader
from sandlot.journal.records import (
    _ADVANCE,
    _TAKEABLE,
    FINAL_STATES,
    LEASED_STATES,
    Allocation,
    Begun,
    Intent,
    IntentState,
    JournalEvent,
    Lease,
    S,
    StaleLease,
    _dt,
    _intent,
    _text,
    allocation_name,
)
from sandlot.journal.schema import (
    authorizations,
    intents,
    journal_events,
    provider_allocations,
)
from sandlot.journal.statements import (
    _Params,
)
from sandlot.receipts.canonical import JsonValue, canonical_json, sha256_ref

if TYPE_CHECKING:
    from sqlalchemy import Connection

__all__ = [
    "FINAL_STATES",
    "LEASED_STATES",
    "Allocation",
    "Begun",
    "Intent",
    "IntentState",
    "Journal",
    "JournalEvent",
    "Lease",
    "StaleLease",
    "allocation_name",
]


@final
class Journal(JournalReader):
    """The intent journal on one database.

    Args:
        engine: An engine from :func:`sandlot.store.sql.open_engine`, schema migrated.
        owner: Who this journal acts as: the lease holder and the actor in the history (one
            per process: :func:`sandlot.journal.owner.process_owner`).
        lease_seconds: How long a lease lasts without a transition or :meth:`renew`. Longer
            than the slowest backend call between two transitions, or another worker takes
            over mid-call (safely: the slow worker is fenced out, but its work is wasted).
    """

    # (construction, plumbing and reads: JournalReader)

    # -- beginning ------------------------------------------------------------------------------

    def begin(
        self,
        *,
        tenant: str,
        principal: str,
        op: str,
        request: Mapping[str, JsonValue],
        idempotency_key: str | None,
        claim_seconds: float | None = None,
    ) -> Begun:
        """Record the intent to do ``op``, or find the one an earlier call with the key made.

        The intent id is the SHA-256 of the RFC 8785 form of ``{op, tenant, request}`` and the
        idempotency key (or, without a key, a random nonce, so that two identical requests
        without keys are two intents). ``request_hash`` is the hash without the key: two
        calls with one key carry the same request exactly when their intent ids are equal.

        Args:
            tenant: The tenant the key is scoped to.
            principal: Who asked (recorded; not part of the identity).
            op: The operation, e.g. ``"sandbox.create"``.
            request: The normalized request, as JSON.
            idempotency_key: The caller's key, or None for a one-off intent.

        A new intent is *claimed* by this journal's owner for ``claim_seconds`` (default
        ``lease_seconds``; longer than the gate may take, a HOLD included): its caller is at
        the gate with it. A repeat that finds it PREPARED waits while the claim holds, and
        takes it over (:meth:`claim`) once it is released or expired.

        Returns:
            The new intent (``replay=False``, state PREPARED), or the existing durable state of
            the key's intent, whatever its state (``replay=True``).

        Raises:
            Conflict: The key was used before with a different request.
            InvalidRequest: The request cannot be written as canonical JSON.
        """
        body: dict[str, JsonValue] = {"op": op, "tenant": tenant, "request": dict(request)}
        request_hash = sha256_ref(canonical_json(body))
        if idempotency_key is None:
            identity = {**body, "nonce": secrets.token_hex(16)}
        else:
            identity = {**body, "idempotency_key": idempotency_key}
        intent_id = sha256_ref(canonical_json(identity))
        values: _Params = {
            "v_id": intent_id,
            "v_request_hash": request_hash,
            "v_tenant": tenant,
            "v_principal": principal,
            "v_op": op,
            "v_key": idempotency_key,
            "v_request_json": canonical_json(body["request"]).decode(),
            "v_owner": self.owner,
            "v_lease": claim_seconds or self.lease_seconds,
        }
        with self._write() as (conn, clock):
            # RETURNING, not rowcount: with DO NOTHING the row count is not reliable across
            # drivers, while "a row came back" means exactly "this call inserted it".
            stmt = (
                self._q.insert_intent if idempotency_key is None else self._q.insert_intent_if_new
            )
            row = conn.execute(stmt, {**clock, **values}).mappings().first()
            if row is not None:
                self._event(conn, clock, intent_id, None, S.PREPARED, 0)
                return Begun(intent=_intent(row), replay=False)
            existing = conn.execute(
                self._q.select_key, {"v_tenant": tenant, "v_key": idempotency_key}
            ).first()
            if existing is None:
                # The insert hit another unique constraint: the same intent id under another
                # (tenant, key) pair, which a SHA-256 collision alone could produce.
                msg = f"intent {intent_id} exists under another key"
                raise Conflict(msg, intent_id=intent_id)
            if existing.intent_id != intent_id:
                msg = (
                    f"idempotency key {idempotency_key!r} was reused with a different request "
                    f"(it was first used for {existing.op}, intent {existing.intent_id})"
                )
                raise Conflict(msg, idempotency_key=idempotency_key, intent_id=existing.intent_id)
            return Begun(intent=self._load(conn, intent_id), replay=True)

    def claim(
        self, intent_id: str, *, dead_owner: str | None = None, claim_seconds: float | None = None
    ) -> bool:
        """Claim a PREPARED intent whose claim is free: released, expired, or held by
        ``dead_owner`` (a process the caller proved gone with :func:`owner_alive`).

        Exactly one of several concurrent callers gets True; it goes to the gate with the
        intent, the others wait for it (:meth:`wait`).
        """
        now = self._q.now
        free = [intents.c.lease_expires_at.is_(None), intents.c.lease_expires_at <= now]
        if dead_owner is not None:
            free.append(intents.c.lease_owner == dead_owner)
        with self._write() as (conn, clock):
            row = conn.execute(
                update(intents)
                .where(
                    intents.c.intent_id == intent_id,
                    intents.c.state == S.PREPARED.value,
                    or_(*free),
                )
                .values(
                    lease_owner=self.owner,
                    lease_expires_at=now + (claim_seconds or self.lease_seconds),
                    updated_at=now,
                )
                .returning(intents.c.intent_id),
                clock,
            ).first()
            return row is not None

    def release_claim(self, intent_id: str) -> None:
        """Give up this owner's claim on a PREPARED intent (its gate failed without a
        decision), so that a waiting repeat takes it at once rather than after expiry."""
        with self._write() as (conn, clock):
            conn.execute(
                update(intents)
                .where(
                    intents.c.intent_id == intent_id,
                    intents.c.state == S.PREPARED.value,
                    intents.c.lease_owner == self.owner,
                )
                .values(lease_expires_at=None, updated_at=self._q.now),
                clock,
            )

    def taken(self, tenant: str, idempotency_key: str) -> bool:
        """Whether a call with this key is past its gate, or at it now (claimed), or done.

        A repeat of such a key runs nothing new (it replays or is refused as a conflict), so
        it needs no quota slot.
        """
        stmt = select(
            select(intents.c.intent_id)
            .where(
                intents.c.tenant == tenant,
                intents.c.idempotency_key == idempotency_key,
                or_(
                    intents.c.state != S.PREPARED.value,
                    intents.c.lease_expires_at > self._q.now,
                ),
            )
            .exists()
        )
        with self._read() as (conn, clock):
            return bool(conn.execute(stmt, clock).scalar())

    def deny(self, intent_id: str, *, decision: str, reason: str) -> Intent:
        """Record that the gate denied a PREPARED intent (final: a replay gets the denial).

        Raises:
            NotFound: No such intent.
            InvalidState: The intent is no longer PREPARED.
        """
        with self._write() as (conn, clock):
            res = conn.execute(
                update(intents)
                .where(intents.c.intent_id == intent_id, intents.c.state == S.PREPARED.value)
                .values(
                    state=S.DENIED.value,
                    error=_text(reason),
                    lease_expires_at=None,
                    updated_at=self._q.now,
                )
                .returning(intents.c.fence),
                clock,
            ).first()
            if res is None:
                current = self._load(conn, intent_id)
                msg = f"cannot deny intent {intent_id}: it is {current.state}, not PREPARED"
                raise InvalidState(msg, intent_id=intent_id, state=current.state.value)
            self._event(conn, clock, intent_id, S.PREPARED, S.DENIED, res.fence, note=decision)
            return self._load(conn, intent_id)

    # -- authorization ------------------------------------------------------------------------

    def grant(self, intent_id: str, *, decision: str, ttl: float = 300.0) -> None:
        """Create the one-use authorization for ``intent_id``, bound to an ALLOW decision.

        Granting again with the same decision is a no-op (a retried grant). An intent has one
        authorization ever, and a decision authorizes one intent.

        Args:
            intent_id: The PREPARED intent the decision allowed.
            decision: The ``entry_hash`` of the ALLOW decision receipt. Without a policy gate
                there is no receipt: pass a per-intent marker such as ``f"ungated:{intent_id}"``.
            ttl: Seconds the authorization may wait to be consumed.

        Raises:
            NotFound: No such intent.
            Conflict: The intent was authorized by another decision, or the decision already
                authorizes another intent.
        """
        with self._write() as (conn, clock):
            self._grant(conn, clock, intent_id, decision, ttl)

    def _grant(
        self, conn: Connection, clock: _Params, intent_id: str, decision: str, ttl: float
    ) -> None:
        params = {
            **clock,
            "v_auth_id": secrets.token_hex(16),
            "v_id": intent_id,
            "v_decision": decision,
            "v_ttl": ttl,
        }
        try:
            if conn.execute(self._q.grant, params).first() is not None:
                return
        except IntegrityError as e:  # ON CONFLICT swallows unique violations, not this one
            msg = f"no intent {intent_id!r}"
            raise NotFound(msg, intent_id=intent_id) from e
        bound = conn.execute(self._q.select_auth, {"v_id": intent_id}).first()
        if bound is None:
            msg = f"decision {decision} already authorizes another intent"
            raise Conflict(msg, intent_id=intent_id, decision=decision)
        if bound.decision != decision:
            msg = f"intent {intent_id} is already authorized by decision {bound.decision}"
            raise Conflict(msg, intent_id=intent_id, decision=bound.decision)

    def consume(self, intent_id: str, *, decision: str) -> Lease:
        """Use up the intent's authorization, once: PREPARED -> AUTHORIZED, a new fence, a lease.

        Exactly one caller (thread, process or host) succeeds; every other one gets
        ``Conflict`` and must not run the operation.

        Raises:
            Conflict: The authorization is already consumed, expired, bound to another
                decision, or missing; or the intent is no longer PREPARED.
        """
        with self._write() as (conn, clock):
            return self._consume(conn, clock, intent_id, decision)

    def _consume(self, conn: Connection, clock: _Params, intent_id: str, decision: str) -> Lease:
        params = {
            **clock,
            "v_id": intent_id,
            "v_decision": decision,
            "v_owner": self.owner,
            "v_lease": self.lease_seconds,
        }
        if conn.execute(self._q.consume, params).rowcount != 1:
            auth = conn.execute(self._q.select_auth, {"v_id": intent_id}).first()
            if auth is None:
                why = "it has no authorization"
            elif auth.decision != decision:
                why = f"its authorization is bound to decision {auth.decision}"
            elif auth.consumed_at is not None:
                why = f"its authorization was already consumed by {auth.consumed_by}"
            else:
                why = "its authorization expired"
            msg = f"cannot run intent {intent_id}: {why}"
            raise Conflict(msg, intent_id=intent_id)
        row = conn.execute(self._q.authorize_intent, params).first()
        if row is None:
            # Raising rolls the consumption back: the authorization stays unused.
            current = self._load(conn, intent_id)
            msg = f"cannot run intent {intent_id}: it is {current.state}, not PREPARED"
            raise Conflict(msg, intent_id=intent_id, state=current.state.value)
        fence = int(row.fence)
        self._event(conn, clock, intent_id, S.PREPARED, S.AUTHORIZED, fence, note=decision)
        return Lease(intent_id, fence, self.owner, S.AUTHORIZED, _dt(row.lease_expires_at))

    def authorize(self, intent_id: str, *, decision: str, ttl: float = 300.0) -> Lease:
        """:meth:`grant` and :meth:`consume` in one transaction: the usual path after ALLOW.

        Raises:
            NotFound: No such intent.
            Conflict: Another caller consumed the authorization first (a concurrent worker or
                a replay), the intent is no longer PREPARED, or the decision is bound elsewhere.
        """
        with self._write() as (conn, clock):
            self._grant(conn, clock, intent_id, decision, ttl)
            return self._consume(conn, clock, intent_id, decision)

    # -- fenced transitions ---------------------------------------------------------------------

    def _move(
        self,
        conn: Connection,
        clock: _Params,
        lease: Lease,
        to_state: IntentState,
        *,
        action: str,
        fields: Mapping[str, object] | None = None,
        receipt_seq: int | None = None,
        note: str | None = None,
    ) -> Lease:
        stmt = self._q.move_resting if to_state not in LEASED_STATES else self._q.move_leased
        params: _Params = {
            **clock,
            "v_sandbox_id": None,
            "v_result_json": None,
            "v_result_hash": None,
            "v_receipt_seq": receipt_seq,
            "v_error": None,
            **(fields or {}),
            "v_id": lease.intent_id,
            "v_fence": lease.fence,
            "v_expected": lease.state.value,
            "v_to": to_state.value,
            "v_lease": self.lease_seconds,
        }
        row = conn.execute(stmt, params).first()
        if row is None:
            self._stale(conn, lease, action)
        if to_state != lease.state or note is not None:
            self._event(
                conn,
                clock,
                lease.intent_id,
                lease.state,
                to_state,
                lease.fence,
                receipt_seq=receipt_seq,
                note=note,
            )
        return Lease(lease.intent_id, lease.fence, lease.owner, to_state, _dt(row.lease_expires_at))

    def advance(
        self,
        lease: Lease,
        to_state: IntentState | str,
        *,
        sandbox_id: str | None = None,
        result: JsonValue = None,
        result_hash: str | None = None,
        receipt_seq: int | None = None,
        error: str | None = None,
        note: str | None = None,
    ) -> Lease:
        """Move the intent from ``lease.state`` to ``to_state``, if ``lease`` is still current.

        Moving to a leased state renews the lease; moving to a resting state ends it. Fields
        given are written in the same update; ``receipt_seq`` also goes into the history.

        Raises:
            StaleLease: The fence moved on or the state is not ``lease.state`` (another worker
                took over): stop without side effects.
            InvalidRequest: ``to_state`` is not reachable from ``lease.state`` through this
                method (ALLOCATING/ALLOCATED/AUTHORIZED/DENIED/NEEDS_RECONCILE have their own).
        """
        target = IntentState(to_state)
        if target not in _ADVANCE.get(lease.state, frozenset()):
            msg = f"no transition {lease.state} -> {target} through advance()"
            raise InvalidRequest(msg, intent_id=lease.intent_id)
        fields: _Params = {"v_sandbox_id": sandbox_id, "v_result_hash": result_hash}
        if result is not None:
            document = canonical_json(result)
            fields["v_result_json"] = document.decode()
            fields["v_result_hash"] = result_hash or sha256_ref(document)
        if error is not None:
            fields["v_error"] = _text(error)
        with self._write() as (conn, clock):
            new = self._move(
                conn,
                clock,
                lease,
                target,
                action=f"move to {target}",
                fields=fields,
                receipt_seq=receipt_seq,
                note=None if note is None else _text(note),
            )
            if target is S.CLEANED:
                conn.execute(self._q.release_intent, {**clock, "v_id": lease.intent_id})
            return new

    def renew(self, lease: Lease) -> Lease:
        """Extend the lease (a heartbeat during a long backend call); fenced like a transition.

        Raises:
            StaleLease: Another worker took over.
        """
        with self._write() as (conn, clock):
            return self._move(conn, clock, lease, lease.state, action="renew")

    def attach_sandbox(self, lease: Lease, sandbox_id: str) -> Lease:
        """Record the sandbox this intent created or acts on (no state change).

        Raises:
            StaleLease: Another worker took over.
        """
        with self._write() as (conn, clock):
            return self._move(
                conn,
                clock,
                lease,
                lease.state,
                action="attach a sandbox to",
                fields={"v_sandbox_id": sandbox_id},
            )

    def allocating(self, lease: Lease, *, backend: str, name: str) -> Lease:
        """AUTHORIZED -> ALLOCATING, recording the allocation *before* the backend is called.

        Args:
            lease: The lease from :meth:`authorize` (state AUTHORIZED).
            backend: The backend that will hold the resource.
            name: The deterministic name/label the backend will be given
                (:func:`allocation_name`); recovery looks the resource up by it.

        Raises:
            StaleLease: Another worker took over.
            Conflict: The intent already has an allocation, or ``name`` is another intent's.
        """
        if lease.state is not S.AUTHORIZED:
            msg = f"allocating() needs an AUTHORIZED lease, not {lease.state}"
            raise InvalidRequest(msg, intent_id=lease.intent_id)
        try:
            with self._write() as (conn, clock):
                new = self._move(
                    conn,
                    clock,
                    lease,
                    S.ALLOCATING,
                    action="start allocating for",
                    note=f"{backend}:{name}",
                )
                conn.execute(
                    self._q.insert_allocation,
                    {
                        **clock,
                        "v_id": lease.intent_id,
                        "v_backend": backend,
                        "v_name": name,
                        "v_fence": lease.fence,
                    },
                )
                return new
        except IntegrityError as e:
            msg = (
                f"intent {lease.intent_id} cannot allocate {backend}:{name}: it already has "
                "an allocation, or the name belongs to another intent"
            )
            raise Conflict(msg, intent_id=lease.intent_id, name=name) from e

    def allocated(self, lease: Lease, *, provider_ref: str) -> Lease:
        """ALLOCATING -> ALLOCATED: the backend created (or recovery adopted) the resource.

        Raises:
            StaleLease: Another worker took over.
            Conflict: A different provider_ref was already recorded for this intent, or
                ``provider_ref`` is another intent's on the same backend.
        """
        if lease.state is not S.ALLOCATING:
            msg = f"allocated() needs an ALLOCATING lease, not {lease.state}"
            raise InvalidRequest(msg, intent_id=lease.intent_id)
        try:
            with self._write() as (conn, clock):
                new = self._move(conn, clock, lease, S.ALLOCATED, action="record the allocation of")
                res = conn.execute(
                    self._q.record_allocation,
                    {
                        **clock,
                        "v_id": lease.intent_id,
                        "v_ref": provider_ref,
                        "v_fence": lease.fence,
                    },
                )
                if res.rowcount != 1:
                    msg = (
                        f"intent {lease.intent_id} already recorded another resource than "
                        f"{provider_ref!r}"
                    )
                    raise Conflict(msg, intent_id=lease.intent_id)
                return new
        except IntegrityError as e:
            msg = f"provider_ref {provider_ref!r} is already another intent's allocation"
            raise Conflict(msg, intent_id=lease.intent_id, provider_ref=provider_ref) from e

    def record_result(
        self,
        lease: Lease,
        *,
        result: Mapping[str, JsonValue],
        result_hash: str | None = None,
        receipt_seq: int | None,
    ) -> Lease:
        """Store the operation's result (replays return it) and move to RESULT_RECORDED.

        Args:
            lease: A lease in AUTHORIZED, ALLOCATED or RUNNING.
            result: The result as JSON (a sandbox record, an ExecResult, …).
            result_hash: Its hash as the execution receipt states it (default: SHA-256 of its
                RFC 8785 form).
            receipt_seq: The execution receipt's seq, if any.

        Raises:
            StaleLease: Another worker took over.
        """
        return self.advance(
            lease,
            S.RESULT_RECORDED,
            result=dict(result),
            result_hash=result_hash,
            receipt_seq=receipt_seq,
        )

    def fail(self, lease: Lease, *, error: str) -> Lease:
        """Record a definitive failure (final; a replay gets ``error``).

        Only for a failure that left nothing behind, or whose leftovers the caller cleaned:
        when the outcome of a backend call is unknown, use :meth:`needs_reconcile`.

        Raises:
            StaleLease: Another worker took over.
        """
        if lease.state not in LEASED_STATES:
            msg = f"cannot fail an intent in {lease.state}"
            raise InvalidRequest(msg, intent_id=lease.intent_id)
        error = _text(error)
        with self._write() as (conn, clock):
            return self._move(
                conn,
                clock,
                lease,
                S.FAILED,
                action="fail",
                fields={"v_error": error},
                note=error,
            )

    def needs_reconcile(self, intent_id: str, *, why: str) -> None:
        """Park the intent for an operator: the outcome of a side effect cannot be known.

        Fails closed: the fence moves on, so a worker still holding a lease is stopped at its
        next transition, and nothing moves the intent until :meth:`resolve`. Idempotent on an
        intent already in NEEDS_RECONCILE.

        Raises:
            NotFound: No such intent.
            InvalidState: The intent already ended (CLEANED, DENIED or FAILED).
        """
        why = _text(why)
        with self._write() as (conn, clock):
            current = self._load(conn, intent_id, lock=True)
            if current.state is S.NEEDS_RECONCILE:
                return
            if current.final:
                msg = f"intent {intent_id} already ended in {current.state}"
                raise InvalidState(msg, intent_id=intent_id, state=current.state.value)
            conn.execute(
                update(intents)
                .where(intents.c.intent_id == intent_id, intents.c.fence == current.fence)
                .values(
                    state=S.NEEDS_RECONCILE.value,
                    fence=current.fence + 1,
                    lease_expires_at=None,
                    error=why,
                    updated_at=self._q.now,
                ),
                clock,
            )
            self._event(
                conn,
                clock,
                intent_id,
                current.state,
                S.NEEDS_RECONCILE,
                current.fence + 1,
                note=why,
            )

    def resolve(
        self, intent_id: str, *, outcome: Literal["FAILED", "CLEANED"], note: str
    ) -> Intent:
        """An operator's verdict on a NEEDS_RECONCILE intent, after looking at the backend.

        Args:
            intent_id: The intent.
            outcome: ``"CLEANED"`` when its resource is gone (or was removed by hand),
                ``"FAILED"`` when it never existed or must be forgotten.
            note: What the operator found (kept in the history).

        Raises:
            NotFound: No such intent.
            InvalidState: The intent is not in NEEDS_RECONCILE.
        """
        target = IntentState(outcome)
        note = _text(note)
        with self._write() as (conn, clock):
            row = conn.execute(
                update(intents)
                .where(
                    intents.c.intent_id == intent_id,
                    intents.c.state == S.NEEDS_RECONCILE.value,
                )
                .values(state=target.value, updated_at=self._q.now)
                .returning(intents.c.fence),
                clock,
            ).first()
            if row is None:
                current = self._load(conn, intent_id)
                msg = f"intent {intent_id} is {current.state}, not NEEDS_RECONCILE"
                raise InvalidState(msg, intent_id=intent_id, state=current.state.value)
            self._event(conn, clock, intent_id, S.NEEDS_RECONCILE, target, row.fence, note=note)
            if target is S.CLEANED:
                conn.execute(self._q.release_intent, {**clock, "v_id": intent_id})
            return self._load(conn, intent_id)

    def release(self, *, backend: str, provider_ref: str) -> bool:
        """Mark the allocation of ``provider_ref`` released (its resource was destroyed).

        For a resource one intent created and another (a destroy) removed. Idempotent.

        Returns:
            Whether an unreleased allocation was found.
        """
        with self._write() as (conn, clock):
            res = conn.execute(
                update(provider_allocations)
                .where(
                    provider_allocations.c.backend == backend,
                    provider_allocations.c.provider_ref == provider_ref,
                    provider_allocations.c.released_at.is_(None),
                )
                .values(released_at=self._q.now),
                clock,
            )
            return res.rowcount == 1

    # -- recovery -------------------------------------------------------------------------------
    def take_over(
        self, intent_id: str, *, dead_owner: str | None = None, leased_only: bool = False
    ) -> Lease:
        """Take the intent's lease with a new fence, if its holder's lease expired (or its
        holder is ``dead_owner``, a process the caller proved gone with :func:`owner_alive`:
        after a crash on this host there is no need to wait the lease out).

        The old holder is fenced out: its next transition raises :class:`StaleLease`. A
        RESULT_RECORDED intent (no lease) can be taken to clean up its allocation, unless
        ``leased_only``: recovery of a worker's unfinished work must not take an intent whose
        worker finished after recovery looked.

        Raises:
            NotFound: No such intent.
            Conflict: The lease is still held (not expired).
            InvalidState: The intent is PREPARED (authorize it) or final (or, with
                ``leased_only``, RESULT_RECORDED).
        """
        with self._write() as (conn, clock):
            current = self._load(conn, intent_id, lock=True)
            if current.state not in (LEASED_STATES if leased_only else _TAKEABLE):
                msg = f"intent {intent_id} is {current.state}: there is no lease to take over"
                raise InvalidState(msg, intent_id=intent_id, state=current.state.value)
            now = self._q.now
            free = [intents.c.lease_expires_at.is_(None), intents.c.lease_expires_at <= now]
            if dead_owner is not None:
                free.append(intents.c.lease_owner == dead_owner)
            row = conn.execute(
                update(intents)
                .where(
                    intents.c.intent_id == intent_id,
                    intents.c.fence == current.fence,
                    or_(*free),
                )
                .values(
                    fence=intents.c.fence + 1,
                    lease_owner=self.owner,
                    lease_expires_at=now + self.lease_seconds,
                    updated_at=now,
                )
                .returning(intents.c.fence, intents.c.lease_expires_at),
                clock,
            ).first()
            if row is None:
                msg = (
                    f"intent {intent_id} is leased to {current.lease_owner} until "
                    f"{current.lease_expires_at}"
                )
                raise Conflict(msg, intent_id=intent_id, lease_owner=current.lease_owner)
            fence = int(row.fence)
            self._event(
                conn,
                clock,
                intent_id,
                current.state,
                current.state,
                fence,
                note=f"took over from {current.lease_owner} (fence {current.fence})",
            )
            return Lease(intent_id, fence, self.owner, current.state, _dt(row.lease_expires_at))

    def prune(self, *, before: datetime) -> int:
        """Forget ended intents last changed before ``before`` (keys become reusable).

        An intent whose allocation was never released is kept whatever its state: it is the
        record that a resource exists.

        Returns:
            How many intents were removed.
        """
        ended = (S.CLEANED, S.DENIED, S.FAILED, S.RESULT_RECORDED)
        live_allocation = exists().where(
            provider_allocations.c.intent_id == intents.c.intent_id,
            provider_allocations.c.released_at.is_(None),
            provider_allocations.c.provider_ref.is_not(None),
        )
        doomed = select(intents.c.intent_id).where(
            intents.c.state.in_([s.value for s in ended]),
            intents.c.updated_at < before.timestamp(),
            ~live_allocation,
        )
        with self._write() as (conn, _):
            # Children first: foreign keys cascade on both databases, but the journal must not
            # depend on PRAGMA foreign_keys being on for a connection someone else made.
            for table in (journal_events, authorizations, provider_allocations):
                conn.execute(delete(table).where(table.c.intent_id.in_(doomed)))
            return conn.execute(delete(intents).where(intents.c.intent_id.in_(doomed))).rowcount
