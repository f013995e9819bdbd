"""``sandlot serve``, ``sandlot mcp`` and ``sandlot api-keys``: the control-plane commands.

``serve`` runs the HTTP API (and MCP at ``/mcp``) on an embedded Manager; ``mcp`` serves the
MCP tools on stdio; ``api-keys`` makes, lists and revokes the keys the API accepts (``sandlot
keys`` is the receipt-signing keys' group; the two are different things). The commands
register themselves on :data:`sandlot.cli.app.app` when this module is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import anyio
import typer
from rich.table import Table

from sandlot.cli.app import _fail, _print_json, _settings, app, err, out
from sandlot.errors import SandboxError

if TYPE_CHECKING:
    from sandlot.server.keys import ApiKeyStore

__all__ = ["api_keys"]

api_keys = typer.Typer(
    name="api-keys",
    help="API keys for `sandlot serve`: each maps to a tenant and a principal.",
    no_args_is_help=True,
)
app.add_typer(api_keys, name="api-keys")

T = TypeVar("T")
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _database(explicit: str | None) -> str:
    from sandlot.config import home
    from sandlot.sdk import database_url

    return database_url(explicit or _settings.database, home(_settings.home))


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port.")] = 8470,
    database: Annotated[
        str | None, typer.Option("--database", help="Database URL (default: the home's SQLite).")
    ] = None,
    max_sandboxes: Annotated[
        int | None, typer.Option("--max-sandboxes", min=1, help="Live sandboxes per tenant.")
    ] = None,
    max_execs: Annotated[
        int | None,
        typer.Option(
            "--max-execs",
            min=1,
            help="Concurrent commands, background processes and terminals per tenant.",
        ),
    ] = None,
    max_uploads: Annotated[
        int,
        typer.Option("--max-uploads", min=1, help="Concurrent file uploads per tenant."),
    ] = 4,
    max_uploads_total: Annotated[
        int,
        typer.Option("--max-uploads-total", min=1, help="Concurrent file uploads in all."),
    ] = 16,
    admission_timeout: Annotated[
        float,
        typer.Option("--admission-timeout", min=0, help="Seconds a request over quota waits."),
    ] = 30.0,
    max_upload_mb: Annotated[
        int, typer.Option("--max-upload-mb", min=1, help="Largest upload (MiB).")
    ] = 256,
    max_download_mb: Annotated[
        int, typer.Option("--max-download-mb", min=1, help="Largest download (MiB).")
    ] = 1024,
    output_retention: Annotated[
        float,
        typer.Option(
            "--output-retention", min=0, help="Seconds command output stays for reconnects."
        ),
    ] = 300.0,
    output_max_mb: Annotated[
        float,
        typer.Option(
            "--output-max-mb",
            min=0.001,
            help="Output kept per command for reconnects (MiB; live streams get all of it).",
        ),
    ] = 4.0,
    public_metrics: Annotated[
        bool, typer.Option("--public-metrics", help="Serve /metrics without a key.")
    ] = False,
    public_docs: Annotated[
        bool,
        typer.Option("--public-docs", help="Serve /openapi.json and /docs without a key."),
    ] = False,
    mcp: Annotated[bool, typer.Option("--mcp/--no-mcp", help="Serve MCP at /mcp.")] = True,
    enable_backend: Annotated[
        list[str] | None,
        typer.Option(
            "--enable-backend",
            help="Offer a development backend (fake) to tenants; repeat for several.",
        ),
    ] = None,
) -> None:
    """Serve the HTTP API (and MCP at /mcp) until interrupted."""
    from sandlot.server import Quota, ServerConfig
    from sandlot.server.serve import serve as run_server

    config = ServerConfig(
        max_upload_bytes=max_upload_mb << 20,
        max_download_bytes=max_download_mb << 20,
        output_retention=output_retention,
        output_max_bytes=int(output_max_mb * (1 << 20)),
        quota=Quota(
            max_live_sandboxes=max_sandboxes,
            max_concurrent_execs=max_execs,
            max_concurrent_uploads=max_uploads,
        ),
        max_concurrent_uploads=max_uploads_total,
        admission_timeout=admission_timeout,
        metrics_public=public_metrics,
        docs_public=public_docs,
        mcp=mcp,
        enable_backends=frozenset(enable_backend or ()),
    )

    async def main() -> None:
        await run_server(
            config,
            host=host,
            port=port,
            home=_settings.home,
            backend=_settings.backend,
            database=_database(database),
            say=lambda line: err.print(line, markup=False),
        )

    try:
        anyio.run(main)
    except SandboxError as e:
        _fail(e, as_json=False)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("mcp")
def mcp_stdio(
    share: Annotated[
        list[Path] | None,
        typer.Option(
            "--share",
            help="A host directory the upload_dir tool may copy from (repeatable; default: none).",
        ),
    ] = None,
) -> None:
    """Serve the MCP tools on stdio (for MCP clients that launch a command).

    Uses the embedded Manager, or the server at $SANDLOT_URL (with $SANDLOT_API_KEY).
    """
    import os

    from sandlot.mcp.stdio import serve_stdio

    async def main() -> None:
        await serve_stdio(
            home=_settings.home,
            backend=_settings.backend,
            database=_settings.database,
            url=os.environ.get("SANDLOT_URL") or None,
            api_key=os.environ.get("SANDLOT_API_KEY") or None,
            upload_roots=list(share or []),
        )

    try:
        anyio.run(main)
    except SandboxError as e:
        print(f"error: {e.message}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _keys_run(as_json: bool, body: Callable[[ApiKeyStore], Awaitable[T]]) -> T:
    from sandlot.server.keys import ApiKeyStore

    async def main() -> T:
        store = ApiKeyStore(_database(None))
        try:
            return await body(store)
        finally:
            await store.aclose()

    try:
        return anyio.run(main)
    except SandboxError as e:
        _fail(e, as_json)


@api_keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant the key acts for.")],
    principal: Annotated[
        str | None,
        typer.Option("--principal", help="Who the key acts as (default: the key's id)."),
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="See every tenant, reconcile, read /metrics.")
    ] = False,
    description: Annotated[
        str | None, typer.Option("--description", help="A note to recognise it by.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a key and print it (this is the only time it is shown)."""
    from sandlot.server.keys import NewApiKey

    async def body(store: ApiKeyStore) -> NewApiKey:
        return await store.create(tenant, principal, admin=admin, description=description)

    made = _keys_run(as_json, body)
    if as_json:
        _print_json({"key": made.key, **made.info.model_dump(mode="json")})
        return
    print(made.key)
    err.print(
        f"key {made.info.id} for tenant {made.info.tenant} as {made.info.principal}"
        + (" (admin)" if made.info.admin else "")
        + ": store it now, it is not shown again"
    )


