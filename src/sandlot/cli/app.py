"""The ``sandlot`` command line (typer + rich).

Every command takes ``--json`` for scripts; errors print one line (``error: …``, or a JSON
object with ``--json``) and exit 1, usage errors exit 2, and ``exec``/``run`` exit with the
command's own code. State lives under ``$SANDLOT_HOME`` so each invocation sees the last
one's sandboxes. The CLI is a front end: it calls the SDK and nothing below it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, TypeVar

import anyio
import anyio.to_thread
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sandlot._version import __version__
from sandlot.cli.doctor import run_doctor
from sandlot.cli.spec import (
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
    IdleOpt,
    ImageOpt,
    LabelOpt,
    MemoryOpt,
    NetworkOpt,
    OptionOpt,
    OwnerOpt,
    PidsOpt,
    PortOpt,
    ResumeOpt,
    SetupOpt,
    SpecOpt,
    StartOpt,
    TimeoutOpt,
    WorkdirOpt,
    parse_pairs,
    spec_from_options,
)
from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError
from sandlot.models import LOCAL_ACTOR, Actor, Approval, OutputChunk, SandboxInfo, SandboxStatus
from sandlot.sdk import AsyncSandlot
from sandlot.taskgroups import lone_error

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
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

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--idempotency-key",
        help="Retry-safe key: a repeat with the same request returns the first outcome.",
    ),
]
IdArg = Annotated[str, typer.Argument(help="Sandbox id.", show_default=False)]


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
        overrides={**overrides, **flags},
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


# -- plumbing ------------------------------------------------------------------------------


def _fail(error: SandboxError, as_json: bool) -> NoReturn:
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

    def held(approval: Approval) -> None:
        # At once, on stderr: the command waits for an answer that only a person can give.
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


_STATUS_STYLE = {
    SandboxStatus.RUNNING: "green",
    SandboxStatus.STOPPED: "yellow",
    SandboxStatus.FAILED: "red",
    SandboxStatus.DESTROYED: "dim",
}


def _status(sb: SandboxInfo) -> str:
    style = _STATUS_STYLE.get(sb.status, "cyan")
    return f"[{style}]{sb.status}[/{style}]"


def _show(sb: SandboxInfo) -> None:
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


def _write(stream: str, data: bytes) -> None:
    target = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
    target.write(data)
    target.flush()


def _read_stdin() -> bytes:
    # read1 returns what is available rather than waiting for a full buffer, so interactive
    # input reaches the command line by line.
    return sys.stdin.buffer.read1(65536)  # type: ignore[union-attr,no-any-return,unused-ignore]


async def _stdin_chunks() -> AsyncIterator[bytes]:
    while True:
        chunk: bytes = await anyio.to_thread.run_sync(_read_stdin)
        if not chunk:
            return
        yield chunk


def _wants_stdin(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return not sys.stdin.isatty()


def _command(argv: list[str], shell: bool) -> list[str] | str:
    if not argv:
        msg = "no command given (put it after --, e.g. `sandlot exec ID -- ls -la`)"
        raise InvalidRequest(msg)
    if shell:
        return " ".join(argv)
    return argv


# -- commands -------------------------------------------------------------------------------


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
    idempotency_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox: clone --git, run --setup, launch --start; print its id."""
    values = dict(locals())

    async def body(client: SandlotAPI) -> SandboxInfo:
        full = spec_from_options(values)

        def show_setup(chunk: OutputChunk) -> None:
            # Setup output goes to stderr so stdout stays the id (or the JSON) for scripts.
            sys.stderr.buffer.write(chunk.data)
            sys.stderr.buffer.flush()

        handle = await client.create(
            full,
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
        list[SandboxStatus] | None,
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
        return await client.list(
            labels=parse_pairs(label, "--label"),
            status=status or None,
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


@app.command()
def exec(
    sandbox_id: IdArg,
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command and its arguments (after --).", show_default=False),
    ] = None,
    shell: Annotated[
        bool, typer.Option("--shell", "-s", help="Join the arguments and run them with sh -c.")
    ] = False,
    cwd: Annotated[
        str | None, typer.Option("--cwd", help="Working directory inside the sandbox.")
    ] = None,
    env: EnvOpt = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", help="Kill the command's whole process tree after this many seconds."
        ),
    ] = None,
    stdin: Annotated[
        bool | None,
        typer.Option(
            "--stdin/--no-stdin",
            help="Pass standard input to the command (default: when it is not a terminal).",
        ),
    ] = None,
    no_resume: Annotated[
        bool, typer.Option("--no-resume", help="Fail instead of resuming a stopped sandbox.")
    ] = False,
    idempotency_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit code."""

    async def body(client: SandlotAPI) -> int:
        handle = await client.get(sandbox_id)
        result = await handle.exec(
            _command(command or [], shell),
            cwd=cwd,
            env=parse_pairs(env, "--env"),
            timeout=timeout,
            stdin=_stdin_chunks() if _wants_stdin(stdin) else None,
            on_output=None if as_json else (lambda c: _write(c.stream, c.data)),
            auto_resume=not no_resume,
            idempotency_key=idempotency_key,
            # Printed as it arrives, so not kept too: output of any size in bounded memory.
            collect_output=as_json,
        )
        if as_json:
            _print_json(result)
        elif result.timed_out:
            err.print(f"[yellow]timed out after {timeout:g}s; the process tree was killed[/yellow]")
        return result.exit_code

    raise typer.Exit(_run(as_json, body))


@app.command()
def run(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command and its arguments (after --).", show_default=False),
    ] = None,
    shell: Annotated[
        bool, typer.Option("--shell", "-s", help="Join the arguments and run them with sh -c.")
    ] = False,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the sandbox instead of destroying it.")
    ] = False,
    image: ImageOpt = None,
    workdir: WorkdirOpt = None,
    env: EnvOpt = None,
    label: LabelOpt = None,
    network: NetworkOpt = None,
    allow_domain: AllowDomainOpt = None,
    allow_cidr: AllowCidrOpt = None,
    deny_cidr: DenyCidrOpt = None,
    timeout: TimeoutOpt = None,
    setup: SetupOpt = None,
    cpus: CpusOpt = None,
    memory: MemoryOpt = None,
    pids: PidsOpt = None,
    disk: DiskOpt = None,
    git: GitOpt = None,
    git_revision: GitRevOpt = None,
    git_auth: GitAuthOpt = None,
    option: OptionOpt = None,
    ca_cert: CaCertOpt = None,
    spec: SpecOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox, run one command in it, destroy it; exit with the command's code."""
    values = dict(locals())
    # --timeout here bounds the command, not the sandbox's TTL.
    values.pop("timeout")

    async def body(client: SandlotAPI) -> int:
        cmd = _command(command or [], shell)
        full = spec_from_options(values)
        try:
            handle = await client.create(
                full, on_setup_output=None if as_json else (lambda c: _write("stderr", c.data))
            )
        except SandboxError as e:
            # A one-shot run cleans up after itself: the failed sandbox goes too.
            if keep or e.sandbox_id is None:
                raise
            with anyio.CancelScope(shield=True):
                try:
                    await (await client.get(e.sandbox_id)).destroy()
                except SandboxError:
                    raise e from None  # its message says it was kept: still true
            e.message = (
                f"{e.details.get('failure', e.message)} (sandbox {e.sandbox_id} was destroyed; "
                "--keep keeps a failed one)"
            )
            raise
        try:
            result = await handle.exec(
                cmd,
                timeout=timeout,
                stdin=_stdin_chunks() if _wants_stdin(None) else None,
                on_output=None if as_json else (lambda c: _write(c.stream, c.data)),
                collect_output=as_json,
            )
        finally:
            if not keep:
                with anyio.CancelScope(shield=True):
                    await handle.destroy()
        if as_json:
            _print_json({"sandbox": handle.id, "result": result.model_dump(mode="json")})
        elif keep:
            err.print(f"kept sandbox {handle.id}")
        return result.exit_code

    raise typer.Exit(_run(as_json, body))


