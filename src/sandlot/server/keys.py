"""API keys: who a request acts as (tenant, principal, admin), from a bearer key.

A key is ``sandlot_`` followed by 256 random bits; the database keeps only its SHA-256
(:mod:`sandlot.server.schema`), so a leaked database does not leak keys, and the key text is
shown exactly once, when it is made. Authentication is one indexed lookup on every request,
never cached: a revocation made anywhere (another server on the same database, ``sandlot
api-keys revoke``) refuses the key's next request at once. Connections that outlive a request
(event streams, terminals) are ended by :mod:`sandlot.server.sessions`, which asks
:meth:`ApiKeyStore.revoked_among`. A cache put in front of :meth:`ApiKeyStore.identify` must
keep that promise: it may remember who a key is, never that it is not revoked.

This module owns the key table's reads and writes; it must not import backends, the Manager
or any web framework.
"""

from __future__ import annotations

import builtins
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TypeVar, final

import anyio.lowlevel
import anyio.to_thread
from pydantic import BaseModel, ConfigDict
from sqlalchemy import insert, inspect, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from sandlot.errors import BackendUnavailable, Conflict, InvalidRequest, NotFound
from sandlot.models import SYSTEM_PRINCIPAL, Actor, new_id
from sandlot.server.schema import api_keys
from sandlot.store.migrate import upgrade
from sandlot.store.sql import open_engine

__all__ = ["KEY_PREFIX", "ApiKeyInfo", "ApiKeyStore", "NewApiKey", "hash_key"]

T = TypeVar("T")

