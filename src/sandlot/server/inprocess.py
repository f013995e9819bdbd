"""An httpx transport that hands requests to an ASGI app in this process, streaming both ways.

The MCP endpoint's tools call the API through an :class:`~sandlot.client.AsyncClient` on this
transport, so they pass through the same middleware, key checks, quotas and routes as any
client, without a TCP round trip to the server's own port. httpx's ``ASGITransport`` will not
do: it runs the app to completion and buffers the whole body, so an exec's output would arrive
only at its end (no MCP progress) and a followed stream would never return. Here the app runs
as a task of the server (``spawn``), its body chunks reach the reader as it sends them (a
small buffer, then back-pressure, as a socket gives), and a reader that closes the response or
is cancelled before it starts is a client that went away: the app gets ``http.disconnect``
and what it still sends is dropped.

This module must not import the Manager, backends, the store or FastAPI.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import final

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.types import ASGIApp, Message, Scope

__all__ = ["AppTransport"]

log = logging.getLogger("sandlot.server")

_SERVER_ERROR = b"Internal Server Error"


@final
class AppTransport(httpx.AsyncBaseTransport):
    """Requests served by ``app`` in this process.

    Args:
        app: The ASGI app (the server's own).
        spawn: Starts a task that may outlive the request call (the server's task group).
        buffer: Body chunks that may wait for the reader before the app blocks.
    """

    def __init__(
        self,
        app: ASGIApp,
        spawn: Callable[[Callable[[], Coroutine[object, object, None]]], None],
        *,
        buffer: int = 16,
    ) -> None:
        self.app = app
        self.spawn = spawn
        self.buffer = buffer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not isinstance(request.stream, httpx.AsyncByteStream):
            msg = "AppTransport serves async requests only"
            raise TypeError(msg)
        request_body: AsyncIterator[bytes] | None = request.stream.__aiter__()
        send_body, receive_body = anyio.create_memory_object_stream[bytes](self.buffer)
        head: list[Message] = []
        started = anyio.Event()
        gone = anyio.Event()  # the response is complete or its reader left: a disconnect

        async def receive() -> Message:
            nonlocal request_body
            if request_body is not None:
                try:
                    chunk = await request_body.__anext__()
                except StopAsyncIteration:
                    request_body = None
                    return {"type": "http.request", "body": b"", "more_body": False}
                return {"type": "http.request", "body": chunk, "more_body": True}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                head.append(message)
                started.set()
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    # A reader that is gone drops the rest, as a closed socket would.
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await send_body.send(chunk)
                if not message.get("more_body", False):
                    send_body.close()
                    gone.set()

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, send)
            except Exception:  # the request fails, never the server's task group
                log.exception("in-process %s %s failed", request.method, request.url.path)
            finally:
                send_body.close()
                gone.set()
                started.set()

        self.spawn(run)
        try:
            await started.wait()
        except BaseException:
            # The caller gave up before the answer began: a client that hung up.
            receive_body.close()
            gone.set()
            raise
        if not head:
            # What uvicorn answers for an app that failed before it began a response.
            receive_body.close()
            return httpx.Response(
                500,
                headers=[(b"content-type", b"text/plain; charset=utf-8")],
                content=_SERVER_ERROR,
            )
        return httpx.Response(
            head[0]["status"],
            headers=head[0].get("headers", []),
            stream=_Body(receive_body, gone),
        )


def _scope(request: httpx.Request) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "scheme": request.url.scheme,
        "path": request.url.path,
        "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query,
        "server": (request.url.host, request.url.port),
        "client": ("127.0.0.1", 0),
        "root_path": "",
    }


@final
class _Body(httpx.AsyncByteStream):
    """A response body as the app sends it; closing it early hangs up on the app."""

    def __init__(self, chunks: MemoryObjectReceiveStream[bytes], gone: anyio.Event) -> None:
        self._chunks = chunks
        self._gone = gone

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        self._chunks.close()
        self._gone.set()
