"""``sandlot exec``, ``run`` and ``logs``: running commands in sandboxes, output streamed.

Output goes straight to this process's stdout and stderr as it arrives (never through rich),
standard input is passed on when it is not a terminal, and the command exits with the
sandboxed command's exit code. ``exec`` is the command a script calls in a loop, so its path
imports nothing it does not use. A front end: it calls the SDK surface and nothing below it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated

import typer

from sandlot.cli.app import _print_json, _run, _use_backend, app, err
from sandlot.cli.options import (
    AllowCidrOpt,
    AllowDomainOpt,
    CaCertOpt,
    CpusOpt,
    DenyCidrOpt,
    DiskOpt,
    EnvOpt,
    GitAuthOpt,
    GitOpt,
    GitRevOpt,
    IdArg,
    ImageOpt,
    JsonOpt,
    KeyOpt,
    LabelOpt,
    MemoryOpt,
    NetworkOpt,
    NewBackendOpt,
    OptionOpt,
    PidsOpt,
    SetupOpt,
    SpecOpt,
    TimeoutOpt,
    WorkdirOpt,
)
from sandlot.cli.spec import parse_pairs, spec_from_options
from sandlot.errors import InvalidRequest, SandboxError

if TYPE_CHECKING:
    from sandlot.api import SandlotAPI

__all__ = ["exec", "logs", "run"]


def _write(stream: str, data: bytes) -> None:
    target = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
    target.write(data)
    target.flush()


def _read_stdin() -> bytes:
    # read1 returns what is available rather than waiting for a full buffer, so interactive
    # input reaches the command line by line.
    return sys.stdin.buffer.read1(65536)  # type: ignore[union-attr,no-any-return,unused-ignore]


async def _stdin_chunks() -> AsyncIterator[bytes]:
    import anyio.to_thread

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
    backend: NewBackendOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox, run one command in it, destroy it; exit with the command's code."""
    values = dict(locals())
    _use_backend(backend)
    # --timeout here bounds the command, not the sandbox's TTL.
    values.pop("timeout")

    async def body(client: SandlotAPI) -> int:
        import anyio

        cmd = _command(command or [], shell)
        full = spec_from_options(values)
        try:
            handle = await client.create(
                full,
                backend=backend,
                on_setup_output=None if as_json else (lambda c: _write("stderr", c.data)),
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
