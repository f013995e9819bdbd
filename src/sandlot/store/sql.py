"""The Store on SQLAlchemy Core: SQLite (embedded default, WAL) and PostgreSQL.

The record itself is one JSON document (the :class:`SandboxInfo` model); the columns beside it
(status, version, tenant, owner, labels, times) exist so that filters and compare-and-set run
in the database. SQLAlchemy is synchronous here; calls run in worker threads so the async core
never blocks on disk. This module must not import backends.
"""

from __future__ import annotations

import builtins
import json
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeVar

import anyio.to_thread
from sqlalchemy import and_, case, delete, insert, select, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError

from sandlot.errors import Conflict, NotFound
from sandlot.models import SandboxInfo, SandboxStatus, SnapshotInfo
from sandlot.store.base import SandboxQuery
from sandlot.store.connect import database_errors, open_engine
from sandlot.store.migrate import upgrade
from sandlot.store.schema import sandboxes, snapshots

if TYPE_CHECKING:
    from sqlalchemy.engine import RowMapping
    from sqlalchemy.sql.elements import ColumnElement

__all__ = ["SqlStore", "open_engine"]

T = TypeVar("T")


def _ts(dt: datetime | None) -> float | None:
    return None if dt is None else dt.timestamp()


def _row_values(sb: SandboxInfo) -> dict[str, object]:
    return {
        "id": sb.id,
        "tenant": sb.tenant,
        "backend": sb.backend,
        "status": sb.status.value,
        "version": sb.version,
        "owner": sb.spec.owner,
        "labels": dict(sb.spec.labels),
        "record": json.loads(sb.model_dump_json()),
        "created_at": _ts(sb.created_at),
        "updated_at": _ts(sb.updated_at),
        "last_active_at": _ts(sb.last_active_at),
        "expires_at": _ts(sb.expires_at),
        "transition_deadline": _ts(sb.transition_deadline),
        "hidden": sb.status is SandboxStatus.DESTROYED,
    }


def _from_row(row: RowMapping) -> SandboxInfo:
    record = SandboxInfo.model_validate(row["record"])
    # Activity is written by touch() without rewriting the document; the column is the truth.
    record.last_active_at = datetime.fromtimestamp(row["last_active_at"], UTC)
    return record


