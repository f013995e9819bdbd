"""``sandlot config``: the effective settings and where each came from.

``sandlot config show`` prints every setting of ``sandlot.toml`` (and the home and the file
itself) with its effective value and its source: ``default``, the file's path, ``env NAME`` or
``flag --name``. The group registers itself on :data:`sandlot.cli.app.app` when this module is
imported. Like every front end it reads settings through :mod:`sandlot.settings` and builds
nothing below the SDK; heavy modules are imported inside the command, not here.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from sandlot.cli.app import _effective_settings, _fail, _print_json, app, out
from sandlot.errors import SandboxError

__all__ = ["config_app"]

config_app = typer.Typer(
    help="Settings from sandlot.toml, the environment and flags: show what is in effect.",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config")


@config_app.command("show")
def show(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Print every setting's effective value and where it came from (flag > environment >
    file > default)."""
    try:
        rows = _rows()
    except SandboxError as e:
        _fail(e, as_json)
    if as_json:
        _print_json({key: {"value": value, "source": source} for key, (value, source) in rows})
        return
    table = Table(box=None, pad_edge=False)
    table.add_column("SETTING", no_wrap=True)
    for col in ("VALUE", "SOURCE"):
        table.add_column(col, overflow="fold")
    for key, (value, source) in rows:
        table.add_row(key, escape(_text(value)), escape(source))
    out.print(table)


def _rows() -> list[tuple[str, tuple[object, str]]]:
    from sandlot.config import default_database_url
    from sandlot.wiring import default_backend_name, redact_url

    settings = _effective_settings()
    rows = settings.effective()
    # What "unset" resolves to, as the commands will use it; a password is never shown.
    value, source = rows["backend"]
    rows["backend"] = (value or default_backend_name(None), source)
    value, source = rows["database"]
    url = str(value) if value else default_database_url(settings.home)
    rows["database"] = (redact_url(url), source)
    return list(rows.items())


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)
