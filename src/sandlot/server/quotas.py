"""Per-tenant quotas with a bounded admission queue.

A tenant over its quota (live sandboxes, concurrent execs) does not fail at once: its request
joins a first-come-first-served queue and proceeds when a slot frees, and only when its
deadline passes does it fail with ``QuotaExceeded`` (HTTP 429). The queue is bounded, so a
runaway client cannot pile up unlimited waiters; a full queue answers 429 at once.

The count of what is in use comes from a callable (the database's live sandboxes, or this
process's running execs) plus the slots this process handed out and not yet returned, so
concurrent requests on one server never overshoot. Across several server processes the
database count is re-read while waiting, so they converge, but two processes admitting at the
same instant may overshoot by one each (exact cross-process quotas belong to the journal).

A background process holds its slot until it exits (:func:`hold_until_exit` watches it), a
terminal while it is open.

This module must not import the Manager, backends or a web framework.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, final

import anyio

from sandlot.errors import QuotaExceeded, SandboxError
from sandlot.models import system_actor

if TYPE_CHECKING:
    from sandlot.models import Actor, ProcessInfo

__all__ = ["Admission", "Quota", "hold_until_exit"]


@dataclass(frozen=True)
class Quota:
    """Limits for one tenant; None means unlimited."""

    max_live_sandboxes: int | None = None
    """Sandboxes not yet destroyed."""
    max_concurrent_execs: int | None = None
    """Commands, background processes and terminals running at the same time."""
    max_concurrent_uploads: int | None = 4
    """Raw file uploads (``PUT …/files/content``) in flight at the same time; each is spooled
    to the server's disk until it is complete, so this bounds what one tenant can park there."""


@dataclass
class _Tenant:
    held: int = 0
    queue: deque[object] = field(default_factory=deque)
    changed: anyio.Event = field(default_factory=anyio.Event)


@final
class Admission:
    """Hands out slots per tenant, making requests wait in line when the tenant is full.

    Args:
        what: What a slot is, for messages (``live sandboxes``, ``concurrent execs``).
        limit: The tenant's limit (None: unlimited).
        in_use: How many the tenant uses outside this process's held slots (default 0).
        timeout: Seconds a request waits before ``QuotaExceeded``.
        max_waiters: Requests that may wait per tenant; more fail at once.
        poll: Seconds between re-reads of ``in_use`` while waiting (other processes free
            slots without telling us).
        owner: Who the slots belong to, for messages, when not each tenant (``this server``
            for a limit shared by all tenants, all acquiring under one key).
    """

    def __init__(
        self,
        what: str,
        limit: Callable[[str], int | None],
        *,
        in_use: Callable[[str], Awaitable[int]] | None = None,
        timeout: float = 30.0,
        max_waiters: int = 64,
        poll: float = 0.5,
        owner: str | None = None,
    ) -> None:
        self.what = what
        self.owner = owner
        self.limit = limit
        self.in_use = in_use
        self.timeout = timeout
        self.max_waiters = max_waiters
        self.poll = poll
        self._tenants: dict[str, _Tenant] = {}

    def held(self, tenant: str) -> int:
        """Slots this process handed to ``tenant`` and that are not returned yet."""
        t = self._tenants.get(tenant)
        return t.held if t else 0

    async def _used(self, tenant: str, t: _Tenant) -> int:
        outside = await self.in_use(tenant) if self.in_use is not None else 0
        return outside + t.held

    async def acquire(self, tenant: str, n: int = 1) -> Callable[[], None]:
        """Take ``n`` of ``tenant``'s slots, waiting in line for them.

        Returns:
            A function that gives the slots back (calling it again does nothing).
        """
        limit = self.limit(tenant)
        if limit is None:
            return _nothing
        t = self._tenants.setdefault(tenant, _Tenant())
        who = self.owner or f"tenant {tenant!r}"
        if n > limit:
            msg = f"asked for {n} {self.what} but {who} may have at most {limit}"
            raise QuotaExceeded(msg, tenant=tenant, limit=limit)
        if len(t.queue) >= self.max_waiters:
            msg = f"{who} is at its limit of {limit} {self.what} and {len(t.queue)} requests already wait"
            raise QuotaExceeded(msg, tenant=tenant, limit=limit)
        me = object()
        t.queue.append(me)
        started = time.monotonic()
        try:
            with anyio.move_on_after(self.timeout) as scope:
                while True:
                    if t.queue[0] is me and await self._used(tenant, t) + n <= limit:
                        break
                    changed = t.changed
                    with anyio.move_on_after(self.poll):
                        await changed.wait()
            if scope.cancelled_caught:
                msg = (
                    f"{who} stayed at its limit of {limit} {self.what} "
                    f"for {time.monotonic() - started:.1f}s"
                )
                raise QuotaExceeded(msg, tenant=tenant, limit=limit)
            t.held += n
        finally:
            t.queue.remove(me)
            self._notify(t)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                t.held -= n
                self._notify(t)

        return release

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, n: int = 1) -> AsyncIterator[None]:
        """Hold ``n`` of ``tenant``'s slots for the ``async with`` block (waiting for them)."""
        release = await self.acquire(tenant, n)
        try:
            yield
        finally:
            release()

    def notify(self, tenant: str) -> None:
        """Wake ``tenant``'s waiters (something was freed outside a slot, e.g. a destroy)."""
        t = self._tenants.get(tenant)
        if t is not None:
            self._notify(t)

    @staticmethod
    def _notify(t: _Tenant) -> None:
        t.changed.set()
        t.changed = anyio.Event()


def _nothing() -> None:
    """The release of an unlimited slot."""


class _ProcessWaiter(Protocol):
    async def wait_process(
        self, sandbox_id: str, process_id: str, *, actor: Actor, timeout: float | None = None
    ) -> ProcessInfo: ...


async def hold_until_exit(
    manager: _ProcessWaiter,
    tenant: str,
    sandbox_id: str,
    process: ProcessInfo,
    release: Callable[[], None],
) -> None:
    """Call ``release`` once the background ``process`` exits (or can no longer be waited
    for: its sandbox stopped or went away, taking the process with it)."""
    try:
        # As sandlot's own duty in the tenant, not as the tenant: its receipts say so.
        await manager.wait_process(sandbox_id, process.id, actor=system_actor(tenant))
    except SandboxError:
        pass
    finally:
        release()
