"""The channel the local backend hands out: the agent client plus what only the host knows.

It forwards everything to the agent connection and adds two things the agent cannot do on its
own: the sandbox's default environment and working directory from its spec (a sandbox claimed
from the warm pool was booted before its spec was known), and ``ExecResult.oom_killed``, read
from the sandbox's memory cgroup on the host (a counter the sandbox cannot forge). Must not
import the store or the Manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import final

from sandlot.channel.base import Channel, OutputCallback, PtySession, Stdin
from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo

__all__ = ["LocalChannel", "read_oom_kills"]


def read_oom_kills(files: list[Path]) -> int:
    """The ``oom_kill`` counter from a cgroup v1 ``memory.oom_control`` or v2 ``memory.events``
    (0 when unreadable)."""
    for path in files:
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return 0


@final
class LocalChannel:
    """A :class:`~sandlot.channel.base.Channel` to one local sandbox."""

    def __init__(
        self,
        inner: Channel,
        *,
        env: dict[str, str],
        workdir: str,
        oom_files: Callable[[], list[Path]],
    ) -> None:
        self._inner = inner
        self._env = env
        self._workdir = workdir
        self._oom_files = oom_files

    @property
    def closed(self) -> bool:
        """True once the underlying agent connection is gone."""
        return self._inner.closed

    def _merge(self, env: dict[str, str] | None) -> dict[str, str] | None:
        if not self._env:
            return env
        return {**self._env, **(env or {})}

    async def exec(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        """Run a command; ``oom_killed`` is set when the memory cgroup killed it."""
        files = self._oom_files()
        before = read_oom_kills(files)
        result = await self._inner.exec(
            argv,
            cwd=cwd or self._workdir,
            env=self._merge(env),
            timeout=timeout,
            stdin=stdin,
            on_output=on_output,
        )
        if (
            result.signal == 9
            and not result.timed_out
            and not result.oom_killed
            and read_oom_kills(files) > before
        ):
            result = result.model_copy(update={"oom_killed": True})
        return result

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
            argv, cwd=cwd or self._workdir, env=self._merge(env), name=name, log_path=log_path
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
            argv, rows=rows, cols=cols, cwd=cwd or self._workdir, env=self._merge(env)
        )

    def read_file(self, path: str) -> AsyncIterator[bytes]:
        """A file's bytes, resolved inside the sandbox."""
        return self._inner.read_file(path)

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], *, mode: int | None = None
    ) -> FileInfo:
        """Create or replace a file inside the sandbox."""
        return await self._inner.write_file(path, data, mode=mode)

    async def list_files(self, path: str) -> list[FileInfo]:
        """A directory's entries."""
        return await self._inner.list_files(path)

    async def stat(self, path: str) -> FileInfo:
        """One entry."""
        return await self._inner.stat(path)

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents."""
        await self._inner.mkdir(path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file or a tree."""
        await self._inner.remove(path, recursive=recursive)

    async def chmod(self, path: str, mode: int) -> None:
        """Change permission bits."""
        await self._inner.chmod(path, mode)

    def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file's bytes from an offset, optionally following appends."""
        return self._inner.follow_file(path, offset=offset, follow=follow)

    async def close(self) -> None:
        """Close the connection."""
        await self._inner.close()
