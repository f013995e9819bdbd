"""What every route of one app shares: the Manager, keys, limits, quotas, jobs and followers.

:func:`~sandlot.server.app.create_app` makes one :class:`Plane` per app and keeps it in
``app.state.plane``; routes reach it through :data:`sandlot.server.deps.PlaneDep` (a
WebSocket route through ``websocket.app.state``), never through a closure. Background work
that must outlive a request (streamed jobs, process followers, slots held until a process
exits) is started with :meth:`Plane.spawn` in the task group the app's lifespan runs.

This module must not import backends, the store, or FastAPI.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, final

import anyio.abc

from sandlot.errors import SandboxError
from sandlot.manager import Manager
from sandlot.models import Actor
from sandlot.server.follow import ProcessFollowers
from sandlot.server.jobs import KEEPALIVE, Job, StdinPipe
from sandlot.server.keys import ApiKeyStore
from sandlot.server.metrics import ServerMetrics
from sandlot.server.outputlog import ExecOutputLog
from sandlot.server.quotas import Admission
from sandlot.server.sessions import KeySessions

if TYPE_CHECKING:
    from sandlot.server.app import ServerConfig

__all__ = ["ADMIN", "Plane"]

ADMIN = Actor(tenant="*", principal="sandlot-server", admin=True)
"""Who the server itself acts as when it reads every tenant's records (health, metrics)."""


@final
class Plane:
    """Everything the routes share (one per app)."""

    def __init__(
        self,
        manager: Manager,
        keys: ApiKeyStore,
        config: ServerConfig,
        output: ExecOutputLog,
    ) -> None:
        self.manager = manager
        self.keys = keys
        self.config = config
        self.output = output
        self.metrics = ServerMetrics()
        self.sessions = KeySessions(keys)
        self.sandboxes = Admission(
            "live sandboxes",
            lambda t: config.quota_for(t).max_live_sandboxes,
            in_use=self._live,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.execs = Admission(
            "concurrent execs",
            lambda t: config.quota_for(t).max_concurrent_execs,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.uploads = Admission(
            "concurrent uploads",
            lambda t: config.quota_for(t).max_concurrent_uploads,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.all_uploads = Admission(
            "concurrent uploads",
            lambda _: config.max_concurrent_uploads,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
            owner="this server",
        )
        self.stdin: dict[str, StdinPipe] = {}
        self.jobs: dict[str, Job] = {}
        """Streamed jobs running in this process, by exec id."""
        self.tasks: anyio.abc.TaskGroup | None = None
        self.followers = ProcessFollowers(
            manager,
            self.spawn,
            buffer_bytes=config.follow_buffer_bytes,
            rate=config.follow_rate_bytes,
            keepalive=KEEPALIVE,
        )

    async def _live(self, tenant: str) -> int:
        limit = self.config.quota_for(tenant).max_live_sandboxes
        records = await self.manager.list(
            actor=Actor(tenant=tenant), limit=None if limit is None else limit + 1
        )
        return len(records)

    async def upload_slot(self, tenant: str) -> Callable[[], None]:
        """One of ``tenant``'s upload slots and one of the server's (the tenant's first, so
        a tenant over its own limit never waits in the server's line)."""
        release = await self.uploads.acquire(tenant)
        try:
            release_all = await self.all_uploads.acquire("*")
        except BaseException:
            release()
            raise

        def both() -> None:
            release_all()
            release()

        return both

    def spawn(self, fn: Callable[[], Coroutine[object, object, None]]) -> None:
        """Run ``fn`` in the server's task group, past the request that asks for it."""
        if self.tasks is None:
            msg = "the server is not running (its lifespan has not started)"
            raise SandboxError(msg)
        self.tasks.start_soon(fn)
