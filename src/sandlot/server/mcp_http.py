"""The ``/mcp`` endpoint of ``sandlot serve``: MCP over streamable HTTP, behind API keys.

A request without a valid key is refused (401) before the MCP layer sees it. Each MCP session
belongs to the key that opened it (its tenant and key id, handed to the MCP layer as the
request's user): with any other key, even the same tenant's, its ``mcp-session-id`` answers
404 exactly like an unknown one, so a leaked session id lets nobody delete the session, read
its stream or call tools in it. A revoked key's open MCP streams end like its other streams
(:mod:`sandlot.server.sessions`). The tools then
call this server's own HTTP API with the caller's key (an :class:`~sandlot.client.AsyncClient`
per key), in process, through the app itself (:class:`~sandlot.server.inprocess.AppTransport`,
no TCP), so an MCP caller is one more client: tenant isolation, quotas, metrics and the policy
gate apply to it exactly as to any other.

This module must not import backends or the store.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import final

import httpx
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import Receive, Scope, Send

from sandlot.client import AsyncClient
from sandlot.errors import InvalidRequest
from sandlot.mcp.server import SandlotApi, build_server
from sandlot.server.keys import ApiKeyStore, hash_key
from sandlot.server.problems import Unauthenticated, problem_body
from sandlot.server.sessions import note_key
from sandlot.server.wire import PROBLEM_TYPE

__all__ = ["McpEndpoint"]

_MAX_CLIENTS = 256
_BASE_URL = "http://sandlot.in-process"
"""The tools' calls never leave the process; the URL only names the API's root."""


def _bearer(headers: Mapping[str, str] | None) -> str | None:
    if headers is None:
        return None
    value = headers.get("authorization") or headers.get("Authorization") or ""
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


@final
class McpEndpoint:
    """An ASGI app serving MCP at ``/mcp`` for API-key holders.

    Args:
        keys: Where keys are checked.
        api: How the tools reach the API: a transport to the server's own app.
    """

    def __init__(self, keys: ApiKeyStore, api: httpx.AsyncBaseTransport) -> None:
        self.keys = keys
        self.api = api
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()
        self.server = build_server(self._provider, mode="server")
        # Keys, not browsers, authenticate here: a DNS-rebinding page cannot send one, so the
        # Host/Origin allowlist would only break clients reaching us by another name.
        self._app = self.server.streamable_http_app(
            streamable_http_path="/mcp",
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the MCP session manager (for the app's lifespan)."""
        try:
            async with self.server.session_manager.run():
                yield
        finally:
            clients = list(self._clients.values())
            self._clients.clear()
            for client in clients:
                await client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        key = _bearer(headers)
        info = await self.keys.identify(key) if key else None
        if info is None:
            body = problem_body(
                Unauthenticated("MCP over HTTP needs an API key: `Authorization: Bearer <key>`")
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", PROBLEM_TYPE.encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        note_key(scope, info.id)
        # The MCP session manager binds a session to the user that opened it and answers 404
        # to anyone else; the key's id (never its text) and tenant say who that is.
        owner = AccessToken(token=info.id, client_id=info.id, subject=info.tenant, scopes=[])
        scope["user"] = AuthenticatedUser(owner)
        await self._app(scope, receive, send)

    async def _provider(self, ctx: Context) -> SandlotApi:
        key = _bearer(ctx.headers)
        if key is None:
            msg = "this MCP call carried no API key"
            raise InvalidRequest(msg)
        digest = hash_key(key)
        client = self._clients.get(digest)
        if client is None:
            client = AsyncClient(_BASE_URL, key, transport=self.api)
            self._clients[digest] = client
            if len(self._clients) > _MAX_CLIENTS:
                _, oldest = self._clients.popitem(last=False)
                await oldest.aclose()
        else:
            self._clients.move_to_end(digest)
        return client
