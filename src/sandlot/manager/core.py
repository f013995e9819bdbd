"""The state every room of the Manager shares, and the plumbing they all use.

:class:`ManagerCore` holds what the constructor is given and this process's state (open
channels, records just seen, operations in flight, transitions this Manager drives), and does
what every room needs: reading records (with the hot path's short-lived cache), compare-and-set
transitions (``_cas``, ``_begin``, ``_fail``, ``_drive``, ``_settled``), waking a sandbox for an
operation (``_ready``), finding its backend on this host, and its channel.

What a room provides to the others is declared here as an abstract method, so each room is
type-checked against the others and a Manager missing a room cannot be made. Of the package it
imports only the leaf modules (``tuning``, ``records``, ``commands``, ``intents``), never a
room; never a front end, nor a concrete backend (the local backend's ``ExecCall`` is named for
type checking only).
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import functools
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

import anyio

from sandlot.backends.base import Backend
from sandlot.channel.base import MAIN_LOG, Channel
from sandlot.errors import (
    BackendError,
    Conflict,
    InvalidRequest,
    InvalidState,
    NotSupported,
    SandboxError,
    SandboxTimeout,
)
from sandlot.journal import Intent, Journal, owner_alive, process_owner
from sandlot.journal.wakeups import Wakeups
from sandlot.manager import tuning
from sandlot.manager.commands import _Tail
from sandlot.manager.intents import _Outcome, _Replay
from sandlot.manager.records import _CREATING, _KEPT, ReconcileReport, _past_ttl
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    Command,
    DeathCertificate,
    JsonValue,
    SandboxInfo,
    SandboxStatus,
    system_actor,
    utcnow,
)
from sandlot.policy.request import Resource
from sandlot.store.base import SandboxQuery
from sandlot.taskgroups import lone_error

if TYPE_CHECKING:
    from sandlot.backends.local.execgate import ExecCall as _ExecCall
    from sandlot.gate.gate import Gate
    from sandlot.store.base import Store

S = SandboxStatus
T = TypeVar("T")
_log = logging.getLogger("sandlot")


class ManagerCore(abc.ABC):
    """The shared state of a Manager's rooms and the plumbing they use.

    Its arguments are documented on :class:`~sandlot.manager.Manager`, the class to build.
    """

    def __init__(
        self,
        store: Store,
        backends: Mapping[str, Backend],
        *,
        default_backend: str,
        transition_timeout: float = 120.0,
        create_timeout: float = 3600.0,
        gate: Gate | None = None,
        journal: Journal | None = None,
        failed_keep: float = tuning.FAILED_KEEP,
        sweep_every: float | None = 30.0,
        option_defaults: Mapping[str, Mapping[str, JsonValue]] | None = None,
    ) -> None:
        if default_backend not in backends:
            msg = f"default backend {default_backend!r} is not among {sorted(backends)}"
            raise InvalidRequest(msg)
        self.store = store
        self.backends = backends
        self.default_backend = default_backend
        self.transition_timeout = transition_timeout
        self.create_timeout = create_timeout
        self.gate = gate
        self.journal = journal
        self.failed_keep = failed_keep
        self.sweep_every = sweep_every
        self.option_defaults = {k: dict(v) for k, v in (option_defaults or {}).items()}
        self._swept_at: float | None = None
        # Who drives a transition: this process (an identity that survives PID reuse) and a
        # nonce telling Managers of one process apart.
        self.instance = f"{process_owner()}/{secrets.token_hex(3)}"
        self.host = socket.gethostname()
        """Sandboxes of host-local backends made here carry this host's name."""
        self._driving: set[str] = set()
        """Sandboxes whose transition this Manager is driving right now."""
        self._channels: dict[str, tuple[str, Channel]] = {}
        self._used: dict[str, Backend] = {}
        self._recent: dict[str, tuple[SandboxInfo, float]] = {}
        self._busy: dict[str, int] = {}
        """Operations in flight per sandbox in this process (the idle reaper leaves them be)."""
        self._program_subjects: dict[str, tuple[Actor, Resource]] = {}
        """Per strict sandbox: who its programs are decided as, and the sandbox as the policy
        sees it (see ``gating``'s ``_decide_program``)."""
        self._wakeups = Wakeups()
        """Repeats of a keyed call run here, waiting for it to end."""

    # -- what the rooms provide one another ---------------------------------------------------
    # Declared here, implemented by the room named in each docstring: mypy checks every room
    # against these, and a Manager missing a room cannot be made (they are abstract).

    @abc.abstractmethod
    def _gated(
        self,
        actor: Actor,
        action: str,
        target: SandboxInfo | Resource,
        *,
        intent: Intent | None = None,
        **args: object,
    ) -> contextlib.AbstractAsyncContextManager[_Outcome]:
        """Decide (and record) before the body runs; record what it did after (``gating``)."""

    @abc.abstractmethod
    async def _decide_program(self, sandbox_id: str, call: _ExecCall) -> bool:
        """Decide a program a strict sandbox starts, stopped in the kernel (``gating``)."""

    @abc.abstractmethod
    async def _begin_intent(
        self,
        actor: Actor,
        op: str,
        request: Mapping[str, JsonValue],
        key: str | None,
    ) -> Intent | _Replay | None:
        """Record a keyed operation's intent, or answer an earlier call's result (``gating``)."""

    @abc.abstractmethod
    async def _recover_intent(self, intent: Intent) -> str:
        """Settle an intent whose worker died (``recovery``)."""

    @abc.abstractmethod
    async def _reconcile_one(self, sb: SandboxInfo) -> str | None:
        """Bring one record up to date with its backend; what changed (``recovery``)."""

    @abc.abstractmethod
    async def _settle(self, sb: SandboxInfo) -> SandboxInfo:
        """Finish or fail a transition whose driver died (``recovery``)."""

    @abc.abstractmethod
    async def _launch_main(
        self, sb: SandboxInfo, actor: Actor, channel: Channel, command: Command
    ) -> None:
        """Start the sandbox's main process (``lifecycle``)."""

    @abc.abstractmethod
    async def _stop(
        self,
        sb: SandboxInfo,
        cause: str,
        message: str,
        still_due: Callable[[SandboxInfo], bool] | None = None,
    ) -> SandboxInfo:
        """Stop a sandbox, recording the cause (``lifecycle``)."""

    @abc.abstractmethod
    async def _do_resume(
        self, sb: SandboxInfo, actor: Actor, expiry: datetime | None
    ) -> SandboxInfo:
        """Resume a sandbox this Manager just moved to ``resuming`` (``lifecycle``)."""

    @abc.abstractmethod
    async def _destroy(self, sb: SandboxInfo, cause: str, message: str) -> SandboxInfo:
        """Destroy a sandbox, recording the cause (``lifecycle``)."""

    @abc.abstractmethod
    async def _destroy_system(self, sb: SandboxInfo, cause: str, message: str) -> SandboxInfo:
        """Destroy a sandbox as sandlot's own duty, decided and receipted (``lifecycle``)."""

    @abc.abstractmethod
    async def _drain_egress(self, sb: SandboxInfo) -> SandboxInfo:
        """Turn logged egress decisions into receipts (``network``)."""

    @abc.abstractmethod
    async def _expose(self, sb: SandboxInfo, port: int) -> SandboxInfo:
        """Publish a port of a running sandbox (``network``)."""

    @abc.abstractmethod
    async def _sweep_if_due(self) -> None:
        """Sweep inline when no server does and the last sweep is old (``housekeeping``)."""

    @abc.abstractmethod
    async def _sweep(self, now: datetime, report: ReconcileReport) -> None:
        """Stop what expired and discard failed creations past inspection (``housekeeping``)."""

    @abc.abstractmethod
    async def _stop_system(self, sb: SandboxInfo, now: datetime) -> str | None:
        """Stop an expired or idle sandbox as sandlot's own duty (``housekeeping``)."""

    # -- records ------------------------------------------------------------------------------

    async def get(self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR) -> SandboxInfo:
        """One sandbox's record (``NotFound`` names the id).

        A record that says ``running`` is checked against its backend when that is cheap (a
        host-local backend, and no open channel vouches for it), so a sandbox whose init
        died is reported ``stopped`` with the cause rather than looking alive.
        """
        sb = await self._fetch(sandbox_id, actor)
        if sb.status is S.RUNNING and sb.backend_ref is not None and self._mine(sb):
            impl = self.backends.get(sb.backend)
            if not self._vouched(sb) and impl is not None and impl.capabilities().host_local:
                sb = await self._checked(sb)
        return sb

    async def _fetch(self, sandbox_id: str, actor: Actor) -> SandboxInfo:
        """The stored record, as the actor may see it."""
        sb = await self.store.get(sandbox_id, tenant=None if actor.admin else actor.tenant)
        self._remember(sb)
        return sb

    async def _checked(self, sb: SandboxInfo) -> SandboxInfo:
        """The record after asking the backend whether a ``running`` sandbox still runs (one
        that died behind our back is recorded so, with its cause)."""
        with contextlib.suppress(SandboxError):
            if await self._reconcile_one(sb) is not None:
                return await self._fetch(sb.id, system_actor(sb.tenant))
        return sb

    def _remember(self, sb: SandboxInfo) -> None:
        """Keep a record just read or written for the hot path (see :meth:`_current`)."""
        now = time.monotonic()
        if len(self._recent) > tuning.RECENT_MAX:
            # A long-lived server sees many sandboxes: forget what aged out.
            self._recent = {k: v for k, v in self._recent.items() if now - v[1] < tuning.RECENT}
        if sb.status is S.DESTROYED:
            self._recent.pop(sb.id, None)
        else:
            self._recent[sb.id] = (sb, now)

    async def _current(self, sandbox_id: str, actor: Actor) -> SandboxInfo:
        """The record for a hot-path operation: the one this process saw within
        :data:`tuning.RECENT` seconds when the sandbox was running and its channel is still open,
        else a fresh read. Tenancy is checked either way."""
        hit = self._recent.get(sandbox_id)
        if hit is not None and time.monotonic() - hit[1] < tuning.RECENT:
            sb = hit[0]
            if (
                sb.status is S.RUNNING
                and (actor.admin or sb.tenant == actor.tenant)
                and self._vouched(sb)
            ):
                return sb
        return await self.get(sandbox_id, actor=actor)

    async def _touch(self, sb: SandboxInfo) -> None:
        """Record activity (for idle timeouts), at most every :data:`tuning.TOUCH_EVERY` seconds."""
        now = utcnow()
        if (now - sb.last_active_at).total_seconds() < tuning.TOUCH_EVERY:
            return
        await self.store.touch(sb.id, now)
        hit = self._recent.get(sb.id)
        if hit is not None and hit[0].version == sb.version:
            self._recent[sb.id] = (hit[0].model_copy(update={"last_active_at": now}), hit[1])

    async def list(
        self,
        *,
        actor: Actor = LOCAL_ACTOR,
        labels: Mapping[str, str] | None = None,
        status: SandboxStatus | Sequence[SandboxStatus] | None = None,
        backend: str | None = None,
        owner: str | None = None,
        include_destroyed: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes, newest first; destroyed ones only when asked."""
        await self._sweep_if_due()
        statuses = None
        if status is not None:
            statuses = frozenset([status] if isinstance(status, SandboxStatus) else status)
        return await self.store.list(
            SandboxQuery(
                tenant=None if actor.admin else actor.tenant,
                owner=owner,
                labels=dict(labels or {}),
                statuses=statuses,
                backend=backend,
                include_destroyed=include_destroyed,
                limit=limit,
                offset=offset,
            )
        )

    # -- the journal --------------------------------------------------------------------------

    def _journal(self) -> Journal:
        if self.journal is None:
            msg = "idempotency keys need the journal (this manager runs without one)"
            raise NotSupported(msg)
        return self.journal

    async def _jr(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run a (synchronous, database) journal call in a worker thread."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    # -- transitions --------------------------------------------------------------------------

    async def _cas(self, sb: SandboxInfo, **patch: object) -> SandboxInfo:
        new = await self.store.update(sb.id, sb.version, patch)
        self._remember(new)
        return new

    async def _begin(
        self, sb: SandboxInfo, allowed: set[SandboxStatus], to: SandboxStatus
    ) -> SandboxInfo:
        if sb.status not in allowed:
            msg = f"sandbox {sb.id} is {sb.status}; {to} needs one of {', '.join(sorted(allowed))}"
            raise InvalidState(msg, id=sb.id)
        return await self._cas(
            sb,
            status=to,
            transition_owner=self.instance,
            transition_deadline=utcnow() + timedelta(seconds=self.transition_timeout),
        )

    async def _fail(
        self,
        sb: SandboxInfo,
        cause: str,
        message: str,
        last_output: builtins.list[str] | None = None,
    ) -> SandboxInfo:
        """Record a failure. A failed *creation* is kept for inspection with its processes
        stopped, for :attr:`failed_keep` seconds (or until its own TTL, if sooner): the sweep
        destroys it then, so a setup that fails never leaves a sandbox running for good."""
        await self._drop_channel(sb.id)
        for _ in range(20):
            current = await self.store.get(sb.id)
            if current.status in (S.DESTROYING, S.DESTROYED):
                return current
            patch: dict[str, object] = {}
            if current.status in _CREATING:
                keep = utcnow() + timedelta(seconds=self.failed_keep)
                if current.expires_at is not None and current.expires_at < keep:
                    keep = current.expires_at
                # Marked so, the sweep destroys it at ``keep``; other failed sandboxes (a
                # stop that failed, say) keep their files until someone decides.
                patch["expires_at"] = keep
                patch["metadata"] = {**current.metadata, _KEPT: True}
                await self._halt_quietly(current)
            try:
                return await self._cas(
                    current,
                    status=S.FAILED,
                    error=message,
                    transition_owner=None,
                    transition_deadline=None,
                    death=DeathCertificate(
                        cause=cause, message=message, last_output=last_output or []
                    ),
                    **patch,
                )
            except Conflict:
                continue
        return await self.store.get(sb.id)

    async def _halt_quietly(self, sb: SandboxInfo) -> None:
        """Stop a failed creation's backend sandbox, best effort and bounded (its files stay;
        ``resume`` starts it again)."""
        if sb.backend_ref is None or not self._mine(sb):
            return
        with anyio.move_on_after(30), contextlib.suppress(SandboxError, OSError):
            await self._backend(sb.backend).stop(sb.backend_ref)

    async def _drive(self, ids: Sequence[str], work: Awaitable[T]) -> T:
        """Run a transition of these sandboxes; if it is interrupted by anything (a cancelled
        caller, a bug, an error of a user's callback), the sandboxes it left in flight are
        failed rather than left transitional."""
        own = [i for i in ids if i not in self._driving]
        self._driving.update(own)
        try:
            return await work
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                for sandbox_id in own:
                    await self._fail_interrupted(sandbox_id, e)
            raise
        finally:
            self._driving.difference_update(own)

    async def _fail_interrupted(self, sandbox_id: str, error: BaseException) -> None:
        with contextlib.suppress(SandboxError):
            current = await self.store.get(sandbox_id)
            if (
                current.status.transitional
                and current.status is not S.DESTROYING
                and current.transition_owner == self.instance
            ):
                why = (
                    "interrupted (the call driving it was cancelled)"
                    if isinstance(error, anyio.get_cancelled_exc_class())
                    else f"interrupted by {type(error).__name__}: {error}"
                )
                await self._fail(current, "interrupted", f"{current.status} {why}")

    def _abandoned(self, sb: SandboxInfo) -> bool:
        """Whether a transition in flight has nobody driving it any more."""
        if sb.transition_deadline is not None and sb.transition_deadline <= utcnow():
            return True
        if sb.transition_owner is None:
            return True
        if sb.transition_owner == self.instance:
            # Ours: live while the call driving it runs (an interrupted one let go of it).
            return sb.id not in self._driving
        return not owner_alive(sb.transition_owner.partition("/")[0])

    async def _settled(self, sb: SandboxInfo) -> SandboxInfo:
        """Wait until no transition is in flight (settling an abandoned one)."""
        with anyio.move_on_after(self.transition_timeout):
            delay = 0.005
            while sb.status.transitional:
                if self._abandoned(sb):
                    with contextlib.suppress(Conflict):
                        return await self._settle(sb)
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.2)
                sb = await self.store.get(sb.id)
            return sb
        msg = f"sandbox {sb.id} stayed {sb.status} for {self.transition_timeout:g}s"
        raise SandboxTimeout(msg, id=sb.id)

    async def _ready(
        self,
        sandbox_id: str,
        actor: Actor,
        auto_resume: bool,
        current: SandboxInfo | None = None,
    ) -> SandboxInfo:
        """The sandbox, running: wait out transitions, resume it if stopped (exactly one
        concurrent caller wins the resume; the rest wait for it). ``current`` is a record the
        caller just read, saving a second read on the hot path."""
        sb = current if current is not None else await self.get(sandbox_id, actor=actor)
        for _ in range(100):
            sb = await self._settled(sb)
            if sb.status in (S.RUNNING, S.STOPPED) and _past_ttl(sb, utcnow()):
                await self._refuse_expired(sb)
            if sb.status is S.RUNNING:
                if await self._answers(sb):
                    return sb
                sb = await self._fetch(sb.id, actor)
                continue
            if sb.status is S.STOPPED:
                if not auto_resume:
                    why = f" ({sb.death.cause}: {sb.death.message})" if sb.death else ""
                    msg = f"sandbox {sb.id} is stopped{why}; auto_resume is off"
                    raise InvalidState(msg, id=sb.id)
                # An implied resume is decided like an explicit one: a policy that forbids
                # resuming is not bypassed by running a command.
                async with self._gated(actor, "resume", sb) as outcome:
                    try:
                        sb = await self._begin(sb, {S.STOPPED}, S.RESUMING)
                    except Conflict:
                        outcome.detail["resumed_by_another"] = True
                        sb = await self.store.get(sb.id)
                        continue
                    return await self._do_resume(sb, actor, sb.expires_at)
            reason = f": {sb.death.cause} ({sb.death.message})" if sb.death else ""
            msg = f"sandbox {sb.id} is {sb.status}{reason}"
            raise InvalidState(msg, id=sb.id, status=sb.status.value)
        msg = f"sandbox {sandbox_id} did not settle"
        raise SandboxTimeout(msg)

    async def _answers(self, sb: SandboxInfo) -> bool:
        """Whether a ``running`` sandbox really answers: an open channel says so; otherwise
        one is opened, and if the backend says the sandbox is gone or stopped, the record is
        brought up to date (False: read it again)."""
        if self._vouched(sb):
            return True
        try:
            await self._channel(sb)
        except (BackendError, InvalidState) as e:
            if not self._mine(sb):
                raise
            await self._drop_channel(sb.id)
            try:
                change = await self._reconcile_one(await self.store.get(sb.id))
            except SandboxError:
                raise e from None
            if change is None:
                raise
            return False
        return True

    async def _refuse_expired(self, sb: SandboxInfo) -> None:
        """An expired sandbox does no more work: stop it if it still runs (as the system, as
        the sweep would) and refuse, saying how to bring it back."""
        sb = await self.store.get(sb.id)
        if not _past_ttl(sb, utcnow()):
            return  # extended meanwhile (keep_alive in another process)
        assert sb.expires_at is not None
        stopped = ""
        if sb.status is S.RUNNING and self._mine(sb):
            try:
                with anyio.CancelScope(shield=True):  # the caller's cancel must not half-stop it
                    if await self._stop_system(sb, utcnow()) is not None:
                        stopped = " and was stopped"
            except SandboxError as e:
                _log.error("could not stop expired sandbox %s: %s", sb.id, e)
        msg = (
            f"sandbox {sb.id} expired at {sb.expires_at:%Y-%m-%d %H:%M:%S} UTC (its time to live "
            f"ran out){stopped}; keep_alive extends it, resume starts it with a new one"
        )
        raise InvalidState(msg, id=sb.id, status="expired")

    # -- where a sandbox lives, and its channel -----------------------------------------------

    def _mine(self, sb: SandboxInfo) -> bool:
        """Whether this Manager can reach the sandbox (it is not on another host)."""
        return sb.host is None or sb.host == self.host

    def _require_here(self, sb: SandboxInfo) -> None:
        """Refuse to act on a sandbox of another host: its runtime is there, not here."""
        if not self._mine(sb):
            msg = (
                f"sandbox {sb.id} lives on host {sb.host} (this is {self.host}): reach it "
                "through that host's server"
            )
            raise InvalidState(msg, id=sb.id, host=sb.host)

    def _backend_of(self, sb: SandboxInfo) -> Backend:
        """The backend holding an existing sandbox, which must be on this host."""
        self._require_here(sb)
        return self._backend(sb.backend)

    def _backend(self, name: str) -> Backend:
        try:
            impl = self._used[name] = self.backends[name]
            # The local backend's strict sandboxes ask here for each program they start.
            if hasattr(impl, "exec_decider") and impl.exec_decider is None:
                impl.exec_decider = self._decide_program
        except KeyError:
            msg = f"backend {name!r} is not available here (configured: {', '.join(sorted(self.backends))})"
            raise InvalidRequest(msg) from None
        return impl

    def _env(self, sb: SandboxInfo, extra: Mapping[str, str]) -> dict[str, str]:
        return {**sb.spec.env, **extra}

    def _vouched(self, sb: SandboxInfo) -> bool:
        """Whether an open channel to this very backend sandbox vouches that it runs."""
        cached = self._channels.get(sb.id)
        return cached is not None and cached[0] == sb.backend_ref and not cached[1].closed

    async def _channel(self, sb: SandboxInfo) -> Channel:
        self._require_here(sb)
        if self._vouched(sb):
            return self._channels[sb.id][1]
        if sb.backend_ref is None:
            msg = f"sandbox {sb.id} has no backend sandbox yet"
            raise InvalidState(msg, id=sb.id)
        channel = await self._backend_of(sb).channel(sb.backend_ref)
        self._channels[sb.id] = (sb.backend_ref, channel)
        return channel

    async def _while_active(self, sb: SandboxInfo, call: Awaitable[T]) -> T:
        """A channel call that counts as activity while it runs: with an idle timeout, a
        command longer than it is not idle (a sweep in another process sees only the record,
        so the record is touched now and then)."""
        idle = sb.spec.idle_timeout
        if idle is None:
            return await self._channel_call(sb, call)
        await self._touch(sb)
        result: list[T] = []

        async def keep_touching() -> None:
            while True:
                await anyio.sleep(max(tuning.TOUCH_EVERY, idle / 3))
                with contextlib.suppress(SandboxError):
                    await self.store.touch(sb.id, utcnow())

        with lone_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_touching)
                result.append(await self._channel_call(sb, call))
                tg.cancel_scope.cancel()
        return result[0]

    async def _channel_call(self, sb: SandboxInfo, call: Awaitable[T]) -> T:
        try:
            return await call
        except BackendError:
            # A broken channel usually means the sandbox died under us (its init was
            # OOM-killed, the host stopped it): record why before the caller sees the error.
            await self._drop_channel(sb.id)
            with contextlib.suppress(SandboxError):
                await self._reconcile_one(await self.store.get(sb.id))
            raise

    async def _drop_channel(self, sandbox_id: str) -> None:
        cached = self._channels.pop(sandbox_id, None)
        if cached is not None:
            with contextlib.suppress(SandboxError, OSError):
                await cached[1].close()

    async def _last_output(self, sb: SandboxInfo) -> builtins.list[str]:
        """The last lines of the main log, for a death certificate (best effort, bounded)."""
        if sb.status is not S.RUNNING or sb.backend_ref is None:
            return []
        tail = _Tail()
        with anyio.move_on_after(2), contextlib.suppress(SandboxError, OSError):
            channel = await self._channel(sb)
            info = await channel.stat(MAIN_LOG)
            async for chunk in channel.follow_file(MAIN_LOG, offset=max(0, info.size - 16384)):
                tail.feed(chunk)
        return tail.lines()

    # -- closing ------------------------------------------------------------------------------

    async def flush_receipts(self) -> None:
        """Wait until every receipt of operations done so far is written."""
        if self.gate is not None:
            await self.gate.flush()

    async def aclose(self) -> None:
        """Write pending receipts; close channels, backends and the store."""
        if self.gate is not None:
            await anyio.to_thread.run_sync(self.gate.close)
        for sid in list(self._channels):
            await self._drop_channel(sid)
        for impl in self._used.values():
            with contextlib.suppress(SandboxError):
                await impl.aclose()
        await self.store.aclose()
