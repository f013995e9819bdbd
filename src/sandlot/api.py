"""sandlot's API as types: :class:`SandlotAPI` (a client) and :class:`SandboxAPI` (a sandbox).

    async def run(api: SandlotAPI) -> None:       # an AsyncSandlot or an AsyncClient
        async with api.create(setup="echo ready") as sb:
            print((await sb.exec("uname -a")).stdout)

The in-process SDK (:class:`sandlot.sdk.AsyncSandlot`) and the HTTP client
(:class:`sandlot.client.AsyncClient`) both implement :class:`SandlotAPI`, and both hand out the
one handle class :class:`sandlot.handle.AsyncSandbox`, which implements :class:`SandboxAPI`.
The CLI and the MCP server are written against these protocols, so each runs on an embedded
Manager or against a server alike; a test checks the implementations match them name for name
and signature for signature (``tests/unit/test_api_surface.py``). What each operation does is
documented on the handle and the clients; this module states the shape once.

This module imports only the wire models, the shared helpers' types and, for type checking,
the handle and the terminal: it must not import the Manager, the store, backends or any front
end.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Protocol, Self

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

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback, Stdin
    from sandlot.handle import AsyncSandbox
    from sandlot.shared import Creating
    from sandlot.terminal import AsyncTerminal

__all__ = ["SandboxAPI", "SandlotAPI"]


class SandboxAPI(Protocol):
    """One sandbox: run commands and processes in it, move files, change its lifecycle.

    ``async with`` destroys it on exit. :class:`sandlot.handle.AsyncSandbox` is the
    implementation, whichever client made it.
    """

    info: SandboxInfo
    """The record as last seen (``refresh()`` reads it again)."""

    @property
    def id(self) -> str:
        """The sandbox id."""
        ...

    @property
    def status(self) -> SandboxStatus:
        """The status as last seen."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def refresh(self) -> SandboxInfo:
        """Read the record again."""
        ...

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
        """Run a command to completion (a string runs under ``sh -c``; a list is an argv)."""
        ...

    async def read_file(self, path: str) -> bytes:
        """A file's bytes."""
        ...

    def stream_file(self, path: str) -> AsyncIterator[bytes]:
        """A file's bytes in chunks."""
        ...

    async def write_file(
        self,
        path: str,
        data: bytes | str | IO[bytes] | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        idempotency_key: str | None = None,
    ) -> FileInfo:
        """Create or replace a file (parents are made)."""
        ...

    async def write_files(
        self, files: Mapping[str, bytes | str], *, idempotency_key: str | None = None
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        ...

    async def list_files(self, path: str | None = None) -> builtins.list[FileInfo]:
        """A directory's entries (default: the workdir)."""
        ...

    async def remove_file(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``."""
        ...

    def logs(self, *, follow: bool = False, offset: int = 0) -> AsyncIterator[bytes]:
        """The main process's output; ``follow`` keeps tailing it."""
        ...

    async def start_process(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background and return at once."""
        ...

    async def list_processes(self) -> builtins.list[ProcessInfo]:
        """Background processes, running and recently exited."""
        ...

    async def signal_process(self, process_id: str, signum: int = 15) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree."""
        ...

    async def wait_process(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits; its final record."""
        ...

    def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset``."""
        ...

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Feed a background process's standard input."""
        ...

    async def open_pty(
        self,
        command: Command | Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> AsyncTerminal:
        """Start a program (default ``sh``) on a new interactive terminal."""
        ...

    async def stop(self) -> SandboxInfo:
        """Stop every process; the filesystem stays."""
        ...

    async def resume(self) -> SandboxInfo:
        """Boot it again and relaunch its ``resume`` command."""
        ...

    async def destroy(
        self, *, idempotency_key: str | None = None, forget_host: bool = False
    ) -> SandboxInfo:
        """Remove it for good (the record stays, hidden, with a death certificate)."""
        ...

    async def keep_alive(self, seconds: float) -> SandboxInfo:
        """Push the time to live out to ``seconds`` from now."""
        ...

    async def snapshot(self) -> SnapshotInfo:
        """Save its state."""
        ...

    async def restore(self, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot's state."""
        ...

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """Make ``count`` new sandboxes from its current state."""
        ...

    async def expose_port(self, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        ...

    async def list_ports(self) -> builtins.list[PortMapping]:
        """Published ports."""
        ...

    async def reset(self, snapshot_id: str | None = None) -> SandboxInfo:
        """Return to a snapshot (default: the state it was created in), verified."""
        ...

    async def update_network(self, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy."""
        ...

    async def network_log(self) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision the sandbox's proxy logged."""
        ...

    async def suggest_network(self) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        ...

    async def explain(self, action: str, **args: object) -> Explanation:
        """What the policy would decide about an operation here, and why (nothing runs)."""
        ...


class SandlotAPI(Protocol):
    """A client of sandlot: create, find and list sandboxes; snapshots, approvals, sweeps.

    ``async with`` closes its connections (sandboxes keep running). Implementations:
    :class:`sandlot.sdk.AsyncSandlot` (a Manager in this process) and
    :class:`sandlot.client.AsyncClient` (a server over HTTP).
    """

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def aclose(self) -> None:
        """Close connections (sandboxes keep running)."""
        ...

    def create(
        self,
        spec: SandboxSpec | Mapping[str, JsonValue] | None = None,
        *,
        backend: str | None = None,
        on_setup_output: OutputCallback | None = None,
        idempotency_key: str | None = None,
        **fields: object,
    ) -> Creating[AsyncSandbox]:
        """Create a sandbox from a spec and/or spec fields: ``await`` it, or ``async with``
        it to destroy the sandbox on exit."""
        ...

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox (``NotFound`` names the id)."""
        ...

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
        ...

    async def fork(self, source: str, count: int = 1) -> builtins.list[AsyncSandbox]:
        """New sandboxes from a snapshot id or a sandbox id."""
        ...

    async def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        ...

    async def list_approvals(self, status: str | None = "pending") -> builtins.list[Approval]:
        """Operations held for approval (``status=None`` for all), newest first."""
        ...

    async def approve(self, approval_id: str) -> Approval:
        """Let a held operation run."""
        ...

    async def deny(self, approval_id: str) -> Approval:
        """Refuse a held operation."""
        ...

    async def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Sync records with the backends (on a server: admin keys only)."""
        ...

    async def stop_expired(self) -> ReconcileReport:
        """Stop sandboxes past their TTL or idle timeout (on a server: admin keys only)."""
        ...
