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

import typer

from sandlot.cli.app import _effective_settings, _fail, _print_json, _settings, app, err, out
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
    from sandlot.wiring import database_url

    settings = _effective_settings(database=(explicit, "flag --database"))
    return database_url(settings.values.database, settings.home)


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option("--host", help="Address to listen on.", show_default="127.0.0.1")
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", min=0, max=65535, help="Port.", show_default="8470")
    ] = None,
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
        int | None,
        typer.Option(
            "--max-uploads", min=1, help="Concurrent file uploads per tenant.", show_default="4"
        ),
    ] = None,
    max_uploads_total: Annotated[
        int | None,
        typer.Option(
            "--max-uploads-total", min=1, help="Concurrent file uploads in all.", show_default="16"
        ),
    ] = None,
    admission_timeout: Annotated[
        float | None,
        typer.Option(
            "--admission-timeout",
            min=0,
            help="Seconds a request over quota waits.",
            show_default="30",
        ),
    ] = None,
    max_upload_mb: Annotated[
        int | None,
        typer.Option("--max-upload-mb", min=1, help="Largest upload (MiB).", show_default="256"),
    ] = None,
    max_download_mb: Annotated[
        int | None,
        typer.Option(
            "--max-download-mb", min=1, help="Largest download (MiB).", show_default="1024"
        ),
    ] = None,
    output_retention: Annotated[
        float | None,
        typer.Option(
            "--output-retention",
            min=0,
            help="Seconds command output stays for reconnects.",
            show_default="300",
        ),
    ] = None,
    output_max_mb: Annotated[
        float | None,
        typer.Option(
            "--output-max-mb",
            min=0.001,
            help="Output kept per command for reconnects (MiB; live streams get all of it).",
            show_default="4",
        ),
    ] = None,
    public_metrics: Annotated[
        bool | None, typer.Option("--public-metrics", help="Serve /metrics without a key.")
    ] = None,
    public_docs: Annotated[
        bool | None,
        typer.Option("--public-docs", help="Serve /openapi.json and /docs without a key."),
    ] = None,
    mcp: Annotated[
        bool | None, typer.Option("--mcp/--no-mcp", help="Serve MCP at /mcp.", show_default="on")
    ] = None,
    enable_backend: Annotated[
        list[str] | None,
        typer.Option(
            "--enable-backend",
            help="Offer a development backend (fake) to tenants; repeat for several.",
        ),
    ] = None,
) -> None:
    """Serve the HTTP API (and MCP at /mcp) until interrupted.

    Every option may be set in the [server] table of sandlot.toml instead; a flag wins.
    """
    import anyio

    from sandlot.server import Quota, ServerConfig
    from sandlot.server.serve import serve as run_server

    flags: dict[str, tuple[object, str]] = {"database": (database, "flag --database")}
    for key, value in {
        "host": host,
        "port": port,
        "max_sandboxes": max_sandboxes,
        "max_execs": max_execs,
        "max_uploads": max_uploads,
        "max_uploads_total": max_uploads_total,
        "admission_timeout": admission_timeout,
        "max_upload_mb": max_upload_mb,
        "max_download_mb": max_download_mb,
        "output_retention": output_retention,
        "output_max_mb": output_max_mb,
        "public_metrics": public_metrics,
        "public_docs": public_docs,
        "mcp": mcp,
    }.items():
        flags[f"server.{key}"] = (value, f"flag --{key.replace('_', '-')}")
    flags["server.enable_backends"] = (enable_backend or None, "flag --enable-backend")
    try:
        settings = _effective_settings(**flags)
    except SandboxError as e:
        _fail(e, as_json=False)
    s = settings.values.server
    config = ServerConfig(
        max_upload_bytes=s.max_upload_mb << 20,
        max_download_bytes=s.max_download_mb << 20,
        output_retention=s.output_retention,
        output_max_bytes=int(s.output_max_mb * (1 << 20)),
        quota=Quota(
            max_live_sandboxes=s.max_sandboxes,
            max_concurrent_execs=s.max_execs,
            max_concurrent_uploads=s.max_uploads,
        ),
        max_concurrent_uploads=s.max_uploads_total,
        admission_timeout=s.admission_timeout,
        metrics_public=s.public_metrics,
        docs_public=s.public_docs,
        mcp=s.mcp,
        enable_backends=frozenset(s.enable_backends),
    )

    async def main() -> None:
        await run_server(config, settings=settings, say=lambda line: err.print(line, markup=False))

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

    import anyio

    from sandlot.mcp.stdio import serve_stdio

    url = os.environ.get("SANDLOT_URL") or None

    async def main() -> None:
        await serve_stdio(
            home=_settings.home,
            backend=_settings.backend,
            database=_settings.database,
            # Embedded: the same settings (sandlot.toml, --config) as every other command.
            settings=None if url else _effective_settings(),
            url=url,
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
    import anyio

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
    from rich.table import Table

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
