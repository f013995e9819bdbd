"""The in-process async SDK: :class:`AsyncSandlot` and its :class:`AsyncSandbox` handles.

    async with AsyncSandlot() as client:
        async with await client.create(setup="pip install requests") as sb:
            result = await sb.exec(["python3", "-c", "print(1)"])

Everything here is a thin layer over :class:`~sandlot.manager.Manager`; the sync SDK
(:mod:`sandlot.sync`) mirrors this module method for method and the HTTP client
(:mod:`sandlot.client`) offers the same surface. This module must not import concrete
backends (the registry builds them).
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Self, final

import anyio.to_thread

from sandlot import wiring
from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError
from sandlot.gate.gate import Approval
from sandlot.manager import ReconcileReport
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    Command,
    ExecResult,
    FileInfo,
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
)
from sandlot.policy import Explanation, PolicyConfig
from sandlot.receipts import Receipt
from sandlot.settings import Settings, load_settings
from sandlot.shared import Creating, build_spec, file_body, split_output
from sandlot.terminal import AsyncTerminal

if TYPE_CHECKING:
    from sandlot.backends.base import Backend
    from sandlot.channel.base import OutputCallback, Stdin

__all__ = ["AsyncSandbox", "AsyncSandlot", "database_url"]


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
class AsyncSandbox:
    """A handle on one sandbox. ``async with`` destroys it on exit."""

    def __init__(self, client: AsyncSandlot, info: SandboxInfo) -> None:
        self._client = client
        self._manager = client.manager
        self._actor = client.actor
        self.info = info
        """The record as last seen (``refresh()`` reads it again)."""

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.info.id

    @property
    def status(self) -> SandboxStatus:
        """The status as last seen."""
        return self.info.status

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.status} on {self.info.backend}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a cancelled body is exactly when the sandbox must still go.
        with anyio.CancelScope(shield=True):
            await self.destroy()

    async def refresh(self) -> SandboxInfo:
        """Read the record again."""
        self.info = await self._manager.get(self.id, actor=self._actor)
        return self.info

    async def exec(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        check: bool = False,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        collect_output: bool = True,
    ) -> ExecResult:
        """Run a command to completion (a string runs under ``sh -c``; a list is an argv).

        Args:
            command: What to run.
            cwd: Working directory (default: the spec's workdir).
            env: Extra environment variables.
            timeout: Seconds before the whole process tree is killed (exit code 124).
            stdin: Input bytes, or an async iterable of chunks.
            on_output: Called with each raw output chunk.
            on_stdout: Called with standard output text as it arrives.
            on_stderr: Called with standard error text as it arrives.
            check: Raise ``ExecFailed`` on a non-zero exit.
            auto_resume: Resume a stopped sandbox first (else ``InvalidState``).
            idempotency_key: Run at most once under this key; a repeat returns the first
                result (``Conflict`` if the key was used for another command).
            collect_output: Also keep the output in the result (False: only the callbacks
                see it, so output of any size passes in bounded memory).

        Returns:
            The exit code, the collected output and the duration.
        """
        return await self._manager.exec(
            self.id,
            command,
            actor=self._actor,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            on_output=split_output(on_output, on_stdout, on_stderr),
            check=check,
            auto_resume=auto_resume,
            idempotency_key=idempotency_key,
            collect_output=collect_output,
        )

    async def read_file(self, path: str) -> bytes:
        """A file's bytes."""
        return await self._manager.read_file(self.id, path, actor=self._actor)

    async def stream_file(self, path: str) -> AsyncIterator[bytes]:
        """A file's bytes in chunks, for files too big to hold in memory."""
        async for chunk in self._manager.stream_file(self.id, path, actor=self._actor):
            yield chunk

    async def write_file(
        self,
        path: str,
        data: bytes | str | IO[bytes] | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        idempotency_key: str | None = None,
    ) -> FileInfo:
        """Create or replace a file (parents are made). Text is written as UTF-8; a binary
        file object or an async iterable of chunks is streamed, never held whole in memory."""
        (info,) = await self._manager.write_files(
            self.id,
            {path: file_body(data)},
            actor=self._actor,
            mode=mode,
            idempotency_key=idempotency_key,
        )
        return info

    async def write_files(
        self, files: Mapping[str, bytes | str], *, idempotency_key: str | None = None
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        return await self._manager.write_files(
            self.id, files, actor=self._actor, idempotency_key=idempotency_key
        )

    async def list_files(self, path: str | None = None) -> builtins.list[FileInfo]:
        """A directory's entries (default: the workdir)."""
        return await self._manager.list_files(
            self.id, path or self.info.spec.workdir, actor=self._actor
        )

    async def remove_file(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``."""
        await self._manager.remove_file(self.id, path, actor=self._actor, recursive=recursive)

    async def logs(self, *, follow: bool = False, offset: int = 0) -> AsyncIterator[bytes]:
        """The main process's output; ``follow`` keeps tailing it."""
        async for chunk in self._manager.logs(
            self.id, actor=self._actor, follow=follow, offset=offset
        ):
            yield chunk

    async def start_process(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background and return at once (a string runs under
        ``sh -c``; a list is an argv).

        It outlives this call and this client, until it exits, is signalled or the sandbox
        stops; read its output with :meth:`process_output`. A ``name`` held by a running
        process is a ``Conflict``; the id or the name finds it later.
        """
        return await self._manager.start_process(
            self.id, command, actor=self._actor, cwd=cwd, env=env, name=name
        )

    async def list_processes(self) -> builtins.list[ProcessInfo]:
        """Background processes (the main process among them), running and recently exited."""
        return await self._manager.list_processes(self.id, actor=self._actor)

    async def signal_process(self, process_id: str, signum: int = 15) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree."""
        await self._manager.signal_process(self.id, process_id, signum, actor=self._actor)

    async def wait_process(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits; its final record (``SandboxTimeout`` when
        ``timeout`` seconds pass first)."""
        return await self._manager.wait_process(
            self.id, process_id, actor=self._actor, timeout=timeout
        )

    async def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset``; ``follow`` keeps yielding
        until it exits. Resume after a chunk with ``offset=chunk.seq + 1``."""
        async for chunk in self._manager.process_output(
            self.id, process_id, actor=self._actor, offset=offset, follow=follow
        ):
            yield chunk

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Feed a background process's standard input (strings as UTF-8); ``close`` closes it
        afterwards (the program reads end of file)."""
        body = data.encode() if isinstance(data, str) else bytes(data)
        await self._manager.write_stdin(self.id, process_id, body, actor=self._actor, close=close)

    async def open_pty(
        self,
        command: Command | Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> AsyncTerminal:
        """Start a program (default ``sh``) on a new interactive terminal.

        Write keystrokes, read output, resize; the terminal ends when the program exits.
        ``async with`` closes it (the program gets SIGHUP).
        """
        session = await self._manager.open_pty(
            self.id, command, actor=self._actor, rows=rows, cols=cols, cwd=cwd, env=env
        )
        return AsyncTerminal(session, self.id)

    async def stop(self) -> SandboxInfo:
        """Stop every process; the filesystem stays."""
        self.info = await self._manager.stop(self.id, actor=self._actor)
        return self.info

    async def resume(self) -> SandboxInfo:
        """Boot it again and relaunch its ``resume`` command."""
        self.info = await self._manager.resume(self.id, actor=self._actor)
        return self.info

    async def destroy(
        self, *, idempotency_key: str | None = None, forget_host: bool = False
    ) -> SandboxInfo:
        """Remove it for good (the record stays, hidden, with a death certificate);
        ``forget_host`` closes the record of a sandbox whose host is gone for good."""
        self.info = await self._manager.destroy(
            self.id, actor=self._actor, idempotency_key=idempotency_key, forget_host=forget_host
        )
        return self.info

    async def keep_alive(self, seconds: float) -> SandboxInfo:
        """Push the time to live out to ``seconds`` from now."""
        self.info = await self._manager.keep_alive(self.id, seconds, actor=self._actor)
        return self.info

    async def snapshot(self) -> SnapshotInfo:
        """Save its state."""
        return await self._manager.snapshot(self.id, actor=self._actor)

    async def restore(self, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot's state."""
        self.info = await self._manager.restore(self.id, snapshot_id, actor=self._actor)
        return self.info

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """Make ``count`` new sandboxes from its current state."""
        infos = await self._manager.fork(self.id, count, actor=self._actor)
        return [AsyncSandbox(self._client, i) for i in infos]

    async def expose_port(self, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        mapping = await self._manager.expose_port(self.id, port, actor=self._actor)
        await self.refresh()
        return mapping

    async def list_ports(self) -> builtins.list[PortMapping]:
        """Published ports."""
        return await self._manager.list_ports(self.id, actor=self._actor)

    async def reset(self, snapshot_id: str | None = None) -> SandboxInfo:
        """Return to a snapshot (default: the state it was created in), verified; a failed
        verification raises ``VerificationFailed`` naming what diverged."""
        self.info = await self._manager.reset(self.id, snapshot_id, actor=self._actor)
        return self.info

    async def update_network(self, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy (``"deny-all"``, ``"allow-all"`` or an allowlist)."""
        self.info = await self._manager.update_network(self.id, policy, actor=self._actor)
        return self.info

    async def network_log(self) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision the sandbox's proxy logged."""
        return await self._manager.network_log(self.id, actor=self._actor)

    async def suggest_network(self) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        return await self._manager.suggest_network(self.id, actor=self._actor)

    async def explain(self, action: str, **args: object) -> Explanation:
        """What the policy would decide about an operation here, and why (nothing runs).

        ``sb.explain("exec", command="rm -rf /")``, ``sb.explain("fs.write", path="/etc/x")``.
        """
        return await self._manager.explain(action, self.id, actor=self._actor, **args)


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
        self.database_url = wired.url
        """The database the records (and receipts) are in."""
        self.receipts = wired.receipts
        """The signed receipt log (in the same database as the records)."""
        self.manager = wired.manager

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
            return AsyncSandbox(self, info)

        return Creating(create())

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox (``NotFound`` names the id)."""
        return AsyncSandbox(self, await self.manager.get(sandbox_id, actor=self.actor))

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
        return [AsyncSandbox(self, i) for i in infos]

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


def _with_backend(settings: Settings, name: str | None) -> Settings:
    """``settings`` with a caller's own backend object (``backends={name: …}``) as default."""
    import dataclasses

    values = settings.values.model_copy(update={"backend": name})
    sources = {**settings.sources, "backend": "argument backend"}
    return dataclasses.replace(settings, values=values, sources=sources)
