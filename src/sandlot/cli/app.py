"""The ``sandlot`` command line (typer + rich): the app, its global options and the plumbing
every command shares.

Every command takes ``--json`` for scripts; errors print one line (``error: …``, or a JSON
object with ``--json``) and exit 1, usage errors exit 2, and ``exec``/``run`` exit with the
command's own code. State lives under ``$SANDLOT_HOME`` so each invocation sees the last
one's sandboxes. The commands live in the modules beside this one and register themselves on
:data:`app` when imported: :func:`load_commands` imports those a command line needs (all of
them for ``--help``), so importing this module alone registers none.

Start-up is most of a short command's time, so nothing heavy is imported here or by a
command module at import time: the SDK (and through it the store, the gate and the
backends), the HTTP client, pydantic and rich come in when a command needs them, and
``--help`` builds the whole command line from typer and :mod:`sandlot.cli.options` alone. The
CLI is a front end: it calls the SDK (or the HTTP client) and nothing below it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, TypeVar, cast

import typer

from sandlot._version import __version__
from sandlot.cli.options import JsonOpt
from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError

if TYPE_CHECKING:
    from rich.console import Console

    from sandlot.api import SandlotAPI
    from sandlot.gate.gate import Approval
    from sandlot.models import Actor, SandboxInfo
    from sandlot.settings import Settings as EffectiveSettings

__all__ = ["app", "main"]

T = TypeVar("T")

app = typer.Typer(
    name="sandlot",
    help="Disposable computers for AI agents: create sandboxes, run commands in them, move files, snapshot, fork, stop, resume, destroy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _LazyConsole:
    """A rich ``Console`` made on first use: importing rich costs more than a command that
    prints nothing through it (``exec`` writes its output straight to the descriptors)."""

    def __init__(self, *, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def __getattr__(self, name: str) -> object:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr, highlight=False, soft_wrap=True)
        return getattr(self._console, name)


out = cast("Console", _LazyConsole(stderr=False))
err = cast("Console", _LazyConsole(stderr=True))


@dataclass
class Settings:
    """Global options, shared by every command."""

    backend: str | None = None
    home: Path | None = None
    database: str | None = None
    config: Path | None = None
    flags: dict[str, tuple[object, str]] = field(default_factory=dict)
    """The global options given on the command line (not from the environment), by setting,
    with the flag's name: they rank over the environment and ``sandlot.toml``."""


_settings = Settings()


def _effective_settings(**flags: tuple[object, str]) -> EffectiveSettings:
    """The settings of this invocation: the global flags (and a command's own ``flags``) over
    the environment, ``sandlot.toml`` and the defaults."""
    from sandlot.settings import load_settings

    given = _settings.flags
    config = _settings.config if "config" in given else None
    overrides = {k: v for k, v in given.items() if k not in ("home", "config")}
    return load_settings(
        # Passed even when it came from $SANDLOT_HOME, so an unusable home is reported as the
        # CLI always did (naming both --home and SANDLOT_HOME).
        home=_settings.home,
        home_source=None if "home" in given or _settings.home is None else "env SANDLOT_HOME",
        config=config,
        # A command's own option left unset must not hide the global flag of the same name.
        overrides={**overrides, **{k: v for k, v in flags.items() if v[0] is not None}},
    )


def _version(value: bool) -> None:
    if value:
        print(f"sandlot {__version__}")
        raise typer.Exit


