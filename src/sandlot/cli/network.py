"""``sandlot network``: change a sandbox's egress policy, read its log, learn an allowlist."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _print_json, _run, app, err, out
from sandlot.cli.options import AllowCidrOpt, AllowDomainOpt, DenyCidrOpt, IdArg, JsonOpt

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.models import JsonValue, NetworkAllowlist, SandboxInfo

__all__ = ["network_app"]

network_app = typer.Typer(
    help="Egress policy of a sandbox: set it, read its log, suggest an allowlist.",
    no_args_is_help=True,
)
app.add_typer(network_app, name="network")


@network_app.command("set")
def set_policy(
    sandbox_id: IdArg,
    policy: Annotated[
        str | None, typer.Argument(help="allow-all, deny-all, or a JSON allowlist.")
    ] = None,
    allow_domain: AllowDomainOpt = None,
    allow_cidr: AllowCidrOpt = None,
    deny_cidr: DenyCidrOpt = None,
    record: Annotated[
        bool, typer.Option("--record", help="Record mode: allow and log, to learn an allowlist.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Change a running sandbox's egress policy (new connections follow within a second)."""
    lists = {
        "allow_domains": allow_domain or [],
        "allow_cidrs": allow_cidr or [],
        "deny_cidrs": deny_cidr or [],
    }
    target: object
    if policy is not None and any(lists.values()):
        msg = "give either a policy argument or --allow-domain/--allow-cidr/--deny-cidr, not both"
        raise typer.BadParameter(msg)
    if policy is None:
        target = {**lists, "record": record}
    elif policy.startswith("{"):
        try:
            target = json.loads(policy)
        except ValueError:
            msg = f"not valid JSON: {policy!r}"
            raise typer.BadParameter(msg) from None
    else:
        target = policy

    async def body(client: SandlotAPI) -> SandboxInfo:
        from sandlot.models import NetworkAllowlist

        raw = target if isinstance(target, str) else NetworkAllowlist.model_validate(target)
        return await (await client.get(sandbox_id)).update_network(raw)

    info = _run(as_json, body)
    if as_json:
        _print_json(info.spec.network)
    else:
        shown = (
            info.spec.network
            if isinstance(info.spec.network, str)
            else info.spec.network.model_dump_json()
        )
        out.print(f"{info.id} network: {shown}")


@network_app.command("log")
def log(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
    """Every allowed and refused connection of the sandbox."""

    async def body(client: SandlotAPI) -> list[dict[str, JsonValue]]:
        return await (await client.get(sandbox_id)).network_log()

    events = _run(as_json, body)
    if as_json:
        _print_json(events)
        return
    if not events:
        err.print("no connections logged")
    for e in events:
        when = datetime.fromtimestamp(float(str(e.get("time", 0))), UTC).strftime("%H:%M:%S")
        verdict = "[green]allow[/green]" if e.get("decision") == "allow" else "[red]deny[/red]"
        out.print(f"{when} {verdict} {e.get('host')}:{e.get('port')} {e.get('reason', '')}")


@network_app.command("suggest")
def suggest(sandbox_id: IdArg, as_json: JsonOpt = False) -> None:
    """The least-privilege allowlist covering what the sandbox connected to (use record mode)."""

    async def body(client: SandlotAPI) -> NetworkAllowlist:
        return await (await client.get(sandbox_id)).suggest_network()

    allowlist = _run(as_json, body)
    if as_json:
        _print_json(allowlist)
    else:
        print(allowlist.model_dump_json(indent=2, exclude={"record"}))
