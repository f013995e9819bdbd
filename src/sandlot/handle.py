"""The one sandbox handle, :class:`AsyncSandbox`, and the seam it runs over, :class:`ControlPlane`.

    sb = await client.create()          # client: an AsyncSandlot or an AsyncClient
    result = await sb.exec("uname -a")  # the same class either way

The in-process SDK (:mod:`sandlot.sdk`) and the HTTP client (:mod:`sandlot.client`) hand out
this same class. What differs is where an operation goes: a :class:`ControlPlane` carries each
one either to a Manager in this process (:class:`sandlot.sdk.ManagerPlane`) or to a server over
HTTP (:class:`sandlot.client.plane.HttpPlane`). Everything a caller sees of a handle (defaults,
argument shaping, which record it keeps, what ``async with`` does) is written here once.

Requests go down as one model each (:class:`~sandlot.wire.ExecRequest`,
:class:`~sandlot.wire.StartProcessRequest`) where the parameters are plain data; what cannot
travel as data (input streams, output callbacks, idempotency keys, which HTTP carries as a
header) goes beside it. The models are built unvalidated (``model_construct``): validation stays
where it was, in the Manager and in the server, so errors are the same classes as before.

This module must not import the Manager, the store, backends, the server or any web client:
the HTTP client imports it.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Protocol, Self, final

import anyio

from sandlot.models import (
    Command,
    CommandSpec,
    ExecResult,
    Explanation,
    FileInfo,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxInfo,
    SandboxStatus,
    SnapshotInfo,
)
from sandlot.shared import file_body, split_output
from sandlot.terminal import AsyncTerminal
from sandlot.wire import ExecRequest, StartProcessRequest

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback, PtySession, Stdin

__all__ = ["AsyncSandbox", "ControlPlane"]


class ControlPlane(Protocol):
    """Where a sandbox handle's operations go: one method per operation, keyed by sandbox id.

    Implementations: :class:`sandlot.sdk.ManagerPlane` (a Manager in this process, acting as
    the SDK's actor) and :class:`sandlot.client.plane.HttpPlane` (a server, as the client's
    key). Each returns what the Manager returns; errors are sandlot's classes either way.
    """

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox's record."""
        ...

    async def exec(
        self,
        sandbox_id: str,
        request: ExecRequest,
        *,
        stdin: Stdin,
        on_output: OutputCallback | None,
        idempotency_key: str | None,
    ) -> ExecResult:
        """Run ``request`` to completion (``request.stdin``/``stdin_stream`` are unused:
        ``stdin`` is the input, bytes or chunks)."""
        ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """A file's bytes."""
        ...

    def stream_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """A file's bytes in chunks."""
        ...

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        body: bytes | AsyncIterator[bytes],
        *,
        mode: int | None,
        idempotency_key: str | None,
    ) -> FileInfo:
        """Create or replace one file from bytes or streamed chunks."""
        ...

    async def write_files(
        self,
        sandbox_id: str,
        files: Mapping[str, bytes | str],
        *,
        idempotency_key: str | None,
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        ...

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        """A directory's entries."""
        ...

    async def remove_file(self, sandbox_id: str, path: str, *, recursive: bool) -> None:
        """Remove a file or a tree."""
        ...

    def logs(self, sandbox_id: str, *, follow: bool, offset: int) -> AsyncIterator[bytes]:
        """The main process's output."""
        ...

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        """Start a background process."""
        ...

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        """Background processes."""
        ...

    async def signal_process(self, sandbox_id: str, process_id: str, signum: int) -> None:
        """Signal a background process's tree."""
        ...

    async def wait_process(
        self, sandbox_id: str, process_id: str, *, timeout: float | None
    ) -> ProcessInfo:
        """Wait for a background process to exit."""
        ...

    def process_output(
        self, sandbox_id: str, process_id: str, *, offset: int, follow: bool
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output chunks."""
        ...

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, close: bool
    ) -> None:
        """Feed a background process's standard input."""
        ...

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
        """Start a program on a new terminal."""
        ...

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        """Stop it."""
        ...

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Boot it again."""
        ...

    async def destroy(
        self, sandbox_id: str, *, idempotency_key: str | None, forget_host: bool
    ) -> SandboxInfo:
        """Remove it for good."""
        ...

    async def keep_alive(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        """Push its time to live out."""
        ...

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Save its state."""
        ...

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot."""
        ...

    async def fork(self, source: str, count: int) -> builtins.list[SandboxInfo]:
        """New sandboxes from a sandbox id or a snapshot id."""
        ...

    async def expose_port(self, sandbox_id: str, port: int) -> PortMapping:
        """Publish a port."""
        ...

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortMapping]:
        """Published ports."""
        ...

    async def reset(self, sandbox_id: str, snapshot_id: str | None) -> SandboxInfo:
        """Return to a snapshot, verified."""
        ...

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy."""
        ...

    async def network_log(self, sandbox_id: str) -> builtins.list[dict[str, JsonValue]]:
        """The egress decisions logged."""
        ...

    async def suggest_network(self, sandbox_id: str) -> NetworkAllowlist:
        """The least-privilege allowlist."""
        ...

    async def explain(self, sandbox_id: str, action: str, args: dict[str, object]) -> Explanation:
        """What the policy would decide."""
        ...


def _command(command: Command | Sequence[str]) -> str | CommandSpec | list[str]:
    # The model's one shape for "a string, a spec or an argv"; list() is what the Manager and
    # the HTTP body did with any other sequence.
    if isinstance(command, str | CommandSpec):
        return command
    return list(command)


@final
class AsyncSandbox:
    """A handle on one sandbox, in this process or on a server. ``async with`` destroys it on
    exit."""

    def __init__(self, plane: ControlPlane, info: SandboxInfo) -> None:
        self._plane = plane
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
        self.info = await self._plane.get(self.id)
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
            stdin: Input bytes, or an async iterable of chunks (streamed while it runs).
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
        request = ExecRequest.model_construct(
            command=_command(command),
            cwd=cwd,
            env=dict(env or {}),
            timeout=timeout,
            check=check,
            auto_resume=auto_resume,
            collect_output=collect_output,
        )
        return await self._plane.exec(
            self.id,
            request,
            stdin=stdin,
            on_output=split_output(on_output, on_stdout, on_stderr),
            idempotency_key=idempotency_key,
        )

    async def read_file(self, path: str) -> bytes:
        """A file's bytes (over HTTP, checked against the server's SHA-256)."""
        return await self._plane.read_file(self.id, path)

    async def stream_file(self, path: str) -> AsyncIterator[bytes]:
        """A file's bytes in chunks, for files too big to hold in memory.

        Over HTTP the SHA-256 the server sent is checked at the end: a mismatch raises
        ``BackendError`` after the last chunk.
        """
        async for chunk in self._plane.stream_file(self.id, path):
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
        return await self._plane.write_file(
            self.id, path, file_body(data), mode=mode, idempotency_key=idempotency_key
        )

    async def write_files(
        self, files: Mapping[str, bytes | str], *, idempotency_key: str | None = None
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        return await self._plane.write_files(self.id, files, idempotency_key=idempotency_key)

    async def list_files(self, path: str | None = None) -> builtins.list[FileInfo]:
        """A directory's entries (default: the workdir)."""
        return await self._plane.list_files(self.id, path or self.info.spec.workdir)

    async def remove_file(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``."""
        await self._plane.remove_file(self.id, path, recursive=recursive)

    async def logs(self, *, follow: bool = False, offset: int = 0) -> AsyncIterator[bytes]:
        """The main process's output; ``follow`` keeps tailing it (over HTTP, across
        reconnects)."""
        async for chunk in self._plane.logs(self.id, follow=follow, offset=offset):
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
        request = StartProcessRequest.model_construct(
            command=_command(command), cwd=cwd, env=dict(env or {}), name=name
        )
        return await self._plane.start_process(self.id, request)

    async def list_processes(self) -> builtins.list[ProcessInfo]:
        """Background processes (the main process among them), running and recently exited."""
        return await self._plane.list_processes(self.id)

    async def signal_process(self, process_id: str, signum: int = 15) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree."""
        await self._plane.signal_process(self.id, process_id, signum)

    async def wait_process(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits; its final record (``SandboxTimeout`` when
        ``timeout`` seconds pass first)."""
        return await self._plane.wait_process(self.id, process_id, timeout=timeout)

    async def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset``; ``follow`` keeps yielding
        until it exits. Resume after a chunk with ``offset=chunk.seq + 1``."""
        async for chunk in self._plane.process_output(
            self.id, process_id, offset=offset, follow=follow
        ):
            yield chunk

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Feed a background process's standard input (strings as UTF-8); ``close`` closes it
        afterwards (the program reads end of file)."""
        body = data.encode() if isinstance(data, str) else bytes(data)
        await self._plane.write_stdin(self.id, process_id, body, close=close)

    async def open_pty(
        self,
        command: Command | Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> AsyncTerminal:
        """Start a program (default ``sh``) on a new interactive terminal (over HTTP, a
        WebSocket).

        Write keystrokes, read output, resize; the terminal ends when the program exits.
        ``async with`` closes it (the program gets SIGHUP).
        """
        session = await self._plane.open_pty(
            self.id, command, rows=rows, cols=cols, cwd=cwd, env=env
        )
        return AsyncTerminal(session, self.id)

    async def stop(self) -> SandboxInfo:
        """Stop every process; the filesystem stays."""
        self.info = await self._plane.stop(self.id)
        return self.info

    async def resume(self) -> SandboxInfo:
        """Boot it again and relaunch its ``resume`` command."""
        self.info = await self._plane.resume(self.id)
        return self.info

    async def destroy(
        self, *, idempotency_key: str | None = None, forget_host: bool = False
    ) -> SandboxInfo:
        """Remove it for good (the record stays, hidden, with a death certificate);
        ``forget_host`` closes the record of a sandbox whose host is gone for good."""
        self.info = await self._plane.destroy(
            self.id, idempotency_key=idempotency_key, forget_host=forget_host
        )
        return self.info

    async def keep_alive(self, seconds: float) -> SandboxInfo:
        """Push the time to live out to ``seconds`` from now."""
        self.info = await self._plane.keep_alive(self.id, seconds)
        return self.info

    async def snapshot(self) -> SnapshotInfo:
        """Save its state."""
        return await self._plane.snapshot(self.id)

    async def restore(self, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot's state."""
        self.info = await self._plane.restore(self.id, snapshot_id)
        return self.info

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """Make ``count`` new sandboxes from its current state."""
        infos = await self._plane.fork(self.id, count)
        return [AsyncSandbox(self._plane, i) for i in infos]

    async def expose_port(self, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        mapping = await self._plane.expose_port(self.id, port)
        await self.refresh()
        return mapping

    async def list_ports(self) -> builtins.list[PortMapping]:
        """Published ports."""
        return await self._plane.list_ports(self.id)

    async def reset(self, snapshot_id: str | None = None) -> SandboxInfo:
        """Return to a snapshot (default: the state it was created in), verified; a failed
        verification raises ``VerificationFailed`` naming what diverged."""
        self.info = await self._plane.reset(self.id, snapshot_id)
        return self.info

    async def update_network(self, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy (``"deny-all"``, ``"allow-all"`` or an allowlist)."""
        self.info = await self._plane.update_network(self.id, policy)
        return self.info

    async def network_log(self) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision the sandbox's proxy logged."""
        return await self._plane.network_log(self.id)

    async def suggest_network(self) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        return await self._plane.suggest_network(self.id)

    async def explain(self, action: str, **args: object) -> Explanation:
        """What the policy would decide about an operation here, and why (nothing runs).

        ``sb.explain("exec", command="rm -rf /")``, ``sb.explain("fs.write", path="/etc/x")``.
        """
        return await self._plane.explain(self.id, action, args)


if TYPE_CHECKING:
    from sandlot.api import SandboxAPI

    # mypy checks the handle against the documented protocol here, member by member.
    _IMPLEMENTS: type[SandboxAPI] = AsyncSandbox
