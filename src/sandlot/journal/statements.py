"""The journal's SQL, built once per dialect, and database errors as sandlot's errors.

Imports nothing of sandlot but its errors, the journal's schema and its records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sqlalchemy import (
    BigInteger,
    Float,
    String,
    Text,
    bindparam,
    cast,
    extract,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import DataError, OperationalError

from sandlot.errors import BackendUnavailable, InvalidRequest
from sandlot.journal.records import (
    _INTENT_COLUMNS,
    _INTENT_FROM,
    S,
)
from sandlot.journal.schema import (
    authorizations,
    intents,
    journal_events,
    provider_allocations,
)

if TYPE_CHECKING:
    from sqlalchemy.sql.elements import ColumnElement


_Params = dict[str, object]


class _Sql:
    """The journal's statements, built once per dialect.

    Building a SQLAlchemy statement (coercing every value, computing its cache key) costs more
    than running it on SQLite, so the hot-path statements are built here once, with bound
    parameters, and run with a parameter dict. ``now`` is the clock every statement uses:
    PostgreSQL's ``now()`` there, a ``:now`` parameter on SQLite (see the module docstring).
    """

    def __init__(self, pg: bool) -> None:
        p = bindparam
        self.now: ColumnElement[float] = (
            cast(extract("epoch", func.now()), Float) if pg else p("now", type_=Float)
        )
        now = self.now
        upsert = pg_dialect.insert if pg else sqlite_dialect.insert
        new_intent = {
            "intent_id": p("v_id"),
            "request_hash": p("v_request_hash"),
            "tenant": p("v_tenant"),
            "principal": p("v_principal"),
            "op": p("v_op"),
            "idempotency_key": p("v_key"),
            "request_json": p("v_request_json"),
            "state": S.PREPARED.value,
            "fence": 0,
            # The beginner's claim: it is at the gate with this intent, so a repeat of its key
            # waits for it instead of deciding (and racing for the authorization) itself.
            "lease_owner": p("v_owner"),
            "lease_expires_at": now + p("v_lease", type_=Float),
            "created_at": now,
            "updated_at": now,
        }
        self.insert_intent = insert(intents).values(new_intent).returning(*intents.c)
        self.insert_intent_if_new = (
            upsert(intents).values(new_intent).on_conflict_do_nothing().returning(*intents.c)
        )
        self.select_intent = (
            select(*_INTENT_COLUMNS)
            .select_from(_INTENT_FROM)
            .where(intents.c.intent_id == p("v_id"))
        )
        # PostgreSQL holds the row until commit; SQLite ignores FOR UPDATE (BEGIN IMMEDIATE
        # already holds the database's write lock).
        self.lock_intent = self.select_intent.with_for_update(of=intents)
        self.select_key = select(intents.c.intent_id, intents.c.op).where(
            intents.c.tenant == p("v_tenant"), intents.c.idempotency_key == p("v_key")
        )
        self.insert_event = insert(journal_events).values(
            intent_id=p("v_id"),
            from_state=p("v_from"),
            to_state=p("v_to"),
            fence=p("v_fence"),
            actor=p("v_actor"),
            receipt_seq=p("v_receipt_seq"),
            note=p("v_note"),
            at=now,
        )
        self.grant = (
            upsert(authorizations)
            .values(
                auth_id=p("v_auth_id"),
                intent_id=p("v_id"),
                decision=p("v_decision"),
                expires_at=now + p("v_ttl", type_=Float),
                created_at=now,
            )
            .on_conflict_do_nothing()
            .returning(authorizations.c.auth_id)
        )
        self.select_auth = select(authorizations).where(authorizations.c.intent_id == p("v_id"))
        self.consume = (
            update(authorizations)
            .where(
                authorizations.c.intent_id == p("v_id"),
                authorizations.c.decision == p("v_decision"),
                authorizations.c.consumed_at.is_(None),
                authorizations.c.expires_at > now,
            )
            .values(consumed_at=now, consumed_by=p("v_owner"))
        )
        self.authorize_intent = (
            update(intents)
            .where(intents.c.intent_id == p("v_id"), intents.c.state == S.PREPARED.value)
            .values(
                state=S.AUTHORIZED.value,
                fence=intents.c.fence + 1,
                lease_owner=p("v_owner"),
                lease_expires_at=now + p("v_lease", type_=Float),
                updated_at=now,
            )
            .returning(intents.c.fence, intents.c.lease_expires_at)
        )
        fenced = (
            intents.c.intent_id == p("v_id"),
            intents.c.fence == p("v_fence"),
            intents.c.state == p("v_expected"),
        )
        # Optional fields: a NULL parameter leaves the column as it is.
        fields = {
            "sandbox_id": func.coalesce(p("v_sandbox_id", type_=String), intents.c.sandbox_id),
            "result_json": func.coalesce(p("v_result_json", type_=Text), intents.c.result_json),
            "result_hash": func.coalesce(p("v_result_hash", type_=String), intents.c.result_hash),
            "receipt_seq": func.coalesce(
                p("v_receipt_seq", type_=BigInteger), intents.c.receipt_seq
            ),
            "error": func.coalesce(p("v_error", type_=Text), intents.c.error),
        }
        self.move_leased = (
            update(intents)
            .where(*fenced)
            .values(
                state=p("v_to"),
                lease_expires_at=now + p("v_lease", type_=Float),
                updated_at=now,
                **fields,
            )
            .returning(intents.c.lease_expires_at)
        )
        self.move_resting = (
            update(intents)
            .where(*fenced)
            .values(state=p("v_to"), lease_expires_at=None, updated_at=now, **fields)
            .returning(intents.c.lease_expires_at)
        )
        self.insert_allocation = insert(provider_allocations).values(
            intent_id=p("v_id"),
            backend=p("v_backend"),
            deterministic_name=p("v_name"),
            fence=p("v_fence"),
            created_at=now,
        )
        self.record_allocation = (
            update(provider_allocations)
            .where(
                provider_allocations.c.intent_id == p("v_id"),
                or_(
                    provider_allocations.c.provider_ref.is_(None),
                    provider_allocations.c.provider_ref == p("v_ref"),
                ),
            )
            .values(provider_ref=p("v_ref"), allocated_at=now, fence=p("v_fence"))
        )
        self.release_intent = (
            update(provider_allocations)
            .where(
                provider_allocations.c.intent_id == p("v_id"),
                provider_allocations.c.released_at.is_(None),
            )
            .values(released_at=now)
        )


_SQL: dict[bool, _Sql] = {}


@contextlib.contextmanager
def _database_errors() -> Iterator[None]:
    """Database failures as sandlot's errors: an unreachable or failing database is
    ``BackendUnavailable``, a value it refuses is ``InvalidRequest``."""
    try:
        yield
    except OperationalError as e:
        msg = f"journal database error: {e.orig}"
        raise BackendUnavailable(msg) from e
    except DataError as e:
        msg = f"the journal database refused a value: {e.orig}"
        raise InvalidRequest(msg) from e
