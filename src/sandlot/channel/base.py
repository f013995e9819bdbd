"""The Channel protocol: how the Manager talks to a running sandbox.

A channel runs commands (streamed output, stdin, timeouts that kill the whole process tree),
holds background processes and PTYs, and moves files in and out. Every backend whose inside we
control hands out the same implementation (the agent client in :mod:`sandlot.channel.client`,
speaking ``docs/agent-protocol.md``); the ``fake`` backend has an in-memory one.

Paths are absolute paths *inside* the sandbox and are resolved inside it, so a symlink the
sandbox planted cannot lead the host outside. This module must not import backends or the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Protocol

from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo

__all__ = ["Channel", "OutputCallback", "PtySession", "Stdin"]

OutputCallback = Callable[[OutputChunk], Awaitable[None] | None]
"""Called with each chunk of output as it arrives (sync or async)."""

Stdin = bytes | AsyncIterable[bytes] | None
"""Input for a command: all at once, streamed (closed when the iterable ends), or none."""

MAIN_LOG = "/var/log/sandlot/main.log"
"""Where the main process's output is appended inside every sandbox."""


class PtySession(Protocol):
    """An interactive terminal inside a sandbox."""

    @property
    def id(self) -> str:
        """A handle for the terminal (unique within the sandbox)."""
        ...

    async def write(self, data: bytes) -> None:
        """Send keystrokes."""
        ...

    async def resize(self, rows: int, cols: int) -> None:
        """Change the window size."""
        ...

    async def read(self) -> bytes:
        """The next output; ``b""`` once the terminal's program exited and all was read."""
        ...

    async def wait(self) -> int:
        """Wait for the program to exit; its exit code."""
        ...

    async def close(self) -> None:
        """Hang up (the program gets SIGHUP) and release the terminal."""
        ...


class Channel(Protocol):
    """Commands, processes, terminals and files of one running sandbox.

    A channel can go stale behind its holder's back (the sandbox stopped, a microVM snapshot
    closed the connection); ``closed`` says so, and the holder asks the backend for a new one.
    """

    @property
    def closed(self) -> bool:
        """True once the channel can no longer be used."""
        ...

    async def exec(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        collect: bool = True,
    ) -> ExecResult:
        """Run a command to completion.

        Output is streamed to ``on_output`` as it arrives and also collected into the result
        (``collect=False``: only streamed, for output too big to hold; the result's ``stdout``
        and ``stderr`` are then empty). On ``timeout`` the whole process tree is killed and the
        result says ``timed_out``.
        """
        ...

    async def start_process(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        log_path: str | None = None,
    ) -> ProcessInfo:
        """Start a background process; its output is buffered (and appended to ``log_path``)."""
        ...

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes, running and exited."""
        ...

    async def signal_process(self, process_id: str, signum: int) -> None:
        """Send a signal to a background process's whole tree."""
        ...

    async def wait_process(self, process_id: str, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits (``SandboxTimeout`` after ``timeout``)."""
        ...

    def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """Buffered output of a background process from chunk ``offset``; with ``follow``,
        keep yielding until it exits."""
        ...

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> None:
        """Feed a background process's stdin (and close it after, when asked)."""
        ...

    async def open_pty(
        self,
        argv: list[str],
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> PtySession:
        """Start a program on a new terminal."""
        ...

    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """``path`` with its symlinks resolved inside the sandbox's root, so a policy decides
        on what an operation will touch; without ``follow_last`` a link in the last place is
        kept (writes replace it, removes remove it)."""
        ...

    def read_file(self, path: str, *, nofollow: bool = False) -> AsyncIterator[bytes]:
        """A file's bytes in chunks (no size cap). With ``nofollow`` a symlink anywhere in
        ``path`` is an error: the path must be one :meth:`resolve` returned."""
        ...

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        nofollow: bool = False,
    ) -> FileInfo:
        """Create or replace a file (parents are made); atomic for readers inside.
        ``nofollow``: a symlink in a parent is an error (a final one is replaced)."""
        ...

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """A directory's entries, sorted by name (``nofollow`` as for :meth:`read_file`)."""
        ...

    async def stat(self, path: str) -> FileInfo:
        """One entry (``NotFound`` when absent)."""
        ...

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents (no error if it exists)."""
        ...

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``. ``nofollow``: a symlink in a
        parent is an error (a final one is removed itself)."""
        ...

    async def chmod(self, path: str, mode: int) -> None:
        """Change permission bits."""
        ...

    def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file's bytes from byte ``offset``; with ``follow``, keep yielding what is appended
        until the caller stops iterating."""
        ...

    async def close(self) -> None:
        """Release the connection (the sandbox keeps running)."""
        ...
