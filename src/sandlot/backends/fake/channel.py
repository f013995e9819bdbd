"""The fake's :class:`~sandlot.channel.base.Channel`: commands, background processes,
terminals and files of one fake sandbox.

The sandbox's state lives in its :class:`~sandlot.backends.fake.backend.FakeBackend` (which
records every call and saves the state file); this module imports the backend for types only,
so that the backend can hand out channels. Must not import the store or the Manager.
"""

from __future__ import annotations

import inspect
import posixpath
import shlex
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, final

import anyio

from sandlot.backends.fake.programs import FakePty, run_builtin
from sandlot.backends.fake.sandbox import FakeExec, FakeSandbox
from sandlot.channel.base import OutputCallback, Stdin
from sandlot.errors import InvalidRequest, InvalidState, NotFound, SandboxTimeout
from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo

if TYPE_CHECKING:
    from sandlot.backends.fake.backend import FakeBackend

__all__ = ["FakeChannel"]


@final
class FakeChannel:
    """The fake's :class:`~sandlot.channel.base.Channel`."""

    def __init__(self, backend: FakeBackend, ref: str) -> None:
        self._backend = backend
        self._ref = ref
        self._next_pid = 100
        self._closed = False

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._closed

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
        """Answer with the ``exec_handler`` or the built-ins, streaming the output."""
        self._backend._record(self._ref, "exec", argv=list(argv), cwd=cwd, timeout=timeout)
        sb = self._backend._running(self._ref)
        data = await _collect(stdin)
        started = time.perf_counter()
        request = FakeExec(self._ref, list(argv), cwd, dict(env or {}), data, timeout, sb)
        result: ExecResult | None = None
        if self._backend.exec_handler is not None:
            answer = self._backend.exec_handler(request)
            result = await answer if inspect.isawaitable(answer) else answer
        if result is None:
            result = await run_builtin(request)
        if result.exit_code == 124 and result.timed_out and timeout is None:
            msg = "exec_handler returned timed_out without a timeout"
            raise InvalidRequest(msg)
        seq = 0
        if on_output is not None:
            for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
                if text:
                    maybe = on_output(OutputChunk(seq=seq, stream=stream, data=text.encode()))
                    if inspect.isawaitable(maybe):
                        await maybe
                    seq += 1
        duration = (time.perf_counter() - started) * 1000
        update: dict[str, object] = {"duration_ms": result.duration_ms or duration}
        if not collect:
            update |= {"stdout": "", "stderr": ""}
        return result.model_copy(update=update)

    async def start_process(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        log_path: str | None = None,
    ) -> ProcessInfo:
        """Record a background process; it 'runs' until stopped or signalled."""
        self._backend._record(self._ref, "start_process", argv=list(argv), name=name)
        sb = self._backend._running(self._ref)
        self._next_pid += 1
        pid = f"p{len(sb.processes) + 1}"
        info = ProcessInfo(
            id=pid, pid=self._next_pid, command=list(argv), name=name, started_at=time.time()
        )
        sb.processes[pid] = info
        sb.process_output[pid] = []
        self._plan(sb, pid, list(argv))
        if log_path is not None:
            sb.append_log(log_path, b"".join(c.data for c in sb.process_output[pid]))
        self._backend._save()
        return sb.processes[pid]

    @staticmethod
    def _plan(sb: FakeSandbox, pid: str, argv: list[str]) -> None:
        """What a background process of the built-ins does (others run until signalled)."""
        if len(argv) >= 3 and posixpath.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
            try:
                argv = shlex.split(argv[2])
            except ValueError:
                argv = []
        if not argv:
            return
        prog, args = posixpath.basename(argv[0]), argv[1:]
        if prog == "echo":
            sb.add_output(pid, (" ".join(args) + "\n").encode())
            sb.end_process(pid, 0)
        elif prog in ("true", "false", "exit"):
            code = {"true": 0, "false": 1}.get(prog)
            if code is None:
                code = int(args[0]) if args and args[0].isdigit() else 0
            sb.end_process(pid, code)
        elif prog == "sleep":
            try:
                seconds = float(args[0]) if args else 0.0
            except ValueError:
                seconds = 0.0
            sb.process_deadlines[pid] = time.time() + seconds
        elif prog == "cat" and not args:
            sb.process_echo.add(pid)

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes."""
        sb = self._backend._running(self._ref)
        sb.settle_processes()
        return list(sb.processes.values())

    async def signal_process(self, process_id: str, signum: int) -> None:
        """'Kill' a background process (``InvalidState`` once it exited)."""
        self._backend._record(self._ref, "signal_process", id=process_id, signum=signum)
        sb = self._backend._running(self._ref)
        if not self._process(sb, process_id).running:
            msg = f"process {process_id} has exited"
            raise InvalidState(msg, process=process_id)
        sb.end_process(process_id, 128 + signum)
        self._backend._save()

    async def wait_process(self, process_id: str, timeout: float | None = None) -> ProcessInfo:
        """Wait until the process exits (polls)."""
        sb = self._backend._running(self._ref)
        with anyio.move_on_after(timeout):
            # Polls: the state lives in plain dicts that tests (and, with a state file, other
            # processes) change.
            while self._process(sb, process_id).running:
                await anyio.sleep(0.01)
                sb = self._backend._running(self._ref)
            return self._process(sb, process_id)
        msg = f"process {process_id} still running after {timeout}s"
        raise SandboxTimeout(msg)

    async def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """Buffered output from chunk ``offset``; with ``follow``, polls until it exits."""
        while True:
            sb = self._backend._running(self._ref)
            running = self._process(sb, process_id).running
            chunks = sb.process_output.get(process_id, [])
            for chunk in chunks[offset:]:
                yield chunk
            offset = max(offset, len(chunks))
            if not follow or not running:
                return
            await anyio.sleep(0.02)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> None:
        """Record the input (a ``cat`` echoes it; closing its stdin ends it)."""
        self._backend._record(self._ref, "write_stdin", id=process_id, data=data, close=close)
        sb = self._backend._running(self._ref)
        if not self._process(sb, process_id).running:
            msg = f"process {process_id} has exited"
            raise InvalidState(msg, process=process_id)
        if process_id in sb.process_echo:
            if data:
                sb.add_output(process_id, data)
            if close:
                sb.end_process(process_id, 0)
        self._backend._save()

    async def open_pty(
        self,
        argv: list[str],
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> FakePty:
        """An echoing fake terminal."""
        self._backend._record(self._ref, "open_pty", argv=list(argv))
        self._backend._running(self._ref)
        self._next_pid += 1
        return FakePty(f"pty{self._next_pid}", list(argv), rows, cols)

    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """The path made normal (the fake filesystem has no symlinks)."""
        self._backend._running(self._ref)
        return posixpath.normpath(path).replace("//", "/")

    async def read_file(self, path: str, *, nofollow: bool = False) -> AsyncIterator[bytes]:
        """A file's bytes."""
        self._backend._record(self._ref, "read_file", path=path)
        sb = self._backend._running(self._ref)
        if path not in sb.files:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        data = sb.files[path]
        for i in range(0, max(len(data), 1), 1 << 16):
            yield data[i : i + (1 << 16)]

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        nofollow: bool = False,
    ) -> FileInfo:
        """Store a file."""
        body = await _collect(data)
        self._backend._record(self._ref, "write_file", path=path, size=len(body))
        sb = self._backend._running(self._ref)
        if path in sb.dirs:
            msg = f"{path} is a directory"
            raise InvalidRequest(msg, path=path)
        sb._parents(path)
        sb.files[path] = body
        sb.modes[path] = mode if mode is not None else sb.modes.get(path, 0o644)
        self._backend._save()
        return self._info(sb, path)

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """Entries directly under ``path``."""
        self._backend._record(self._ref, "list_files", path=path)
        sb = self._backend._running(self._ref)
        if path not in sb.dirs:
            msg = f"no such directory {path!r}"
            raise NotFound(msg, path=path)
        names = {p for p in (*sb.files, *sb.dirs) if p != path and posixpath.dirname(p) == path}
        return [self._info(sb, p) for p in sorted(names)]

    async def stat(self, path: str) -> FileInfo:
        """One entry."""
        sb = self._backend._running(self._ref)
        if path not in sb.files and path not in sb.dirs:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        return self._info(sb, path)

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents."""
        self._backend._record(self._ref, "mkdir", path=path)
        sb = self._backend._running(self._ref)
        sb._parents(path + "/x")
        self._backend._save()

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file or a tree."""
        self._backend._record(self._ref, "remove", path=path, recursive=recursive)
        sb = self._backend._running(self._ref)
        if path in sb.files:
            del sb.files[path]
        elif path in sb.dirs:
            inside = [p for p in (*sb.files, *sb.dirs) if p.startswith(path.rstrip("/") + "/")]
            if inside and not recursive:
                msg = f"{path} is a non-empty directory (use recursive)"
                raise InvalidRequest(msg, path=path)
            for p in inside:
                sb.files.pop(p, None)
                sb.dirs.discard(p)
            sb.dirs.discard(path)
        else:
            msg = f"no such file {path!r}"
            raise NotFound(msg, path=path)
        self._backend._save()

    async def chmod(self, path: str, mode: int) -> None:
        """Change a file's mode."""
        sb = self._backend._running(self._ref)
        await self.stat(path)
        sb.modes[path] = mode
        self._backend._save()

    async def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file from ``offset``; with ``follow``, poll for appended data."""
        sb = self._backend._running(self._ref)
        while True:
            data = sb.files.get(path, b"")
            if len(data) > offset:
                yield data[offset:]
                offset = len(data)
            if not follow:
                return
            await anyio.sleep(0.05)

    async def close(self) -> None:
        """Mark the channel closed."""
        self._closed = True

    def _process(self, sb: FakeSandbox, process_id: str) -> ProcessInfo:
        sb.settle_processes()
        p = sb.processes.get(process_id)
        if p is None:
            msg = f"no process {process_id!r}"
            raise NotFound(msg, process=process_id)
        return p

    def _info(self, sb: FakeSandbox, path: str) -> FileInfo:
        is_dir = path in sb.dirs
        return FileInfo(
            path=path,
            name=posixpath.basename(path) or "/",
            type="dir" if is_dir else "file",
            size=0 if is_dir else len(sb.files.get(path, b"")),
            mode=0o755 if is_dir else sb.modes.get(path, 0o644),
            mtime=time.time(),
        )


async def _collect(data: Stdin | bytes) -> bytes:
    if data is None:
        return b""
    if isinstance(data, bytes):
        return data
    parts = [chunk async for chunk in data]
    return b"".join(parts)