@app.callback()
def _global(
    ctx: typer.Context,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            "-b",
            envvar="SANDLOT_BACKEND",
            help="Backend for new sandboxes (local, microvm, fake, …).",
            show_envvar=True,
        ),
    ] = None,
    home: Annotated[
        Path | None,
        typer.Option(
            "--home",
            envvar="SANDLOT_HOME",
            help="State directory (default ~/.local/share/sandlot).",
            show_envvar=True,
        ),
    ] = None,
    database: Annotated[
        str | None,
        typer.Option(
            "--database",
            envvar="SANDLOT_DATABASE_URL",
            help="Database URL (default: SQLite in the home).",
            show_envvar=True,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="SANDLOT_CONFIG",
            help="Configuration file (default: sandlot.toml in the home).",
            show_envvar=True,
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Global options."""
    _settings.backend = backend
    _settings.home = home
    _settings.database = database
    _settings.config = config
    given = {"backend": backend, "home": home, "database": database, "config": config}
    _settings.flags = {
        key: (value, f"flag --{key}")
        for key, value in given.items()
        if value is not None and _from_command_line(ctx, key)
    }


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    # By name: typer vendors its own click, whose ParameterSource is not the real click's.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _use_backend(backend: str | None) -> None:
    """A command's own ``--backend`` wins over the global one (and over the environment and
    ``sandlot.toml``): the embedded client then checks the name as it does the global's (one
    message for a name it does not know)."""
    if backend is not None:
        _settings.backend = backend
        _settings.flags["backend"] = (backend, "flag --backend")


# -- plumbing ------------------------------------------------------------------------------


def _fail(error: SandboxError, as_json: bool) -> NoReturn:
    from rich.markup import escape

    if as_json:
        print(json.dumps({"error": error.to_dict()}, default=str))
    elif isinstance(error, PolicyDenied):
        err.print(
            f"[red]denied:[/red] {escape(error.message)} "
            f"[dim]({error.reason_code}; receipt {error.receipt_id})[/dim]",
            markup=True,
        )
    else:
        # Escaped: a message may hold brackets (pip install 'sandlot[postgres]').
        err.print(f"[red]error:[/red] {escape(error.message)}", markup=True)
    raise typer.Exit(1)


def _run(
    as_json: bool,
    body: Callable[[SandlotAPI], Awaitable[T]],
    *,
    actor: Actor | None = None,
    interrupted: Callable[[], str] | None = None,
) -> T:
    """Run ``body`` with a client, turning sandlot errors into one line and exit code 1.

    ``actor`` overrides who the embedded client acts as (a server decides that from the key).
    ``interrupted`` says, after a Ctrl-C, what the command left behind.
    """

    import anyio

    from sandlot.taskgroups import lone_error

    def held(approval: Approval) -> None:
        # At once, on stderr: the command waits for an answer that only a person can give.
        from rich.markup import escape

        if as_json:
            print(json.dumps({"held": approval.to_dict()}), file=sys.stderr, flush=True)
            return
        wait = max(0, round(approval.expires_at - approval.created_at))
        err.print(
            f"[yellow]held for approval[/yellow] {approval.id}: {escape(approval.summary)} — "
            f"{escape(approval.question)}\n  approve: sandlot approvals approve {approval.id}   "
            f"deny: sandlot approvals deny {approval.id}   (waiting up to {wait}s)",
            markup=True,
        )

    async def main() -> T:
        if os.environ.get("SANDLOT_URL"):
            from sandlot.client import AsyncClient

            # Both clients implement SandlotAPI (a test checks), so each body runs on either.
            async with AsyncClient(os.environ["SANDLOT_URL"], on_hold=held) as remote:
                return await body(remote)
        from sandlot.models import LOCAL_ACTOR
        from sandlot.sdk import AsyncSandlot

        async with AsyncSandlot(
            settings=_effective_settings(),
            actor=actor or LOCAL_ACTOR,
            on_hold=held,
        ) as client:
            return await body(client)

    try:
        with lone_error():
            return anyio.run(main)
    except SandboxError as e:
        _fail(e, as_json)
    except KeyboardInterrupt:
        err.print(f"interrupted{': ' + interrupted() if interrupted else ''}")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort, SystemExit, BrokenPipeError):
        raise
    except OSError as e:
        # The host said no (a full disk, a missing directory): that, in one line.
        where = f" ({e.filename})" if e.filename else ""
        _fail(InvalidRequest(f"{e.strerror or e}{where}"), as_json)
    except Exception as e:
        # A bug of ours: still one line (and the traceback when asked for), never a dump.
        if os.environ.get("SANDLOT_DEBUG"):
            raise
        _fail(
            SandboxError(
                f"internal error ({type(e).__name__}: {e}); this is a bug in sandlot: "
                "SANDLOT_DEBUG=1 shows the traceback"
            ),
            as_json,
        )


def _dump(value: object) -> object:
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


def _print_json(value: object) -> None:
    print(json.dumps(_dump(value), indent=2, default=str))


def _age(when: datetime) -> str:
    seconds = (datetime.now(when.tzinfo) - when).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


# By status value (SandboxStatus is a StrEnum, so its members find these keys).
_STATUS_STYLE = {"running": "green", "stopped": "yellow", "failed": "red", "destroyed": "dim"}


def _status(sb: SandboxInfo) -> str:
    style = _STATUS_STYLE.get(sb.status, "cyan")
    return f"[{style}]{sb.status}[/{style}]"


def _main_json() -> int:
    """Run with ``--json``: a usage error is a JSON error object too (exit 2), as every other
    error is, rather than usage text a script cannot read."""
    usage_errors: tuple[type[Exception], ...]
    try:
        from typer._click.exceptions import ClickException  # typer vendors click

        usage_errors = (ClickException,)
    except ImportError:  # pragma: no cover - an older typer on the real click
        import click

        usage_errors = (click.ClickException,)
    try:
        code = app(standalone_mode=False)
    except usage_errors as e:
        message = e.format_message()
        print(json.dumps({"error": {"code": "usage", "message": message, "details": {}}}))
        return int(e.exit_code)
    except typer.Abort:
        print(json.dumps({"error": {"code": "aborted", "message": "aborted", "details": {}}}))
        return 1
    return code if isinstance(code, int) else 0


def main() -> None:
    """The console script entry point."""
    load_commands(sys.argv[1:])
    try:
        args = sys.argv[1:]
        ours = args[: args.index("--")] if "--" in args else args  # not the command's own
        if "--json" in ours:
            raise SystemExit(_main_json())
        app()
    except BrokenPipeError:
        # `sandlot logs ID | head` closes the pipe early; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0) from None


# -- the commands ---------------------------------------------------------------------------


def doctor(as_json: JsonOpt = False) -> None:
    """Check which backends work on this host, and how to fix those that don't."""
    from sandlot.cli.doctor import run_doctor

    try:
        settings = _effective_settings()
    except SandboxError as e:
        _fail(e, as_json)
    home, database = settings.home, settings.values.database
    raise typer.Exit(run_doctor(home, database, as_json=as_json, console=out))


