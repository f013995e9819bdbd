"""The Manager: the one place that composes store, backends, channels and the policy gate.

It owns the lifecycle state machine (DESIGN.md)::

    create ─► provisioning ─► setting_up ─► starting ─► running ◄──► stopping ─► stopped
                                                            ▲                       │
                                                            └──────── resuming ◄────┘
    any ─► destroying ─► destroyed                  failures ─► failed

Every status change is a compare-and-set on the record's ``version``, so several processes
(or hosts, on PostgreSQL) can drive the same sandboxes: when many requests find a sandbox
stopped, exactly one wins the ``stopped -> resuming`` update and resumes it; the others wait
for the transition (bounded by ``transition_timeout``) and then proceed. A transition whose
driver died is *abandoned*: its owner process is gone (same host) or its deadline passed, and
``reconcile`` (or the next waiter) settles it.

Front ends (SDK, CLI, HTTP, MCP) call the Manager and nothing below it. The Manager never
imports a concrete backend; it gets them by name from the caller.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import json
import logging
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar, final

import anyio

from sandlot.backends.base import Backend, NetworkControl, SnapshotRef
from sandlot.backends.options import BACKEND_OPTIONS, check_backend_options
from sandlot.channel.base import MAIN_LOG, Channel, OutputCallback, PtySession, Stdin
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    Conflict,
    ExecFailed,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    PolicyDenied,
    SandboxError,
    SandboxTimeout,
    VerificationFailed,
    error_from_code,
)
from sandlot.gate.gate import SYSTEM
from sandlot.journal import (
    LEASED_STATES,
    Intent,
    IntentState,
    Journal,
    Lease,
    owner_alive,
    process_owner,
)
from sandlot.journal.wakeups import Wakeups
from sandlot.models import (
    LOCAL_ACTOR,
    SYSTEM_PRINCIPAL,
    Actor,
    Command,
    CommandSpec,
    DeathCertificate,
    ExecResult,
    FileInfo,
    GitSource,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
    new_id,
    parse_model,
    system_actor,
    utcnow,
)
from sandlot.policy import limits
from sandlot.policy.normalize import normalize_path
from sandlot.policy.request import Resource
from sandlot.store.base import SandboxQuery
from sandlot.taskgroups import lone_error

if TYPE_CHECKING:
    from sandlot.backends.local.execgate import ExecCall as _ExecCall
    from sandlot.gate.gate import Approval, Authorization, Gate
    from sandlot.policy import Explanation
    from sandlot.store.base import Store

__all__ = ["FileBody", "Manager", "ReconcileReport", "command_argv"]

S = SandboxStatus
T = TypeVar("T")
FileBody = bytes | str | AsyncIterable[bytes]
"""What a file write takes: its bytes, text (written as UTF-8), or chunks to stream."""
_log = logging.getLogger("sandlot")
RECENT = 1.0
"""Seconds a record this process just read or wrote may stand in for a read on the hot path
(while its channel is open, which is the stronger sign the sandbox still runs)."""
_RECENT_MAX = 4096
TOUCH_EVERY = 1.0
"""Activity is written at most this often per sandbox (idle timeouts are far coarser)."""
LAST_LINES = 20
"""How many lines of output a death certificate keeps."""
FAILED_KEEP = 3600.0
"""Seconds a failed creation is kept for inspection (its backend sandbox stopped) before the
sweep destroys it, unless the sandbox's own time to live ends sooner."""
SWEEP_BOUND = 30.0
"""Seconds an embedded caller's inline sweep may take at most (the rest waits for the next)."""
_KEPT = "kept_for_inspection"
"""Metadata marking a failed creation, kept for inspection until its ``expires_at``."""
_CREATING = frozenset(
    {SandboxStatus.PROVISIONING, SandboxStatus.SETTING_UP, SandboxStatus.STARTING}
)


def command_argv(command: Command | Sequence[str]) -> tuple[list[str], str | None, dict[str, str]]:
    """A command as ``(argv, cwd, env)``: strings run under ``sh -c``, lists are an argv.

    Raises:
        InvalidRequest: an empty argv, or a command over :mod:`sandlot.policy.limits`.
    """
    if isinstance(command, str):
        limits.check_command(command)
        return ["sh", "-c", command], None, {}
    if isinstance(command, CommandSpec):
        limits.check_argv(command.argv())
        return command.argv(), command.cwd, dict(command.env)
    argv = list(command)
    if not argv:
        msg = "command: an empty argv"
        raise InvalidRequest(msg)
    limits.check_argv(argv)
    return argv, None, {}


@dataclass
class ReconcileReport:
    """What ``reconcile`` changed."""

    checked: int = 0
    updated: dict[str, str] = field(default_factory=dict)
    """Sandbox id -> what happened (``running -> stopped (oom)``, …)."""
    reaped: builtins.list[str] = field(default_factory=list)
    """Backend sandboxes with our mark but no record, destroyed."""
    errors: dict[str, str] = field(default_factory=dict)
    """Backends or sandboxes that could not be checked (or stopped, or destroyed), and why."""
    expired: builtins.list[str] = field(default_factory=list)
    """Running sandboxes past their time to live or idle timeout, stopped."""
    discarded: builtins.list[str] = field(default_factory=list)
    """Failed creations whose time for inspection ran out, destroyed."""


class _Outcome:
    """What an operation reports for its execution receipt and, when it carries an
    idempotency key, for its journal intent (filled in while it runs)."""

    def __init__(self) -> None:
        self.output: bytes | None = None
        self.output_hash: str | None = None
        """``sha256:`` of output hashed as it passed (else taken of ``output``)."""
        self.exit_code: int | None = None
        self.detail: dict[str, JsonValue] = {}
        self.lease: Lease | None = None
        """The journal lease, for operations with an idempotency key."""
        self.result: JsonValue = None
        """The durable result a replay of the same key returns."""
        self.final_state: str = "RESULT_RECORDED"
        self.creating: str | None = None
        """The sandbox a creation is making (so an interruption's record can name it)."""


class _LeaseKeeper:
    """Renews an operation's journal lease from a thread while the operation runs.

    A thread, not a task: the operation's own cancel scopes must not be able to stop the
    heartbeat early, and the renewal is a short blocking database write.
    """

    def __init__(self, journal: Journal, outcome: _Outcome) -> None:
        self._journal = journal
        self._outcome = outcome
        self._interval = journal.lease_seconds / 3
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandlot-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            lease = self._outcome.lease
            if lease is None or lease.expires_at is None:
                continue
            # A transition racing with the renewal makes one of them see a stale state; the
            # next beat uses the new lease.
            with contextlib.suppress(SandboxError):
                self._journal.renew(lease)

    def stop(self) -> None:
        self._stopped.set()


@dataclass(frozen=True)
class _Replay:
    """The recorded result of an earlier call with the same idempotency key."""

    result: JsonValue


class _Tail:
    """Keeps the last lines of a stream of output chunks (for death certificates)."""

    def __init__(self, keep: int = LAST_LINES) -> None:
        self.keep = keep
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        self.buffer = (self.buffer + data)[-16384:]

    def lines(self) -> builtins.list[str]:
        text = self.buffer.decode(errors="replace")
        return text.splitlines()[-self.keep :]