KEY_PREFIX = "sandlot_"
"""Every key starts with this, so secret scanners and humans recognise one."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")


def hash_key(key: str) -> str:
    """The stored form of a key: hex SHA-256 of its text."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyInfo(BaseModel):
    """What is known about a key, without the key itself."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str
    """Stable id (``ak-…``), used to revoke it."""
    prefix: str
    """The first characters of the key, to recognise it."""
    tenant: str
    """The tenant whose records the key sees."""
    principal: str
    """Who the key acts as, in policy decisions and receipts."""
    admin: bool = False
    """Admin keys see every tenant and may reconcile."""
    description: str | None = None
    """Free text given at creation."""
    created_at: datetime
    """When it was made."""
    revoked_at: datetime | None = None
    """When it was revoked (it no longer authenticates)."""

    @property
    def actor(self) -> Actor:
        """The actor requests with this key act as."""
        return Actor(tenant=self.tenant, principal=self.principal, admin=self.admin)


class NewApiKey(BaseModel):
    """A key just made: the only time its text is available."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    """The secret, to hand to the client (``SANDLOT_API_KEY``)."""
    info: ApiKeyInfo
    """Its record."""


# Key lookups have worker threads of their own (per event loop): every request is
# authenticated first, so if they shared anyio's default pool, work that fills it (slow
# backend or database calls of one tenant) would leave every other tenant unanswered.
_KEY_THREADS: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar("key_threads")


def _key_threads() -> anyio.CapacityLimiter:
    try:
        return _KEY_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(8)
        _KEY_THREADS.set(limiter)
        return limiter


def _check_name(value: str, what: str) -> str:
    if not _NAME.match(value):
        msg = f"{what} {value!r} must be 1-128 letters, digits or . _ @ : - (starting with a letter or digit)"
        raise InvalidRequest(msg)
    return value


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _info(row: object) -> ApiKeyInfo:
    m = row._mapping  # type: ignore[attr-defined]
    created = _ts(m["created_at"])
    assert created is not None
    return ApiKeyInfo(
        id=m["id"],
        prefix=m["prefix"],
        tenant=m["tenant"],
        principal=m["principal"],
        admin=bool(m["admin"]),
        description=m["description"],
        created_at=created,
        revoked_at=_ts(m["revoked_at"]),
    )


@final
class ApiKeyStore:
    """API keys in the sandlot database (the same one the sandbox records live in).

    Args:
        url: A SQLAlchemy database URL (SQLite or PostgreSQL).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = open_engine(url)
        self._writer = self.engine.execution_options(sandlot_write=True)
        self._ready = False
        self._lock = threading.Lock()

    def _ensure_schema(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            upgrade(self.engine)
            if not inspect(self.engine).has_table("api_keys"):
                msg = "the database has no api_keys table: its migrations are incomplete (revision 0004)"
                raise BackendUnavailable(msg)
            self._ready = True

    async def _run(self, fn: Callable[[], T]) -> T:
        def call() -> T:
            try:
                self._ensure_schema()
                return fn()
            except OperationalError as e:
                msg = f"database error: {e.orig}"
                raise BackendUnavailable(msg) from e

        return await anyio.to_thread.run_sync(call, limiter=_key_threads())

    async def create(
        self,
        tenant: str,
        principal: str | None = None,
        *,
        admin: bool = False,
        description: str | None = None,
    ) -> NewApiKey:
        """Make a key for ``tenant`` acting as ``principal`` (default: the key's own id).

        Returns:
            The key text (shown only now) and its record.
        """
        _check_name(tenant, "tenant")
        key_id = new_id("ak")
        principal = _check_name(principal, "principal") if principal else key_id
        if principal == SYSTEM_PRINCIPAL:
            # Receipts of sandlot's own duties name this principal; nobody may sign as it.
            msg = f"principal {SYSTEM_PRINCIPAL!r} is reserved for sandlot's own duties"
            raise InvalidRequest(msg)
        if description is not None and len(description) > 512:
            msg = "description must be at most 512 characters"
            raise InvalidRequest(msg)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        info = ApiKeyInfo(
            id=key_id,
            prefix=key[: len(KEY_PREFIX) + 6],
            tenant=tenant,
            principal=principal,
            admin=admin,
            description=description,
            created_at=datetime.fromtimestamp(now, UTC),
        )

        def do() -> None:
            try:
                with self._writer.begin() as conn:
                    conn.execute(
                        insert(api_keys).values(
                            id=key_id,
                            key_hash=hash_key(key),
                            prefix=info.prefix,
                            tenant=tenant,
                            principal=principal,
                            admin=admin,
                            description=description,
                            created_at=now,
                            revoked_at=None,
                        )
                    )
            except IntegrityError as e:
                msg = f"api key {key_id} already exists"
                raise Conflict(msg) from e

        await self._run(do)
        return NewApiKey(key=key, info=info)

    async def list(
        self, *, tenant: str | None = None, include_revoked: bool = True
    ) -> builtins.list[ApiKeyInfo]:
        """Keys, oldest first (of one tenant when given)."""

        def do() -> builtins.list[ApiKeyInfo]:
            stmt = select(api_keys).order_by(api_keys.c.created_at, api_keys.c.id)
            if tenant is not None:
                stmt = stmt.where(api_keys.c.tenant == tenant)
            if not include_revoked:
                stmt = stmt.where(api_keys.c.revoked_at.is_(None))
            with self.engine.connect() as conn:
                return [_info(r) for r in conn.execute(stmt)]

        return await self._run(do)

    async def revoke(self, key_id: str) -> ApiKeyInfo:
        """Make a key stop authenticating (revoking twice is fine)."""

        def do() -> ApiKeyInfo:
            with self._writer.begin() as conn:
                conn.execute(
                    update(api_keys)
                    .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                    .values(revoked_at=time.time())
                )
                row = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
            if row is None:
                msg = f"no api key {key_id!r}"
                raise NotFound(msg, id=key_id)
            return _info(row)

        return await self._run(do)

    async def identify(self, key: str) -> ApiKeyInfo | None:
        """The record of a live key, or None when the key is unknown or revoked.

        Reads the database every time, so a revocation from anywhere counts at once.
        """
        if not key.startswith(KEY_PREFIX) or len(key) > 256:
            return None
        digest = hash_key(key)

        def do() -> ApiKeyInfo | None:
            with self.engine.connect() as conn:
                row = conn.execute(
                    select(api_keys).where(
                        api_keys.c.key_hash == digest, api_keys.c.revoked_at.is_(None)
                    )
                ).first()
            if row is None:
                return None
            found = _info(row)
            # A key made before the name was reserved must not sign as sandlot's own duties.
            return None if found.principal == SYSTEM_PRINCIPAL else found

        return await self._run(do)

    async def authenticate(self, key: str) -> Actor | None:
        """The actor a key acts as, or None when the key is unknown or revoked."""
        info = await self.identify(key)
        return None if info is None else info.actor

    async def revoked_among(self, key_ids: Iterable[str]) -> set[str]:
        """Which of ``key_ids`` are revoked (or gone): the authority on revocation."""
        wanted = set(key_ids)
        if not wanted:
            return set()

        def do() -> set[str]:
            with self.engine.connect() as conn:
                live = conn.execute(
                    select(api_keys.c.id).where(
                        api_keys.c.id.in_(wanted), api_keys.c.revoked_at.is_(None)
                    )
                ).scalars()
                return wanted - set(live)

        return await self._run(do)

    async def aclose(self) -> None:
        """Release connections."""
        await anyio.to_thread.run_sync(self.engine.dispose)
