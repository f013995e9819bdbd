"""A small QEMU Machine Protocol client over a unix socket (anyio).

This module owns the QMP wire exchange: the greeting, ``qmp_capabilities``, commands with ids,
and the asynchronous events QEMU sends in between. It is deliberately minimal: one command in
flight at a time (QMP answers in order anyway), events kept in arrival order for
:meth:`QmpClient.wait_event`. It must not import the store or anything above the backend.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Final, final

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from sandlot.errors import BackendError, BackendUnavailable, SandboxTimeout
from sandlot.models import JsonValue

__all__ = ["QmpClient", "QmpError", "connect_unix"]

# sockaddr_un.sun_path is 108 bytes including the NUL.
_SUN_PATH_MAX: Final = 107
_MAX_LINE: Final = 16 << 20


class QmpError(BackendError):
    """QEMU answered a command with an error (its ``class`` and ``desc`` are in details)."""


async def connect_unix(path: Path) -> SocketStream:
    """Connect to a unix socket, even one whose path is longer than ``sun_path`` allows.

    A long path is reached through ``/proc/self/fd/N/<name>`` of an ``O_PATH`` descriptor of its
    directory, which the kernel resolves like the real path.
    """
    text = str(path)
    if len(text.encode()) <= _SUN_PATH_MAX:
        return await anyio.connect_unix(text)
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return await anyio.connect_unix(f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)


@final
class QmpClient:
    """One QMP session with one QEMU process."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._events: deque[dict[str, JsonValue]] = deque()
        self._next_id = 0
        self._lock = anyio.Lock()

    @classmethod
    async def connect(cls, path: Path, *, timeout: float = 5.0) -> QmpClient:
        """Connect, read the greeting and leave capabilities negotiation mode.

        Raises:
            BackendUnavailable: The socket is absent or refuses (QEMU is not running).
            SandboxTimeout: QEMU did not greet within ``timeout``.
        """
        try:
            stream = await connect_unix(path)
        except OSError as e:
            msg = f"cannot reach QEMU's QMP socket {path}: {e}"
            raise BackendUnavailable(msg) from e
        client = cls(stream)
        try:
            with anyio.fail_after(timeout):
                greeting = await client._read()
                if "QMP" not in greeting:
                    msg = f"unexpected QMP greeting: {greeting}"
                    raise BackendError(msg)
                await client.execute("qmp_capabilities")
        except TimeoutError as e:
            await client.aclose()
            msg = f"QEMU did not answer on {path} within {timeout} s"
            raise SandboxTimeout(msg) from e
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _read(self) -> dict[str, JsonValue]:
        try:
            line = await self._reader.receive_until(b"\n", _MAX_LINE)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as e:
            msg = "QEMU closed the QMP connection"
            raise BackendError(msg) from e
        except OSError as e:
            msg = f"QMP connection failed: {e}"
            raise BackendError(msg) from e
        message = json.loads(line)
        if not isinstance(message, dict):
            msg = f"QMP sent a non-object: {line[:200]!r}"
            raise BackendError(msg)
        return message

    async def execute(
        self, command: str, arguments: dict[str, JsonValue] | None = None
    ) -> JsonValue:
        """Run one command and return its ``return`` value.

        Raises:
            QmpError: QEMU answered with an error.
            BackendError: The connection broke.
        """
        async with self._lock:
            self._next_id += 1
            ident = self._next_id
            request: dict[str, JsonValue] = {"execute": command, "id": ident}
            if arguments:
                request["arguments"] = arguments
            try:
                await self._stream.send(json.dumps(request).encode() + b"\n")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                msg = f"QMP connection failed sending {command}: {e}"
                raise BackendError(msg) from e
            while True:
                message = await self._read()
                if "event" in message:
                    self._events.append(message)
                    continue
                if message.get("id") != ident:
                    continue
                if "error" in message:
                    err = message["error"]
                    desc = err.get("desc", "") if isinstance(err, dict) else str(err)
                    cls = err.get("class", "") if isinstance(err, dict) else ""
                    msg = f"QMP {command} failed: {desc}"
                    raise QmpError(msg, qmp_class=cls)
                return message.get("return")

    async def wait_event(self, name: str) -> dict[str, JsonValue]:
        """Wait for the next event called ``name`` (events seen earlier count); callers bound
        the wait with their own deadline."""
        async with self._lock:
            while True:
                while self._events:
                    event = self._events.popleft()
                    if event.get("event") == name:
                        return event
                self._events.append(await self._read())

    async def status(self) -> str:
        """The VM's run state (``running``, ``paused``, ``inmigrate``, ``postmigrate``, …)."""
        result = await self.execute("query-status")
        if not isinstance(result, dict) or not isinstance(result.get("status"), str):
            msg = f"query-status returned {result!r}"
            raise BackendError(msg)
        return str(result["status"])

    async def aclose(self) -> None:
        """Close the connection (QEMU keeps running)."""
        await self._stream.aclose()

    async def __aenter__(self) -> QmpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
