"""A channel that forwards to another: the base of the backends' channels.

A backend's channel is the agent connection plus what only the host knows (a sandbox's default
environment and working directory, its network's proxy variables, the cgroup's OOM counter).
:class:`ForwardingChannel` forwards every :class:`~sandlot.channel.base.Channel` call to the
agent connection unchanged, except that what it starts (commands, background processes,
terminals) gets :meth:`~ForwardingChannel.start_env` and :meth:`~ForwardingChannel.start_cwd`;
a subclass overrides those two hooks, or a call, and nothing else. Imports only the channel
protocol and the models.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from sandlot.channel.base import Channel, OutputCallback, PtySession, Stdin
from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo

__all__ = ["ForwardingChannel"]


class ForwardingChannel:
    """A :class:`~sandlot.channel.base.Channel` that forwards to ``inner`` (closing this one
    closes it)."""

    def __init__(self, inner: Channel) -> None:
        self._inner = inner

    def start_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
        """The environment a start gets, from the caller's (default: the caller's)."""
        return env

    def start_cwd(self, cwd: str | None) -> str | None:
        """The working directory a start gets, from the caller's (default: the caller's)."""
        return cwd

    @property
    def closed(self) -> bool:
        """True once the underlying agent connection is gone."""
        return self._inner.closed

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
        """Run a command to completion."""
        return await self._inner.exec(
            argv,
            cwd=self.start_cwd(cwd),
            env=self.start_env(env),
            timeout=timeout,
            stdin=stdin,
            on_output=on_output,
            collect=collect,
        )

    async def start_process(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        log_path: str | None = None,
    ) -> ProcessInfo:
        """Start a background process."""
        return await self._inner.start_process(
            argv,
            cwd=self.start_cwd(cwd),
            env=self.start_env(env),
            name=name,
            log_path=log_path,
        )

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes."""
        return await self._inner.list_processes()

    async def signal_process(self, process_id: str, signum: int) -> None:
        """Signal a background process's tree."""
        await self._inner.signal_process(process_id, signum)

    async def wait_process(self, process_id: str, timeout: float | None = None) -> ProcessInfo:
        """Wait for a background process."""
        return await self._inner.wait_process(process_id, timeout)

    def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output."""
        return self._inner.process_output(process_id, offset=offset, follow=follow)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> None:
        """Feed a background process's stdin."""
        await self._inner.write_stdin(process_id, data, close=close)

    async def open_pty(
        self,
        argv: list[str],
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> PtySession:
        """A program on a new terminal."""
        return await self._inner.open_pty(
            argv, rows=rows, cols=cols, cwd=self.start_cwd(cwd), env=self.start_env(env)
        )

    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """A path with its symlinks resolved inside the sandbox."""
        return await self._inner.resolve(path, follow_last=follow_last)

    def read_file(self, path: str, *, nofollow: bool = False) -> AsyncIterator[bytes]:
        """A file's bytes, resolved inside the sandbox."""
        return self._inner.read_file(path, nofollow=nofollow)

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        nofollow: bool = False,
    ) -> FileInfo:
        """Create or replace a file inside the sandbox."""
        return await self._inner.write_file(path, data, mode=mode, nofollow=nofollow)

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """A directory's entries."""
        return await self._inner.list_files(path, nofollow=nofollow)

    async def stat(self, path: str) -> FileInfo:
        """One entry."""
        return await self._inner.stat(path)

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents."""
        await self._inner.mkdir(path)

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file or a tree."""
        await self._inner.remove(path, recursive=recursive, nofollow=nofollow)

    async def chmod(self, path: str, mode: int) -> None:
        """Change permission bits."""
        await self._inner.chmod(path, mode)

    def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file's bytes from an offset, optionally following appends."""
        return self._inner.follow_file(path, offset=offset, follow=follow)

    async def close(self) -> None:
        """Close the agent connection."""
        await self._inner.close()
