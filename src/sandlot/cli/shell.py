"""``sandlot shell ID``: an interactive terminal in a sandbox, like ``ssh`` into it.

The local terminal is put in raw mode, so every keystroke (Ctrl-C, arrows, tab) goes to the
program inside, and restored however the session ends; its window size follows this terminal
(SIGWINCH). Input that is not a terminal (a pipe, a file) is sent as typed lines and ends with
Ctrl-D. The command exits with the program's exit code. Like every command it runs on the
embedded Manager, or against a server when ``SANDLOT_URL`` is set (the terminal is then a
WebSocket). This module is a front end: it calls the SDK surface and nothing below it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _run, app
from sandlot.cli.options import EnvOpt, IdArg
from sandlot.cli.spec import parse_pairs
from sandlot.errors import SandboxError

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.terminal import AsyncTerminal

__all__ = ["shell"]

_EOF = b"\x04"
"""Ctrl-D: the end of input for a program reading a terminal in cooked mode."""


@app.command()
def shell(
    sandbox_id: IdArg,
    command: Annotated[
        list[str] | None,
        typer.Argument(help="Program and arguments (default: sh). Put them after --."),
    ] = None,
    cwd: Annotated[
        str | None, typer.Option("--cwd", "-w", help="Working directory inside the sandbox.")
    ] = None,
    env: EnvOpt = None,
) -> None:
    """Open an interactive terminal in a sandbox; exits with the program's exit code."""
    variables = parse_pairs(env, "--env")

    async def body(client: SandlotAPI) -> int:
        rows, cols = _window_size()
        sb = await client.get(sandbox_id)
        term = await sb.open_pty(command or None, rows=rows, cols=cols, cwd=cwd, env=variables)
        async with term:
            with _raw_mode(sys.stdin.fileno()):
                return await _relay(term)

    raise typer.Exit(_run(False, body))


def _window_size() -> tuple[int, int]:
    size = shutil.get_terminal_size()
    return max(1, size.lines), max(1, size.columns)


@contextlib.contextmanager
def _raw_mode(fd: int) -> Iterator[None]:
    """Raw mode on ``fd`` while inside (a no-op when it is not a terminal)."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _relay(term: AsyncTerminal) -> int:
    """Copy keystrokes in and output out until the program exits; its exit code."""
    import anyio
    import anyio.to_thread

    stdin = sys.stdin.fileno()
    interactive = os.isatty(stdin)
    ended = threading.Event()

    def read_some() -> bytes | None:
        # In a worker thread, since stdin may be a file (which no event loop can wait on),
        # and never blocked for good: the interpreter waits for its worker threads at exit,
        # so a thread stuck reading a terminal kept the command alive until a key was typed.
        while not ended.is_set():
            ready, _, _ = select.select([stdin], [], [], 0.2)
            if ready:
                return os.read(stdin, 65536)
        return None

    async def keystrokes() -> None:
        while True:
            data = await anyio.to_thread.run_sync(read_some, abandon_on_cancel=True)
            if data is None:
                return
            # A write that fails (the program just exited) is not this side's error: the
            # output side reports how the program ended.
            with contextlib.suppress(SandboxError):
                if not data:
                    if not interactive:
                        await term.write(_EOF)
                    return
                await term.write(data)

    async def window() -> None:
        with anyio.open_signal_receiver(signal.SIGWINCH) as signals:
            async for _ in signals:
                with contextlib.suppress(SandboxError):
                    await term.resize(*_window_size())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keystrokes)
            tg.start_soon(window)
            out = sys.stdout.buffer
            async for data in term:
                out.write(data)
                out.flush()
            code = await term.wait()
            tg.cancel_scope.cancel()
    finally:
        ended.set()  # however it ended (the server gone too): the reader thread lets go
    return code
