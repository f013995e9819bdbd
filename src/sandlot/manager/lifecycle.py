"""A sandbox's lifecycle: create (clone, setup, main process), stop, resume, destroy, keep alive.

Each transition is a compare-and-set on the record (``core``) driven under
:meth:`~sandlot.manager.core.ManagerCore._drive`, so an interrupted one leaves the sandbox failed,
never transitional. Creation writes the record before the backend is asked, and under an
idempotency key journals its allocation so a crash never allocates twice. Must not import a
front end or a concrete backend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import anyio

from sandlot.backends.base import Backend
from sandlot.backends.options import BACKEND_OPTIONS, check_backend_options
from sandlot.channel.base import MAIN_LOG, Channel, OutputCallback
from sandlot.errors import (
    Conflict,
    ExecFailed,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    SandboxError,
)
from sandlot.manager.commands import _CountedOutput, _Tail, command_argv
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import _Outcome, _Replay
from sandlot.manager.records import _KEPT, _past_ttl, _resumed_expiry
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    Command,
    DeathCertificate,
    ExecResult,
    GitSource,
    JsonValue,
    OutputChunk,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    new_id,
    system_actor,
    utcnow,
)
from sandlot.policy.request import Resource

S = SandboxStatus
_log = logging.getLogger("sandlot")


class Lifecycle(ManagerCore):
    """Creation, stop, resume, destroy and keep-alive: the state machine's transitions."""

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
