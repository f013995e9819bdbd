"""The in-process async SDK: :class:`AsyncSandlot`, and :class:`ManagerPlane` under its handles.

    async with AsyncSandlot() as client:
        async with await client.create(setup="pip install requests") as sb:
            result = await sb.exec(["python3", "-c", "print(1)"])

Everything here is a thin layer over :class:`~sandlot.manager.Manager`. Sandboxes are the one
handle class, :class:`sandlot.handle.AsyncSandbox`, over a :class:`ManagerPlane`; the HTTP
client hands out the same class over HTTP. Both clients implement :class:`sandlot.api.SandlotAPI`
(a test checks name for name and signature for signature), and the sync SDK
(:mod:`sandlot.sync`) mirrors this module method for method. This module must not import
concrete backends (the registry builds them) or any front end.
"""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self, final

import anyio.to_thread

from sandlot import wiring
from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError
from sandlot.gate.gate import Approval
from sandlot.handle import AsyncSandbox
from sandlot.manager import Manager
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    Command,
    ExecResult,
    Explanation,
    FileInfo,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    ReconcileReport,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
)
from sandlot.policy import PolicyConfig
from sandlot.receipts import Receipt
from sandlot.settings import Settings, load_settings
from sandlot.shared import Creating, build_spec
from sandlot.wire import ExecRequest, StartProcessRequest

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from sandlot.backends.base import Backend
    from sandlot.channel.base import OutputCallback, PtySession, Stdin

__all__ = ["AsyncSandbox", "AsyncSandlot", "ManagerPlane", "database_url"]


def database_url(database: str | None, home_dir: Path) -> str:
    """A SQLAlchemy URL from a URL, a SQLite file path, or nothing (see
    :func:`sandlot.wiring.database_url`, which this is)."""
    return wiring.database_url(database, home_dir)


def policy_config(
    policy: str | Path | Sequence[str | Path] | PolicyConfig | None,
) -> PolicyConfig:
    """The gate's policy configuration from what a caller passed (or the environment)."""
    return wiring.policy_config(policy)


