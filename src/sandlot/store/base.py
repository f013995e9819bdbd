"""The Store protocol: durable sandbox records with compare-and-set.

Every status change is ``update(id, expected_version, patch)``, which succeeds only if nobody
changed the record since the caller read it (``Conflict`` otherwise), so many processes and
hosts can share sandboxes through one database. This module must not import backends.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from sandlot.models import SandboxInfo, SandboxStatus, SnapshotInfo

__all__ = ["SandboxQuery", "Store"]


@dataclass(frozen=True)
class SandboxQuery:
    """Which records ``list`` returns, newest first."""

    tenant: str | None = None
    owner: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    """Subset match: every given label must be present with that value."""
    statuses: frozenset[SandboxStatus] | None = None
    backend: str | None = None
    include_destroyed: bool = False
    expired_before: datetime | None = None
    """Only records whose TTL ran out before this time."""
    limit: int | None = None
    offset: int = 0


class Store(Protocol):
    """Where sandbox and snapshot records live."""

    async def insert(self, sandbox: SandboxInfo) -> SandboxInfo:
        """Add a new record (``Conflict`` if the id exists)."""
        ...

    async def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxInfo:
        """One record (``NotFound`` if absent, or if it belongs to another tenant)."""
        ...

    async def list(self, query: SandboxQuery) -> builtins.list[SandboxInfo]:
        """Records matching ``query``, newest first."""
        ...

    async def update(
        self, sandbox_id: str, expected_version: int, patch: Mapping[str, object]
    ) -> SandboxInfo:
        """Apply ``patch`` (field -> value) if the record is still at ``expected_version``.

        Returns the new record (version bumped). ``Conflict`` when another writer got there
        first, ``NotFound`` when the record is gone.
        """
        ...

    async def touch(self, sandbox_id: str, at: datetime) -> None:
        """Record activity (for ``idle_timeout``) without bumping the version: activity must
        never make a concurrent state transition fail."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """Remove a record for good (a missing record is not an error)."""
        ...

    async def insert_snapshot(self, snapshot: SnapshotInfo, *, tenant: str) -> SnapshotInfo:
        """Add a snapshot record."""
        ...

    async def get_snapshot(self, snapshot_id: str, *, tenant: str | None = None) -> SnapshotInfo:
        """One snapshot record (``NotFound`` if absent)."""
        ...

    async def list_snapshots(
        self, *, sandbox_id: str | None = None, tenant: str | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Snapshot records, newest first."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot record (a missing one is not an error)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
