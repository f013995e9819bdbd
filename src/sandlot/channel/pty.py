"""A terminal inside the sandbox, as the agent client hands it out: :class:`AgentPty`.

It runs on a stream of the channel's :class:`~sandlot.channel.connection.Connection`; the
channel's ``open_pty`` opens it. Imports only :mod:`.connection`, :mod:`.replies`,
:mod:`.protocol` and the errors; must not import backends, the store or the Manager.
"""

from __future__ import annotations

from typing import final

from sandlot.channel.connection import Connection, Stream
from sandlot.channel.protocol import FrameType, encode_json, error_from_reply
from sandlot.channel.replies import as_int, unwrap
from sandlot.errors import InvalidRequest

__all__ = ["AgentPty"]


@final
class AgentPty:
    """A terminal inside the sandbox (implements :class:`~sandlot.channel.base.PtySession`)."""

    def __init__(self, conn: Connection, st: Stream, pty_id: str, pid: int) -> None:
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
            result = unwrap(end) if end.get("ok") is True else {}
            self._exit = as_int(result.get("exit_code"), -1)

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