@final
class ManagerPlane:
    """The in-process :class:`~sandlot.handle.ControlPlane`: each operation is one call on the
    Manager, as the SDK's actor."""

    def __init__(self, manager: Manager, actor: Actor) -> None:
        self._manager = manager
        self._actor = actor

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._manager.get(sandbox_id, actor=self._actor)

    async def exec(
        self,
        sandbox_id: str,
        request: ExecRequest,
        *,
        stdin: Stdin,
        on_output: OutputCallback | None,
        idempotency_key: str | None,
    ) -> ExecResult:
        return await self._manager.exec(
            sandbox_id,
            request.command,
            actor=self._actor,
            cwd=request.cwd,
            env=request.env,
            timeout=request.timeout,
            stdin=stdin,
            on_output=on_output,
            check=request.check,
            auto_resume=request.auto_resume,
            idempotency_key=idempotency_key,
            collect_output=request.collect_output,
        )

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._manager.read_file(sandbox_id, path, actor=self._actor)

    async def stream_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._manager.stream_file(sandbox_id, path, actor=self._actor):
            yield chunk

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        body: bytes | AsyncIterator[bytes],
        *,
        mode: int | None,
        idempotency_key: str | None,
    ) -> FileInfo:
        (info,) = await self._manager.write_files(
            sandbox_id,
            {path: body},
            actor=self._actor,
            mode=mode,
            idempotency_key=idempotency_key,
        )
        return info

    async def write_files(
        self,
        sandbox_id: str,
        files: Mapping[str, bytes | str],
        *,
        idempotency_key: str | None,
    ) -> builtins.list[FileInfo]:
        return await self._manager.write_files(
            sandbox_id, files, actor=self._actor, idempotency_key=idempotency_key
        )

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        return await self._manager.list_files(sandbox_id, path, actor=self._actor)

    async def remove_file(self, sandbox_id: str, path: str, *, recursive: bool) -> None:
        await self._manager.remove_file(sandbox_id, path, actor=self._actor, recursive=recursive)

    async def logs(self, sandbox_id: str, *, follow: bool, offset: int) -> AsyncIterator[bytes]:
        async for chunk in self._manager.logs(
            sandbox_id, actor=self._actor, follow=follow, offset=offset
        ):
            yield chunk

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        return await self._manager.start_process(
            sandbox_id,
            request.command,
            actor=self._actor,
            cwd=request.cwd,
            env=request.env,
            name=request.name,
        )

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return await self._manager.list_processes(sandbox_id, actor=self._actor)

    async def signal_process(self, sandbox_id: str, process_id: str, signum: int) -> None:
        await self._manager.signal_process(sandbox_id, process_id, signum, actor=self._actor)

    async def wait_process(
        self, sandbox_id: str, process_id: str, *, timeout: float | None
    ) -> ProcessInfo:
        return await self._manager.wait_process(
            sandbox_id, process_id, actor=self._actor, timeout=timeout
        )

    async def process_output(
        self, sandbox_id: str, process_id: str, *, offset: int, follow: bool
    ) -> AsyncIterator[OutputChunk]:
        async for chunk in self._manager.process_output(
            sandbox_id, process_id, actor=self._actor, offset=offset, follow=follow
        ):
            yield chunk

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, close: bool
    ) -> None:
        await self._manager.write_stdin(
            sandbox_id, process_id, data, actor=self._actor, close=close
        )

    async def open_pty(
        self,
        sandbox_id: str,
        command: Command | Sequence[str] | None,
        *,
        rows: int,
        cols: int,
        cwd: str | None,
        env: Mapping[str, str] | None,
    ) -> PtySession:
        return await self._manager.open_pty(
            sandbox_id, command, actor=self._actor, rows=rows, cols=cols, cwd=cwd, env=env
        )

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return await self._manager.stop(sandbox_id, actor=self._actor)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._manager.resume(sandbox_id, actor=self._actor)

    async def destroy(
        self, sandbox_id: str, *, idempotency_key: str | None, forget_host: bool
    ) -> SandboxInfo:
        return await self._manager.destroy(
            sandbox_id, actor=self._actor, idempotency_key=idempotency_key, forget_host=forget_host
        )

    async def keep_alive(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        return await self._manager.keep_alive(sandbox_id, seconds, actor=self._actor)

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        return await self._manager.snapshot(sandbox_id, actor=self._actor)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        return await self._manager.restore(sandbox_id, snapshot_id, actor=self._actor)

    async def fork(self, source: str, count: int) -> builtins.list[SandboxInfo]:
        return await self._manager.fork(source, count, actor=self._actor)

    async def expose_port(self, sandbox_id: str, port: int) -> PortMapping:
        return await self._manager.expose_port(sandbox_id, port, actor=self._actor)

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortMapping]:
        return await self._manager.list_ports(sandbox_id, actor=self._actor)

    async def reset(self, sandbox_id: str, snapshot_id: str | None) -> SandboxInfo:
        return await self._manager.reset(sandbox_id, snapshot_id, actor=self._actor)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy | str) -> SandboxInfo:
        return await self._manager.update_network(sandbox_id, policy, actor=self._actor)

    async def network_log(self, sandbox_id: str) -> builtins.list[dict[str, JsonValue]]:
        return await self._manager.network_log(sandbox_id, actor=self._actor)

    async def suggest_network(self, sandbox_id: str) -> NetworkAllowlist:
        return await self._manager.suggest_network(sandbox_id, actor=self._actor)

    async def explain(self, sandbox_id: str, action: str, args: dict[str, object]) -> Explanation:
        return await self._manager.explain(action, sandbox_id, actor=self._actor, **args)


