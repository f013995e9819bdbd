"""``sandlot serve`` behind its options: open the Manager, recover from a crash, serve.

:func:`serve` is the one call the command line makes once it has parsed its options: it opens
the embedded SDK on the database, refuses a default backend tenants may not use, keeps command
output in that same database (so a client reconnecting after a restart gets the rest, or
"outcome unknown" for a command that died with the server), settles what the last server left
behind, and runs the app under uvicorn until it is stopped, closing everything after.

This module must not import concrete backends or the store (the SDK opens them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from sandlot.errors import InvalidRequest
from sandlot.server.app import ServerConfig, create_app
from sandlot.server.keys import ApiKeyStore
from sandlot.server.offer import offered
from sandlot.server.outputlog import DatabaseExecOutputLog

if TYPE_CHECKING:
    from sandlot.sdk import AsyncSandlot
    from sandlot.settings import Settings

__all__ = ["serve"]


async def serve(
    config: ServerConfig,
    *,
    settings: Settings,
    say: Callable[[str], None],
) -> None:
    """Serve the HTTP API (and MCP at ``/mcp``) until interrupted.

    Args:
        config: What the server allows and keeps.
        settings: The effective settings (``sandlot.toml``, environment and flags): the
            address and port (``[server]``), home, default backend, database, policy, pools.
        say: Where the start-up lines go (what was recovered, what is served where).

    Raises:
        InvalidRequest: The default backend is a development backend not enabled for tenants.
    """
    import uvicorn

    from sandlot.gate.offload import favour_the_event_loop
    from sandlot.sdk import AsyncSandlot
    from sandlot.server.redact import log_config
    from sandlot.wiring import redact_url, warm_pools

    host, port = settings.values.server.host, settings.values.server.port
    sdk = AsyncSandlot(settings=settings)
    database = sdk.database_url
    default = sdk.manager.default_backend
    if default not in offered(sdk.manager.backends, default, config.enable_backends):
        await sdk.aclose()
        msg = (
            f"the default backend {default!r} is a development backend, not offered to "
            f"tenants unless enabled: pass --enable-backend {default}, or choose another "
            f"with sandlot --backend NAME serve (or SANDLOT_BACKEND)"
        )
        raise InvalidRequest(msg)
    # Command output lives in the database, so a client reconnecting after a restart gets the
    # rest (or "outcome unknown" for a command that died with the server).
    output = DatabaseExecOutputLog(
        sdk.database_engine,
        retention=config.output_retention,
        max_bytes=config.output_max_bytes,
    )
    await _recover(sdk, output, say)
    keys = ApiKeyStore(database)
    app = create_app(sdk.manager, keys, config, output_log=output)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            log_level="info",
            log_config=log_config(),
        )
    )
    shown = f"[{host}]" if ":" in host else host
    say(f"sandlot {sdk.manager.default_backend} backend, database {redact_url(database)}")
    say(f"serving http://{shown}:{port} (MCP at /mcp); Ctrl-C stops")
    favour_the_event_loop()
    try:
        async with warm_pools(sdk.manager):  # the pools sandlot.toml asks for, kept full
            await server.serve()
    finally:
        with anyio.CancelScope(shield=True):
            await output.aclose()
            await keys.aclose()
            await sdk.aclose()


async def _recover(
    sdk: AsyncSandlot, output: DatabaseExecOutputLog, say: Callable[[str], None]
) -> None:
    """After a crash: runs that died with the last server are marked unknown, intents whose
    worker died are settled, then records are synced with the backends."""
    abandoned = await output.mark_unknown_abandoned()
    recovered = await sdk.manager.recover()
    report = await sdk.manager.reconcile()
    if abandoned or recovered or report.updated or report.reaped:
        say(
            f"recovered: {len(abandoned)} command(s) marked unknown, "
            f"{len(recovered)} intent(s) settled, {len(report.updated)} record(s) "
            f"updated, {len(report.reaped)} orphan(s) reaped"
        )
