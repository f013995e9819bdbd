"""The sync facade: the :class:`Sandbox` handle and :class:`SyncClientBase`, written once for
the in-process SDK (:class:`sandlot.Sandlot`) and the HTTP client (:class:`sandlot.client.Client`).

Each method runs its async twin on an event loop in a background (daemon) thread, so there is
one source of behaviour; a test checks the sync and async surfaces match name for name and
signature for signature. Callbacks (``on_stdout``, …) are called on that loop's thread. A
:class:`Sandbox` wraps the one async handle, :class:`sandlot.handle.AsyncSandbox`, whichever
client made it.

This module must not import the SDK, the Manager or anything below it: the HTTP client's sync
``Client`` is built on it.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Generic, Self, TypeVar, final

from sandlot.models import (
    Approval,
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
from sandlot.shared import EventLoopThread, file_body
from sandlot.terminal import Terminal

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback, Stdin
    from sandlot.client.remote import AsyncClient
    from sandlot.handle import AsyncSandbox
    from sandlot.sdk import AsyncSandlot

__all__ = ["Sandbox", "SyncClientBase"]

#: The async client a sync facade runs: the in-process SDK or the HTTP client.
AsyncT = TypeVar("AsyncT", "AsyncSandlot", "AsyncClient")
T = TypeVar("T")


@final
class Sandbox:
    """A handle on one sandbox, in this process or on a server. ``with`` destroys it on exit."""

    def __init__(self, client: SyncClientBase[Any], handle: AsyncSandbox) -> None:
        self._client = client
        self._loop = client._loop
        self._async = handle

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self._async.id

    @property
    def status(self) -> SandboxStatus:
        """The status as last seen."""
        return self._async.status

    @property
    def info(self) -> SandboxInfo:
        """The record as last seen (``refresh()`` reads it again)."""
        return self._async.info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.status} on {self.info.backend}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    def refresh(self) -> SandboxInfo:
        """Read the record again."""
        return self._loop.run(self._async.refresh())

    def exec(
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
        """Run a command to completion; see :meth:`AsyncSandbox.exec`."""
        return self._loop.run(
            self._async.exec(
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                stdin=stdin,
                on_output=on_output,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                check=check,
                auto_resume=auto_resume,
                idempotency_key=idempotency_key,
                collect_output=collect_output,
            )
        )

    def read_file(self, path: str) -> bytes:
        """A file's bytes."""
        return self._loop.run(self._async.read_file(path))

    def stream_file(self, path: str) -> Iterator[bytes]:
        """A file's bytes in chunks."""
        return self._loop.iterate(self._async.stream_file(path))

    def write_file(
        self,
        path: str,
        data: bytes | str | IO[bytes] | Iterable[bytes],
        *,
        mode: int | None = None,
        idempotency_key: str | None = None,
    ) -> FileInfo:
        """Create or replace a file; a binary file object or an iterable of chunks is
        streamed, never held whole in memory."""
        # A plain iterable becomes chunks read off the event loop (a generator may block).
        body = file_body(data)
        return self._loop.run(
            self._async.write_file(path, body, mode=mode, idempotency_key=idempotency_key)
        )

    def write_files(
        self, files: Mapping[str, bytes | str], *, idempotency_key: str | None = None
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        return self._loop.run(self._async.write_files(files, idempotency_key=idempotency_key))

    def list_files(self, path: str | None = None) -> builtins.list[FileInfo]:
        """A directory's entries (default: the workdir)."""
        return self._loop.run(self._async.list_files(path))

    def remove_file(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file or a tree."""
        self._loop.run(self._async.remove_file(path, recursive=recursive))

    def logs(self, *, follow: bool = False, offset: int = 0) -> Iterator[bytes]:
        """The main process's output; ``follow`` keeps tailing it."""
        return self._loop.iterate(self._async.logs(follow=follow, offset=offset))

    def start_process(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background; see :meth:`AsyncSandbox.start_process`."""
        return self._loop.run(self._async.start_process(command, cwd=cwd, env=env, name=name))

    def list_processes(self) -> builtins.list[ProcessInfo]:
        """Background processes, running and recently exited."""
        return self._loop.run(self._async.list_processes())

    def signal_process(self, process_id: str, signum: int = 15) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree."""
        self._loop.run(self._async.signal_process(process_id, signum))

    def wait_process(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits; its final record."""
        return self._loop.run(self._async.wait_process(process_id, timeout=timeout))

    def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> Iterator[OutputChunk]:
        """A background process's output from chunk ``offset``; ``follow`` keeps yielding
        until it exits."""
        return self._loop.iterate(
            self._async.process_output(process_id, offset=offset, follow=follow)
        )

    def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Feed a background process's standard input; ``close`` closes it afterwards."""
        self._loop.run(self._async.write_stdin(process_id, data, close=close))

    def open_pty(
        self,
        command: Command | Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Terminal:
        """Start a program (default ``sh``) on a new interactive terminal; see
        :meth:`AsyncSandbox.open_pty`."""
        handle = self._loop.run(
            self._async.open_pty(command, rows=rows, cols=cols, cwd=cwd, env=env)
        )
        return Terminal(handle, self._loop)

    def stop(self) -> SandboxInfo:
        """Stop every process; the filesystem stays."""
        return self._loop.run(self._async.stop())

    def resume(self) -> SandboxInfo:
        """Boot it again."""
        return self._loop.run(self._async.resume())

    def destroy(
        self, *, idempotency_key: str | None = None, forget_host: bool = False
    ) -> SandboxInfo:
        """Remove it for good; see :meth:`AsyncSandbox.destroy`."""
        return self._loop.run(
            self._async.destroy(idempotency_key=idempotency_key, forget_host=forget_host)
        )

    def keep_alive(self, seconds: float) -> SandboxInfo:
        """Push the time to live out."""
        return self._loop.run(self._async.keep_alive(seconds))

    def snapshot(self) -> SnapshotInfo:
        """Save its state."""
        return self._loop.run(self._async.snapshot())

    def restore(self, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot's state."""
        return self._loop.run(self._async.restore(snapshot_id))

    def fork(self, count: int = 1) -> builtins.list[Sandbox]:
        """Make ``count`` new sandboxes from its current state."""
        return [Sandbox(self._client, h) for h in self._loop.run(self._async.fork(count))]

    def expose_port(self, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        return self._loop.run(self._async.expose_port(port))

    def list_ports(self) -> builtins.list[PortMapping]:
        """Published ports."""
        return self._loop.run(self._async.list_ports())

    def reset(self, snapshot_id: str | None = None) -> SandboxInfo:
        """Return to a snapshot (default: as created), verified."""
        return self._loop.run(self._async.reset(snapshot_id))

    def update_network(self, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy."""
        return self._loop.run(self._async.update_network(policy))

    def network_log(self) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision the sandbox's proxy logged."""
        return self._loop.run(self._async.network_log())

    def suggest_network(self) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        return self._loop.run(self._async.suggest_network())

    def explain(self, action: str, **args: object) -> Explanation:
        """What the policy would decide about an operation here, and why (nothing runs)."""
        return self._loop.run(self._async.explain(action, **args))


class SyncClientBase(Generic[AsyncT]):
    """The sync client methods, written once for :class:`Sandlot` and the HTTP ``Client``.

    A subclass's constructor starts ``self._loop`` and builds ``self._async`` on it.
    """

    _loop: EventLoopThread
    _async: AsyncT

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close connections (sandboxes keep running)."""
        if self._loop.loop.is_closed():
            return
        self._loop.run(self._async.aclose())
        self._loop.close()

    def create(
        self,
        spec: SandboxSpec | Mapping[str, JsonValue] | None = None,
        *,
        backend: str | None = None,
        on_setup_output: OutputCallback | None = None,
        idempotency_key: str | None = None,
        **fields: object,
    ) -> Sandbox:
        """Create a sandbox; see :meth:`AsyncSandlot.create` (``with`` destroys it on exit)."""
        handle = self._loop.run(
            _awaited(
                self._async.create(
                    spec,
                    backend=backend,
                    on_setup_output=on_setup_output,
                    idempotency_key=idempotency_key,
                    **fields,
                )
            )
        )
        return Sandbox(self, handle)

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self, self._loop.run(self._async.get(sandbox_id)))

    def list(
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
        return self._loop.run(
            self._async.list(
                labels=labels,
                status=status,
                backend=backend,
                owner=owner,
                include_destroyed=include_destroyed,
                limit=limit,
                offset=offset,
            )
        )

    def fork(self, source: str, count: int = 1) -> builtins.list[Sandbox]:
        """New sandboxes from a snapshot id or a sandbox id."""
        return [Sandbox(self, h) for h in self._loop.run(self._async.fork(source, count))]

    def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first."""
        return self._loop.run(self._async.list_snapshots(sandbox_id))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        self._loop.run(self._async.delete_snapshot(snapshot_id))

    def list_approvals(self, status: str | None = "pending") -> builtins.list[Approval]:
        """Operations held for approval, newest first."""
        return self._loop.run(self._async.list_approvals(status))

    def approve(self, approval_id: str) -> Approval:
        """Let a held operation run."""
        return self._loop.run(self._async.approve(approval_id))

    def deny(self, approval_id: str) -> Approval:
        """Refuse a held operation."""
        return self._loop.run(self._async.deny(approval_id))

    def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Sync records with the backends and reap orphans (on a server: admin keys only)."""
        return self._loop.run(self._async.reconcile(ids))

    def stop_expired(self) -> ReconcileReport:
        """Stop sandboxes past their TTL or idle timeout and destroy failed creations kept
        past their time for inspection (on a server: admin keys only)."""
        return self._loop.run(self._async.stop_expired())


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable
