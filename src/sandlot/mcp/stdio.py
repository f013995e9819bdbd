"""``sandlot mcp``: the MCP server on stdio, for desktop and IDE clients that launch it.

The tools run on an embedded Manager (the same state as the CLI), or against a server when
``SANDLOT_URL`` is set (then ``SANDLOT_API_KEY`` names the tenant). Only stdout carries the
protocol; anything else goes to stderr. This module must not import backends or the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mcp.server.mcpserver import Context

from sandlot.api import SandlotAPI
from sandlot.mcp.server import build_server

if TYPE_CHECKING:
    from sandlot.settings import Settings

__all__ = ["serve_stdio"]


async def serve_stdio(
    *,
    home: Path | None = None,
    backend: str | None = None,
    database: str | None = None,
    url: str | None = None,
    api_key: str | None = None,
    upload_roots: Sequence[Path] = (),
    settings: Settings | None = None,
) -> None:
    """Serve the tools on stdin/stdout until the client closes the stream.

    Args:
        home: State directory of the embedded Manager.
        backend: Backend for new sandboxes.
        database: Database URL of the embedded Manager.
        url: A sandlot server to use instead of an embedded Manager.
        api_key: The key for ``url``.
        upload_roots: Host directories ``upload_dir`` may read.
        settings: The embedded Manager's settings, resolved already (the CLI's); then
            ``home``, ``backend`` and ``database`` are unused.
    """
    api: SandlotAPI
    if url:
        from sandlot.client import AsyncClient

        remote = AsyncClient(url, api_key)
        api, closer, mode = remote, remote.aclose, url
    else:
        from sandlot.sdk import AsyncSandlot

        local = AsyncSandlot(home, backend, database, settings=settings)
        api, closer, mode = local, local.aclose, "embedded"

    async def provider(ctx: Context) -> SandlotAPI:
        return api

    server = build_server(provider, mode=mode, upload_roots=upload_roots)
    try:
        await server.run_stdio_async()
    finally:
        await closer()
