"""What a revoked API key has open ends: its event streams, terminals and MCP streams.

A request's key is checked when the request arrives, but an event stream or a terminal it
opens can last hours. So each long-lived connection is registered under the id of the key that
opened it, and :meth:`KeySessions.watch` (one task per server) asks the key table every
``interval`` seconds which of those keys are revoked, and cancels what they have open: an
event stream ends with an ``error`` event (``unauthenticated``), a terminal gets an ``error``
frame and is closed with 1008 (policy violation), its program hung up. It polls the
database rather than waiting for word from whoever revoked, because revocation may come from
another server sharing the database or from ``sandlot api-keys revoke``, which talks to no
server at all.

:class:`KeySessionGuard` is the ASGI middleware that registers connections: authentication
calls :func:`note_key` with the key's id, and once the response turns out to be an event
stream (or the WebSocket is accepted) the connection becomes cancellable; so does a request
body still streaming in after authentication (a command's standard input, typed like a
terminal's), until its last byte, when it is refused with 401. Work itself is never cut
short: its key was valid when it arrived, and a half-done create or write is worse than a
finished one; commands the key started run on (the tenant's other keys see them). Other long-lived things (MCP sessions) register through
:meth:`KeySessions.open`.

This module must not import the Manager, backends or FastAPI.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import final

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.errors import SandboxError, Unauthenticated
from sandlot.server.keys import ApiKeyStore
from sandlot.server.problems import problem_body
from sandlot.server.wire import PROBLEM_TYPE, PtyError

__all__ = ["REVOKED", "KeySessionGuard", "KeySessions", "note_key"]

log = logging.getLogger("sandlot.server")

REVOKED = "the API key this connection was opened with has been revoked"
"""What a connection ended by revocation is told."""

_SCOPE_KEY = "sandlot.key_session"
_POLICY_VIOLATION = 1008


class _Entry:
    """One open thing of a key, and how to end it (compared by identity)."""

    __slots__ = ("cancel",)

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel


@final
class KeySessions:
    """The long-lived connections of this server, by the id of the key that opened them.

    Args:
        keys: The key table, asked which keys are revoked.
        interval: Seconds between checks (a revoked key's connections end within about this).
    """

    def __init__(self, keys: ApiKeyStore, *, interval: float = 0.5) -> None:
        self.keys = keys
        self.interval = interval
        self._open: dict[str, set[_Entry]] = {}

    def open(self, key_id: str, cancel: Callable[[], None]) -> Callable[[], None]:
        """Call ``cancel`` once key ``key_id`` is revoked; returns the call that unregisters."""
        entry = _Entry(cancel)
        self._open.setdefault(key_id, set()).add(entry)

        def close() -> None:
            entries = self._open.get(key_id)
            if entries is not None:
                entries.discard(entry)
                if not entries:
                    del self._open[key_id]

        return close

    def count(self, key_id: str) -> int:
        """How many things key ``key_id`` has open here."""
        return len(self._open.get(key_id, ()))

    async def check(self) -> set[str]:
        """End what revoked keys have open; returns those keys' ids."""
        if not self._open:
            return set()
        revoked = await self.keys.revoked_among(list(self._open))
        for key_id in revoked:
            for entry in self._open.pop(key_id, set()):
                entry.cancel()
        if revoked:
            log.info("ended the connections of revoked API keys %s", ", ".join(sorted(revoked)))
        return revoked

    async def watch(self) -> None:
        """Check every ``interval`` seconds until cancelled (the server's lifespan)."""
        while True:
            try:
                await self.check()
            except SandboxError as e:
                # The database is away: the next round tries again, and new requests are
                # refused meanwhile (they cannot be authenticated either).
                log.warning("checking for revoked API keys failed: %s", e.message)
            except Exception:
                # This task lives in the server's lifespan task group: letting a bug out would
                # stop the whole server, so it is logged and the next round tries again.
                log.exception("checking for revoked API keys failed")
            await anyio.sleep(self.interval)


class _Connection:
    """A request as the guard sees it: the key it was authenticated with, and its scope."""

    __slots__ = ("key_id", "scope")

    def __init__(self) -> None:
        self.key_id: str | None = None
        self.scope = anyio.CancelScope()


def note_key(scope: Scope, key_id: str) -> None:
    """Record that the request of ASGI ``scope`` was authenticated with key ``key_id``."""
    connection = scope.get(_SCOPE_KEY)
    if isinstance(connection, _Connection):
        connection.key_id = key_id


def _is_event_stream(message: Message) -> bool:
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-type":
            return bytes(value).startswith(b"text/event-stream")
    return False


class KeySessionGuard:
    """ASGI middleware: event streams, WebSockets and request bodies still streaming in end
    when their key is revoked."""

    def __init__(self, app: ASGIApp, sessions: Callable[[], KeySessions]) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        connection = _Connection()
        scope[_SCOPE_KEY] = connection
        unregister: Callable[[], None] | None = None
        body_watch: Callable[[], None] | None = None
        started = ended = body_done = False

        def watch() -> Callable[[], None] | None:
            if connection.key_id is None:
                return None
            return self.sessions().open(connection.key_id, connection.scope.cancel)

        async def tracked_receive() -> Message:
            nonlocal body_watch, body_done
            if kind == "http" and not started and not body_done and body_watch is None:
                # A body still coming in after authentication (a command's streamed
                # standard input, an upload) is the key keeping a connection open too: it
                # may be cut until its last byte, never after, when the work it feeds starts.
                body_watch = watch()
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
                if body_watch is not None:
                    body_watch()
                    body_watch = None
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal unregister, started, ended
            what = message["type"]
            if what == "websocket.accept" or (
                what == "http.response.start" and _is_event_stream(message)
            ):
                started = True
                if unregister is None:
                    unregister = watch()
            elif what == "http.response.start":
                started = True
            elif what == "websocket.close" or (
                what == "http.response.body" and not message.get("more_body", False)
            ):
                ended = True
            await send(message)

        try:
            with connection.scope:
                await self.app(scope, tracked_receive, tracked_send)
        finally:
            for done in (unregister, body_watch):
                if done is not None:
                    done()
        if connection.scope.cancel_called and not ended:
            await _tell_revoked(kind, started, send)


async def _tell_revoked(kind: str, started: bool, send: Send) -> None:
    problem = problem_body(Unauthenticated(REVOKED))
    # A client that stopped reading must not hold the connection open: after a second
    # the server drops it without the last word.
    with anyio.move_on_after(1), contextlib.suppress(OSError, RuntimeError):
        if kind == "http" and not started:
            headers = [(b"content-type", PROBLEM_TYPE.encode()), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": json.dumps(problem).encode()})
        elif kind == "http":
            event = f"event: error\ndata: {json.dumps(problem)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            # The terminal is the only WebSocket: its error frame, then a policy close.
            frame = PtyError(problem=problem).model_dump_json()
            await send({"type": "websocket.send", "text": frame})
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION, "reason": REVOKED})