MODULES = (
    "sandboxes",
    "execute",
    "files",
    "lifecycle",
    "doctor",
    "governance",
    "images",
    "network",
    "server_cmds",
    "shell",
    "config_cmds",
)
"""The modules that register commands on :data:`app` when imported (``doctor`` is the
command above), in the order ``--help`` lists their commands."""

COMMANDS = {
    **dict.fromkeys(("create", "list", "get"), "sandboxes"),
    **dict.fromkeys(("exec", "run", "logs"), "execute"),
    **dict.fromkeys(("write-file", "read-file", "list-files"), "files"),
    **dict.fromkeys(
        (
            "stop",
            "resume",
            "destroy",
            "reset",
            "keep-alive",
            "expose-port",
            "list-ports",
            "snapshot",
            "restore",
            "fork",
            "reconcile",
        ),
        "lifecycle",
    ),
    "doctor": "doctor",
    **dict.fromkeys(("receipts", "keys", "approvals", "policy", "intents"), "governance"),
    "images": "images",
    "network": "network",
    **dict.fromkeys(("serve", "mcp", "api-keys"), "server_cmds"),
    "shell": "shell",
    "config": "config_cmds",
}
"""Which module registers each command and group (a test keeps this equal to what the
modules register)."""

_GLOBAL_WITH_VALUE = frozenset({"--backend", "-b", "--home", "--database", "--config"})
_loaded: set[str] = set()


def load_commands(args: list[str] | None = None) -> None:
    """Register the commands a command line needs on :data:`app`: when ``args`` name a known
    command, only its module's (typer builds every registered command's parameters on each
    start, a third of a short command's start-up with all of them); else (``--help``, no
    command, a typo for "did you mean") all of them."""
    name = _command_name(args or [])
    module = COMMANDS.get(name) if name is not None else None
    for m in (module,) if module is not None else MODULES:
        if m in _loaded:
            continue
        _loaded.add(m)
        if m == "doctor":
            app.command("doctor")(doctor)
        else:
            importlib.import_module(f"sandlot.cli.{m}")


def _command_name(args: list[str]) -> str | None:
    """The command a command line names: its first word that is not a global option or an
    option's value."""
    words = iter(args)
    for word in words:
        if word == "--":
            return None
        if word in _GLOBAL_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None
