"""Terminal handles: :class:`AsyncTerminal` and its sync twin :class:`Terminal`.

``open_pty`` hands these out, in the in-process SDK and in the HTTP client alike, so code that
drives a terminal does not care where the sandbox is::

    async with await sb.open_pty(rows=40, cols=120) as term:
        await term.write(b"ls\\n")
        print((await term.read()).decode())

A terminal is a byte stream both ways (the program's output arrives with the terminal's own
echo and line endings) plus a window size; it ends when its program exits (``read`` then
returns ``b""`` and ``wait`` the exit code) or when it is closed, which hangs up (the program
gets SIGHUP). This module wraps a :class:`~sandlot.channel.base.PtySession` and must not import
the Manager, backends or any web framework.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Self, final

import anyio

from sandlot.errors import InvalidRequest, SandboxTimeout

if TYPE_CHECKING:
    from sandlot.channel.base import PtySession
    from sandlot.shared import EventLoopThread

__all__ = ["AsyncTerminal", "Terminal"]


def _size(rows: int, cols: int) -> None:
    for what, n in (("rows", rows), ("cols", cols)):
        if not 1 <= n <= 65535:
            msg = f"{what} must be 1..65535, got {n}"
            raise InvalidRequest(msg)


@final
class AsyncTerminal:
    """An interactive terminal inside a sandbox. ``async with`` closes it on exit; ``async
    for`` yields its output until the program exits."""

    def __init__(self, session: PtySession, sandbox_id: str) -> None:
        self._session = session
        self._sandbox_id = sandbox_id
        self._exit_code: int | None = None
        self._closed = False

    @property
    def id(self) -> str:
        """The terminal's handle (unique within its sandbox)."""
        return self._session.id

    @property
    def sandbox_id(self) -> str:
        """The sandbox it runs in."""
        return self._sandbox_id

    @property
    def exit_code(self) -> int | None:
        """The program's exit code once ``wait`` returned it (None before)."""
        return self._exit_code

    def __repr__(self) -> str:
        state = "open" if self._exit_code is None else f"exited {self._exit_code}"
        return f"<AsyncTerminal {self.id} in {self._sandbox_id} {state}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._output()

    async def _output(self) -> AsyncIterator[bytes]:
        while data := await self.read():
            yield data

    async def write(self, data: bytes | str) -> None:
        """Send keystrokes (a string is sent as UTF-8)."""
        await self._session.write(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        """Change the window size (the program gets SIGWINCH)."""
        _size(rows, cols)
        await self._session.resize(rows, cols)

    async def read(self, *, timeout: float | None = None) -> bytes:
        """The next output as it arrives; ``b""`` once the program exited and everything was
        read. ``SandboxTimeout`` when nothing arrives within ``timeout`` seconds."""
        if timeout is None:
            return await self._session.read()
        with anyio.move_on_after(timeout):
            return await self._session.read()
        msg = f"terminal {self.id}: no output within {timeout:g}s"
        raise SandboxTimeout(msg)

    async def wait(self, *, timeout: float | None = None) -> int:
        """Wait for the program to exit; its exit code (``SandboxTimeout`` after
        ``timeout`` seconds, the program still running)."""
        if self._exit_code is not None:
            return self._exit_code
        with anyio.move_on_after(timeout):
            self._exit_code = await self._session.wait()
            return self._exit_code
        msg = f"terminal {self.id}: its program still runs after {timeout:g}s"
        raise SandboxTimeout(msg)

    async def close(self) -> None:
        """Hang up (the program gets SIGHUP, unless it already exited) and release the
        terminal; closing twice is fine."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._session.close()


@final
class Terminal:
    """The sync twin of :class:`AsyncTerminal` (its calls run on the SDK's loop thread).
    ``with`` closes it on exit; iterating yields its output until the program exits."""

    def __init__(self, handle: AsyncTerminal, loop: EventLoopThread) -> None:
        self._async = handle
        self._loop = loop

    @property
    def id(self) -> str:
        """The terminal's handle (unique within its sandbox)."""
        return self._async.id

    @property
    def sandbox_id(self) -> str:
        """The sandbox it runs in."""
        return self._async.sandbox_id

    @property
    def exit_code(self) -> int | None:
        """The program's exit code once ``wait`` returned it (None before)."""
        return self._async.exit_code

    def __repr__(self) -> str:
        return repr(self._async).replace("<AsyncTerminal", "<Terminal", 1)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[bytes]:
        while data := self.read():
            yield data

    def write(self, data: bytes | str) -> None:
        """Send keystrokes (a string is sent as UTF-8)."""
        self._loop.run(self._async.write(data))

    def resize(self, rows: int, cols: int) -> None:
        """Change the window size (the program gets SIGWINCH)."""
        self._loop.run(self._async.resize(rows, cols))

    def read(self, *, timeout: float | None = None) -> bytes:
        """The next output; ``b""`` once the program exited and everything was read."""
        return self._loop.run(self._async.read(timeout=timeout))

    def wait(self, *, timeout: float | None = None) -> int:
        """Wait for the program to exit; its exit code."""
        return self._loop.run(self._async.wait(timeout=timeout))

    def close(self) -> None:
        """Hang up and release the terminal; closing twice is fine."""
        if self._loop.loop.is_closed():
            return
        self._loop.run(self._async.close())