@final
class AsyncSandlot:
    """The async SDK on an embedded Manager.

    Args:
        home: State directory (default ``$SANDLOT_HOME`` or ``~/.local/share/sandlot``).
        backend: Backend for new sandboxes (default ``$SANDLOT_BACKEND``, else ``backend`` in
            ``sandlot.toml``, else ``local``).
        database: A database URL or SQLite file path (default ``$SANDLOT_DATABASE_URL``, else
            ``database`` in ``sandlot.toml``, else ``sandlot.db`` in the home).
        backends: Backend objects to use instead of the built-in ones, by name (tests pass a
            ``FakeBackend`` here).
        actor: Who the calls act as (tenant and principal).
        policy: The policy the gate decides with: Cedar policy files (a path or a list), a
            :class:`~sandlot.policy.PolicyConfig`, or None for ``$SANDLOT_POLICY`` (a file or
            ``:``-separated files), else ``policy`` in ``sandlot.toml``, else the shipped
            default policy.
        hold_timeout: Seconds a HOLD decision waits for an approval before it is a denial.
        on_deny: Called with each ``PolicyDenied`` before it is raised.
        on_hold: Called with the pending :class:`Approval` when an operation of this client
            is held for approval, as its wait begins (say how to approve it).
        on_receipt: Called with each signed receipt after it is written.
        config: The configuration file (default ``$SANDLOT_CONFIG``, else ``sandlot.toml`` in
            the home, which may be absent): backends' warm pools, the policy, the database.
        settings: Settings resolved already (:func:`sandlot.settings.load_settings`; the CLI
            passes its own); ``home``, ``backend``, ``database`` and ``config`` are then unused.
    """

    def __init__(
        self,
        home: str | Path | None = None,
        backend: str | None = None,
        database: str | None = None,
        *,
        backends: Mapping[str, Backend] | None = None,
        actor: Actor = LOCAL_ACTOR,
        policy: str | Path | Sequence[str | Path] | PolicyConfig | None = None,
        hold_timeout: float = 300.0,
        on_deny: Callable[[PolicyDenied], object] | None = None,
        on_receipt: Callable[[Receipt], None] | None = None,
        on_hold: Callable[[Approval], object] | None = None,
        config: str | Path | None = None,
        settings: Settings | None = None,
    ) -> None:
        if settings is None:
            # Arguments rank as flags do: over the environment, the file and the defaults. A
            # backend object handed in under its own name is chosen by that name, not checked
            # against the built-in ones.
            own = backend is not None and backend in (backends or {})
            settings = load_settings(
                home=home,
                config=config,
                overrides={
                    "backend": (None if own else backend, "argument backend"),
                    "database": (database, "argument database"),
                },
            )
            if own:
                settings = _with_backend(settings, backend)
        self.home = settings.home
        self.settings = settings
        """The effective settings (``settings.sources`` says where each came from)."""
        self.actor = actor
        wired = wiring.build_manager(
            settings,
            backends=backends,
            policy=policy,
            hold_timeout=hold_timeout,
            on_deny=on_deny,
            on_receipt=on_receipt,
            on_hold=on_hold,
        )
        self.store = wired.store
        self.database_engine: Engine = wired.store.engine
        """The engine of the database the records are in (the receipts and the journal too),
        for what shares that database: a server's command output."""
        self.database_url = wired.url
        """The database the records (and receipts) are in."""
        self.receipts = wired.receipts
        """The signed receipt log (in the same database as the records)."""
        self.manager = wired.manager

    @functools.cached_property
    def _plane(self) -> ManagerPlane:
        # Made on first use rather than in the constructor: handles need only the Manager and
        # the actor, whichever way they were built.
        return ManagerPlane(self.manager, self.actor)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections (sandboxes keep running); sign a checkpoint of new receipts."""
        try:
            await self.manager.flush_receipts()
            await anyio.to_thread.run_sync(self._final_checkpoint)
        finally:
            try:
                # A create of this process may have drawn on a warm pool that nothing here
                # will refill (a CLI command ends now).
                wiring.top_up_pools(self.manager)
                await self.manager.aclose()
            finally:
                self.receipts.close()

    def _final_checkpoint(self) -> None:
        # checkpoint() returns the last one unchanged when nothing was appended since. A
        # failure here must not stop the rest of the shutdown; the next start checkpoints.
        try:
            if self.receipts.size():
                self.receipts.checkpoint()
        except SandboxError as e:
            logging.getLogger("sandlot").warning("could not sign a closing checkpoint: %s", e)

    def create(
        self,
        spec: SandboxSpec | Mapping[str, JsonValue] | None = None,
        *,
        backend: str | None = None,
        on_setup_output: OutputCallback | None = None,
        idempotency_key: str | None = None,
        **fields: object,
    ) -> Creating[AsyncSandbox]:
        """Create a sandbox from a spec and/or spec fields (``image=``, ``setup=``, …):
        ``sb = await client.create(…)``, or ``async with client.create(…) as sb:`` to destroy
        it on exit.

        Raises ``InvalidRequest`` naming the bad field, ``NotSupported`` when the backend
        cannot enforce what the spec asks, ``ExecFailed`` when setup fails (the sandbox is then
        ``failed`` and kept for inspection; the error's ``sandbox_id`` names it).
        """
        full = build_spec(spec, fields)

        async def create() -> AsyncSandbox:
            info = await self.manager.create(
                full,
                backend=backend,
                actor=self.actor,
                on_setup_output=on_setup_output,
                idempotency_key=idempotency_key,
            )
            return AsyncSandbox(self._plane, info)

        return Creating(create())

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox (``NotFound`` names the id)."""
        return AsyncSandbox(self._plane, await self.manager.get(sandbox_id, actor=self.actor))

    async def list(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        status: SandboxStatus | Sequence[SandboxStatus] | None = None,
        backend: str | None = None,
        owner: str | None = None,
        include_destroyed: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Sandbox records, newest first."""
        if limit is not None and limit < 0:
            msg = f"limit must not be negative, got {limit}"
            raise InvalidRequest(msg)
        return await self.manager.list(
            actor=self.actor,
            labels=labels,
            status=status,
            backend=backend,
            owner=owner,
            include_destroyed=include_destroyed,
            limit=limit,
            offset=offset,
        )

    async def fork(self, source: str, count: int = 1) -> builtins.list[AsyncSandbox]:
        """New sandboxes from a snapshot id or a sandbox id."""
        infos = await self.manager.fork(source, count, actor=self.actor)
        return [AsyncSandbox(self._plane, i) for i in infos]

    async def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first."""
        return await self.manager.list_snapshots(sandbox_id, actor=self.actor)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        await self.manager.delete_snapshot(snapshot_id, actor=self.actor)

    async def list_approvals(self, status: str | None = "pending") -> builtins.list[Approval]:
        """Operations held for approval (``status=None`` for all), newest first."""
        return await self.manager.list_approvals(actor=self.actor, status=status)

    async def approve(self, approval_id: str) -> Approval:
        """Let a held operation run."""
        return await self.manager.approve(approval_id, actor=self.actor)

    async def deny(self, approval_id: str) -> Approval:
        """Refuse a held operation."""
        return await self.manager.deny(approval_id, actor=self.actor)

    async def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Sync records with the backends; without ``ids`` also reap orphans and sweep
        (:meth:`stop_expired`)."""
        return await self.manager.reconcile(ids)

    async def stop_expired(self) -> ReconcileReport:
        """Stop sandboxes past their TTL or idle timeout and destroy failed creations kept
        past their time for inspection; what was done (``expired``, ``discarded``) and what
        could not be (``errors``)."""
        return await self.manager.stop_expired()


if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.handle import ControlPlane

    # mypy checks these against their protocols here, member by member.
    _IMPLEMENTS: type[SandlotAPI] = AsyncSandlot
    _PLANE: type[ControlPlane] = ManagerPlane


def _with_backend(settings: Settings, name: str | None) -> Settings:
    """``settings`` with a caller's own backend object (``backends={name: …}``) as default."""
    import dataclasses

    values = settings.values.model_copy(update={"backend": name})
    sources = {**settings.sources, "backend": "argument backend"}
    return dataclasses.replace(settings, values=values, sources=sources)
