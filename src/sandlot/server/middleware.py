"""The app's own ASGI middleware: the request-body cap and request metrics.

:class:`BodyLimit` refuses a body over the upload limit with 413 before the route reads it
(from ``Content-Length`` when sent, else as it streams in), and :func:`too_large` is the one
wording every upload refusal uses, naming the configured limit. :class:`RequestMetrics`
counts requests and times them to the first response byte, by route template.

This module must not import the Manager, backends or the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.server.deps import problem
from sandlot.server.metrics import ServerMetrics
from sandlot.server.problems import PayloadTooLarge

__all__ = ["BodyLimit", "RequestMetrics", "too_large"]


class BodyLimit:
    """Refuse request bodies over the limit with 413, before reading them when possible.

    The limit is on content: a raw upload's body (a file, or a process's standard input) is the
    content, while a JSON body carries it in base64 (4/3 as long, plus the rest of the
    request), so each is allowed what that same content takes, and every refusal names the one
    configured limit.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        content_limit = self.limit()
        what = _raw_body(str(scope.get("path", "")))
        raw = what is not None
        limit = content_limit if raw else content_limit * 4 // 3 + 65536
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                msg = too_large(content_limit, int(value), raw=raw, what=what or "the upload")
                await problem(PayloadTooLarge(msg, limit=content_limit))(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    msg = too_large(content_limit, None, raw=raw, what=what or "the upload")
                    raise PayloadTooLarge(msg, limit=content_limit)
            return message

        await self.app(scope, limited, send)


def _raw_body(path: str) -> str | None:
    """What a raw (not JSON) body to ``path`` is, in a refusal's words; None for JSON."""
    if path.endswith("/files/content"):
        return "the upload"
    if path.endswith("/stdin") and "/processes/" in path:
        return "the input"
    return None


def too_large(limit: int, size: int | None, *, raw: bool, what: str = "the upload") -> str:
    """One wording for every upload refusal, naming the configured limit.

    ``what`` names a raw body (a file upload, a process's input); a JSON body is its files.
    """
    if not raw:
        what = "the files in this request (as base64 JSON)"
    how_big = f" ({size} bytes)" if size is not None and raw else ""
    return f"{what}{how_big} is over this server's upload limit of {limit} bytes"


class RequestMetrics:
    """Count requests and time them to the first response byte, by route template."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ServerMetrics]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")
                m = self.metrics()
                m.requests.labels(
                    method=scope["method"], route=route, status=str(message["status"])
                ).inc()
                m.request_seconds.labels(route=route).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, counted)
