"""The host side of the agent protocol: :class:`AgentChannel`, a :class:`Channel` over one byte stream.

Many requests share one connection (virtio-serial offers exactly one stream), each on its own
stream id. There is no background reader task, so a channel needs no task group and can be
handed around freely: whichever caller is waiting for a frame reads from the connection and
dispatches everything it reads to the streams it belongs to, then hands reading over to the
next waiter. Per-stream credit (``docs/agent-protocol.md`` section 4) bounds what can pile up
for a stream whose consumer is slow.

This module imports only anyio, the wire models, the errors and :mod:`.protocol`; it must not
import backends, the store or the Manager.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from inspect import isawaitable
from typing import Final, Literal, final

import anyio
import anyio.abc

from sandlot.channel.base import OutputCallback, Stdin
from sandlot.channel.protocol import (
    MAGIC,
    MAX_DATA,
    PROTOCOL_VERSION,
    WINDOW,
    AgentInfo,
    Chan,
    FrameDecoder,
    FrameType,
    ProtocolError,
    decode_json,
    decode_window,
    encode_frame,
    encode_json,
    encode_window,
    error_from_reply,
    parse_hello,
)
from sandlot.errors import (
    BackendError,
    InvalidRequest,
    NotFound,
    NotSupported,
    SandboxError,
    SandboxTimeout,
)
from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo
from sandlot.taskgroups import lone_error

__all__ = ["AgentChannel", "AgentPty", "connect_stream", "connect_unix"]

_RECEIVE_SIZE: Final = 1 << 20
_GRANT_AT: Final = WINDOW // 4
_CANCEL_GRACE: Final = 2.0
_EXEC_SLACK: Final = 30.0
_MAX_LINKS: Final = 40  # the kernel's MAXSYMLINKS, as the agent's file.resolve
"""How long past an exec's own timeout the client waits for the agent's verdict."""

_Item = tuple[int, int, object]
"""(frame type, chan, payload): bytes for DATA, a dict for EVENT and END."""


def _label(chan: int) -> Literal["stdout", "stderr"]:
    return "stderr" if chan == Chan.ERR else "stdout"


class _Stream:
    """The client's state for one stream id."""

    __slots__ = ("credit", "end", "items", "sid", "unacked")

    def __init__(self, sid: int, credit: int) -> None:
        self.sid = sid
        self.items: deque[_Item] = deque()
        self.credit = credit
        self.unacked = 0
        self.end: dict[str, object] | None = None