@final
class Manager:
    """Drives sandboxes through their lifecycle on a store and a set of backends.

    Args:
        store: Where records live.
        backends: Backends by name; new sandboxes go to ``default_backend`` unless asked.
        default_backend: The name of the backend for new sandboxes.
        transition_timeout: How long a request waits for another's transition (seconds).
        create_timeout: After this, a creation in flight counts as abandoned (seconds).
        gate: The policy gate every operation passes first (None: no policy, no receipts —
            for unit tests of the lifecycle only; the SDK always has one).
        journal: The durable intent journal that makes operations with an idempotency key
            replayable and crash-safe (None: idempotency keys are refused).
        failed_keep: Seconds a failed creation is kept for inspection before the sweep
            (:meth:`stop_expired`) destroys it.
        sweep_every: With no server around to sweep (the embedded SDK and CLI), ``create``
            and ``list`` first sweep this host's sandboxes when the last sweep of this Manager
            is older than this many seconds (None: never; a server sweeps on its own
            schedule).
        option_defaults: Backend options a new sandbox gets on its backend when its spec does
            not set them (``{"local": {"isolation": "gvisor"}}``, from ``sandlot.toml``); they
            are written into its spec, so its record says what it runs on.
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
        failed_keep: float = FAILED_KEEP,
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
        self._wakeups = Wakeups()
        """Repeats of a keyed call run here, waiting for it to end."""

    # -- records ----------------------------------------------------------------------------

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
        if len(self._recent) > _RECENT_MAX:
            # A long-lived server sees many sandboxes: forget what aged out.
            self._recent = {k: v for k, v in self._recent.items() if now - v[1] < RECENT}
        if sb.status is S.DESTROYED:
            self._recent.pop(sb.id, None)
        else:
            self._recent[sb.id] = (sb, now)

    async def _current(self, sandbox_id: str, actor: Actor) -> SandboxInfo:
        """The record for a hot-path operation: the one this process saw within
        :data:`RECENT` seconds when the sandbox was running and its channel is still open,
        else a fresh read. Tenancy is checked either way."""
        hit = self._recent.get(sandbox_id)
        if hit is not None and time.monotonic() - hit[1] < RECENT:
            sb = hit[0]
            if (
                sb.status is S.RUNNING
                and (actor.admin or sb.tenant == actor.tenant)
                and self._vouched(sb)
            ):
                return sb
        return await self.get(sandbox_id, actor=actor)

    async def _launch(
        self,
        sandbox_id: str,
        actor: Actor,
        command: Command | Sequence[str],
        cwd: str | None,
        env: Mapping[str, str] | None,
    ) -> tuple[SandboxInfo, list[str], str, dict[str, str], str | list[str]]:
        """What ``exec``, ``start_process`` and ``open_pty`` start, checked before anything
        reaches the sandbox: its record, the argv, the working directory (the caller's, else
        the command's, else the spec's), the extra environment (the caller's over the
        command's) and the command as policy and receipts show it."""
        if cwd is not None and not cwd.startswith("/"):
            msg = f"cwd must be an absolute path, got {cwd!r}"
            raise InvalidRequest(msg)
        argv, spec_cwd, spec_env = command_argv(command)
        sb = await self._current(sandbox_id, actor)
        workdir = cwd or spec_cwd or sb.spec.workdir
        shown = command if isinstance(command, str) else argv
        extra_env = spec_env | dict(env or {})
        limits.check_env(extra_env)
        return sb, argv, workdir, extra_env, shown

    async def _touch(self, sb: SandboxInfo) -> None:
        """Record activity (for idle timeouts), at most every :data:`TOUCH_EVERY` seconds."""
        now = utcnow()
        if (now - sb.last_active_at).total_seconds() < TOUCH_EVERY:
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

    # -- the gate -----------------------------------------------------------------------------

    async def _decide_program(self, sandbox_id: str, call: _ExecCall) -> bool:
        """A program started inside a strict sandbox, stopped in the kernel: decided and
        receipted as ``exec.program`` (the binary as the caller named it, then its arguments;
        ``argv[0]`` is the caller's to choose, so the program is the path), as the sandbox's
        owner without admin rights (the kernel does not say who typed the command)."""
        try:
            sb = await self.store.get(sandbox_id)
        except NotFound:
            return False
        actor = Actor(tenant=sb.tenant, principal=sb.owner or SYSTEM_PRINCIPAL)
        command = [call.path, *call.argv[1:]]
        try:
            async with self._gated(actor, "exec.program", sb, command=command, cwd=call.cwd):
                return True
        except PolicyDenied:
            return False

    @contextlib.asynccontextmanager
    async def _gated(
        self,
        actor: Actor,
        action: str,
        target: SandboxInfo | Resource,
        *,
        intent: Intent | None = None,
        **args: object,
    ) -> AsyncIterator[_Outcome]:
        """Decide (and record) before the body runs; record what it did after.

        Nothing in the body runs unless the gate allowed it, and every allowed operation gets
        an execution receipt, also when it fails. With an ``intent`` (an idempotency key), the
        ALLOW decision is consumed as the intent's one-use authorization before the body runs,
        and the body's result (or its error) is recorded for replays.
        """
        outcome = _Outcome()
        # While it runs the sandbox is busy: the idle reaper of this process leaves it be.
        busy = target.sandbox_id if isinstance(target, Resource) else target.id
        self._busy[busy] = self._busy.get(busy, 0) + 1
        try:
            async with self._gated_body(actor, action, target, intent, args, outcome) as done:
                yield done
        finally:
            self._busy[busy] -= 1
            if not self._busy[busy]:
                del self._busy[busy]
            if intent is not None:
                self._wakeups.wake(intent.intent_id)

    @contextlib.asynccontextmanager
    async def _gated_body(
        self,
        actor: Actor,
        action: str,
        target: SandboxInfo | Resource,
        intent: Intent | None,
        args: Mapping[str, object],
        outcome: _Outcome,
    ) -> AsyncIterator[_Outcome]:
        auth = None
        if self.gate is not None:
            resource = target if isinstance(target, Resource) else Resource.of(target)
            try:
                auth = await self.gate.authorize(
                    actor,
                    action,
                    resource,
                    args,
                    idempotency_key=intent.idempotency_key if intent else None,
                )
            except PolicyDenied as e:
                if intent is not None:
                    await self._jr(
                        self._journal().deny,
                        intent.intent_id,
                        decision=e.receipt_id or "none",
                        reason=e.reason_code,
                    )
                raise
            except BaseException:
                if intent is not None:
                    # No decision (an error, a cancelled caller): a repeat waiting for this
                    # call's claim may go to the gate itself at once.
                    with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError):
                        await self._jr(self._journal().release_claim, intent.intent_id)
                raise
        keeper = None
        if intent is not None:
            decision = auth.receipt.entry_hash if auth else f"ungated:{intent.intent_id}"
            try:
                outcome.lease = await self._jr(
                    self._journal().authorize, intent.intent_id, decision=decision
                )
            except Conflict:
                # Another call with the same key was authorized first and runs it; this
                # decision authorized nothing, and its receipt says so.
                if auth is not None:
                    await self._complete(auth, outcome, error="superseded by another call")
                msg = (
                    f"another call with idempotency key {intent.idempotency_key!r} is running "
                    "this operation; repeat the call to get its outcome"
                )
                raise Conflict(msg, intent_id=intent.intent_id) from None
            # A long operation keeps its lease, so nobody takes it for dead.
            keeper = _LeaseKeeper(self._journal(), outcome)
        try:
            yield outcome
        except GeneratorExit:
            # A reader stopped consuming a stream (logs, a file, process output): the
            # operation itself went fine, it was only cut short.
            outcome.detail["stopped_early"] = True
            with anyio.CancelScope(shield=True):
                if auth is not None:
                    await self._complete(auth, outcome)
                if outcome.lease is not None:
                    await self._finish_intent(outcome, auth)
            raise
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                if auth is not None:
                    await self._complete(auth, outcome, error=f"{type(e).__name__}: {e}")
                if outcome.lease is not None:
                    recorded: BaseException = e
                    if not isinstance(e, SandboxError):
                        recorded = _interrupted(e, outcome, self.failed_keep)
                    with contextlib.suppress(SandboxError):
                        await self._jr(
                            self._journal().fail, outcome.lease, error=_encode_error(recorded)
                        )
            raise
        finally:
            if keeper is not None:
                keeper.stop()
        if auth is not None:
            await self._complete(auth, outcome)
        if outcome.lease is not None:
            await self._finish_intent(outcome, auth)

    async def _finish_intent(self, outcome: _Outcome, auth: Authorization | None) -> None:
        assert outcome.lease is not None
        journal = self._journal()
        if outcome.final_state == "CLEANED":
            await self._jr(journal.advance, outcome.lease, "CLEANED", result=outcome.result)
        else:
            await self._jr(
                journal.record_result,
                outcome.lease,
                result=outcome.result,
                receipt_seq=auth.receipt.seq if auth else None,
            )

    # -- idempotency keys ------------------------------------------------------------------

    def _journal(self) -> Journal:
        if self.journal is None:
            msg = "idempotency keys need the journal (this manager runs without one)"
            raise NotSupported(msg)
        return self.journal

    async def _jr(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run a (synchronous, database) journal call in a worker thread."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    async def _begin_intent(
        self,
        actor: Actor,
        op: str,
        request: Mapping[str, JsonValue],
        key: str | None,
    ) -> Intent | _Replay | None:
        """Record the intent of an operation with an idempotency key.

        Returns None without a key; the new (or never authorized) intent to run; or, for a
        key seen before with the same request, the recorded result (``_Replay``). Raises what
        an earlier attempt raised, and ``Conflict`` for a key reused with another request. A
        replay that finds the first attempt still running waits for it; one that finds it
        abandoned by a crash settles it (it is never run twice).
        """
        if key is None:
            return None
        if not key or len(key) > 200:
            msg = "an idempotency key is 1 to 200 characters"
            raise InvalidRequest(msg)
        journal = self._journal()
        begun = await self._jr(
            journal.begin,
            tenant=actor.tenant,
            principal=actor.principal,
            op=op,
            request=dict(request),
            idempotency_key=key,
            claim_seconds=self._claim_seconds(),
        )
        intent = begun.intent
        if not begun.replay:
            return intent
        deadline = anyio.current_time() + self.transition_timeout
        while intent.state is IntentState.PREPARED or (
            intent.state in LEASED_STATES and owner_alive(intent.lease_owner or "")
        ):
            if intent.state is IntentState.PREPARED:
                # Its first call is at the gate (it holds the claim) or went away (the claim
                # is free or its holder died): one repeat takes it over, the others wait.
                holder = intent.lease_owner
                dead = holder if holder and not owner_alive(holder) else None
                if await self._jr(
                    journal.claim,
                    intent.intent_id,
                    dead_owner=dead,
                    claim_seconds=self._claim_seconds(),
                ):
                    return intent
            left = deadline - anyio.current_time()
            if left <= 0:
                break
            with self._wakeups.waiting(intent.intent_id) as wake:
                # Woken at once by a call run here; a slow poll sees one run elsewhere.
                intent = await journal.wait(intent.intent_id, timeout=left, wake=wake, max_poll=1)
            if intent.state in LEASED_STATES:
                break  # its lease expired (or the wait timed out): settle it below
        if intent.state is IntentState.PREPARED:
            msg = (
                f"another call with idempotency key {key!r} is still being decided after "
                f"{self.transition_timeout:g}s; repeat the call to get its outcome"
            )
            raise Conflict(msg, intent_id=intent.intent_id)
        if intent.state in LEASED_STATES:
            try:
                await self._recover_intent(intent)
            except InvalidState:
                pass  # it came to rest after we looked: its outcome is recorded
            except Conflict:
                msg = (
                    f"the first call with idempotency key {key!r} is still running after "
                    f"{self.transition_timeout:g}s; repeat the call to get its outcome"
                )
                raise Conflict(msg, intent_id=intent.intent_id) from None
            intent = await self._jr(journal.get, intent.intent_id)
            if intent.state in LEASED_STATES:
                msg = f"the first call with idempotency key {key!r} is still running"
                raise Conflict(msg, intent_id=intent.intent_id)
        return _Replay(_replayed(intent))

    def _claim_seconds(self) -> float:
        """How long a caller at the gate holds its key's intent: through a HOLD's wait for an
        approval, so that a repeat does not ask for a second approval meanwhile (a claim is
        released as soon as the gate answers; only a crash on another host waits it out)."""
        lease = self._journal().lease_seconds
        return lease if self.gate is None else max(lease, self.gate.hold_timeout + lease)

    async def recover(self) -> dict[str, str]:
        """Settle intents whose worker died (a crash, a ``kill -9``): run at start-up.

        Nothing is run twice: an exec or a write that may have started is reported with an
        unknown outcome, a creation is settled like any abandoned one (its record failed, its
        backend sandbox kept), a destroy is finished (destroying is idempotent). A backend
        that cannot answer leaves the intent ``NEEDS_RECONCILE`` (``sandlot doctor`` lists
        them). Returns intent id -> what happened.
        """
        if self.journal is None:
            return {}
        done: dict[str, str] = {}
        intents = await self._jr(self.journal.list, states=sorted(s.value for s in LEASED_STATES))
        now = utcnow()
        for intent in intents:
            expired = intent.lease_expires_at is None or intent.lease_expires_at <= now
            if not expired and (intent.lease_owner is None or owner_alive(intent.lease_owner)):
                continue
            try:
                done[intent.intent_id] = await self._recover_intent(intent)
            except Conflict:
                continue  # another process took it over, or its worker is still alive
            except SandboxError as e:
                # One intent that cannot be settled must not stop the others (or start-up).
                _log.warning("could not recover intent %s: %s", intent.intent_id, e)
                done[intent.intent_id] = f"error: {e}"
        return done

    async def _recover_intent(self, intent: Intent) -> str:
        journal = self._journal()
        dead = (
            intent.lease_owner
            if intent.lease_owner and not owner_alive(intent.lease_owner)
            else None
        )
        lease = await self._jr(
            journal.take_over, intent.intent_id, dead_owner=dead, leased_only=True
        )
        if intent.op == "destroy":
            # A crash before the sandbox was attached to the intent leaves it in the request.
            target = intent.sandbox_id or intent.request.get("sandbox_id")
            if isinstance(target, str):
                return await self._recover_destroy(lease, target)
        if intent.op == "sandbox.create" and intent.sandbox_id is not None:
            try:
                sb = await self.store.get(intent.sandbox_id)
            except NotFound:
                pass  # the record is written before the backend is asked: nothing was made
            else:
                return await self._recover_create(lease, sb)
        unknown = intent.state is IntentState.RUNNING
        what = (
            "its outcome is unknown (the process running it died); it was not run again"
            if unknown
            else "it was interrupted before it ran; it was not run"
        )
        error = BackendUnavailable(
            f"{intent.op} {what}", outcome="unknown" if unknown else "not_run"
        )
        await self._jr(journal.fail, lease, error=_encode_error(error))
        return "failed"

    async def _recover_destroy(self, lease: Lease, sandbox_id: str) -> str:
        """Finish a destroy whose worker died (destroying is idempotent), so a replay of its
        key answers the destroyed record."""
        journal = self._journal()
        try:
            sb = await self.store.get(sandbox_id)
            sb = await self._destroy(sb, "destroyed", "destroy finished after a crash")
        except BackendUnavailable as e:
            await self._jr(journal.needs_reconcile, lease.intent_id, why=str(e))
            return "needs_reconcile"
        if lease.state is not IntentState.CLEANING:
            lease = await self._jr(journal.advance, lease, "CLEANING", sandbox_id=sb.id)
        await self._jr(journal.advance, lease, "CLEANED", result=sb.model_dump(mode="json"))
        return "finished"

    async def _recover_create(self, lease: Lease, sb: SandboxInfo) -> str:
        """Settle a creation whose worker died, so a replay of its key answers its sandbox.

        A sandbox that reached ``running`` is the result (only the journal's last write was
        lost); one still in creation is failed like any abandoned creation (its backend
        sandbox kept), and the replay raises ``InvalidState`` naming it. Either way a backend
        sandbox found for the record is recorded as the intent's allocation (adopted, never
        made again), so destroying it later releases the allocation.
        """
        journal = self._journal()
        if sb.status.transitional and not self._abandoned(sb):
            msg = f"sandbox {sb.id} is still being driven by {sb.transition_owner}"
            raise Conflict(msg, id=sb.id)
        if sb.status.transitional:
            try:
                sb = await self._settle(sb)
            except BackendUnavailable as e:
                await self._jr(journal.needs_reconcile, lease.intent_id, why=str(e))
                return "needs_reconcile"
        if lease.state is IntentState.ALLOCATING and sb.backend_ref is not None:
            lease = await self._jr(journal.allocated, lease, provider_ref=sb.backend_ref)
        if sb.status is S.RUNNING:
            await self._jr(
                journal.record_result, lease, result={"sandbox_id": sb.id}, receipt_seq=None
            )
            return "adopted"
        cause = f": {sb.death.cause} ({sb.death.message})" if sb.death else ""
        error = InvalidState(
            f"the creation of sandbox {sb.id} was interrupted by a crash; it is {sb.status}{cause}",
            id=sb.id,
            sandbox_id=sb.id,
            status=sb.status.value,
        )
        await self._jr(journal.fail, lease, error=_encode_error(error))
        return "failed"

    async def _complete(
        self, auth: Authorization, outcome: _Outcome, error: str | None = None
    ) -> None:
        assert self.gate is not None
        await self.gate.complete(
            auth,
            output=outcome.output,
            output_hash=outcome.output_hash,
            exit_code=outcome.exit_code,
            error=error,
            detail=outcome.detail or None,
        )

    async def explain(
        self,
        action: str,
        sandbox_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        **args: object,
    ) -> Explanation:
        """What the policy would decide about an operation and why, without running it."""
        gate = self._require_gate()
        sb = await self.get(sandbox_id, actor=actor)
        return await gate.explain(actor, action, Resource.of(sb), args)

    async def list_approvals(
        self, *, actor: Actor = LOCAL_ACTOR, status: str | None = "pending"
    ) -> builtins.list[Approval]:
        """HOLD decisions (pending by default) of the actor's tenant, newest first."""
        return await self._require_gate().list_approvals(actor, status=status)

    async def approve(self, approval_id: str, *, actor: Actor = LOCAL_ACTOR) -> Approval:
        """Let a held operation run (the answer is a signed receipt)."""
        return await self._require_gate().answer(approval_id, actor, allow=True)

    async def deny(self, approval_id: str, *, actor: Actor = LOCAL_ACTOR) -> Approval:
        """Refuse a held operation (the answer is a signed receipt)."""
        return await self._require_gate().answer(approval_id, actor, allow=False)

    def _require_gate(self) -> Gate:
        if self.gate is None:
            msg = "this manager runs without a policy gate"
            raise NotSupported(msg)
        return self.gate

    # -- create -----------------------------------------------------------------------------

    async def create(
        self,
        spec: SandboxSpec,
        *,
        backend: str | None = None,
        actor: Actor = LOCAL_ACTOR,
        on_setup_output: OutputCallback | None = None,
        idempotency_key: str | None = None,
    ) -> SandboxInfo:
        """Provision a sandbox, clone its repository, run its setup and start its main process.

        A failing step leaves the sandbox ``failed`` with a death certificate and keeps the
        backend's sandbox for inspection; the error is raised. With an ``idempotency_key``,
        a repeated call with the same spec returns the same sandbox (a different spec under
        the same key is a ``Conflict``), and a crash never allocates twice.
        """
        name = backend or self.default_backend
        if defaults := self.option_defaults.get(name):
            options = {**spec.backend_options, name: {**defaults, **spec.options_for(name)}}
            spec = spec.model_copy(update={"backend_options": options})
        # Every entry point (SDK, HTTP, MCP) refuses options a known backend does not take, as
        # the CLI does; entries for backends this build does not know (a user's own, one of
        # another deployment) are theirs to read.
        check_backend_options(
            {b: o for b, o in spec.backend_options.items() if b in BACKEND_OPTIONS}
        )
        impl = self._backend(name)
        self._check_capabilities(impl, spec)
        for step in (*spec.setup_steps(), spec.start, spec.resume):
            if step is not None:
                command_argv(step)  # its bounds, before anything is made
        await self._sweep_if_due()
        request: dict[str, JsonValue] = {"backend": name, "spec": spec.model_dump(mode="json")}
        begun = await self._begin_intent(actor, "sandbox.create", request, idempotency_key)
        if isinstance(begun, _Replay):
            assert isinstance(begun.result, dict)
            return await self.get(str(begun.result["sandbox_id"]), actor=actor)
        # Under a key the id (and so every backend name derived from it) follows from the
        # intent: a retry after a crash finds what the first attempt made.
        sandbox_id = "sb-" + begun.intent_id.split(":")[-1][:12] if begun else new_id("sb")
        target = Resource.for_spec(sandbox_id, spec, backend=name, tenant=actor.tenant)
        async with self._gated(actor, "sandbox.create", target, intent=begun, spec=spec) as outcome:
            outcome.creating = sandbox_id
            try:
                info = await self._drive(
                    [sandbox_id],
                    self._create(sandbox_id, name, impl, spec, actor, on_setup_output, outcome),
                )
            except SandboxError as e:
                await self._named(e, sandbox_id)
                raise
            except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
                if begun is None:
                    # Interrupted (Ctrl-C, a cancelled caller) with no key to replay it by:
                    # nobody learnt its id, so nothing it made is left behind. (Any other
                    # failure keeps it, failed, for inspection like a failed setup.)
                    with anyio.CancelScope(shield=True):
                        await self._discard_interrupted(sandbox_id)
                raise
            outcome.result = {"sandbox_id": info.id}
            return info

    async def _named(self, error: SandboxError, sandbox_id: str) -> None:
        """Make a failed creation's error name the sandbox it left (so a caller can look at
        it or destroy it) and until when it is kept."""
        if "sandbox_id" in error.details:
            return
        try:
            sb = await self.store.get(sandbox_id)
        except SandboxError:
            return  # refused before anything was recorded (or the store is down: say no more)
        error.details["sandbox_id"] = sb.id
        error.details["failure"] = error.message
        if sb.status is S.FAILED and sb.expires_at is not None:
            error.details["kept_until"] = sb.expires_at.isoformat()
            error.message += (
                f" (sandbox {sb.id} is kept, failed, for inspection until "
                f"{sb.expires_at:%Y-%m-%d %H:%M:%S} UTC)"
            )
        elif sb.status is not S.DESTROYED:
            error.message += f" (sandbox {sb.id} is {sb.status})"

    async def _destroy_system(self, sb: SandboxInfo, cause: str, message: str) -> SandboxInfo:
        """Destroy a sandbox as sandlot's own duty, decided and receipted as such."""
        async with self._gated(system_actor(sb.tenant), "destroy", sb, reason=cause):
            return await self._destroy(sb, cause, message)

    async def _discard_interrupted(self, sandbox_id: str) -> None:
        try:
            sb = await self.store.get(sandbox_id)
        except NotFound:
            return
        if sb.status is S.DESTROYED:
            return
        try:
            message = "its creation was interrupted; what it had made was destroyed"
            await self._destroy_system(sb, "interrupted", message)
        except SandboxError as e:
            # Then it stays failed, kept for inspection, and the sweep destroys it later.
            _log.warning("could not destroy interrupted creation %s: %s", sandbox_id, e)

    async def _create(
        self,
        sandbox_id: str,
        name: str,
        impl: Backend,
        spec: SandboxSpec,
        actor: Actor,
        on_setup_output: OutputCallback | None,
        outcome: _Outcome,
    ) -> SandboxInfo:
        if outcome.lease is not None:
            journal = self._journal()
            outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sandbox_id)
            # ALLOCATING is durable before the backend is asked: recovery looks the name up
            # instead of allocating a second time.
            outcome.lease = await self._jr(
                journal.allocating, outcome.lease, backend=name, name=sandbox_id
            )
        now = utcnow()
        sb = SandboxInfo(
            id=sandbox_id,
            backend=name,
            host=self.host if impl.capabilities().host_local else None,
            status=S.PROVISIONING,
            spec=spec,
            tenant=actor.tenant,
            created_at=now,
            updated_at=now,
            last_active_at=now,
            expires_at=now + timedelta(seconds=spec.timeout) if spec.timeout else None,
            transition_owner=self.instance,
            transition_deadline=now + timedelta(seconds=self.create_timeout),
        )
        sb = await self.store.insert(sb)
        # The record exists before the backend is asked, so a crash in between leaves a record
        # that reconcile settles, never a backend sandbox nobody knows about.
        try:
            ref = await impl.create(sb.id, spec)
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"backend create failed: {e}")
            raise
        if outcome.lease is not None:
            outcome.lease = await self._jr(
                self._journal().allocated, outcome.lease, provider_ref=ref
            )
        sb = await self._cas(sb, status=S.SETTING_UP, backend_ref=ref)
        tail = _Tail()

        async def setup_output(chunk: OutputChunk) -> None:
            tail.feed(chunk.data)
            if on_setup_output is not None:
                result = on_setup_output(chunk)
                if result is not None:
                    await result

        try:
            channel = await self._channel(sb)
            await channel.mkdir(spec.workdir)
            if spec.git is not None:
                # The caller's spec, not the stored one: the credential is never stored.
                await self._clone(sb, spec.git, actor, channel, setup_output, tail)
            for i, step in enumerate(spec.setup_steps()):
                result = await self._run(sb, actor, channel, step, setup_output)
                if result.exit_code != 0:
                    msg = f"setup step {i + 1} exited with {result.exit_code}"
                    await self._fail(sb, "setup_failed", msg, tail.lines())
                    raise ExecFailed(msg, result)
            sb = await self._cas(sb, status=S.STARTING, setup_done=True)
            if spec.start is not None:
                await self._launch_main(sb, actor, channel, spec.start)
            sb = await self._cas(
                sb, status=S.RUNNING, transition_owner=None, transition_deadline=None
            )
        except Conflict:
            current = await self.store.get(sb.id)
            msg = f"sandbox {sb.id} was {current.status} while being created"
            raise InvalidState(msg, id=sb.id) from None
        except ExecFailed:
            raise
        except SandboxError as e:
            await self._fail(sb, "backend_error", str(e), tail.lines())
            raise
        for port in spec.ports:
            async with self._gated(actor, "port.expose", sb, port=port):
                sb = await self._expose(sb, port)
        return sb

    def _check_capabilities(self, impl: Backend, spec: SandboxSpec) -> None:
        """Refuse, before anything is made, what the backend could not enforce."""
        caps = impl.capabilities()
        kind = spec.network if isinstance(spec.network, str) else "allowlist"
        if kind not in caps.network:
            msg = (
                f"backend {impl.name!r} cannot enforce network policy {kind!r} "
                f"(it enforces: {', '.join(sorted(caps.network)) or 'none'})"
            )
            if kind in caps.missing:
                msg += f": {caps.missing[kind]}"
            raise NotSupported(msg)
        asked = {k for k, v in spec.resources.model_dump().items() if v is not None}
        missing = sorted(asked - caps.limits)
        if missing:
            msg = f"backend {impl.name!r} cannot enforce resource limits: {', '.join(missing)}"
            why = sorted({caps.missing[m] for m in missing if m in caps.missing})
            if why:
                msg += f" ({'; '.join(why)})"
            raise NotSupported(msg)
        if spec.image is not None and not caps.images:
            msg = f"backend {impl.name!r} does not support images"
            raise NotSupported(msg)
        if spec.ports and not caps.ports:
            msg = f"backend {impl.name!r} cannot expose ports"
            raise NotSupported(msg)

    async def _clone(
        self,
        sb: SandboxInfo,
        git: GitSource,
        actor: Actor,
        channel: Channel,
        on_output: OutputCallback,
        tail: _Tail,
    ) -> None:
        env = {"GIT_TERMINAL_PROMPT": "0"}
        if git.auth:
            # Passed through the environment for this one command: it is never written into the
            # repository's config and never appears in an argv.
            env |= {
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "http.extraHeader",
                "GIT_CONFIG_VALUE_0": f"Authorization: {git.auth}",
            }
        depth = ["--depth", str(git.depth)] if git.depth else []
        workdir = sb.spec.workdir
        steps: list[list[str]] = [["git", "clone", *depth, "--", git.url, workdir]]
        if git.revision:
            steps += [
                ["git", "-C", workdir, "fetch", *depth, "origin", git.revision],
                ["git", "-C", workdir, "checkout", "-q", "FETCH_HEAD"],
            ]
        for argv in steps:
            # The gate sees the command without the credential (it is in env, not decided on).
            async with self._gated(actor, "exec", sb, command=argv, cwd="/") as outcome:
                result = await channel.exec(
                    argv, cwd="/", env=self._env(sb, env), on_output=on_output
                )
                outcome.exit_code = result.exit_code
            if result.exit_code != 0:
                msg = (
                    f"git {argv[1] if argv[1] != '-C' else argv[3]} exited with {result.exit_code}"
                )
                await self._fail(sb, "git_failed", msg, tail.lines())
                raise ExecFailed(msg, result)

    async def _launch_main(
        self, sb: SandboxInfo, actor: Actor, channel: Channel, command: Command
    ) -> None:
        argv, cwd, env = command_argv(command)
        workdir = cwd or sb.spec.workdir
        async with self._gated(actor, "process.start", sb, command=argv, cwd=workdir, env=env):
            await channel.start_process(
                argv, cwd=workdir, env=self._env(sb, env), name="main", log_path=MAIN_LOG
            )

    # -- commands and files -----------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        command: Command | Sequence[str],
        *,
        actor: Actor = LOCAL_ACTOR,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        check: bool = False,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        collect_output: bool = True,
    ) -> ExecResult:
        """Run a command to completion; output streams to ``on_output`` and is collected
        (``collect_output=False``: only streamed, so output of any size passes in bounded
        memory; the result's ``stdout``/``stderr`` are then empty; under an idempotency key
        the output is always kept, since a repeat returns it).

        ``check=True`` raises ``ExecFailed`` (carrying the result) on a non-zero exit. With an
        ``idempotency_key`` the command runs at most once: a repeat returns the first result
        (its output replayed to ``on_output``), and one whose first attempt died with its
        process reports the outcome as unknown.
        """
        if timeout is not None and timeout <= 0:
            msg = f"timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, command, cwd, env
        )
        begun: Intent | _Replay | None = None
        if idempotency_key is not None:
            request: dict[str, JsonValue] = {
                "sandbox_id": sb.id,
                "command": shown if isinstance(shown, str) else list[JsonValue](shown),
                "cwd": workdir,
                "env": dict(extra_env),
                "timeout": timeout,
                "stdin": _stdin_identity(stdin),
            }
            begun = await self._begin_intent(actor, "exec", request, idempotency_key)
            if isinstance(begun, _Replay):
                result = ExecResult.model_validate(begun.result)
                await _replay_output(result, on_output)
                if check and result.exit_code != 0:
                    msg = f"command exited with {result.exit_code}: {' '.join(argv)[:200]}"
                    raise ExecFailed(msg, result)
                return result
        async with self._gated(
            actor, "exec", sb, intent=_fresh(begun), command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            if outcome.lease is not None:
                journal = self._journal()
                outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sb.id)
                # RUNNING before the command is sent: after a crash, an intent found here has
                # an unknown outcome and is never sent again.
                outcome.lease = await self._jr(journal.advance, outcome.lease, "RUNNING")
            channel = await self._channel(sb)
            keep = collect_output or idempotency_key is not None
            counted = _CountedOutput(on_output)
            result = await self._while_active(
                sb,
                channel.exec(
                    argv,
                    cwd=workdir,
                    env=self._env(sb, extra_env),
                    timeout=timeout,
                    stdin=stdin,
                    on_output=counted.feed,
                    collect=keep,
                ),
            )
            outcome.exit_code = result.exit_code
            outcome.output_hash = counted.output_hash()
            outcome.detail = {
                "duration_ms": round(result.duration_ms, 3),
                "timed_out": result.timed_out,
                **counted.summary(),
            }
            outcome.result = result.model_dump(mode="json")
        await self._touch(sb)
        if check and result.exit_code != 0:
            msg = f"command exited with {result.exit_code}: {' '.join(argv)[:200]}"
            raise ExecFailed(msg, result)
        return result

    async def read_file(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> bytes:
        """A whole file's bytes (for large files use :meth:`stream_file`)."""
        return b"".join(
            [
                c
                async for c in self.stream_file(
                    sandbox_id, path, actor=actor, auto_resume=auto_resume
                )
            ]
        )

    async def stream_file(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> AsyncIterator[bytes]:
        """A file's bytes in chunks."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.read", sb, path=path) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            digest = hashlib.sha256()
            size = 0
            async with self._resolved(actor, "fs.read", sb, channel, path) as real:
                async for chunk in channel.read_file(real, nofollow=True):
                    digest.update(chunk)
                    size += len(chunk)
                    yield chunk
            outcome.detail = {"sha256": digest.hexdigest(), "size": size}
        await self._touch(sb)

    async def write_files(
        self,
        sandbox_id: str,
        files: Mapping[str, FileBody],
        *,
        actor: Actor = LOCAL_ACTOR,
        mode: int | None = None,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> builtins.list[FileInfo]:
        """Create or replace files (parents are made); strings are written as UTF-8, and an
        async iterable of chunks is streamed (never held whole in memory).

        Each file is decided by the policy on its own. With an ``idempotency_key`` a repeat
        of the same call (same paths and contents) returns the first call's result; a streamed
        body counts by its ``digests`` entry (``sha256:…``, when the caller knows it) or else
        as "a stream".
        """
        for path in files:
            _check_path(path)
        if not files:
            return []
        bodies = {p: d.encode() if isinstance(d, str) else d for p, d in files.items()}
        digests = dict(digests or {})
        spools: list[_Spool] = []
        try:
            if idempotency_key is not None:
                for path, body in bodies.items():
                    if not isinstance(body, bytes) and path not in digests:
                        # A key remembers what was written: a stream is spooled (to disk past
                        # a MiB) to learn its hash first, so the same key with other content is
                        # a Conflict, never a silent replay.
                        spools.append(spool := _Spool())
                        digests[path] = await spool.fill(body)
                        bodies[path] = spool
            return await self._write_files(
                sandbox_id, bodies, actor, mode, auto_resume, idempotency_key, digests
            )
        finally:
            for spool in spools:
                spool.close()

    async def _write_files(
        self,
        sandbox_id: str,
        bodies: dict[str, bytes | AsyncIterable[bytes]],
        actor: Actor,
        mode: int | None,
        auto_resume: bool,
        idempotency_key: str | None,
        digests: Mapping[str, str],
    ) -> builtins.list[FileInfo]:
        sb = await self._current(sandbox_id, actor)
        begun: Intent | _Replay | None = None
        if idempotency_key is not None:
            request: dict[str, JsonValue] = {
                "sandbox_id": sb.id,
                "files": {p: _body_identity(b, digests.get(p)) for p, b in bodies.items()},
                "mode": mode,
            }
            begun = await self._begin_intent(actor, "fs.write", request, idempotency_key)
            if isinstance(begun, _Replay):
                assert isinstance(begun.result, dict)
                files_done = begun.result["files"]
                assert isinstance(files_done, list)
                return [FileInfo.model_validate(f) for f in files_done]
        (first, *rest) = bodies.items()
        infos: builtins.list[FileInfo] = []

        async def write(path: str, body: bytes | AsyncIterable[bytes], outcome: _Outcome) -> None:
            nonlocal sb
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(
                actor, "fs.write", sb, channel, path, follow_last=False
            ) as real:
                await write_at(channel, path, real, body, outcome)

        async def write_at(
            channel: Channel,
            path: str,
            real: str,
            body: bytes | AsyncIterable[bytes],
            outcome: _Outcome,
        ) -> None:
            if isinstance(body, bytes):
                info = await self._channel_call(
                    sb, channel.write_file(real, body, mode=mode, nofollow=True)
                )
                infos.append(info.model_copy(update={"path": path}))
                outcome.output = body
                return
            digest = hashlib.sha256()

            async def hashed() -> AsyncIterator[bytes]:
                async for chunk in body:
                    digest.update(chunk)
                    yield chunk

            info = await self._channel_call(
                sb, channel.write_file(real, hashed(), mode=mode, nofollow=True)
            )
            infos.append(info.model_copy(update={"path": path}))
            outcome.output_hash = "sha256:" + digest.hexdigest()

        # The first file's decision also authorizes the intent; the others are decided inside
        # its block, so a later denial fails the call as a whole (and its replays alike).
        async with self._gated(
            actor, "fs.write", sb, intent=_fresh(begun), path=first[0]
        ) as outcome:
            if outcome.lease is not None:
                journal = self._journal()
                outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sb.id)
                outcome.lease = await self._jr(journal.advance, outcome.lease, "RUNNING")
            await write(*first, outcome)
            for path, body in rest:
                async with self._gated(actor, "fs.write", sb, path=path) as inner:
                    await write(path, body, inner)
            outcome.result = {"files": [i.model_dump(mode="json") for i in infos]}
        await self._touch(sb)
        return infos

    async def list_files(
        self, sandbox_id: str, path: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> builtins.list[FileInfo]:
        """A directory's entries."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.list", sb, path=path) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(actor, "fs.list", sb, channel, path) as real:
                entries = await self._channel_call(sb, channel.list_files(real, nofollow=True))
            outcome.detail = {"entries": len(entries)}
            return entries

    async def remove_file(
        self,
        sandbox_id: str,
        path: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        recursive: bool = False,
        auto_resume: bool = True,
    ) -> None:
        """Remove a file (or a tree with ``recursive``)."""
        _check_path(path)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "fs.remove", sb, path=path, recursive=recursive):
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            async with self._resolved(
                actor, "fs.remove", sb, channel, path, follow_last=False, recursive=recursive
            ) as real:
                await self._channel_call(
                    sb, channel.remove(real, recursive=recursive, nofollow=True)
                )

    @contextlib.asynccontextmanager
    async def _resolved(
        self,
        actor: Actor,
        action: str,
        sb: SandboxInfo,
        channel: Channel,
        path: str,
        *,
        follow_last: bool = True,
        recursive: bool = False,
    ) -> AsyncIterator[str]:
        """``path`` as the sandbox resolves it; decided again when symlinks lead elsewhere.

        The gate decided on the path as written, but a link planted inside (``/workspace/e``
        -> ``/etc``) would carry the operation somewhere else, so the resolved path is decided
        too (its receipt names it), and the channel is then told to act on exactly that path,
        following no link (one swapped in after this check fails the operation).
        """
        real = await self._channel_call(sb, channel.resolve(path, follow_last=follow_last))
        if real == normalize_path(path):
            yield real
            return
        async with self._gated(actor, action, sb, path=real, recursive=recursive):
            yield real

    async def logs(
        self,
        sandbox_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        follow: bool = False,
        offset: int = 0,
        auto_resume: bool = True,
    ) -> AsyncIterator[bytes]:
        """The main process's output log, from byte ``offset``; ``follow`` keeps tailing."""
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "fs.read", sb, path=MAIN_LOG):
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            channel = await self._channel(sb)
            try:
                async for chunk in channel.follow_file(MAIN_LOG, offset=offset, follow=follow):
                    yield chunk
            except NotFound:
                return

    # -- lifecycle --------------------------------------------------------------------------

    async def stop(self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR) -> SandboxInfo:
        """End every process in the sandbox and keep its filesystem."""
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "stop", sb):
            return await self._stop(sb, "stopped", "stopped by request")

    async def _stop(
        self,
        sb: SandboxInfo,
        cause: str,
        message: str,
        still_due: Callable[[SandboxInfo], bool] | None = None,
    ) -> SandboxInfo:
        return await self._drive([sb.id], self._stop_body(sb, cause, message, still_due))

    async def _stop_body(
        self,
        sb: SandboxInfo,
        cause: str,
        message: str,
        still_due: Callable[[SandboxInfo], bool] | None = None,
    ) -> SandboxInfo:
        sb = await self._settled(sb)
        if sb.status in (S.STOPPED, S.FAILED):
            return sb
        if sb.status is S.DESTROYED:
            msg = f"sandbox {sb.id} is destroyed"
            raise InvalidState(msg, id=sb.id)
        last = await self._last_output(sb)
        sb = await self._drain_egress(sb)
        if still_due is not None and not still_due(sb):
            # Checked on the very record the compare-and-set below swaps: a keep_alive after
            # it makes that swap fail instead of being overwritten.
            msg = f"sandbox {sb.id} is no longer due to stop"
            raise Conflict(msg, id=sb.id)
        sb = await self._begin(sb, {S.RUNNING}, S.STOPPING)
        impl = self._backend_of(sb)
        try:
            if sb.backend_ref is not None:
                await impl.stop(sb.backend_ref)
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"stop failed: {e}", last)
            raise
        finally:
            await self._drop_channel(sb.id)
        return await self._cas(
            sb,
            status=S.STOPPED,
            transition_owner=None,
            transition_deadline=None,
            death=DeathCertificate(cause=cause, message=message, last_output=last),
        )

    async def resume(self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR) -> SandboxInfo:
        """Boot a stopped sandbox and relaunch its ``resume`` command; retry a failed one
        (without running setup again)."""
        sb = await self.get(sandbox_id, actor=actor)
        self._require_here(sb)
        async with self._gated(actor, "resume", sb):
            sb = await self._settled(sb)
            if sb.status is S.RUNNING:
                # Only if it really runs: a sandbox whose init died is recorded stopped here
                # and started below.
                sb = await self._checked(sb)
            if sb.status is S.RUNNING:
                if _past_ttl(sb, utcnow()):
                    sb = await self._renew_ttl(sb)
                return sb
            if sb.status not in (S.STOPPED, S.FAILED):
                msg = f"sandbox {sb.id} is {sb.status} and cannot be resumed"
                raise InvalidState(msg, id=sb.id)
            # A TTL that ran out, or a failed creation's time for inspection, starts afresh.
            expiry = _resumed_expiry(sb, utcnow())
            try:
                sb = await self._begin(sb, {S.STOPPED, S.FAILED}, S.RESUMING)
            except Conflict:
                return await self._ready(sb.id, actor, auto_resume=False)
            return await self._do_resume(sb, actor, expiry)

    async def _do_resume(
        self, sb: SandboxInfo, actor: Actor, expiry: datetime | None
    ) -> SandboxInfo:
        return await self._drive([sb.id], self._resume_body(sb, actor, expiry))

    async def _resume_body(
        self, sb: SandboxInfo, actor: Actor, expiry: datetime | None
    ) -> SandboxInfo:
        impl = self._backend_of(sb)
        await self._drop_channel(sb.id)
        try:
            if sb.backend_ref is None:
                # Creation failed before the backend answered: try to make it again. The
                # backend derives names from the id, so an earlier half-made one is adopted.
                ref = await impl.create(sb.id, sb.spec)
                sb = await self._cas(sb, backend_ref=ref)
            else:
                state = await impl.inspect(sb.backend_ref)
                if state.state == "running":
                    await impl.stop(sb.backend_ref)
                elif state.state == "missing":
                    await self._fail(sb, "vanished", "the backend no longer has this sandbox")
                    msg = f"sandbox {sb.id} vanished from backend {sb.backend}"
                    raise InvalidState(msg, id=sb.id)
                await impl.start(sb.backend_ref, sb.spec)
            channel = await self._channel(sb)
            command = sb.spec.resume_command()
            if command is not None:
                await self._launch_main(sb, actor, channel, command)
        except InvalidState:
            raise
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"resume failed: {e}")
            raise
        # Running again: the last death is history (its receipts keep it).
        return await self._cas(
            sb,
            status=S.RUNNING,
            transition_owner=None,
            transition_deadline=None,
            error=None,
            death=None,
            expires_at=expiry,
            metadata={k: v for k, v in sb.metadata.items() if k != _KEPT},
            last_active_at=utcnow(),
        )

    async def _renew_ttl(self, sb: SandboxInfo) -> SandboxInfo:
        for _ in range(50):
            try:
                return await self._cas(sb, expires_at=_resumed_expiry(sb, utcnow()))
            except Conflict:
                sb = await self.store.get(sb.id)
        msg = f"sandbox {sb.id} keeps changing; resume gave up"
        raise Conflict(msg)

    async def destroy(
        self,
        sandbox_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        idempotency_key: str | None = None,
        forget_host: bool = False,
    ) -> SandboxInfo:
        """Remove the sandbox from its backend. The record stays (hidden from ``list``) with a
        death certificate; destroying twice is fine.

        A sandbox of another host is destroyed by that host; ``forget_host=True`` is for a host
        that is gone for good: the record is closed (cause ``host_lost``) without reaching any
        runtime, and should that host come back, its reconcile reaps what it still has.
        """
        sb = await self.get(sandbox_id, actor=actor)
        if forget_host:
            return await self._forget(sb, actor)
        begun = await self._begin_intent(actor, "destroy", {"sandbox_id": sb.id}, idempotency_key)
        if isinstance(begun, _Replay):
            return SandboxInfo.model_validate(begun.result)
        async with self._gated(actor, "destroy", sb, intent=begun) as outcome:
            if outcome.lease is not None:
                journal = self._journal()
                outcome.lease = await self._jr(journal.attach_sandbox, outcome.lease, sb.id)
                outcome.lease = await self._jr(journal.advance, outcome.lease, "CLEANING")
            info = await self._destroy(sb, "destroyed", "destroyed by request")
            outcome.result = info.model_dump(mode="json")
            outcome.final_state = "CLEANED"
            return info

    async def _destroy(self, sb: SandboxInfo, cause: str, message: str) -> SandboxInfo:
        return await self._drive([sb.id], self._destroy_body(sb, cause, message))

    async def _forget(self, sb: SandboxInfo, actor: Actor) -> SandboxInfo:
        if sb.status is S.DESTROYED:
            return sb
        if self._mine(sb):
            msg = f"sandbox {sb.id} lives on this host ({self.host}): destroy it plainly"
            raise InvalidRequest(msg, id=sb.id)
        message = (
            f"its host {sb.host} was given up for lost (from {self.host}); that host's "
            "reconcile reaps whatever of it is left there"
        )
        async with self._gated(actor, "destroy", sb, reason="host_lost"):
            for _ in range(50):
                try:
                    return await self._cas(
                        sb,
                        status=S.DESTROYED,
                        transition_owner=None,
                        transition_deadline=None,
                        ports=[],
                        death=DeathCertificate(
                            cause="host_lost",
                            message=message,
                            last_output=sb.death.last_output if sb.death else [],
                        ),
                    )
                except Conflict:
                    sb = await self.store.get(sb.id)
                    if sb.status is S.DESTROYED:
                        return sb
        msg = f"sandbox {sb.id} keeps changing; destroy gave up"
        raise Conflict(msg)

    async def _destroy_body(self, sb: SandboxInfo, cause: str, message: str) -> SandboxInfo:
        while True:
            if sb.status is S.DESTROYED:
                return sb
            # Before the record changes: another host's runtime would keep running.
            self._require_here(sb)
            last = await self._last_output(sb) if sb.status is S.RUNNING else []
            if sb.death is not None and not last:
                last = sb.death.last_output
            try:
                # Destroy preempts any transition: a creator or resumer sees its next
                # compare-and-set fail and stops.
                sb = await self._cas(
                    sb,
                    status=S.DESTROYING,
                    transition_owner=self.instance,
                    transition_deadline=utcnow() + timedelta(seconds=self.transition_timeout),
                )
                break
            except Conflict:
                sb = await self.store.get(sb.id)
        await self._drop_channel(sb.id)
        sb = await self._drain_egress(sb)
        impl = self._backend_of(sb)
        ref = sb.backend_ref
        if ref is None:
            # Creation may have reached the backend without recording the ref; ask the
            # backend for anything it holds under this id.
            with contextlib.suppress(SandboxError):
                ref = (await impl.list_owned()).get(sb.id)
        if ref is not None:
            await impl.destroy(ref)
            if self.journal is not None:
                # Whichever way it goes (a keyed or plain destroy, reconcile, a TTL), the
                # allocation of the intent that created it, if any, ends with it.
                await self._jr(self.journal.release, backend=sb.backend, provider_ref=ref)
        return await self._cas(
            sb,
            status=S.DESTROYED,
            transition_owner=None,
            transition_deadline=None,
            ports=[],
            death=DeathCertificate(cause=cause, message=message, last_output=last),
        )

    async def keep_alive(
        self, sandbox_id: str, seconds: float, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Push the TTL out to ``seconds`` from now (never shortens it) and count as activity."""
        if seconds <= 0:
            msg = f"keep_alive needs a positive number of seconds, got {seconds}"
            raise InvalidRequest(msg)
        async with self._gated(actor, "keep_alive", await self.get(sandbox_id, actor=actor)):
            return await self._keep_alive(sandbox_id, seconds, actor)

    async def _keep_alive(self, sandbox_id: str, seconds: float, actor: Actor) -> SandboxInfo:
        for _ in range(50):
            sb = await self.get(sandbox_id, actor=actor)
            if sb.status is S.DESTROYED:
                msg = f"sandbox {sb.id} is destroyed"
                raise InvalidState(msg, id=sb.id)
            until = utcnow() + timedelta(seconds=seconds)
            if sb.expires_at is not None and sb.expires_at > until:
                until = sb.expires_at
            try:
                return await self._cas(
                    sb,
                    expires_at=until if sb.expires_at or sb.spec.timeout else None,
                    last_active_at=utcnow(),
                )
            except Conflict:
                continue
        msg = f"sandbox {sandbox_id} keeps changing; keep_alive gave up"
        raise Conflict(msg)

    # -- snapshots ---------------------------------------------------------------------------

    async def snapshot(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> SnapshotInfo:
        """Save the sandbox's state; new sandboxes can be made from it."""
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        if not impl.capabilities().snapshot:
            msg = f"backend {sb.backend!r} cannot snapshot"
            raise NotSupported(msg)
        snapshot_id = new_id("snap")
        async with self._gated(actor, "snapshot", sb, snapshot_id=snapshot_id) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            assert sb.backend_ref is not None
            ref = await impl.snapshot(sb.backend_ref, snapshot_id)
            outcome.detail = {"size_bytes": ref.size_bytes}
        info = SnapshotInfo(
            id=snapshot_id,
            sandbox_id=sb.id,
            backend=sb.backend,
            ref=ref.ref,
            size_bytes=ref.size_bytes,
            spec=sb.spec,
            metadata=dict(ref.metadata),
        )
        return await self.store.insert_snapshot(info, tenant=sb.tenant)

    async def list_snapshots(
        self, sandbox_id: str | None = None, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first (of one sandbox when given)."""
        return await self.store.list_snapshots(
            sandbox_id=sandbox_id, tenant=None if actor.admin else actor.tenant
        )

    async def delete_snapshot(self, snapshot_id: str, *, actor: Actor = LOCAL_ACTOR) -> None:
        """Remove a snapshot and its data."""
        snap = await self.store.get_snapshot(
            snapshot_id, tenant=None if actor.admin else actor.tenant
        )
        await self._require_snapshot_here(snap)
        target = await self._snapshot_resource(snap, actor)
        async with self._gated(actor, "snapshot.delete", target, snapshot_id=snap.id):
            await self._backend(snap.backend).delete_snapshot(_snapshot_ref(snap))
            await self.store.delete_snapshot(snap.id)

    async def _require_snapshot_here(self, snap: SnapshotInfo) -> None:
        """A host-local backend's snapshot lives on the host of the sandbox it was taken
        from: deleting or forking it elsewhere would find nothing (or drop only the record)."""
        if not self._backend(snap.backend).capabilities().host_local:
            return
        with contextlib.suppress(NotFound):
            self._require_here(await self.store.get(snap.sandbox_id))

    async def _snapshot_resource(self, snap: SnapshotInfo, actor: Actor) -> Resource:
        """What a snapshot operation targets: the sandbox it was taken from (which may be gone)."""
        try:
            return Resource.of(await self.store.get(snap.sandbox_id))
        except NotFound:
            spec = snap.spec or SandboxSpec()
            return Resource.for_spec(
                snap.sandbox_id, spec, backend=snap.backend, tenant=actor.tenant
            )

    async def restore(
        self, sandbox_id: str, snapshot_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Put a sandbox back to a snapshot's state (its main process is relaunched)."""
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "restore", sb, snapshot_id=snapshot_id):
            return await self._drive([sb.id], self._restore(sb, snapshot_id, actor))

    async def _restore(self, sb: SandboxInfo, snapshot_id: str, actor: Actor) -> SandboxInfo:
        sb = await self._settled(sb)
        snap = await self.store.get_snapshot(
            snapshot_id, tenant=None if actor.admin else actor.tenant
        )
        if snap.backend != sb.backend:
            msg = f"snapshot {snap.id} is from backend {snap.backend}, sandbox is on {sb.backend}"
            raise InvalidRequest(msg)
        await self._require_snapshot_here(snap)
        impl = self._backend_of(sb)
        if not impl.capabilities().snapshot:
            msg = f"backend {sb.backend!r} cannot restore snapshots"
            raise NotSupported(msg)
        sb = await self._begin(sb, {S.RUNNING, S.STOPPED, S.FAILED}, S.RESUMING)
        await self._drop_channel(sb.id)
        assert sb.backend_ref is not None
        try:
            await impl.restore(sb.backend_ref, _snapshot_ref(snap), sb.spec)
            command = sb.spec.resume_command()
            if command is not None:
                await self._launch_main(sb, actor, await self._channel(sb), command)
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"restore failed: {e}")
            raise
        return await self._cas(
            sb, status=S.RUNNING, transition_owner=None, transition_deadline=None, error=None
        )

    async def fork(
        self,
        source: str,
        count: int = 1,
        *,
        actor: Actor = LOCAL_ACTOR,
        labels: Mapping[str, str] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Make ``count`` new sandboxes from a snapshot id, or from a sandbox id (snapshotted
        first). Each starts with the snapshot's files and runs its ``resume`` command."""
        if not 1 <= count <= 1000:
            msg = f"fork count must be 1..1000, got {count}"
            raise InvalidRequest(msg)
        tenant = None if actor.admin else actor.tenant
        if source.startswith("snap-"):
            snap = await self.store.get_snapshot(source, tenant=tenant)
        else:
            impl = self._backend((await self.get(source, actor=actor)).backend)
            if not impl.capabilities().fork:
                msg = f"backend {impl.name!r} cannot fork"
                raise NotSupported(msg)
            snap = await self.snapshot(source, actor=actor)
        impl = self._backend(snap.backend)
        if not impl.capabilities().fork:
            msg = f"backend {snap.backend!r} cannot fork"
            raise NotSupported(msg)
        await self._require_snapshot_here(snap)
        target = await self._snapshot_resource(snap, actor)
        async with self._gated(actor, "fork", target, snapshot_id=snap.id, count=count) as outcome:
            forked = await self._fork(snap, impl, count, actor, labels)
            outcome.detail = {"sandboxes": [f.id for f in forked]}
            return forked

    async def _fork(
        self,
        snap: SnapshotInfo,
        impl: Backend,
        count: int,
        actor: Actor,
        labels: Mapping[str, str] | None,
    ) -> builtins.list[SandboxInfo]:
        spec = (snap.spec or SandboxSpec()).model_copy(
            update={"labels": {**(snap.spec.labels if snap.spec else {}), **dict(labels or {})}}
        )
        now = utcnow()
        records = [
            SandboxInfo(
                id=new_id("sb"),
                backend=snap.backend,
                host=self.host if impl.capabilities().host_local else None,
                status=S.PROVISIONING,
                spec=spec,
                tenant=actor.tenant,
                setup_done=True,
                created_at=now,
                updated_at=now,
                last_active_at=now,
                expires_at=now + timedelta(seconds=spec.timeout) if spec.timeout else None,
                transition_owner=self.instance,
                transition_deadline=now + timedelta(seconds=self.create_timeout),
                metadata={"forked_from": snap.id},
            )
            for _ in range(count)
        ]
        for r in records:
            await self.store.insert(r)
        return await self._drive(
            [r.id for r in records], self._fork_body(snap, impl, records, spec, actor)
        )

    async def _fork_body(
        self,
        snap: SnapshotInfo,
        impl: Backend,
        records: builtins.list[SandboxInfo],
        spec: SandboxSpec,
        actor: Actor,
    ) -> builtins.list[SandboxInfo]:
        try:
            refs = await impl.fork(_snapshot_ref(snap), [r.id for r in records], spec)
        except SandboxError as e:
            for r in records:
                await self._fail(r, "backend_error", f"fork failed: {e}")
            raise
        out = []
        for r, ref in zip(records, refs, strict=True):
            r = await self._cas(r, status=S.STARTING, backend_ref=ref)
            command = spec.resume_command()
            if command is not None:
                await self._launch_main(r, actor, await self._channel(r), command)
            out.append(
                await self._cas(
                    r, status=S.RUNNING, transition_owner=None, transition_deadline=None
                )
            )
        return out

    # -- processes and terminals ---------------------------------------------------------------

    async def start_process(
        self,
        sandbox_id: str,
        command: Command | Sequence[str],
        *,
        actor: Actor = LOCAL_ACTOR,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background and return at once.

        It belongs to the sandbox, not to the caller: it outlives this call and the caller's
        connection, until it exits, is signalled, or the sandbox stops. Its output is kept
        (the last 8 MiB) for :meth:`process_output`; a ``name`` held by a running process is
        a ``Conflict``.
        """
        if name is not None and not name:
            msg = "a process name must not be empty"
            raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, command, cwd, env
        )
        async with self._gated(
            actor, "process.start", sb, command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            info = await self._channel_call(
                sb,
                channel.start_process(argv, cwd=workdir, env=self._env(sb, extra_env), name=name),
            )
            outcome.detail = {"process_id": info.id, "pid": info.pid}
        await self._touch(sb)
        return info

    async def list_processes(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[ProcessInfo]:
        """Background processes (the main process among them), running and recently exited,
        in start order."""
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "process.list", sb, process_id="", signal=0) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            processes = await self._channel_call(sb, channel.list_processes())
            outcome.detail = {"processes": len(processes)}
            return processes

    async def signal_process(
        self,
        sandbox_id: str,
        process_id: str,
        signum: int = 15,
        *,
        actor: Actor = LOCAL_ACTOR,
    ) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree.

        ``InvalidState`` when it already exited; ``NotFound`` for an unknown id.
        """
        self._check_process_id(process_id)
        if not 1 <= signum <= 64:
            msg = f"signal must be a signal number 1..64, got {signum}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(actor, "process.signal", sb, process_id=process_id, signal=signum):
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            await self._channel_call(sb, channel.signal_process(process_id, signum))
        await self._touch(sb)

    async def wait_process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        timeout: float | None = None,
    ) -> ProcessInfo:
        """Wait until a background process exits and its output is complete; its final
        record. ``SandboxTimeout`` when ``timeout`` seconds pass first (it keeps running)."""
        self._check_process_id(process_id)
        if timeout is not None and timeout <= 0:
            msg = f"timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.wait", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            info = await self._channel_call(sb, channel.wait_process(process_id, timeout))
            outcome.exit_code = info.exit_code
            return info

    async def process_output(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        offset: int = 0,
        follow: bool = False,
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset`` on; with ``follow``, keep
        yielding until it exits.

        Chunks are numbered (``seq``) across stdout and stderr, so a reader resumes after the
        last one it has. Output older than the sandbox keeps (the last 8 MiB) is gone: the
        first chunk's ``seq`` is then greater than ``offset``.
        """
        self._check_process_id(process_id)
        if offset < 0:
            msg = f"offset must not be negative, got {offset}"
            raise InvalidRequest(msg)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.output", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            sent = 0
            async for chunk in channel.process_output(process_id, offset=offset, follow=follow):
                sent += 1
                yield chunk
            outcome.detail = {"chunks": sent}

    async def write_stdin(
        self,
        sandbox_id: str,
        process_id: str,
        data: bytes,
        *,
        actor: Actor = LOCAL_ACTOR,
        close: bool = False,
    ) -> None:
        """Feed a background process's standard input (then close it, with ``close``).

        Returns once every byte is in the process's stdin pipe. ``InvalidState`` when its
        stdin was closed or it exited.
        """
        self._check_process_id(process_id)
        sb = await self._current(sandbox_id, actor)
        async with self._gated(
            actor, "process.stdin", sb, process_id=process_id, signal=0
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            await self._channel_call(sb, channel.write_stdin(process_id, data, close=close))
            # The receipt records what went in (its hash), as an exec's records its output.
            outcome.output = data
            outcome.detail = {"bytes": len(data), "closed": close}
        await self._touch(sb)

    async def open_pty(
        self,
        sandbox_id: str,
        command: Command | Sequence[str] | None = None,
        *,
        actor: Actor = LOCAL_ACTOR,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> PtySession:
        """Start a program (default ``sh``) on a new terminal inside the sandbox.

        The terminal lives until its program exits or it is closed (``close`` hangs up: the
        program gets SIGHUP). Keystrokes and output count as activity for idle timeouts. What
        is typed into it is not decided by the policy (only opening it is): a policy that must
        see every command denies ``pty.open``.
        """
        for what, n in (("rows", rows), ("cols", cols)):
            if not 1 <= n <= 65535:
                msg = f"{what} must be 1..65535, got {n}"
                raise InvalidRequest(msg)
        sb, argv, workdir, extra_env, shown = await self._launch(
            sandbox_id, actor, ["sh"] if command is None else command, cwd, env
        )
        async with self._gated(
            actor, "pty.open", sb, command=shown, cwd=workdir, env=extra_env
        ) as outcome:
            sb = await self._ready(sandbox_id, actor, True, sb)
            channel = await self._channel(sb)
            session = await self._channel_call(
                sb,
                channel.open_pty(
                    argv, rows=rows, cols=cols, cwd=workdir, env=self._env(sb, extra_env)
                ),
            )
            outcome.detail = {"pty_id": session.id, "rows": rows, "cols": cols}
        await self._touch(sb)
        return Manager._Terminal(self, sb.id, session)

    @staticmethod
    def _check_process_id(process_id: str) -> None:
        if not process_id or len(process_id) > 256 or "\x00" in process_id:
            msg = f"not a process id: {process_id!r}"
            raise InvalidRequest(msg)

    @final
    class _Terminal:
        """A channel's terminal whose use counts as activity, so a sandbox someone is typing
        into (or watching output in) is not stopped as idle."""

        def __init__(self, manager: Manager, sandbox_id: str, session: PtySession) -> None:
            self._manager = manager
            self._sandbox_id = sandbox_id
            self._session = session
            self._touched = time.monotonic()

        @property
        def id(self) -> str:
            return self._session.id

        async def _touch(self) -> None:
            now = time.monotonic()
            if now - self._touched < TOUCH_EVERY:
                return
            self._touched = now
            # Bookkeeping only: a sandbox gone meanwhile shows in the terminal's own calls.
            with contextlib.suppress(SandboxError):
                await self._manager.store.touch(self._sandbox_id, utcnow())

        async def write(self, data: bytes) -> None:
            await self._session.write(data)
            await self._touch()

        async def resize(self, rows: int, cols: int) -> None:
            for what, n in (("rows", rows), ("cols", cols)):
                if not 1 <= n <= 65535:
                    msg = f"{what} must be 1..65535, got {n}"
                    raise InvalidRequest(msg)
            await self._session.resize(rows, cols)

        async def read(self) -> bytes:
            data = await self._session.read()
            if data:
                await self._touch()
            return data

        async def wait(self) -> int:
            return await self._session.wait()

        async def close(self) -> None:
            await self._session.close()

    # -- ports --------------------------------------------------------------------------------

    async def reset(
        self, sandbox_id: str, snapshot_id: str | None = None, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Return the sandbox to a snapshot (default: its baseline, as created) and verify it.

        If a verification source disagrees, the sandbox is marked ``failed`` (cause
        ``verification``, the report in ``metadata["verification"]``) and ``VerificationFailed``
        is raised naming the sources.
        """
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        if not impl.capabilities().reset:
            msg = f"backend {sb.backend!r} cannot reset"
            raise NotSupported(msg)
        async with self._gated(actor, "reset", sb, snapshot_id=snapshot_id) as outcome:
            snap = None
            if snapshot_id is not None:
                snap = await self.store.get_snapshot(
                    snapshot_id, tenant=None if actor.admin else actor.tenant
                )
                if snap.backend != sb.backend:
                    msg = f"snapshot {snap.id} is from backend {snap.backend}, sandbox is on {sb.backend}"
                    raise InvalidRequest(msg)
            sb = await self._settled(sb)
            return await self._drive([sb.id], self._reset_body(sb, impl, snap, actor, outcome))

    async def _reset_body(
        self,
        sb: SandboxInfo,
        impl: Backend,
        snap: SnapshotInfo | None,
        actor: Actor,
        outcome: _Outcome,
    ) -> SandboxInfo:
        sb = await self._begin(sb, {S.RUNNING, S.STOPPED, S.FAILED}, S.RESUMING)
        await self._drop_channel(sb.id)
        assert sb.backend_ref is not None
        try:
            report = await impl.reset(
                sb.backend_ref, None if snap is None else _snapshot_ref(snap), sb.spec
            )
        except VerificationFailed as e:
            await self._fail(sb, "verification", e.message)
            current = await self.store.get(sb.id)
            await self._cas(current, metadata={**current.metadata, "verification": e.details})
            raise
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"reset failed: {e}")
            raise
        outcome.detail = {"verification": report}
        command = sb.spec.resume_command()
        if command is not None:
            await self._launch_main(sb, actor, await self._channel(sb), command)
        return await self._cas(
            sb,
            status=S.RUNNING,
            transition_owner=None,
            transition_deadline=None,
            error=None,
            metadata={**sb.metadata, "verification": report},
        )

    # -- network --------------------------------------------------------------------------------

    def _network_control(self, sb: SandboxInfo) -> NetworkControl:
        impl = self._backend_of(sb)
        if not isinstance(impl, NetworkControl):
            msg = f"backend {sb.backend!r} has no egress control"
            raise NotSupported(msg)
        return impl

    async def update_network(
        self, sandbox_id: str, policy: NetworkPolicy | str, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Change a running sandbox's egress policy; new connections follow it within a second."""
        raw = policy.model_dump() if isinstance(policy, NetworkAllowlist) else policy
        network = parse_model(SandboxSpec, {"network": raw}).network
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        kind = network if isinstance(network, str) else "allowlist"
        caps = impl.capabilities()
        if kind not in caps.network:
            msg = f"backend {sb.backend!r} cannot enforce network policy {kind!r}"
            if kind in caps.missing:
                msg += f": {caps.missing[kind]}"
            raise NotSupported(msg)
        control = self._network_control(sb)
        policy_json = network if isinstance(network, str) else network.model_dump(mode="json")
        async with self._gated(actor, "network.update", sb, network=policy_json):
            sb = await self._ready(sandbox_id, actor, True, sb)
            assert sb.backend_ref is not None
            await control.update_network(sb.backend_ref, network)
            for _ in range(50):
                try:
                    return await self._cas(sb, spec=sb.spec.model_copy(update={"network": network}))
                except Conflict:
                    sb = await self.store.get(sb.id)
            msg = f"sandbox {sb.id} keeps changing; update_network gave up"
            raise Conflict(msg)

    async def network_log(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision logged for the sandbox (and new ones become receipts)."""
        sb = await self.get(sandbox_id, actor=actor)
        control = self._network_control(sb)
        _require_live(sb, "its egress log went with it; the decisions are in the receipts")
        await self._drain_egress(sb)
        assert sb.backend_ref is not None
        events, _ = await anyio.to_thread.run_sync(control.network_events, sb.backend_ref, 0)
        return events

    async def suggest_network(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to (record mode)."""
        sb = await self.get(sandbox_id, actor=actor)
        control = self._network_control(sb)
        _require_live(sb, "its egress log went with it")
        assert sb.backend_ref is not None
        return await anyio.to_thread.run_sync(control.suggest_network, sb.backend_ref)

    async def _drain_egress(self, sb: SandboxInfo) -> SandboxInfo:
        """Turn egress events logged since the last drain into ``network.egress`` receipts;
        the record as it is afterwards."""
        impl = self._backend_of(sb)
        if self.gate is None or not isinstance(impl, NetworkControl) or sb.backend_ref is None:
            return sb
        offset = sb.metadata.get("egress_offset", 0)
        start = offset if isinstance(offset, int) else 0
        try:
            events, nxt = await anyio.to_thread.run_sync(impl.network_events, sb.backend_ref, start)
        except SandboxError:
            return sb
        if not events:
            return sb
        await self.gate.record_egress(sb.tenant, sb.id, events)
        for _ in range(50):
            try:
                return await self._cas(sb, metadata={**sb.metadata, "egress_offset": nxt})
            except Conflict:
                sb = await self.store.get(sb.id)
        return sb

    async def expose_port(
        self, sandbox_id: str, port: int, *, actor: Actor = LOCAL_ACTOR
    ) -> PortMapping:
        """Publish a sandbox port on the host."""
        if not 1 <= port <= 65535:
            msg = f"port {port} is outside 1..65535"
            raise InvalidRequest(msg)
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "port.expose", sb, port=port):
            sb = await self._ready(sandbox_id, actor, True, sb)
            sb = await self._expose(sb, port)
            return next(p for p in sb.ports if p.port == port)

    async def _expose(self, sb: SandboxInfo, port: int) -> SandboxInfo:
        impl = self._backend_of(sb)
        if not impl.capabilities().ports:
            msg = f"backend {sb.backend!r} cannot expose ports"
            raise NotSupported(msg)
        assert sb.backend_ref is not None
        mapping = await impl.expose_port(sb.backend_ref, port)
        for _ in range(50):
            ports = [p for p in sb.ports if p.port != port] + [mapping]
            try:
                return await self._cas(sb, ports=sorted(ports, key=lambda p: p.port))
            except Conflict:
                sb = await self.store.get(sb.id)
        msg = f"sandbox {sb.id} keeps changing; expose_port gave up"
        raise Conflict(msg)

    async def list_ports(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[PortMapping]:
        """Published ports."""
        return list((await self.get(sandbox_id, actor=actor)).ports)

    # -- housekeeping ------------------------------------------------------------------------

    async def record_egress(self) -> int:
        """Turn the egress decisions of every running sandbox, logged since the last time, into
        ``network.egress`` receipts (the server does this periodically; stop and destroy do it
        for their sandbox). The number of sandboxes looked at."""
        running = [
            sb
            for sb in await self.store.list(SandboxQuery(statuses=frozenset({S.RUNNING})))
            if self._mine(sb)
        ]
        for sb in running:
            with contextlib.suppress(SandboxError):
                await self._drain_egress(sb)
        return len(running)

    async def stop_expired(self, *, now: datetime | None = None) -> ReconcileReport:
        """The sweep: stop running sandboxes whose TTL ran out (cause ``ttl``) or that sat
        idle longer than ``idle_timeout`` (cause ``idle``), and destroy failed creations whose
        time for inspection ran out. The system does this as itself, in each sandbox's tenant
        (receipts name the ``system`` principal). What could not be done is in ``errors``
        (and logged), never silently skipped."""
        report = ReconcileReport()
        await self._sweep(now or utcnow(), report)
        return report

    async def _sweep_if_due(self) -> None:
        """The embedded stand-in for a server's sweep: no daemon runs, so whoever uses sandlot
        on this host stops what has expired (errors are logged, never raised into the
        caller's unrelated operation)."""
        now = time.monotonic()
        if self.sweep_every is None or (
            self._swept_at is not None and now - self._swept_at < self.sweep_every
        ):
            return
        self._swept_at = now
        # Shielded: a caller cancelled (Ctrl-C on `sandlot list`) must not leave another
        # sandbox half stopped; bounded, so a stuck backend does not hold up the caller long.
        with anyio.CancelScope(shield=True), anyio.move_on_after(SWEEP_BOUND):
            try:
                await self.stop_expired()  # what it could not do, it logs
            except SandboxError as e:
                _log.error("sweeping expired sandboxes failed: %s", e)

    async def _sweep(self, now: datetime, report: ReconcileReport) -> None:
        due = [
            sb
            for sb in await self.store.list(SandboxQuery(statuses=frozenset({S.RUNNING, S.FAILED})))
            if self._mine(sb)
        ]
        for sb in due:
            if sb.status is S.FAILED:
                if not _past_ttl(sb, now):
                    continue
                report.checked += 1
                if sb.metadata.get(_KEPT):
                    await self._discard(sb, report)
                else:
                    await self._stop_failed(sb, report)
                continue
            if self._due(sb, now) is None:
                continue
            report.checked += 1
            try:
                cause = await self._stop_system(sb, now)
            except (Conflict, InvalidState):
                continue  # changed meanwhile (kept alive, busy, stopped): the next sweep sees it
            except SandboxError as e:
                # One sandbox that cannot be stopped must not keep the others running.
                _log.error("could not stop sandbox %s past its TTL or idle time: %s", sb.id, e)
                report.errors[sb.id] = f"could not stop it past its TTL or idle time: {e}"
                continue
            if cause is not None:
                report.expired.append(sb.id)

    def _due(self, sb: SandboxInfo, now: datetime, *, busy: int = 0) -> tuple[str, str] | None:
        """Why a running sandbox is due to stop (its cause and message), if it is; ``busy``
        operations of its own in flight are the caller's (the stop itself)."""
        if _past_ttl(sb, now):
            return "ttl", _ttl_message(sb)
        if (
            sb.spec.idle_timeout is not None
            and sb.last_active_at + timedelta(seconds=sb.spec.idle_timeout) <= now
            and self._busy.get(sb.id, 0) <= busy
        ):
            return "idle", f"idle for more than {sb.spec.idle_timeout:g}s"
        return None

    async def _stop_system(self, sb: SandboxInfo, now: datetime) -> str | None:
        """Stop a sandbox as sandlot's own duty (TTL, idle), decided and receipted as such; the
        cause, or None when the record read again shows it is no longer due (another process
        kept it alive or used it since the sweep listed it)."""
        sb = await self.store.get(sb.id)
        due = self._due(sb, now) if sb.status is S.RUNNING else None
        if due is None:
            return None
        cause, message = due
        async with self._gated(system_actor(sb.tenant), "stop", sb, reason=cause):
            await self._stop(
                sb, cause, message, still_due=lambda r: self._due(r, now, busy=1) is not None
            )
        return cause

    async def _stop_failed(self, sb: SandboxInfo, report: ReconcileReport) -> None:
        """Stop the runtime of a failed sandbox past its TTL if it still runs (a stop that
        failed once leaves the record failed; its processes must not run on for good)."""
        if sb.backend_ref is None:
            return
        try:
            impl = self._backend_of(sb)
            if (await impl.inspect(sb.backend_ref)).state != "running":
                return
            async with self._gated(system_actor(sb.tenant), "stop", sb, reason="ttl"):
                await impl.stop(sb.backend_ref)
                await self._drop_channel(sb.id)
                await self._cas(
                    sb,
                    status=S.STOPPED,
                    death=DeathCertificate(
                        cause="ttl", message=f"{_ttl_message(sb)} (it had failed: {sb.error})"
                    ),
                )
        except Conflict:
            return
        except SandboxError as e:
            _log.error("could not stop failed sandbox %s past its TTL: %s", sb.id, e)
            report.errors[sb.id] = f"could not stop it past its TTL (it had failed): {e}"
            return
        report.expired.append(sb.id)

    async def _discard(self, sb: SandboxInfo, report: ReconcileReport) -> None:
        """Destroy a failed creation whose time for inspection ran out (the record stays)."""
        first = f"{sb.death.cause}: {sb.death.message}" if sb.death else (sb.error or "failed")
        message = f"failed ({first}); destroyed when its time for inspection ran out"
        try:
            await self._destroy_system(sb, "discarded", message)
        except (Conflict, InvalidState):
            return
        except SandboxError as e:
            _log.error("could not destroy failed sandbox %s: %s", sb.id, e)
            report.errors[sb.id] = f"could not destroy it after its failure: {e}"
            return
        report.discarded.append(sb.id)

    async def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Make records agree with what backends report and settle abandoned transitions;
        when ``ids`` is None also reap backend sandboxes that carry our mark but have no
        record, and sweep (:meth:`stop_expired`)."""
        report = ReconcileReport()
        if ids is None:
            # Another host's sandboxes are its own Manager's to check.
            records = [sb for sb in await self.store.list(SandboxQuery()) if self._mine(sb)]
        else:
            records = [await self.store.get(i) for i in ids]
        for sb in records:
            report.checked += 1
            try:
                self._require_here(sb)
                change = await self._reconcile_one(sb)
            except SandboxError as e:
                report.errors[sb.id] = str(e)
                continue
            if change:
                report.updated[sb.id] = change
        if ids is None:
            for name in self.backends:
                await self._reap(name, self._backend(name), report)
            checked = report.checked
            await self._sweep(utcnow(), report)
            report.checked = checked
        return report

    async def _reconcile_one(self, sb: SandboxInfo) -> str | None:
        before = sb.status
        if before.transitional:
            if not self._abandoned(sb):
                return None
            settled = await self._settle(sb)
            return f"{before} (abandoned) -> {settled.status}"
        if before not in (S.RUNNING, S.STOPPED) or sb.backend_ref is None:
            return None
        state = await self._backend_of(sb).inspect(sb.backend_ref)
        if state.state == "missing":
            await self._fail(sb, "vanished", "the backend no longer has this sandbox")
            return f"{before} -> failed (vanished)"
        if before is S.RUNNING and state.state == "stopped":
            # An init that exited without being asked to is a crash (an OOM kill says oom).
            cause = state.reason or "exited"
            message = state.detail or f"stopped behind our back ({cause})"
            if cause == "exited":
                cause = "crashed"
                message = (
                    state.detail or "its init ended with no stop asked for (killed or crashed)"
                )
            await self._drop_channel(sb.id)
            await self._cas(
                sb, status=S.STOPPED, death=DeathCertificate(cause=cause, message=message)
            )
            return f"running -> stopped ({cause})"
        return None

    async def _reap(self, name: str, impl: Backend, report: ReconcileReport) -> None:
        try:
            owned = await impl.list_owned()
        except SandboxError as e:
            report.errors[name] = f"cannot list backend sandboxes: {e}"
            return
        for sandbox_id, ref in owned.items():
            try:
                record = await self.store.get(sandbox_id)
            except NotFound:
                record = None
            # No record, or one closed while this runtime lived on (a host given up for lost
            # that came back): nobody will ever reach it again.
            if record is None or record.status is S.DESTROYED:
                orphan = Resource(sandbox_id=sandbox_id, backend=name)
                try:
                    async with self._gated(SYSTEM, "destroy", orphan, reason="orphan"):
                        await impl.destroy(ref)
                except SandboxError as e:
                    report.errors[sandbox_id] = f"could not reap orphan: {e}"
                    continue
                report.reaped.append(sandbox_id)

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

    async def _settle(self, sb: SandboxInfo) -> SandboxInfo:
        """Finish or fail a transition whose driver died."""
        impl = self._backend_of(sb)
        owner = f"abandoned by {sb.transition_owner}"
        if sb.status is S.DESTROYING:
            return await self._destroy(sb, "destroyed", f"destroy finished by reconcile ({owner})")
        if sb.status in (S.STOPPING, S.RESUMING):
            sb = await self._cas(sb, transition_owner=self.instance)
            with contextlib.suppress(SandboxError):
                if sb.backend_ref is not None:
                    await impl.stop(sb.backend_ref)
            await self._drop_channel(sb.id)
            return await self._cas(
                sb,
                status=S.STOPPED,
                transition_owner=None,
                transition_deadline=None,
                death=DeathCertificate(cause="abandoned", message=f"{sb.status} {owner}"),
            )
        # provisioning / setting_up / starting: the backend's sandbox (if any) is kept for
        # inspection, as for any failed creation.
        if sb.backend_ref is None:
            with contextlib.suppress(SandboxError):
                ref = (await impl.list_owned()).get(sb.id)
                if ref is not None:
                    sb = await self._cas(sb, backend_ref=ref)
        return await self._fail(sb, "abandoned", f"{sb.status} {owner}")

    # -- internals -----------------------------------------------------------------------------

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

    async def _run(
        self,
        sb: SandboxInfo,
        actor: Actor,
        channel: Channel,
        command: Command,
        on_output: OutputCallback,
    ) -> ExecResult:
        argv, cwd, env = command_argv(command)
        workdir = cwd or sb.spec.workdir
        shown = command if isinstance(command, str) else argv
        async with self._gated(actor, "exec", sb, command=shown, cwd=workdir, env=env) as outcome:
            counted = _CountedOutput(on_output)
            result = await channel.exec(
                argv, cwd=workdir, env=self._env(sb, env), on_output=counted.feed
            )
            outcome.output_hash = counted.output_hash()
            outcome.exit_code = result.exit_code
            outcome.detail = counted.summary()
            return result

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
                await anyio.sleep(max(TOUCH_EVERY, idle / 3))
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


def _past_ttl(sb: SandboxInfo, now: datetime) -> bool:
    """Whether the sandbox's time to live has run out."""
    return sb.expires_at is not None and sb.expires_at <= now


def _resumed_expiry(sb: SandboxInfo, now: datetime) -> datetime | None:
    """A resumed sandbox's TTL: what is left of it, else a whole new one (or none)."""
    if sb.status is not S.FAILED and sb.expires_at is not None and sb.expires_at > now:
        return sb.expires_at
    return now + timedelta(seconds=sb.spec.timeout) if sb.spec.timeout else None


def _ttl_message(sb: SandboxInfo) -> str:
    assert sb.expires_at is not None
    return f"time to live ran out at {sb.expires_at.isoformat()}"


def _require_live(sb: SandboxInfo, why: str) -> None:
    if sb.status is S.DESTROYED or sb.backend_ref is None:
        msg = f"sandbox {sb.id} is {sb.status}: {why}"
        raise InvalidState(msg, id=sb.id)


def _fresh(begun: Intent | _Replay | None) -> Intent | None:
    """The intent to run (a replay has returned before this is asked)."""
    assert not isinstance(begun, _Replay)
    return begun


class _CountedOutput:
    """Hashes and counts each output stream as it passes to the caller's callback: a
    command's receipt says what it printed whether or not the output was kept.

    ``output_hash`` is ``sha256("stdout:<hex>\nstderr:<hex>\n")`` over each stream's raw
    bytes' SHA-256 (``detail.stdout`` / ``detail.stderr`` carry each hash and byte count).
    """

    def __init__(self, on_output: OutputCallback | None) -> None:
        self._on_output = on_output
        self._hashes = {"stdout": hashlib.sha256(), "stderr": hashlib.sha256()}
        self._sizes = {"stdout": 0, "stderr": 0}

    async def feed(self, chunk: OutputChunk) -> None:
        self._hashes[chunk.stream].update(chunk.data)
        self._sizes[chunk.stream] += len(chunk.data)
        if self._on_output is not None:
            result = self._on_output(chunk)
            if result is not None:
                await result

    def summary(self) -> dict[str, JsonValue]:
        return {
            name: {"sha256": "sha256:" + h.hexdigest(), "bytes": self._sizes[name]}
            for name, h in self._hashes.items()
        }

    def output_hash(self) -> str:
        both = "".join(f"{name}:{h.hexdigest()}\n" for name, h in self._hashes.items())
        return "sha256:" + hashlib.sha256(both.encode()).hexdigest()


async def _replay_output(result: ExecResult, on_output: OutputCallback | None) -> None:
    """A replayed command's recorded output, given to the caller's callback as it was the
    first time (a retry prints what the command printed)."""
    if on_output is None:
        return
    seq = 0
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            maybe = on_output(OutputChunk(seq=seq, stream=stream, data=text.encode()))
            if maybe is not None:
                await maybe
            seq += 1


def _interrupted(error: BaseException, outcome: _Outcome, keep: float) -> SandboxError:
    """What a replay of an interrupted keyed operation raises (never a bare CancelledError)."""
    assert outcome.lease is not None
    why = f"interrupted ({type(error).__name__})"
    if outcome.lease.state is IntentState.RUNNING:
        # Interrupted while the command ran: whether it finished is unknown, and a replay must
        # say so rather than run it again.
        msg = f"{why} while running; its outcome is unknown and it was not run again"
        return BackendUnavailable(msg, outcome="unknown")
    sandbox_id = outcome.creating
    if sandbox_id is not None:
        msg = (
            f"{why} while creating; sandbox {sandbox_id} is kept, failed, for inspection (for "
            f"{keep / 3600:g} h at most): destroy it or resume it"
        )
        return InvalidState(msg, sandbox_id=sandbox_id, status="failed")
    return BackendUnavailable(f"{why} before it ran; it was not run", outcome="not_run")


@final
class _Spool:
    """A stream's bytes kept (on disk past a MiB) to be streamed again, and their hash."""

    def __init__(self) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - close()
        self.digest = hashlib.sha256()

    async def fill(self, chunks: AsyncIterable[bytes]) -> str:
        async for chunk in chunks:
            self.digest.update(chunk)
            await anyio.to_thread.run_sync(self.file.write, chunk)
        await anyio.to_thread.run_sync(self.file.seek, 0)
        return "sha256:" + self.digest.hexdigest()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await anyio.to_thread.run_sync(self.file.read, 1 << 20):
            yield chunk

    def close(self) -> None:
        self.file.close()


def _body_identity(body: bytes | AsyncIterable[bytes], digest: str | None) -> str:
    """What an idempotency key remembers of a file's content."""
    if isinstance(body, bytes):
        return "sha256:" + hashlib.sha256(body).hexdigest()
    return digest or "stream"


def _stdin_identity(stdin: Stdin) -> JsonValue:
    """What an idempotency key remembers of a command's input: a hash, or that it streamed."""
    if stdin is None:
        return None
    if isinstance(stdin, bytes):
        return "sha256:" + hashlib.sha256(stdin).hexdigest()
    return "stream"


def _encode_error(error: BaseException) -> str:
    """An error as the journal records it, so a replay raises the same class."""
    if isinstance(error, SandboxError):
        return json.dumps(error.to_dict(), default=str)
    return json.dumps({"code": "sandbox_error", "message": f"{type(error).__name__}: {error}"})


def _replayed(intent: Intent) -> JsonValue:
    """What a replay of ``intent`` returns, or raises what its first attempt raised."""
    if intent.state in (IntentState.RESULT_RECORDED, IntentState.CLEANED):
        return intent.result
    if intent.state is IntentState.NEEDS_RECONCILE:
        msg = (
            f"the operation of this idempotency key needs an operator ({intent.error}); "
            "see `sandlot doctor`"
        )
        raise InvalidState(msg, intent_id=intent.intent_id)
    try:
        data = json.loads(intent.error or "{}")
    except ValueError:
        data = {"message": intent.error}
    if intent.state is IntentState.DENIED:
        raise PolicyDenied(str(data.get("message") or intent.error or "denied by policy"))
    details = data.get("details") if isinstance(data.get("details"), dict) else {}
    raise error_from_code(
        str(data.get("code", "sandbox_error")), str(data.get("message", "")), details
    )


def _snapshot_ref(snap: SnapshotInfo) -> SnapshotRef:
    return SnapshotRef(ref=snap.ref, size_bytes=snap.size_bytes, metadata=dict(snap.metadata))


def _check_path(path: str) -> None:
    if not path.startswith("/"):
        msg = f"path must be absolute, got {path!r}"
        raise InvalidRequest(msg)
    if "\x00" in path:
        msg = "path must not contain NUL bytes"
        raise InvalidRequest(msg)