@api_keys.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List keys (never their text), revoked ones included."""
    from sandlot.server.keys import ApiKeyInfo

    async def body(store: ApiKeyStore) -> list[ApiKeyInfo]:
        return await store.list(tenant=tenant)

    items = _keys_run(as_json, body)
    if as_json:
        _print_json(items)
        return
    if not items:
        err.print("no api keys")
        return
    table = Table(box=None, pad_edge=False)
    # The id is what `revoke` takes: shown whole, whatever the terminal's width (the other
    # columns fold instead).
    widest = max((len(k.id) for k in items), default=2)
    table.add_column("ID", no_wrap=True, min_width=widest)
    for col in ("PREFIX", "TENANT", "PRINCIPAL", "ADMIN", "CREATED", "REVOKED"):
        table.add_column(col, overflow="fold")
    for k in items:
        table.add_row(
            k.id,
            k.prefix + "…",
            k.tenant,
            k.principal,
            "yes" if k.admin else "",
            _when(k.created_at),
            _when(k.revoked_at) if k.revoked_at else "",
        )
    out.print(table)


@api_keys.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (ak-…).", show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """Revoke a key: requests with it fail from now on (within seconds on running servers)."""
    from sandlot.server.keys import ApiKeyInfo

    async def body(store: ApiKeyStore) -> ApiKeyInfo:
        return await store.revoke(key_id)

    info = _keys_run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        out.print(f"{info.id} revoked")


def _when(at: datetime | None) -> str:
    return f"{at:%Y-%m-%d %H:%M:%S}" if at else ""