class _Connection:
    """Framing, dispatch and flow control over one anyio byte stream."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.send_lock = anyio.Lock()
        self.read_lock = anyio.Lock()
        self.streams: dict[int, _Stream] = {}
        self.waiters: list[tuple[_Stream | None, anyio.Event]] = []
        self.next_sid = 1
        self.error: SandboxError | None = None
        self.hello: dict[str, object] | None = None
        self.nonce = os.urandom(8).hex()
        """Sent in our HELLO and echoed in the agent's: which answer is this handshake's."""
        self.info: AgentInfo | None = None
        self.peer_window = 64 << 10
        self.max_data = MAX_DATA
        self.orphans: list[int] = []

    # receiving
    def fail(self, error: SandboxError) -> None:
        if self.error is None:
            self.error = error
        for _, ev in self.waiters:
            ev.set()

    def _wake(self, st: _Stream | None) -> None:
        for target, ev in self.waiters:
            if target is st:
                ev.set()

    async def _read_once(self) -> None:
        try:
            data = await self.stream.receive(_RECEIVE_SIZE)
        except anyio.EndOfStream:
            self.fail(BackendError("the sandbox agent closed the connection"))
            return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
            self.fail(BackendError(f"connection to the sandbox agent failed: {e}"))
            return
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as e:
            self.fail(e)
            await self._abort_transport()
            return
        for f in frames:
            self._dispatch(f.type, f.chan, f.stream, f.payload)

    def _dispatch(self, ftype: int, chan: int, sid: int, payload: bytes) -> None:
        if ftype == FrameType.HELLO:
            hello = decode_json(payload)
            hello = hello if isinstance(hello, dict) else {}
            if self.hello is None:
                nonce = hello.get("nonce")
                if nonce is not None and nonce != self.nonce:
                    return  # the late answer to an earlier attempt's HELLO: not ours
                self.hello = hello
                self._wake(None)
                return
            # A second session began behind ours (another HELLO reached the agent): it ended
            # ours, and with it everything in flight here.
            self.fail(BackendError("the sandbox agent began another session; this one ended"))
            return
        if ftype == FrameType.ERROR and sid == 0:
            err = decode_json(payload)
            if self.hello is None:
                self.fail(error_from_reply(err))
            return
        if ftype in (FrameType.PONG, FrameType.PING):
            return
        st = self.streams.get(sid)
        if st is None:
            return  # late frames of a stream we gave up on
        if ftype == FrameType.DATA:
            st.items.append((ftype, chan, payload))
        elif ftype == FrameType.WINDOW:
            st.credit += decode_window(payload)
        elif ftype == FrameType.EVENT:
            st.items.append((ftype, chan, decode_json(payload)))
        elif ftype == FrameType.ERROR:
            st.items.append((FrameType.EVENT, chan, {"type": "error", **_as_dict(payload)}))
        elif ftype == FrameType.END:
            end = decode_json(payload)
            st.end = end if isinstance(end, dict) else {"ok": False, "error": end}
            st.items.append((ftype, chan, st.end))
            del self.streams[sid]
        self._wake(st)

    async def wait(self, st: _Stream | None, ready: Callable[[], bool]) -> None:
        """Read and dispatch frames until ``ready()`` (or the connection fails)."""
        while not ready():
            if self.error is not None:
                raise self.error
            if self.read_lock.locked():
                ev = anyio.Event()
                entry = (st, ev)
                self.waiters.append(entry)
                try:
                    await ev.wait()
                finally:
                    self.waiters.remove(entry)
                continue
            async with self.read_lock:
                try:
                    while not ready() and self.error is None:
                        await self._read_once()
                finally:
                    # Whoever still waits must take over reading.
                    for _, ev in self.waiters:
                        ev.set()

    async def next_item(self, st: _Stream) -> _Item:
        """The stream's next frame; DATA consumed here is granted back to the agent."""
        if not st.items:
            await self.wait(st, lambda: bool(st.items))
        item = st.items.popleft()
        if item[0] == FrameType.DATA:
            assert isinstance(item[2], bytes)
            st.unacked += len(item[2])
            if st.unacked >= _GRANT_AT and st.end is None:
                n, st.unacked = st.unacked, 0
                await self.send(FrameType.WINDOW, st.sid, encode_window(n))
        return item

    # sending
    async def send(
        self, ftype: int, sid: int, payload: bytes | memoryview = b"", chan: int = 0
    ) -> None:
        await self.send_raw(encode_frame(ftype, sid, payload, chan))

    async def send_raw(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        if self.orphans:
            orphans, self.orphans = self.orphans, []
            data = b"".join(encode_frame(FrameType.CANCEL, sid) for sid in orphans) + data
        # A frame is never half-sent: cancelling the caller mid-frame would break the framing
        # for every other stream on the connection.
        with anyio.CancelScope(shield=True):
            async with self.send_lock:
                if self.error is not None:
                    raise self.error
                try:
                    await self.stream.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                    err = BackendError(f"connection to the sandbox agent failed: {e}")
                    self.fail(err)
                    raise (self.error or err) from e

    async def open(self, request: dict[str, object]) -> _Stream:
        sid = self.next_sid
        self.next_sid += 1
        st = _Stream(sid, self.peer_window)
        self.streams[sid] = st
        try:
            await self.send(FrameType.OPEN, sid, encode_json(request))
        except BaseException:
            self.streams.pop(sid, None)
            raise
        return st

    async def send_data(self, st: _Stream, data: bytes, chan: int = Chan.IN) -> None:
        """Send bytes on a stream within its credit (waits for WINDOW frames as needed)."""
        view = memoryview(data)
        while view:
            if st.end is not None:
                return
            if st.credit <= 0:
                await self.wait(st, lambda: st.credit > 0 or st.end is not None)
                continue
            n = min(len(view), st.credit, self.max_data)
            st.credit -= n
            # The slice is a view: encode_frame's concatenation is the only copy.
            await self.send(FrameType.DATA, st.sid, view[:n], chan)
            view = view[n:]

    async def cancel(self, st: _Stream) -> None:
        """Tell the agent to abandon a stream; never raises, never blocks for long."""
        self.streams.pop(st.sid, None)
        if st.end is not None or self.error is not None:
            return
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(_CANCEL_GRACE),
            contextlib.suppress(SandboxError),
        ):
            await self.send(FrameType.CANCEL, st.sid)

    def forget(self, st: _Stream) -> None:
        """Drop a stream whose consumer went away without waiting (cancel sent lazily)."""
        if self.streams.pop(st.sid, None) is not None and st.end is None:
            self.orphans.append(st.sid)

    async def _abort_transport(self) -> None:
        with (
            anyio.CancelScope(shield=True),
            contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
        ):
            await self.stream.aclose()

    async def result(self, st: _Stream) -> dict[str, object]:
        """Wait for END, skipping anything else; the result object or the mapped error."""
        while True:
            kind, _, payload = await self.next_item(st)
            if kind == FrameType.END:
                assert isinstance(payload, dict)
                return _unwrap(payload)