@app.command()
def logs(
    sandbox_id: IdArg,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print the main process's output log."""

    async def body(client: SandlotAPI) -> None:
        handle = await client.get(sandbox_id)
        async for chunk in handle.logs(follow=follow):
            if as_json:
                print(json.dumps({"data": chunk.decode(errors="replace")}), flush=True)
            else:
                _write("stdout", chunk)

    _run(as_json, body)


@app.command("write-file")
def write_file(
    sandbox_id: IdArg,
    path: Annotated[
        str, typer.Argument(help="Absolute path inside the sandbox.", show_default=False)
    ],
    source: Annotated[
        str, typer.Argument(help="Host file to upload, or - for standard input.")
    ] = "-",
    mode: Annotated[
        str | None, typer.Option("--mode", help="Permission bits in octal, e.g. 755.")
    ] = None,
    idempotency_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a file into a sandbox from a host file or standard input."""

    async def body(client: SandlotAPI) -> object:
        try:
            bits = int(mode, 8) if mode is not None else None
        except ValueError:
            msg = f"--mode must be octal, got {mode!r}"
            raise InvalidRequest(msg) from None
        handle = await client.get(sandbox_id)
        if source == "-":
            # Streamed as it is read: a 1 GiB upload never sits in this process's memory.
            return await handle.write_file(
                path, sys.stdin.buffer, mode=bits, idempotency_key=idempotency_key
            )
        try:
            data = open(source, "rb")  # noqa: SIM115, ASYNC230 - closed below; opening is quick
        except OSError as e:
            msg = f"cannot read {source}: {e.strerror}"
            raise InvalidRequest(msg) from None
        with data:
            return await handle.write_file(path, data, mode=bits, idempotency_key=idempotency_key)

    info = _run(as_json, body)
    if as_json:
        _print_json(info)


@app.command("read-file")
def read_file(
    sandbox_id: IdArg,
    path: Annotated[
        str, typer.Argument(help="Absolute path inside the sandbox.", show_default=False)
    ],
    output: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write to this host file instead of standard output."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a file from a sandbox (or save it with --out)."""

    async def body(client: SandlotAPI) -> int:
        handle = await client.get(sandbox_id)
        if output is None:
            size = 0
            async for chunk in handle.stream_file(path):
                sys.stdout.buffer.write(chunk)
                size += len(chunk)
            sys.stdout.buffer.flush()
            return size
        return await _download(handle.stream_file(path), output)

    size = _run(as_json, body)
    if as_json and output:
        _print_json({"path": path, "out": str(output), "size": size})


async def _download(chunks: AsyncIterator[bytes], output: Path) -> int:
    """Save a stream to ``output``. A regular file (or a new one) is written through a
    temporary file beside it, renamed over it only when the whole stream arrived, so a failed
    read (a wrong path, a broken connection) leaves an existing file as it was; a symlink is
    followed, and anything else (``/dev/null``, a FIFO, a terminal) is written in place."""
    target, fd, tmp = await anyio.to_thread.run_sync(_open_download, output)
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        if tmp is not None:
            await anyio.to_thread.run_sync(_put_in_place, tmp, target)
    except BaseException:
        if tmp is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(functools.partial(tmp.unlink, missing_ok=True))
        raise
    return size


def _open_download(output: Path) -> tuple[Path, int, Path | None]:
    """Where a download goes: the target (a symlink resolved), an open descriptor, and the
    temporary file to rename over the target at the end (None: written in place)."""
    target = Path(os.path.realpath(output.expanduser()))
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        msg = f"cannot write {output}: {e.strerror}"
        raise InvalidRequest(msg) from None
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            # A device or a pipe cannot be replaced by renaming (and must not be).
            return target, os.open(target, os.O_WRONLY | os.O_CLOEXEC), None
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        msg = f"cannot write {output}: {e.strerror}"
        raise InvalidRequest(msg) from None
    return target, fd, Path(name)


def _put_in_place(tmp: Path, target: Path) -> None:
    # The mode (and owner, where we may set it) a plain write would have kept or given it;
    # mkstemp makes files 0600.
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        st = target.stat()
        tmp.chmod(st.st_mode & 0o7777)
        os.chown(tmp, st.st_uid, st.st_gid)
    if not target.exists():
        tmp.chmod(0o666 & ~umask)
    tmp.replace(target)


@app.command("list-files")
def list_files(
    sandbox_id: IdArg,
    path: Annotated[str | None, typer.Argument(help="Directory (default: the workdir).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List a directory in a sandbox."""

    async def body(client: SandlotAPI) -> list[object]:
        return list(await (await client.get(sandbox_id)).list_files(path))

    items = _run(as_json, body)
    if as_json:
        _print_json(items)
        return
    table = Table(box=None, pad_edge=False)
    for col in ("MODE", "SIZE", "NAME"):
        table.add_column(col)
    for f in items:
        assert isinstance(f, BaseModel)
        d = f.model_dump()
        name = (
            d["name"]
            + ("/" if d["type"] == "dir" else "")
            + (f" -> {d['target']}" if d["target"] else "")
        )
        table.add_row(oct(d["mode"])[2:], str(d["size"]), name)
    out.print(table)


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


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """Check which backends work on this host, and how to fix those that don't."""
    try:
        settings = _effective_settings()
    except SandboxError as e:
        _fail(e, as_json)
    home, database = settings.home, settings.values.database
    raise typer.Exit(run_doctor(home, database, as_json=as_json, console=out))


def main() -> None:
    """The console script entry point."""
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
