"""The commands that change or copy one sandbox: ``stop``, ``resume``, ``destroy``, ``reset``,
``keep-alive``, ports, ``snapshot``, ``restore``, ``fork``; and ``reconcile`` over all of them.

A front end: it calls the SDK surface and nothing below it; the SDK, pydantic and the wire
models are imported when a command runs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _print_json, _run, _status, app, err, out
from sandlot.cli.options import IdArg, JsonOpt, KeyOpt

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.models import SandboxInfo

__all__ = ["destroy", "fork", "reconcile", "reset", "restore", "snapshot"]


def _simple(
    name: str, doc: str, action: Callable[[SandlotAPI, str], Awaitable[SandboxInfo]]
) -> None:
    """Register a command that takes an id, changes the sandbox and shows it."""

    def command(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
        info = _run(as_json, lambda client: action(client, sandbox_id))
        if as_json:
            _print_json(info)
        else:
            out.print(f"{info.id} {_status(info)}")

    command.__doc__ = doc
    app.command(name)(command)


async def _stop(client: SandlotAPI, sandbox_id: str) -> SandboxInfo:
    return await (await client.get(sandbox_id)).stop()


async def _resume(client: SandlotAPI, sandbox_id: str) -> SandboxInfo:
    return await (await client.get(sandbox_id)).resume()


_simple("stop", "Stop a sandbox's processes; its filesystem stays.", _stop)
_simple("resume", "Boot a stopped (or failed) sandbox again.", _resume)


@app.command()
def destroy(
    sandbox_id: IdArg,
    idempotency_key: KeyOpt = None,
    forget_host: Annotated[
        bool,
        typer.Option(
            "--forget-host",
            help="Its host is gone for good: close the record (cause host_lost) without it.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Destroy a sandbox (its record stays, with the cause)."""

    async def body(client: SandlotAPI) -> SandboxInfo:
        handle = await client.get(sandbox_id)
        return await handle.destroy(idempotency_key=idempotency_key, forget_host=forget_host)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        out.print(f"{info.id} {_status(info)}")


@app.command()
def reset(
    sandbox_id: IdArg,
    snapshot_id: Annotated[
        str | None,
        typer.Option(
            "--snapshot", help="Reset to this snapshot (default: the state it was created in)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Return a sandbox to a snapshot and verify it; exit 1 naming what diverged if not."""

    async def body(client: SandlotAPI) -> SandboxInfo:
        return await (await client.get(sandbox_id)).reset(snapshot_id)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        report = info.metadata.get("verification")
        checks = report.get("checks", []) if isinstance(report, dict) else []
        out.print(
            f"{info.id} {_status(info)} (verified: {len(checks) if isinstance(checks, list) else 0} checks)"
        )


@app.command("keep-alive")
def keep_alive(
    sandbox_id: IdArg,
    seconds: Annotated[float, typer.Argument(help="Seconds from now.", min=0.001)] = 300,
    as_json: JsonOpt = False,
) -> None:
    """Push a sandbox's time to live out."""

    async def body(client: SandlotAPI) -> SandboxInfo:
        return await (await client.get(sandbox_id)).keep_alive(seconds)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        out.print(
            f"{info.id} expires {info.expires_at:%Y-%m-%d %H:%M:%S}"
            if info.expires_at
            else f"{info.id} has no time limit"
        )


@app.command("expose-port")
def expose_port(
    sandbox_id: IdArg,
    port: Annotated[int, typer.Argument(help="Port inside the sandbox.", min=1, max=65535)],
    as_json: JsonOpt = False,
) -> None:
    """Publish a sandbox port on the host; print its URL."""

    async def body(client: SandlotAPI) -> object:
        return await (await client.get(sandbox_id)).expose_port(port)

    mapping = _run(as_json, body)
    if as_json:
        _print_json(mapping)
    else:
        from pydantic import BaseModel

        assert isinstance(mapping, BaseModel)
        print(mapping.model_dump()["url"])


@app.command("list-ports")
def list_ports(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
    """List a sandbox's published ports."""

    async def body(client: SandlotAPI) -> list[object]:
        return list(await (await client.get(sandbox_id)).list_ports())

    items = _run(as_json, body)
    if as_json:
        _print_json(items)
        return
    from pydantic import BaseModel

    for m in items:
        assert isinstance(m, BaseModel)
        d = m.model_dump()
        print(f"{d['port']}\t{d['url']}")


@app.command()
def snapshot(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
    """Save a sandbox's state; print the snapshot id."""

    async def body(client: SandlotAPI) -> object:
        return await (await client.get(sandbox_id)).snapshot()

    snap = _run(as_json, body)
    if as_json:
        _print_json(snap)
    else:
        from pydantic import BaseModel

        assert isinstance(snap, BaseModel)
        print(snap.model_dump()["id"])


@app.command()
def restore(
    sandbox_id: IdArg,
    snapshot_id: Annotated[str, typer.Argument(help="Snapshot id.", show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """Put a sandbox back to a snapshot's state."""

    async def body(client: SandlotAPI) -> SandboxInfo:
        return await (await client.get(sandbox_id)).restore(snapshot_id)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        out.print(f"{info.id} {_status(info)}")


@app.command()
def fork(
    source: Annotated[
        str, typer.Argument(help="A sandbox id or a snapshot id.", show_default=False)
    ],
    count: Annotated[
        int, typer.Option("--count", "-n", min=1, max=1000, help="How many sandboxes to make.")
    ] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Make new sandboxes from a sandbox's current state or a snapshot; print their ids."""

    async def body(client: SandlotAPI) -> list[SandboxInfo]:
        return [h.info for h in await client.fork(source, count)]

    infos = _run(as_json, body)
    if as_json:
        _print_json(infos)
    else:
        for info in infos:
            print(info.id)


@app.command()
def reconcile(
    ids: Annotated[
        list[str] | None,
        typer.Argument(help="Only these sandboxes (default: all, reap orphans and sweep)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Sync records with backends, settle abandoned transitions, stop expired sandboxes,
    destroy failed ones kept past their time, reap orphans; exit 1 if anything could not be
    done."""

    async def body(client: SandlotAPI) -> dict[str, object]:
        report = await client.reconcile(ids or None)
        return {
            "checked": report.checked,
            "updated": report.updated,
            "reaped": report.reaped,
            "expired": report.expired,
            "discarded": report.discarded,
            "errors": report.errors,
        }

    report = _run(as_json, body)
    failed = bool(report["errors"])
    if as_json:
        _print_json(report)
        raise typer.Exit(1 if failed else 0)
    out.print(f"checked {report['checked']} sandboxes")
    updated = report["updated"]
    assert isinstance(updated, dict)
    for sid, what in updated.items():
        out.print(f"  updated {sid}: {what}")
    for key, verb in (
        ("reaped", "reaped orphan"),
        ("expired", "stopped expired"),
        ("discarded", "destroyed failed"),
    ):
        ids_done = report[key]
        assert isinstance(ids_done, list)
        for sid in ids_done:
            out.print(f"  {verb} {sid}")
    errors = report["errors"]
    assert isinstance(errors, dict)
    for sid, what in errors.items():
        err.print(f"[red]error:[/red] {sid}: {what}", markup=True)
    raise typer.Exit(1 if failed else 0)