class SqlStore:
    """A :class:`~sandlot.store.base.Store` on SQLite or PostgreSQL."""

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.url = url
        self.engine = open_engine(url)
        # Writes go through this view of the engine, so SQLite takes the write lock at BEGIN.
        self._writer = self.engine.execution_options(sandlot_write=True)
        self._migrated = not migrate
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------

    def ensure_schema(self) -> None:
        """Migrate the database now if it is not current (otherwise done at first use)."""
        self._ensure_schema()

    def _ensure_schema(self) -> None:
        if self._migrated:
            return
        with self._lock:
            if not self._migrated:
                upgrade(self.engine)
                self._migrated = True

    async def _run(self, fn: Callable[[], T]) -> T:
        def call() -> T:
            self._ensure_schema()
            with database_errors(self.engine):
                return fn()

        return await anyio.to_thread.run_sync(call)

    # -- sandboxes ------------------------------------------------------------------------

    async def insert(self, sandbox: SandboxInfo) -> SandboxInfo:
        def do() -> SandboxInfo:
            try:
                with self._writer.begin() as conn:
                    conn.execute(insert(sandboxes).values(**_row_values(sandbox)))
            except IntegrityError as e:
                msg = f"sandbox {sandbox.id} already exists"
                raise Conflict(msg) from e
            return sandbox

        return await self._run(do)

    async def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxInfo:
        def do() -> SandboxInfo:
            cond = sandboxes.c.id == sandbox_id
            if tenant is not None:
                cond = and_(cond, sandboxes.c.tenant == tenant)
            with self.engine.connect() as conn:
                row = conn.execute(select(sandboxes).where(cond)).mappings().first()
            if row is None:
                msg = f"no sandbox {sandbox_id!r}"
                raise NotFound(msg, id=sandbox_id)
            return _from_row(row)

        return await self._run(do)

    async def list(self, query: SandboxQuery) -> builtins.list[SandboxInfo]:
        def do() -> builtins.list[SandboxInfo]:
            conds: list[ColumnElement[bool]] = []
            if query.tenant is not None:
                conds.append(sandboxes.c.tenant == query.tenant)
            if query.owner is not None:
                conds.append(sandboxes.c.owner == query.owner)
            if query.backend is not None:
                conds.append(sandboxes.c.backend == query.backend)
            if query.statuses is not None:
                conds.append(sandboxes.c.status.in_(sorted(s.value for s in query.statuses)))
            elif not query.include_destroyed:
                conds.append(sandboxes.c.hidden.is_(False))
            if query.expired_before is not None:
                conds.append(sandboxes.c.expires_at < query.expired_before.timestamp())
            if query.labels and self.engine.dialect.name == "postgresql":
                # Containment (`labels @> '{"k": "v"}'`) is what the GIN index on labels serves.
                labels = type_coerce(sandboxes.c.labels, JSONB)
                conds.append(labels.contains(dict(query.labels)))
            else:
                conds.extend(
                    sandboxes.c.labels[k].as_string() == v for k, v in query.labels.items()
                )
            stmt = (
                select(sandboxes)
                .where(and_(True, *conds))
                .order_by(sandboxes.c.created_at.desc(), sandboxes.c.id.desc())
                .offset(query.offset)
            )
            if query.limit is not None:
                stmt = stmt.limit(query.limit)
            with self.engine.connect() as conn:
                return [_from_row(r) for r in conn.execute(stmt).mappings()]

        return await self._run(do)

    async def update(
        self, sandbox_id: str, expected_version: int, patch: Mapping[str, object]
    ) -> SandboxInfo:
        def do() -> SandboxInfo:
            with self._writer.begin() as conn:
                row = (
                    conn.execute(select(sandboxes).where(sandboxes.c.id == sandbox_id))
                    .mappings()
                    .first()
                )
                if row is None:
                    msg = f"no sandbox {sandbox_id!r}"
                    raise NotFound(msg, id=sandbox_id)
                current = _from_row(row)
                if current.version != expected_version:
                    msg = (
                        f"sandbox {sandbox_id} changed concurrently "
                        f"(version {current.version}, expected {expected_version})"
                    )
                    raise Conflict(msg, id=sandbox_id)
                fields = {**current.model_dump(), **patch}
                fields["version"] = expected_version + 1
                fields["updated_at"] = datetime.now(UTC)
                new = SandboxInfo.model_validate(fields)
                values = _row_values(new)
                values.pop("id")
                # A touch() may have moved last_active_at since we read; never move it back.
                values["last_active_at"] = case(
                    (
                        sandboxes.c.last_active_at > values["last_active_at"],
                        sandboxes.c.last_active_at,
                    ),
                    else_=values["last_active_at"],
                )
                result = conn.execute(
                    update(sandboxes)
                    .where(sandboxes.c.id == sandbox_id, sandboxes.c.version == expected_version)
                    .values(**values)
                )
                if result.rowcount != 1:
                    msg = f"sandbox {sandbox_id} changed concurrently"
                    raise Conflict(msg, id=sandbox_id)
                return new

        return await self._run(do)

    async def touch(self, sandbox_id: str, at: datetime) -> None:
        def do() -> None:
            with self._writer.begin() as conn:
                conn.execute(
                    update(sandboxes)
                    .where(
                        sandboxes.c.id == sandbox_id, sandboxes.c.last_active_at < at.timestamp()
                    )
                    .values(last_active_at=at.timestamp())
                )

        await self._run(do)

    async def delete(self, sandbox_id: str) -> None:
        def do() -> None:
            with self._writer.begin() as conn:
                conn.execute(delete(sandboxes).where(sandboxes.c.id == sandbox_id))

        await self._run(do)

    # -- snapshots ------------------------------------------------------------------------

    async def insert_snapshot(self, snapshot: SnapshotInfo, *, tenant: str) -> SnapshotInfo:
        def do() -> SnapshotInfo:
            try:
                with self._writer.begin() as conn:
                    conn.execute(
                        insert(snapshots).values(
                            id=snapshot.id,
                            tenant=tenant,
                            sandbox_id=snapshot.sandbox_id,
                            backend=snapshot.backend,
                            record=json.loads(snapshot.model_dump_json()),
                            created_at=snapshot.created_at.timestamp(),
                        )
                    )
            except IntegrityError as e:
                msg = f"snapshot {snapshot.id} already exists"
                raise Conflict(msg) from e
            return snapshot

        return await self._run(do)

    async def get_snapshot(self, snapshot_id: str, *, tenant: str | None = None) -> SnapshotInfo:
        def do() -> SnapshotInfo:
            cond = snapshots.c.id == snapshot_id
            if tenant is not None:
                cond = and_(cond, snapshots.c.tenant == tenant)
            with self.engine.connect() as conn:
                row = conn.execute(select(snapshots.c.record).where(cond)).first()
            if row is None:
                msg = f"no snapshot {snapshot_id!r}"
                raise NotFound(msg, id=snapshot_id)
            return SnapshotInfo.model_validate(row[0])

        return await self._run(do)

    async def list_snapshots(
        self, *, sandbox_id: str | None = None, tenant: str | None = None
    ) -> builtins.list[SnapshotInfo]:
        def do() -> builtins.list[SnapshotInfo]:
            stmt = select(snapshots.c.record).order_by(snapshots.c.created_at.desc())
            if sandbox_id is not None:
                stmt = stmt.where(snapshots.c.sandbox_id == sandbox_id)
            if tenant is not None:
                stmt = stmt.where(snapshots.c.tenant == tenant)
            with self.engine.connect() as conn:
                return [SnapshotInfo.model_validate(r[0]) for r in conn.execute(stmt)]

        return await self._run(do)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        def do() -> None:
            with self._writer.begin() as conn:
                conn.execute(delete(snapshots).where(snapshots.c.id == snapshot_id))

        await self._run(do)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.engine.dispose)
