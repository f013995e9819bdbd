"""Framing, dispatch and flow control over one byte stream: the agent client's transport.

Many requests share one connection (virtio-serial offers exactly one stream), each on its own
stream id. There is no background reader task, so a connection needs no task group and can be
handed around freely: whichever caller is waiting for a frame reads from the connection and
dispatches everything it reads to the streams it belongs to, then hands reading over to the
next waiter. Per-stream credit (``docs/agent-protocol.md`` section 4) bounds what can pile up
for a stream whose consumer is slow.

This module imports only anyio, the errors, :mod:`.protocol` and :mod:`.replies`; it knows no
operation of the protocol (those are :mod:`.client`'s) and must not import backends, the store
or the Manager.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable
from typing import Final

import anyio
import anyio.abc

from sandlot.channel.protocol import (
    MAX_DATA,
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
)
from sandlot.channel.replies import unwrap
from sandlot.errors import BackendError, SandboxError

__all__ = ["Connection", "Item", "Stream"]

_RECEIVE_SIZE: Final = 1 << 20
_GRANT_AT: Final = WINDOW // 4
_CANCEL_GRACE: Final = 2.0

Item = tuple[int, int, object]
"""(frame type, chan, payload): bytes for DATA, a dict for EVENT and END."""


class Stream:
    """The client's state for one stream id."""

    __slots__ = ("credit", "end", "items", "sid", "unacked")

    def __init__(self, sid: int, credit: int) -> None:
        self.sid = sid
        self.items: deque[Item] = deque()
        self.credit = credit
        self.unacked = 0
        self.end: dict[str, object] | None = None


class Connection:
    """Framing, dispatch and flow control over one anyio byte stream."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()
        self.send_lock = anyio.Lock()
        self.read_lock = anyio.Lock()
        self.streams: dict[int, Stream] = {}
        self.waiters: list[tuple[Stream | None, anyio.Event]] = []
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

    def _wake(self, st: Stream | None) -> None:
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
            await self.abort_transport()
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

    async def wait(self, st: Stream | None, ready: Callable[[], bool]) -> None:
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

    async def next_item(self, st: Stream) -> Item:
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

    async def open(self, request: dict[str, object]) -> Stream:
        sid = self.next_sid
        self.next_sid += 1
        st = Stream(sid, self.peer_window)
        self.streams[sid] = st
        try:
            await self.send(FrameType.OPEN, sid, encode_json(request))
        except BaseException:
            self.streams.pop(sid, None)
            raise
        return st

    async def send_data(self, st: Stream, data: bytes, chan: int = Chan.IN) -> None:
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

    async def cancel(self, st: Stream) -> None:
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

    def forget(self, st: Stream) -> None:
        """Drop a stream whose consumer went away without waiting (cancel sent lazily)."""
        if self.streams.pop(st.sid, None) is not None and st.end is None:
            self.orphans.append(st.sid)

    async def abort_transport(self) -> None:
        with (
            anyio.CancelScope(shield=True),
            contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
        ):
            await self.stream.aclose()

    async def result(self, st: Stream) -> dict[str, object]:
        """Wait for END, skipping anything else; the result object or the mapped error."""
        while True:
            kind, _, payload = await self.next_item(st)
            if kind == FrameType.END:
                assert isinstance(payload, dict)
                return unwrap(payload)


def _as_dict(payload: bytes) -> dict[str, object]:
    try:
        obj = decode_json(payload)
    except ProtocolError:
        return {}
    return obj if isinstance(obj, dict) else {}