def _as_dict(payload: bytes) -> dict[str, object]:
    try:
        obj = decode_json(payload)
    except ProtocolError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _unwrap(end: dict[str, object]) -> dict[str, object]:
    if end.get("ok") is True:
        result = end.get("result")
        return result if isinstance(result, dict) else {}
    raise error_from_reply(end.get("error"))


def _abs_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        msg = f"paths inside a sandbox must be absolute, got {path!r}"
        raise InvalidRequest(msg)
    if "\x00" in path:
        msg = "a path must not contain NUL bytes"
        raise InvalidRequest(msg)
    return path


def _check_argv(argv: list[str]) -> list[str]:
    if not argv or not all(isinstance(a, str) for a in argv):
        msg = "argv must be a non-empty list of strings"
        raise InvalidRequest(msg)
    return list(argv)


def _int(v: object, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _float(v: object, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _opt_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _file_info(obj: dict[str, object]) -> FileInfo:
    kind = obj.get("type")
    target = obj.get("target")
    return FileInfo(
        path=str(obj.get("path", "")),
        name=str(obj.get("name", "")),
        type=kind if kind in ("file", "dir", "symlink", "other") else "other",
        size=_int(obj.get("size")),
        mode=_int(obj.get("mode")),
        mtime=_float(obj.get("mtime")),
        target=target if isinstance(target, str) else None,
    )


def _process_info(obj: dict[str, object]) -> ProcessInfo:
    command = obj.get("command")
    name = obj.get("name")
    return ProcessInfo(
        id=str(obj.get("id", "")),
        pid=_int(obj.get("pid")),
        command=[str(c) for c in command] if isinstance(command, list) else [],
        name=name if isinstance(name, str) else None,
        running=bool(obj.get("running", False)),
        exit_code=_opt_int(obj.get("exit_code")),
        started_at=_float(obj.get("started_at")),
    )


async def _emit(on_output: OutputCallback | None, chunk: OutputChunk) -> None:
    if on_output is not None:
        r = on_output(chunk)
        if isawaitable(r):
            await r


@final
class AgentPty:
    """A terminal inside the sandbox (implements :class:`~sandlot.channel.base.PtySession`)."""

    def __init__(self, conn: _Connection, st: _Stream, pty_id: str, pid: int) -> None:
        self._conn = conn
        self._st = st
        self._id = pty_id
        self.pid = pid
        """The program's pid inside the sandbox."""
        self._exit: int | None = None
        self._closed = False

    @property
    def id(self) -> str:
        """A handle for the terminal (unique within the sandbox)."""
        return self._id

    async def write(self, data: bytes) -> None:
        """Send keystrokes (waits while the agent's window for this terminal is full)."""
        await self._conn.send_data(self._st, bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        """Change the window size (the program gets SIGWINCH)."""
        if not (0 < rows < 65536 and 0 < cols < 65536):
            msg = f"rows and cols must be within 1..65535, got {rows}x{cols}"
            raise InvalidRequest(msg)
        if self._st.end is None:
            payload = encode_json({"type": "resize", "rows": rows, "cols": cols})
            await self._conn.send(FrameType.EVENT, self._st.sid, payload)

    async def read(self) -> bytes:
        """The next output; ``b""`` once the program exited and everything was read."""
        while True:
            if self._st.end is not None and not self._st.items:
                self._note_end(self._st.end)
                return b""
            kind, _, payload = await self._conn.next_item(self._st)
            if kind == FrameType.DATA:
                assert isinstance(payload, bytes)
                return payload
            if kind == FrameType.END:
                assert isinstance(payload, dict)
                self._note_end(payload)
                return b""

    def _note_end(self, end: dict[str, object]) -> None:
        if self._exit is None:
            result = _unwrap(end) if end.get("ok") is True else {}
            self._exit = _int(result.get("exit_code"), -1)

    async def wait(self) -> int:
        """Wait for the program to exit; its exit code (``128 + N`` when killed by signal N).

        Unread output stays readable. The agent stops reading the terminal once a window's
        worth of output (4 MiB) is unread, so a program that writes more than that only exits
        while someone reads.
        """
        st = self._st
        if st.end is None:
            await self._conn.wait(st, lambda: st.end is not None)
        assert st.end is not None
        if st.end.get("ok") is not True and self._exit is None:
            raise error_from_reply(st.end.get("error"))
        self._note_end(st.end)
        assert self._exit is not None
        return self._exit

    async def close(self) -> None:
        """Hang up: the program gets SIGHUP, and its tree SIGKILL a second later if it stays."""
        if not self._closed:
            self._closed = True
            await self._conn.cancel(self._st)


@final
class AgentChannel:
    """A :class:`~sandlot.channel.base.Channel` speaking ``docs/agent-protocol.md``.

    Build one with :func:`connect_unix` or :func:`connect_stream`. Every method may be called
    concurrently from many tasks; they share the one connection. A broken connection raises
    :class:`~sandlot.errors.BackendError`.
    """

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._closed = False

    @property
    def agent_info(self) -> AgentInfo:
        """What the agent said about itself when the connection opened."""
        assert self._conn.info is not None
        return self._conn.info

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called or the connection broke."""
        return self._closed or self._conn.error is not None

    async def _call(self, request: dict[str, object]) -> dict[str, object]:
        st = await self._conn.open(request)
        try:
            return await self._conn.result(st)
        except BaseException:
            await self._conn.cancel(st)
            raise

    # commands
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
        (decoded as UTF-8 with invalid bytes replaced; ``collect=False`` keeps none of it, for
        output too big to hold). On ``timeout`` the agent kills the
        whole process tree and the result says ``timed_out`` with exit code 124. Cancelling
        the caller kills the remote process tree too.
        """
        if timeout is not None and timeout <= 0:
            msg = f"timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        request: dict[str, object] = {
            "op": "exec",
            "argv": _check_argv(argv),
            "stdin": stdin is not None,
        }
        if cwd is not None:
            request["cwd"] = cwd
        if env:
            request["env"] = dict(env)
        if timeout is not None:
            request["timeout"] = timeout
        conn = self._conn
        st = await conn.open(request)
        try:
            deadline = math.inf if timeout is None else timeout + _EXEC_SLACK
            with anyio.move_on_after(deadline) as scope:
                if stdin is None:
                    end = await self._collect(st, on_output, collect)
                elif isinstance(stdin, (bytes, bytearray, memoryview)) and len(stdin) <= st.credit:
                    # Fits in the initial window: no need to feed it concurrently.
                    await conn.send_data(st, bytes(stdin))
                    await conn.send(FrameType.EOF, st.sid, b"", Chan.IN)
                    end = await self._collect(st, on_output, collect)
                else:
                    end = await self._exec_with_stdin(st, stdin, on_output, collect)
            if scope.cancelled_caught:
                msg = f"the agent did not finish {argv[0]!r} within {deadline:.0f}s"
                raise SandboxTimeout(msg)
        except BaseException:
            await conn.cancel(st)
            raise
        return end

    async def _exec_with_stdin(
        self, st: _Stream, stdin: Stdin, on_output: OutputCallback | None, collect: bool
    ) -> ExecResult:
        conn = self._conn
        result: list[ExecResult] = []

        async def feed() -> None:
            if isinstance(stdin, (bytes, bytearray, memoryview)):
                await conn.send_data(st, bytes(stdin))
            elif stdin is not None:
                async for piece in stdin:
                    if st.end is not None:
                        break
                    await conn.send_data(st, bytes(piece))
            if st.end is None:
                await conn.send(FrameType.EOF, st.sid, b"", Chan.IN)

        async def gather() -> None:
            result.append(await self._collect(st, on_output, collect))

        # The command's own error (a missing cwd, say) is what the caller handles, not a group.
        with lone_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed)
                await gather()
                tg.cancel_scope.cancel()
        return result[0]

    async def _collect(
        self, st: _Stream, on_output: OutputCallback | None, collect: bool = True
    ) -> ExecResult:
        out: list[bytes] = []
        err: list[bytes] = []
        seq = 0
        while True:
            kind, chan, payload = await self._conn.next_item(st)
            if kind == FrameType.DATA:
                assert isinstance(payload, bytes)
                if collect:
                    (err if chan == Chan.ERR else out).append(payload)
                if on_output is not None:
                    chunk = OutputChunk.model_construct(seq=seq, stream=_label(chan), data=payload)
                    await _emit(on_output, chunk)
                seq += 1
            elif kind == FrameType.END:
                assert isinstance(payload, dict)
                res = _unwrap(payload)
                sig = _opt_int(res.get("signal"))
                return ExecResult(
                    exit_code=_int(res.get("exit_code"), -1),
                    stdout=b"".join(out).decode("utf-8", "replace"),
                    stderr=b"".join(err).decode("utf-8", "replace"),
                    duration_ms=_float(res.get("duration_ms")),
                    signal=sig,
                    timed_out=bool(res.get("timed_out", False)),
                    oom_killed=bool(res.get("oom_killed", False)),
                )

    # background processes
    async def start_process(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        log_path: str | None = None,
    ) -> ProcessInfo:
        """Start a background process; its output is buffered (and appended to ``log_path``).

        The process belongs to the agent, not to this connection: it keeps running after the
        channel closes. A ``name`` must be unique among running processes (``Conflict``).
        """
        request: dict[str, object] = {"op": "proc.start", "argv": _check_argv(argv)}
        if cwd is not None:
            request["cwd"] = cwd
        if env:
            request["env"] = dict(env)
        if name is not None:
            request["name"] = name
        if log_path is not None:
            request["log_path"] = _abs_path(log_path)
        return _process_info(await self._call(request))

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes, running and exited (the last 16 exited are kept)."""
        res = await self._call({"op": "proc.list"})
        procs = res.get("processes")
        return (
            [_process_info(p) for p in procs if isinstance(p, dict)]
            if isinstance(procs, list)
            else []
        )

    async def signal_process(self, process_id: str, signum: int) -> None:
        """Send a signal to a background process's whole tree (``InvalidState`` once it exited)."""
        await self._call({"op": "proc.signal", "id": process_id, "signal": int(signum)})

    async def wait_process(self, process_id: str, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits (``SandboxTimeout`` after ``timeout``)."""
        request: dict[str, object] = {"op": "proc.wait", "id": process_id}
        if timeout is not None:
            request["timeout"] = max(0.0, timeout)
        return _process_info(await self._call(request))

    def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """Buffered output of a background process from chunk ``offset``; with ``follow``,
        keep yielding until it exits.

        The agent keeps the last 8 MiB (and at most 65,536 chunks) per process. When
        ``offset`` has fallen out of that buffer, output starts at the oldest chunk still held:
        the first chunk's ``seq`` is then larger than ``offset`` and says how much was lost.
        """
        return self._process_output(process_id, offset, follow)

    async def _process_output(
        self, process_id: str, offset: int, follow: bool
    ) -> AsyncIterator[OutputChunk]:
        request = {
            "op": "proc.output",
            "id": process_id,
            "offset": max(0, offset),
            "follow": follow,
        }
        st = await self._conn.open(request)
        seq = offset
        finished = False
        try:
            while True:
                kind, chan, payload = await self._conn.next_item(st)
                if kind == FrameType.DATA:
                    assert isinstance(payload, bytes)
                    yield OutputChunk.model_construct(seq=seq, stream=_label(chan), data=payload)
                    seq += 1
                elif kind == FrameType.EVENT:
                    if isinstance(payload, dict) and payload.get("type") == "seq":
                        seq = _int(payload.get("seq"), seq)
                elif kind == FrameType.END:
                    assert isinstance(payload, dict)
                    finished = True
                    _unwrap(payload)
                    return
        finally:
            if not finished:
                await self._conn.cancel(st)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool = False) -> None:
        """Feed a background process's stdin (and close it after, when asked).

        Returns once the bytes are in the process's stdin pipe. ``InvalidState`` when its stdin
        is already closed or it exited.
        """
        conn = self._conn
        st = await conn.open({"op": "proc.stdin", "id": process_id, "close": close})
        try:
            await conn.send_data(st, bytes(data))
            if st.end is None:
                await conn.send(FrameType.EOF, st.sid, b"", Chan.IN)
            await conn.result(st)
        except BaseException:
            await conn.cancel(st)
            raise

    # terminals
    async def open_pty(
        self,
        argv: list[str],
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> AgentPty:
        """Start a program on a new terminal. It is killed when the terminal is closed or the
        channel's connection ends."""
        request: dict[str, object] = {
            "op": "pty.open",
            "argv": _check_argv(argv),
            "rows": rows,
            "cols": cols,
        }
        if cwd is not None:
            request["cwd"] = cwd
        if env:
            request["env"] = dict(env)
        conn = self._conn
        st = await conn.open(request)
        try:
            kind, _, payload = await conn.next_item(st)
        except BaseException:
            await conn.cancel(st)
            raise
        assert isinstance(payload, dict)
        if kind == FrameType.END:
            _unwrap(payload)
            msg = "the agent ended the terminal before starting it"
            raise BackendError(msg)
        return AgentPty(conn, st, str(payload.get("id", st.sid)), _int(payload.get("pid")))

    # files
    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """``path`` with its symlinks resolved inside the sandbox (a link never leads out of
        its root); without ``follow_last`` a link in the last place is kept."""
        try:
            reply = await self._call(
                {"op": "file.resolve", "path": _abs_path(path), "follow_last": follow_last}
            )
        except NotSupported:
            # An agent started before file.resolve existed (a sandbox running across an
            # upgrade): the same walk, one lstat per component.
            return await self._resolve_by_stat(path, follow_last=follow_last)
        resolved = reply.get("path")
        if not isinstance(resolved, str) or not resolved.startswith("/"):
            msg = f"the agent resolved {path!r} to {resolved!r}, not an absolute path"
            raise BackendError(msg)
        return resolved

    async def _resolve_by_stat(self, path: str, *, follow_last: bool) -> str:
        todo = [c for c in path.split("/") if c]
        todo.reverse()
        parts: list[str] = []
        links = 0
        while todo:
            name = todo.pop()
            if name in (".", ".."):
                if name == ".." and parts:
                    parts.pop()
                continue
            try:
                info = await self.stat("/" + "/".join([*parts, name]))
            except (NotFound, InvalidRequest):
                parts.append(name)
                continue
            if info.type == "symlink" and info.target and (todo or follow_last):
                links += 1
                if links > _MAX_LINKS:
                    msg = f"{path}: too many levels of symbolic links"
                    raise InvalidRequest(msg, path=path)
                if info.target.startswith("/"):
                    parts = []
                todo.extend(reversed([c for c in info.target.split("/") if c]))
                continue
            parts.append(name)
        return "/" + "/".join(parts)

    def read_file(self, path: str, *, nofollow: bool = False) -> AsyncIterator[bytes]:
        """A file's bytes in chunks (no size cap). Only regular files can be read."""
        return self._read(_abs_path(path), 0, follow=False, nofollow=nofollow)

    def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file's bytes from byte ``offset``; with ``follow``, keep yielding what is appended
        until the caller stops iterating. A file replaced under the same name is followed from
        its start; one truncated below the read position is read again from 0."""
        if offset < 0:
            msg = f"offset must be >= 0, got {offset}"
            raise InvalidRequest(msg)
        return self._read(_abs_path(path), offset, follow=follow)

    async def _read(
        self, path: str, offset: int, *, follow: bool, nofollow: bool = False
    ) -> AsyncIterator[bytes]:
        conn = self._conn
        request = {
            "op": "file.read",
            "path": path,
            "offset": offset,
            "follow": follow,
            "nofollow": nofollow,
        }
        st = await conn.open(request)
        finished = False
        try:
            while True:
                kind, _, payload = await conn.next_item(st)
                if kind == FrameType.DATA:
                    assert isinstance(payload, bytes)
                    yield payload
                elif kind == FrameType.END:
                    assert isinstance(payload, dict)
                    finished = True
                    _unwrap(payload)
                    return
        finally:
            if not finished:
                await conn.cancel(st)

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        nofollow: bool = False,
    ) -> FileInfo:
        """Create or replace a file (parents are made); atomic for readers inside.

        The bytes go to a temporary file beside the target that is renamed over it at the end,
        so readers see the old or the new content, never a mix; a failed or cancelled write
        leaves the old file as it was. Without ``mode`` an existing file keeps its permission
        bits and a new one gets ``0666 & ~umask``. A symlink at ``path`` is replaced, not
        followed.
        """
        request: dict[str, object] = {
            "op": "file.write",
            "path": _abs_path(path),
            "nofollow": nofollow,
        }
        if mode is not None:
            request["mode"] = mode
        conn = self._conn
        st = await conn.open(request)
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await conn.send_data(st, bytes(data))
            else:
                async for piece in data:
                    if st.end is not None:
                        break
                    await conn.send_data(st, bytes(piece))
            if st.end is None:
                await conn.send(FrameType.EOF, st.sid, b"", Chan.IN)
            return _file_info(await conn.result(st))
        except BaseException:
            await conn.cancel(st)
            raise

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """A directory's entries, sorted by name; symlinks are not followed."""
        conn = self._conn
        st = await conn.open({"op": "file.list", "path": _abs_path(path), "nofollow": nofollow})
        entries: list[FileInfo] = []
        try:
            while True:
                kind, _, payload = await conn.next_item(st)
                if kind == FrameType.EVENT and isinstance(payload, dict):
                    batch = payload.get("entries")
                    if isinstance(batch, list):
                        entries.extend(_file_info(e) for e in batch if isinstance(e, dict))
                elif kind == FrameType.END:
                    assert isinstance(payload, dict)
                    _unwrap(payload)
                    return entries
        except BaseException:
            await conn.cancel(st)
            raise

    async def stat(self, path: str) -> FileInfo:
        """One entry, not following a final symlink (``NotFound`` when absent)."""
        return _file_info(await self._call({"op": "file.stat", "path": _abs_path(path)}))

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents (no error if it exists; ``Conflict`` if a file does)."""
        await self._call({"op": "file.mkdir", "path": _abs_path(path)})

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive`` (``Conflict`` for a non-empty
        directory without it). Symlinks are removed, never followed."""
        await self._call(
            {
                "op": "file.remove",
                "path": _abs_path(path),
                "recursive": recursive,
                "nofollow": nofollow,
            }
        )

    async def chmod(self, path: str, mode: int) -> None:
        """Change permission bits."""
        await self._call({"op": "file.chmod", "path": _abs_path(path), "mode": int(mode)})

    async def set_clock(self, when: float) -> None:
        """Set the sandbox's system clock to ``when`` (seconds since the epoch), without
        starting a program; needs an agent that serves ``clock.set`` and may set the clock
        (a VM's agent is its root; elsewhere ``EPERM`` is refused as ``InvalidRequest``)."""
        await self._call({"op": "clock.set", "time": float(when)})

    async def count_fds(self) -> int:
        """How many file descriptors the sandbox's processes hold open, the agent's own left
        out (needs an agent that serves ``fd.count``)."""
        reply = await self._call({"op": "fd.count"})
        count = reply.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            msg = f"the agent's fd count is not a count: {count!r}"
            raise BackendError(msg)
        return count

    async def detach(self) -> None:
        """End the agent's side of this session (needs an agent that serves
        ``session.detach``); only :meth:`close` is of use after. Once this returns, the agent has
        cancelled the session's streams and takes the next bytes it reads as a new host's: over
        a device (a VM's virtio-serial port), where the agent cannot see one host connection end
        and the next begin, this is how the host knows the agent waits for a new one, e.g.
        before the VM's memory is saved."""
        await self._call({"op": "session.detach"})

    async def close(self) -> None:
        """Release the connection (the sandbox and its background processes keep running).

        Calls still in flight on other tasks fail with ``BackendError``; the agent kills the
        commands and terminals this connection started.
        """
        if self._closed:
            return
        self._closed = True
        self._conn.fail(BackendError("the channel was closed"))
        await self._conn._abort_transport()

    async def __aenter__(self) -> AgentChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def connect_stream(stream: anyio.abc.ByteStream, *, timeout: float = 10.0) -> AgentChannel:
    """Speak the agent protocol over an already open byte stream (e.g. a VMM's unix socket
    leading to virtio-serial); returns once the agent's HELLO arrived.

    Raises:
        SandboxTimeout: no HELLO within ``timeout``.
        BackendError: the connection failed, or the agent speaks no common protocol version.
    """
    conn = _Connection(stream)
    hello = encode_frame(
        FrameType.HELLO,
        0,
        encode_json(
            {
                "versions": [PROTOCOL_VERSION],
                "window": WINDOW,
                "client": "sandlot",
                "nonce": conn.nonce,
            }
        ),
    )
    try:
        with anyio.fail_after(timeout):
            await conn.send_raw(MAGIC + hello)
            await conn.wait(None, lambda: conn.hello is not None)
    except TimeoutError:
        await conn._abort_transport()
        msg = f"the sandbox agent did not answer within {timeout:g}s"
        raise SandboxTimeout(msg) from None
    except BaseException:
        await conn._abort_transport()
        raise
    try:
        info = parse_hello(conn.hello)
    except ProtocolError:
        await conn._abort_transport()
        raise
    conn.info = info
    conn.peer_window = info.window
    conn.max_data = info.max_data
    return AgentChannel(conn)


async def connect_unix(path: str | os.PathLike[str], *, timeout: float = 10.0) -> AgentChannel:
    """Connect to an agent serving a unix socket; returns once the agent is ready.

    While the socket does not exist yet or refuses connections (the agent is still starting),
    connecting is retried until ``timeout``.

    Raises:
        SandboxTimeout: the agent did not answer within ``timeout``.
        BackendError: connecting failed for another reason.
    """
    path = os.fspath(path)
    deadline = anyio.current_time() + timeout
    delay = 0.002
    while True:
        try:
            stream = await anyio.connect_unix(path)
            break
        except (FileNotFoundError, ConnectionRefusedError) as e:
            if anyio.current_time() + delay > deadline:
                msg = f"no sandbox agent listening at {path} after {timeout:g}s"
                raise SandboxTimeout(msg) from e
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)
        except OSError as e:
            msg = f"cannot connect to the sandbox agent at {path}: {e}"
            raise BackendError(msg) from e
    return await connect_stream(stream, timeout=max(0.001, deadline - anyio.current_time()))
