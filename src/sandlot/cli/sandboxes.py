"""``sandlot create``, ``list`` and ``get``: making sandboxes and finding them again.

A front end: it calls the SDK surface (embedded or over HTTP, see :func:`sandlot.cli.app._run`)
and nothing below it; the SDK and the wire models are imported when a command runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _age, _print_json, _run, _status, _use_backend, app, err, out
from sandlot.cli.options import (
    AllowCidrOpt,
    AllowDomainOpt,
    CaCertOpt,
    CpusOpt,
    DenyCidrOpt,
    DiskOpt,
    EnvOpt,
    GitAuthOpt,
    GitDepthOpt,
    GitOpt,
    GitRevOpt,
    IdArg,
    IdleOpt,
    ImageOpt,
    JsonOpt,
    KeyOpt,
    LabelOpt,
    MemoryOpt,
    NetworkOpt,
    NewBackendOpt,
    OptionOpt,
    OwnerOpt,
    PidsOpt,
    PortOpt,
    ResumeOpt,
    SetupOpt,
    SpecOpt,
    StartOpt,
    StatusName,
    TimeoutOpt,
    WorkdirOpt,
)
from sandlot.cli.spec import parse_pairs, spec_from_options

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.models import OutputChunk, SandboxInfo

__all__ = ["create", "get", "list_"]


@app.command()
def create(
    image: ImageOpt = None,
    workdir: WorkdirOpt = None,
    env: EnvOpt = None,
    label: LabelOpt = None,
    network: NetworkOpt = None,
    allow_domain: AllowDomainOpt = None,
    allow_cidr: AllowCidrOpt = None,
    deny_cidr: DenyCidrOpt = None,
    timeout: TimeoutOpt = None,
    idle_timeout: IdleOpt = None,
    setup: SetupOpt = None,
    start: StartOpt = None,
    resume: ResumeOpt = None,
    port: PortOpt = None,
    cpus: CpusOpt = None,
    memory: MemoryOpt = None,
    pids: PidsOpt = None,
    disk: DiskOpt = None,
    owner: OwnerOpt = None,
    git: GitOpt = None,
    git_revision: GitRevOpt = None,
    git_depth: GitDepthOpt = None,
    git_auth: GitAuthOpt = None,
    option: OptionOpt = None,
    ca_cert: CaCertOpt = None,
    spec: SpecOpt = None,
    backend: NewBackendOpt = None,
    idempotency_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox: clone --git, run --setup, launch --start; print its id."""
    values = dict(locals())
    _use_backend(backend)

    async def body(client: SandlotAPI) -> SandboxInfo:
        full = spec_from_options(values)

        def show_setup(chunk: OutputChunk) -> None:
            # Setup output goes to stderr so stdout stays the id (or the JSON) for scripts.
            sys.stderr.buffer.write(chunk.data)
            sys.stderr.buffer.flush()

        handle = await client.create(
            full,
            backend=backend,
            on_setup_output=None if as_json else show_setup,
            idempotency_key=idempotency_key,
        )
        made.append(handle.info)
        return handle.info

    made: list[SandboxInfo] = []

    def left_behind() -> str:
        # Ctrl-C after the sandbox was made: name it (stdout, as a success would), since
        # nothing else would. Before: a creation without a key destroys what it had made.
        if made:
            print(made[0].id, flush=True)
            return f"sandbox {made[0].id} had been created and is {made[0].status}"
        if idempotency_key:
            return "repeat with the same --idempotency-key to get the creation's outcome"
        return "nothing was left behind"

    info = _run(as_json, body, interrupted=left_behind)
    if as_json:
        _print_json(info)
    else:
        print(info.id)


@app.command("list")
def list_(
    label: LabelOpt = None,
    status: Annotated[
        list[StatusName] | None,
        typer.Option("--status", help="Only these statuses (repeatable)."),
    ] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="Only this backend.")] = None,
    owner: OwnerOpt = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include destroyed sandboxes.")] = False,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List sandboxes, newest first."""

    async def body(client: SandlotAPI) -> list[SandboxInfo]:
        from sandlot.models import SandboxStatus

        return await client.list(
            labels=parse_pairs(label, "--label"),
            status=[SandboxStatus(s.value) for s in status] if status else None,
            backend=backend,
            owner=owner,
            include_destroyed=all_,
            limit=limit,
        )

    items = _run(as_json, body)
    if as_json:
        _print_json(items)
        return
    if not items:
        err.print("no sandboxes")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("ID", "STATUS", "BACKEND", "CREATED", "LABELS"):
        table.add_column(col)
    for sb in items:
        labels = ",".join(f"{k}={v}" for k, v in sorted(sb.spec.labels.items()))
        table.add_row(sb.id, _status(sb), sb.backend, _age(sb.created_at), labels)
    out.print(table)


@app.command()
def get(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
    """Show one sandbox, with the cause and last output if it died."""

    async def body(client: SandlotAPI) -> SandboxInfo:
        return (await client.get(sandbox_id)).info

    info = _run(as_json, body)
    if as_json:
        _print_json(info)
    else:
        _show(info)


def _show(sb: SandboxInfo) -> None:
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("id", sb.id)
    table.add_row("status", _status(sb))
    table.add_row("backend", sb.backend + (f" ({sb.backend_ref})" if sb.backend_ref else ""))
    table.add_row("created", f"{sb.created_at:%Y-%m-%d %H:%M:%S} ({_age(sb.created_at)})")
    table.add_row("last active", _age(sb.last_active_at))
    if sb.expires_at:
        table.add_row("expires", f"{sb.expires_at:%Y-%m-%d %H:%M:%S}")
    if sb.spec.image:
        table.add_row("image", sb.spec.image)
    table.add_row("workdir", sb.spec.workdir)
    if sb.spec.labels:
        table.add_row("labels", ", ".join(f"{k}={v}" for k, v in sorted(sb.spec.labels.items())))
    if sb.spec.owner:
        table.add_row("owner", sb.spec.owner)
    for p in sb.ports:
        table.add_row(f"port {p.port}", p.url)
    if sb.error:
        table.add_row("error", f"[red]{sb.error}[/red]")
    if sb.death:
        table.add_row(
            "cause", f"{sb.death.cause}: {sb.death.message} ({sb.death.at:%Y-%m-%d %H:%M:%S})"
        )
        for line in sb.death.last_output:
            table.add_row("", f"[dim]{line}[/dim]")
    out.print(table)
