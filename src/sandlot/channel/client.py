"""The host side of the agent protocol: :class:`AgentChannel`, a :class:`Channel` over one byte stream.

Each operation of ``docs/agent-protocol.md`` (commands, background processes, terminals,
files, clock, descriptors, session) is a method here that opens a stream on the channel's
:class:`~sandlot.channel.connection.Connection` (framing, dispatch and flow control: many
requests share one connection, with no background reader task, so a channel can be handed
around freely) and reads its reply with :mod:`.replies`; a terminal is an
:class:`~sandlot.channel.pty.AgentPty`, re-exported here.

This module imports only anyio, the wire models, the errors and the channel's own
:mod:`.protocol`, :mod:`.connection`, :mod:`.replies` and :mod:`.pty`; it must not import
backends, the store or the Manager.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterable, AsyncIterator
from inspect import isawaitable
from typing import Final, final

import anyio
import anyio.abc

from sandlot.channel.base import OutputCallback, Stdin
from sandlot.channel.connection import Connection, Stream
from sandlot.channel.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    WINDOW,
    AgentInfo,
    Chan,
    FrameType,
    ProtocolError,
    encode_frame,
    encode_json,
    parse_hello,
)
from sandlot.channel.pty import AgentPty
from sandlot.channel.replies import (
    abs_path,
    as_float,
    as_int,
    check_argv,
    file_info,
    label,
    opt_int,
    process_info,
    unwrap,
)
from sandlot.errors import (
    BackendError,
    InvalidRequest,
    NotFound,
    NotSupported,
    SandboxTimeout,
)
from sandlot.models import ExecResult, FileInfo, OutputChunk, ProcessInfo
from sandlot.taskgroups import lone_error

__all__ = ["AgentChannel", "AgentPty", "connect_stream", "connect_unix"]

_EXEC_SLACK: Final = 30.0
"""How long past an exec's own timeout the client waits for the agent's verdict."""
_MAX_LINKS: Final = 40  # the kernel's MAXSYMLINKS, as the agent's file.resolve


async def _emit(on_output: OutputCallback | None, chunk: OutputChunk) -> None:
    if on_output is not None:
        r = on_output(chunk)
        if isawaitable(r):
            await r


@final
class AgentChannel:
    """A :class:`~sandlot.channel.base.Channel` speaking ``docs/agent-protocol.md``.

    Build one with :func:`connect_unix` or :func:`connect_stream`. Every method may be called
    concurrently from many tasks; they share the one connection. A broken connection raises
    :class:`~sandlot.errors.BackendError`.
    """

    def __init__(self, conn: Connection) -> None:
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
            "argv": check_argv(argv),
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
        self, st: Stream, stdin: Stdin, on_output: OutputCallback | None, collect: bool
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
        self, st: Stream, on_output: OutputCallback | None, collect: bool = True
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
                    chunk = OutputChunk.model_construct(seq=seq, stream=label(chan), data=payload)
                    await _emit(on_output, chunk)
                seq += 1
            elif kind == FrameType.END:
                assert isinstance(payload, dict)
                res = unwrap(payload)
                sig = opt_int(res.get("signal"))
                return ExecResult(
                    exit_code=as_int(res.get("exit_code"), -1),
                    stdout=b"".join(out).decode("utf-8", "replace"),
                    stderr=b"".join(err).decode("utf-8", "replace"),
                    duration_ms=as_float(res.get("duration_ms")),
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
        request: dict[str, object] = {"op": "proc.start", "argv": check_argv(argv)}
        if cwd is not None:
            request["cwd"] = cwd
        if env:
            request["env"] = dict(env)
        if name is not None:
            request["name"] = name
        if log_path is not None:
            request["log_path"] = abs_path(log_path)
        return process_info(await self._call(request))

    async def list_processes(self) -> list[ProcessInfo]:
        """Background processes, running and exited (the last 16 exited are kept)."""
        res = await self._call({"op": "proc.list"})
        procs = res.get("processes")
        return (
            [process_info(p) for p in procs if isinstance(p, dict)]
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
        return process_info(await self._call(request))

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
                    yield OutputChunk.model_construct(seq=seq, stream=label(chan), data=payload)
                    seq += 1
                elif kind == FrameType.EVENT:
                    if isinstance(payload, dict) and payload.get("type") == "seq":
                        seq = as_int(payload.get("seq"), seq)
                elif kind == FrameType.END:
                    assert isinstance(payload, dict)
                    finished = True
                    unwrap(payload)
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
            "argv": check_argv(argv),
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
            unwrap(payload)
            msg = "the agent ended the terminal before starting it"
            raise BackendError(msg)
        return AgentPty(conn, st, str(payload.get("id", st.sid)), as_int(payload.get("pid")))

    # files
    async def resolve(self, path: str, *, follow_last: bool = True) -> str:
        """``path`` with its symlinks resolved inside the sandbox (a link never leads out of
        its root); without ``follow_last`` a link in the last place is kept."""
        try:
            reply = await self._call(
                {"op": "file.resolve", "path": abs_path(path), "follow_last": follow_last}
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
        return self._read(abs_path(path), 0, follow=False, nofollow=nofollow)

    def follow_file(
        self, path: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[bytes]:
        """A file's bytes from byte ``offset``; with ``follow``, keep yielding what is appended
        until the caller stops iterating. A file replaced under the same name is followed from
        its start; one truncated below the read position is read again from 0."""
        if offset < 0:
            msg = f"offset must be >= 0, got {offset}"
            raise InvalidRequest(msg)
        return self._read(abs_path(path), offset, follow=follow)

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
                    unwrap(payload)
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
            "path": abs_path(path),
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
            return file_info(await conn.result(st))
        except BaseException:
            await conn.cancel(st)
            raise

    async def list_files(self, path: str, *, nofollow: bool = False) -> list[FileInfo]:
        """A directory's entries, sorted by name; symlinks are not followed."""
        conn = self._conn
        st = await conn.open({"op": "file.list", "path": abs_path(path), "nofollow": nofollow})
        entries: list[FileInfo] = []
        try:
            while True:
                kind, _, payload = await conn.next_item(st)
                if kind == FrameType.EVENT and isinstance(payload, dict):
                    batch = payload.get("entries")
                    if isinstance(batch, list):
                        entries.extend(file_info(e) for e in batch if isinstance(e, dict))
                elif kind == FrameType.END:
                    assert isinstance(payload, dict)
                    unwrap(payload)
                    return entries
        except BaseException:
            await conn.cancel(st)
            raise

    async def stat(self, path: str) -> FileInfo:
        """One entry, not following a final symlink (``NotFound`` when absent)."""
        return file_info(await self._call({"op": "file.stat", "path": abs_path(path)}))

    async def mkdir(self, path: str) -> None:
        """Make a directory and its parents (no error if it exists; ``Conflict`` if a file does)."""
        await self._call({"op": "file.mkdir", "path": abs_path(path)})

    async def remove(self, path: str, *, recursive: bool = False, nofollow: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive`` (``Conflict`` for a non-empty
        directory without it). Symlinks are removed, never followed."""
        await self._call(
            {
                "op": "file.remove",
                "path": abs_path(path),
                "recursive": recursive,
                "nofollow": nofollow,
            }
        )

    async def chmod(self, path: str, mode: int) -> None:
        """Change permission bits."""
        await self._call({"op": "file.chmod", "path": abs_path(path), "mode": int(mode)})

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
        await self._conn.abort_transport()

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
    conn = Connection(stream)
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
        await conn.abort_transport()
        msg = f"the sandbox agent did not answer within {timeout:g}s"
        raise SandboxTimeout(msg) from None
    except BaseException:
        await conn.abort_transport()
        raise
    try:
        info = parse_hello(conn.hello)
    except ProtocolError:
        await conn.abort_transport()
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
