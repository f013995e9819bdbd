"""The API's description (``/openapi.json``, ``/docs``, ``/redoc``) behind an API key.

The description lists every route and parameter of this server, its version and options:
a map for anyone probing it, so by default only key holders get it, like ``/metrics``.
:attr:`ServerConfig.docs_public <sandlot.server.app.ServerConfig>` (``sandlot serve
--public-docs``) serves it to anyone, for a browser (which cannot send the key header to
``/docs``) on a trusted network.

This module must not import the Manager, backends or FastAPI.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.server.keys import ApiKeyStore
from sandlot.server.problems import Unauthenticated, problem_body
from sandlot.server.wire import PROBLEM_TYPE

__all__ = ["DocsGate", "is_docs_path"]


def is_docs_path(path: str) -> bool:
    """Whether ``path`` serves the API's description (Swagger UI's helper pages included)."""
    return path in ("/openapi.json", "/docs", "/redoc") or path.startswith(("/docs/", "/redoc/"))


class DocsGate:
    """ASGI middleware: the API's description needs a valid key unless ``public``."""

    def __init__(self, app: ASGIApp, keys: ApiKeyStore, public: bool) -> None:
        self.app = app
        self.keys = keys
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.public or scope["type"] != "http" or not is_docs_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        key = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                key = key.strip() if scheme.lower() == "bearer" else ""
        if key and await self.keys.identify(key) is not None:
            await self.app(scope, receive, send)
            return
        error = Unauthenticated(
            "the API description needs an API key: send `Authorization: Bearer <key>` "
            "(or serve it to anyone with `sandlot serve --public-docs`)"
        )
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", PROBLEM_TYPE.encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(problem_body(error)).encode()})
