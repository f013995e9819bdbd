"""What runs inside a fake sandbox: the built-in commands and the toy terminal.

:func:`run_builtin` answers the handful of commands the fake knows when no ``exec_handler``
does; :class:`FakePty` is its terminal. Imports :mod:`.sandbox` and the wire models only.
"""

from __future__ import annotations

import posixpath
import shlex

import anyio

from sandlot.backends.fake.sandbox import FakeExec
from sandlot.errors import BackendError
from sandlot.models import ExecResult

__all__ = ["FakePty", "run_builtin"]


class FakePty:
    """A terminal in miniature: echoes keystrokes (as a terminal in cooked mode does) and runs
    a line-oriented toy shell: ``stty size`` answers the size, ``exit [N]`` ends it."""

    def __init__(self, pty_id: str, argv: list[str], rows: int, cols: int) -> None:
        self._id = pty_id
        self.argv = argv
        self.rows, self.cols = rows, cols
        self.exit_code: int | None = None
        self._buffer = bytearray()
        self._line = bytearray()
        self._changed = anyio.Event()

    @property
    def id(self) -> str:
        return self._id

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def write(self, data: bytes) -> None:
        if self.exit_code is not None:
            msg = f"terminal {self._id} has exited"
            raise BackendError(msg)
        for byte in data:
            if byte in (0x0D, 0x0A):
                self._buffer.extend(b"\r\n")
                self._run(self._line.decode(errors="replace").strip())
                self._line.clear()
                if self.exit_code is not None:
                    break
            else:
                self._buffer.append(byte)
                self._line.append(byte)
        self._notify()

    def _run(self, line: str) -> None:
        words = line.split()
        if words == ["stty", "size"]:
            self._buffer.extend(f"{self.rows} {self.cols}\r\n".encode())
        elif words[:1] == ["exit"]:
            self.exit_code = int(words[1]) if len(words) > 1 and words[1].isdigit() else 0

    async def resize(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols

    async def read(self) -> bytes:
        while not self._buffer and self.exit_code is None:
            await self._changed.wait()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def wait(self) -> int:
        while self.exit_code is None:
            await self._changed.wait()
        return self.exit_code

    async def close(self) -> None:
        if self.exit_code is None:
            self.exit_code = 129  # hung up: 128 + SIGHUP
        self._notify()


async def run_builtin(req: FakeExec) -> ExecResult:
    """A few commands, enough to try the CLI and the SDK on the fake backend."""
    argv = req.argv
    if len(argv) >= 3 and posixpath.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
        try:
            argv = shlex.split(argv[2])
        except ValueError:
            return ExecResult(exit_code=2, stderr="fake sh: cannot parse command\n")
    if not argv:
        return ExecResult(exit_code=0)
    prog, args = posixpath.basename(argv[0]), argv[1:]
    if prog == "echo":
        return ExecResult(exit_code=0, stdout=" ".join(args) + "\n")
    if prog == "true":
        return ExecResult(exit_code=0)
    if prog == "false":
        return ExecResult(exit_code=1)
    if prog == "exit":
        if args and not args[0].lstrip("-").isdigit():
            return ExecResult(
                exit_code=2, stderr=f"fake sh: exit: {args[0]}: numeric argument required\n"
            )
        return ExecResult(exit_code=int(args[0]) if args else 0)
    if prog == "sleep":
        try:
            seconds = float(args[0]) if args else 0.0
        except ValueError:
            return ExecResult(
                exit_code=1, stderr=f"fake sleep: invalid time interval {args[0]!r}\n"
            )
        if req.timeout is not None and seconds > req.timeout:
            await anyio.sleep(req.timeout)
            return ExecResult(exit_code=124, timed_out=True)
        await anyio.sleep(seconds)
        return ExecResult(exit_code=0)
    if prog == "cat":
        if not args:
            return ExecResult(exit_code=0, stdout=req.stdin.decode(errors="replace"))
        out = []
        for path in args:
            full = posixpath.normpath(posixpath.join(req.cwd or "/", path))
            if full not in req.sandbox.files:
                return ExecResult(exit_code=1, stderr=f"cat: {path}: No such file or directory\n")
            out.append(req.sandbox.files[full].decode(errors="replace"))
        return ExecResult(exit_code=0, stdout="".join(out))
    return ExecResult(exit_code=127, stderr=f"fake backend: {prog}: command not found\n")
