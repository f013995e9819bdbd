"""The MCP server: sandlot's tools for a model, over stdio or streamable HTTP.

    server = build_server(lambda ctx: api)      # api: an AsyncSandlot or an AsyncClient
    await server.run_stdio_async()

The tools call the SDK surface (:class:`sandlot.api.SandlotAPI`), which both the in-process
SDK and the HTTP client implement, so ``sandlot mcp`` can run on an embedded Manager or against a server, and
the server's ``/mcp`` endpoint calls its own API with the caller's key (tenancy, quotas and
policy apply exactly as for any client). Results are structured (pydantic models); a sandlot
error, a policy denial above all, comes back as a tool error the model can read, with its
``code`` (and ``reason_code`` and ``receipt_id`` for denials). ``exec_command`` streams output
as progress notifications while the command runs. ``run_agent`` starts a background process
(the sandbox keeps it and its output, not this server) and ``get_logs`` pages through that
output by the process's handle.

This module must not import backends, the store or the web server.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import json
import logging
import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal, TypeVar

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from sandlot._version import __version__
from sandlot.api import SandboxAPI, SandlotAPI
from sandlot.errors import InvalidRequest, InvalidState, PolicyDenied, SandboxError
from sandlot.models import (
    FileInfo,
    OutputChunk,
    PortMapping,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
)

__all__ = ["ApiProvider", "SandboxHandle", "SandlotApi", "build_server"]

MAX_LOG_WAIT = 60.0
"""The longest ``get_logs`` waits for new output of a running process (seconds)."""

M = TypeVar("M", bound=BaseModel)


SandlotApi = SandlotAPI
"""What the tools call: the documented client protocol (an ``AsyncSandlot`` or an
``AsyncClient``); the old name, kept for callers."""

SandboxHandle = SandboxAPI
"""A sandbox handle as the tools use it: the documented handle protocol; the old name."""

ApiProvider = Callable[[Context], Awaitable[SandlotApi]]
"""Gives the SDK to use for one tool call (per caller, on a shared server)."""


# -- results ----------------------------------------------------------------------------------


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class SandboxView(_Result):
    """A sandbox, as a model needs to see it."""

    id: str
    """Sandbox id, for every other tool."""
    status: SandboxStatus
    """Lifecycle status."""
    backend: str
    """Where it lives."""
    workdir: str
    """Default working directory."""
    created_at: datetime
    """Creation time."""
    expires_at: datetime | None = None
    """When its time to live runs out."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Its labels."""
    ports: list[PortMapping] = Field(default_factory=list)
    """Published ports."""
    error: str | None = None
    """Why it failed, if it did."""
    death_cause: str | None = None
    """Why it stopped or died (``ttl``, ``idle``, ``oom``, ``destroyed``, …)."""
    last_output: list[str] = Field(default_factory=list)
    """The last lines of output before it stopped or died."""

    @classmethod
    def of(cls, info: SandboxInfo) -> SandboxView:
        """The view of a record."""
        return cls(
            id=info.id,
            status=info.status,
            backend=info.backend,
            workdir=info.spec.workdir,
            created_at=info.created_at,
            expires_at=info.expires_at,
            labels=dict(info.spec.labels),
            ports=list(info.ports),
            error=info.error,
            death_cause=info.death.cause if info.death else None,
            last_output=list(info.death.last_output) if info.death else [],
        )


class SandboxList(_Result):
    """Sandboxes, newest first."""

    sandboxes: list[SandboxView]
    """The sandboxes."""


class CommandResult(_Result):
    """How a command ended, with its output (the end of it, when long)."""

    exit_code: int
    """Exit status (124 on timeout, 128+N when killed by signal N)."""
    stdout: str
    """Standard output (its last ``max_output_bytes`` when longer)."""
    stderr: str
    """Standard error (its last ``max_output_bytes`` when longer)."""
    stdout_bytes: int
    """Full size of standard output."""
    stderr_bytes: int
    """Full size of standard error."""
    truncated: bool
    """True when stdout or stderr above is only the end of the output."""
    output_sha256: str
    """SHA-256 of the full stdout then stderr, to compare runs."""
    duration_ms: float
    """Wall time."""
    timed_out: bool = False
    """True when the timeout killed it."""
    oom_killed: bool = False
    """True when the memory limit killed it."""


class FileContent(_Result):
    """A range of a file."""

    path: str
    """The file."""
    offset: int
    """Where this range starts."""
    length: int
    """Bytes in this range."""
    eof: bool
    """True when the file ends within this range; else read on from ``offset + length``."""
    encoding: Literal["utf-8", "base64"]
    """How ``content`` is encoded (base64 for binary data)."""
    content: str
    """The bytes."""


class FileList(_Result):
    """A directory's entries."""

    path: str
    """The directory."""
    entries: list[FileInfo]
    """Its entries, sorted by name."""


class LogChunk(_Result):
    """A range of a log."""

    sandbox_id: str
    """The sandbox."""
    process_id: str | None
    """The ``run_agent`` process, or None for the main process."""
    offset: int
    """Where this range starts (bytes into the output)."""
    next_offset: int
    """Pass this as ``offset`` to read on."""
    data: str
    """The output (UTF-8, invalid bytes replaced; stdout and stderr interleaved as written)."""
    running: bool | None = None
    """For a process: whether it still runs (more output may come)."""
    exit_code: int | None = None
    """For a process that exited: its exit code."""


class PortList(_Result):
    """Published ports."""

    ports: list[PortMapping]
    """The ports."""


class SnapshotView(_Result):
    """A snapshot."""

    id: str
    """Snapshot id."""
    sandbox_id: str
    """The sandbox it was taken from."""
    backend: str
    """The backend it belongs to."""
    created_at: datetime
    """When it was taken."""
    size_bytes: int
    """Size on disk, when known."""


class UploadResult(_Result):
    """What ``upload_dir`` copied."""

    remote_path: str
    """Where the directory now is inside the sandbox."""
    files: int
    """Files copied."""
    bytes: int
    """Bytes copied."""
    skipped: list[str]
    """Entries not copied (symlinks, special files), relative to the source."""


class ProcessHandle(_Result):
    """A program ``run_agent`` started in the background."""

    sandbox_id: str
    """The sandbox it runs in."""
    process_id: str
    """Handle for ``get_logs``."""
    pid: int
    """Its process id inside the sandbox."""
    command: list[str]
    """What runs."""
    name: str | None = None
    """The name it was given, if any (it finds the process like the handle does)."""


class VersionView(_Result):
    """What serves these tools."""

    version: str
    """sandlot's version."""
    mode: str
    """``embedded`` (an in-process Manager) or the server URL."""


class Health(_Result):
    """Whether the tools can reach their sandboxes."""

    status: Literal["ok"]
    """``ok`` when the Manager (or the server) answered."""
    sandboxes: int
    """Live sandboxes visible to the caller (at most 1000 counted)."""


# -- errors -----------------------------------------------------------------------------------


def error_result(error: SandboxError) -> CallToolResult:
    """A sandlot error as a tool error the model can read and act on."""
    body: dict[str, object] = {"code": error.code, "message": error.message}
    if isinstance(error, PolicyDenied):
        body["reason_code"] = error.reason_code
        body["receipt_id"] = error.receipt_id
    else:
        details = {k: v for k, v in error.details.items() if _is_json(v)}
        if details:
            body["details"] = details
    text = f"{error.code}: {error.message}"
    if isinstance(error, PolicyDenied):
        text += f" (reason_code={error.reason_code}, receipt_id={error.receipt_id})"
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structured_content={"error": body},
        is_error=True,
    )


def _is_json(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _tool(
    server: MCPServer,
    fn: Callable[..., Awaitable[M]],
    *,
    title: str,
    read_only: bool = False,
    destructive: bool = False,
    idempotent: bool = False,
    open_world: bool = False,
) -> None:
    """Register ``fn`` as a tool whose sandlot errors become readable tool errors."""

    @functools.wraps(fn)
    async def call(*args: object, **kwargs: object) -> M | CallToolResult:
        try:
            return await fn(*args, **kwargs)
        except SandboxError as e:
            return error_result(e)

    server.add_tool(
        call,
        name=fn.__name__,
        title=title,
        description=fn.__doc__,
        annotations=ToolAnnotations(
            title=title,
            read_only_hint=read_only,
            destructive_hint=destructive if not read_only else False,
            idempotent_hint=idempotent or read_only,
            open_world_hint=open_world,
        ),
        structured_output=True,
    )


# -- the server -------------------------------------------------------------------------------


def build_server(
    provider: ApiProvider,
    *,
    mode: str = "embedded",
    upload_roots: Sequence[Path] = (),
    max_output_bytes: int = 32768,
) -> MCPServer:
    """The MCP server with every sandlot tool.

    Args:
        provider: Gives the SDK for one tool call.
        mode: What ``version`` reports (``embedded`` or the server URL).
        upload_roots: Host directories ``upload_dir`` may read (none: the tool refuses).
        max_output_bytes: Default cap on command output returned to the model (the end is
            kept, and the result says so).
    """
    # MCPServer configures the root logger (basicConfig with a rich handler at INFO); a library
    # must leave logging to the application, so that change is undone.
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    server = MCPServer(
        "sandlot",
        title="sandlot",
        version=__version__,
        instructions=(
            "Disposable sandboxes: create_sandbox, then exec_command, read_file/write_file, "
            "and delete_sandbox when done. Commands run inside the sandbox, never on the host."
        ),
        log_level="WARNING",
    )
    root.setLevel(saved_level)
    root.handlers[:] = saved_handlers
    roots = [Path(r).resolve() for r in upload_roots]
    default_cap = max_output_bytes

    async def create_sandbox(
        ctx: Context,
        image: str | None = None,
        setup: str | list[str] | None = None,
        start: str | None = None,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        network: Literal["allow-all", "deny-all"] | None = None,
        labels: dict[str, str] | None = None,
        ports: list[int] | None = None,
        backend: str | None = None,
    ) -> SandboxView:
        """Create a sandbox: an isolated Linux computer to run commands in.

        `setup` runs once (a command or a list); `start` launches a long-running main process
        whose output get_logs reads; `timeout` is its time to live in seconds; `network` is
        allow-all (default) or deny-all.
        """
        fields: dict[str, object] = {
            "image": image,
            "setup": setup,
            "start": start,
            "env": env,
            "workdir": workdir,
            "timeout": timeout,
            "idle_timeout": idle_timeout,
            "network": network,
            "labels": labels,
            "ports": ports,
        }
        spec = SandboxSpec.model_validate({k: v for k, v in fields.items() if v is not None})
        api = await provider(ctx)
        handle = await api.create(spec, backend=backend)
        return SandboxView.of(handle.info)

    async def list_sandboxes(
        ctx: Context,
        labels: dict[str, str] | None = None,
        status: list[SandboxStatus] | None = None,
        include_destroyed: bool = False,
        limit: int = 50,
    ) -> SandboxList:
        """List sandboxes, newest first (destroyed ones only when asked)."""
        api = await provider(ctx)
        items = await api.list(
            labels=labels,
            status=status or None,
            include_destroyed=include_destroyed,
            limit=max(1, min(limit, 1000)),
        )
        return SandboxList(sandboxes=[SandboxView.of(i) for i in items])

    async def get_sandbox(ctx: Context, sandbox_id: str) -> SandboxView:
        """One sandbox: its status, ports, and why it stopped or died (with last output)."""
        return SandboxView.of((await (await provider(ctx)).get(sandbox_id)).info)

    async def delete_sandbox(ctx: Context, sandbox_id: str) -> SandboxView:
        """Destroy a sandbox and everything in it (its record stays, with the cause)."""
        handle = await (await provider(ctx)).get(sandbox_id)
        return SandboxView.of(await handle.destroy())

    async def stop_sandbox(ctx: Context, sandbox_id: str) -> SandboxView:
        """Stop a sandbox's processes; its files stay and the next command resumes it."""
        handle = await (await provider(ctx)).get(sandbox_id)
        return SandboxView.of(await handle.stop())

    async def keep_alive(ctx: Context, sandbox_id: str, seconds: float = 600) -> SandboxView:
        """Push a sandbox's time to live out to `seconds` from now (never shortens it)."""
        handle = await (await provider(ctx)).get(sandbox_id)
        return SandboxView.of(await handle.keep_alive(seconds))

    async def exec_command(
        ctx: Context,
        sandbox_id: str,
        command: str | list[str],
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandResult:
        """Run a command in a sandbox and wait for it; output streams as progress notifications.

        A string runs under `sh -c`; a list is an exact argv. `timeout` (seconds) kills the
        whole process tree (exit code 124). Long output is cut to its last `max_output_bytes`.
        """
        cap = max_output_bytes or default_cap
        handle = await (await provider(ctx)).get(sandbox_id)
        sent = 0

        async def progress(chunk: OutputChunk) -> None:
            nonlocal sent
            sent += len(chunk.data)
            text = chunk.data.decode(errors="replace")
            await ctx.report_progress(sent, None, f"{chunk.stream}: {text}"[:4096])

        result = await handle.exec(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin.encode() if stdin is not None else None,
            on_output=progress,
        )
        out, err = result.stdout.encode(), result.stderr.encode()
        return CommandResult(
            exit_code=result.exit_code,
            stdout=out[-cap:].decode(errors="replace"),
            stderr=err[-cap:].decode(errors="replace"),
            stdout_bytes=len(out),
            stderr_bytes=len(err),
            truncated=len(out) > cap or len(err) > cap,
            output_sha256=hashlib.sha256(out + err).hexdigest(),
            duration_ms=result.duration_ms,
            timed_out=result.timed_out,
            oom_killed=result.oom_killed,
        )

    async def read_file(
        ctx: Context, sandbox_id: str, path: str, offset: int = 0, max_bytes: int = 65536
    ) -> FileContent:
        """Read a file inside a sandbox, `max_bytes` at a time from `offset` (page on while
        `eof` is false). Text comes as UTF-8, binary data as base64."""
        if offset < 0 or max_bytes <= 0:
            msg = "offset must be >= 0 and max_bytes > 0"
            raise InvalidRequest(msg)
        handle = await (await provider(ctx)).get(sandbox_id)
        data, eof = await _read_range(handle.stream_file(path), offset, max_bytes)
        try:
            text, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = _b64(data), "base64"
        return FileContent(
            path=path,
            offset=offset,
            length=len(data),
            eof=eof,
            encoding=encoding,
            content=text,
        )

    async def write_file(
        ctx: Context,
        sandbox_id: str,
        path: str,
        content: str,
        encoding: Literal["utf-8", "base64"] = "utf-8",
        mode: str | None = None,
    ) -> FileInfo:
        """Create or replace a file inside a sandbox (parents are made). `mode` is octal,
        like "755"."""
        data = content.encode() if encoding == "utf-8" else _unb64(content)
        bits = _octal(mode)
        handle = await (await provider(ctx)).get(sandbox_id)
        return await handle.write_file(path, data, mode=bits)

    async def list_files(ctx: Context, sandbox_id: str, path: str | None = None) -> FileList:
        """List a directory inside a sandbox (default: its workdir)."""
        handle = await (await provider(ctx)).get(sandbox_id)
        where = path or handle.info.spec.workdir
        return FileList(path=where, entries=await handle.list_files(where))

    async def get_logs(
        ctx: Context,
        sandbox_id: str,
        process_id: str | None = None,
        offset: int = 0,
        max_bytes: int = 65536,
        wait: float = 0,
    ) -> LogChunk:
        """Read output of the sandbox's main process, or of a run_agent program
        (`process_id`), from byte `offset`; call again with `next_offset` to follow it.

        For a program, `running` says whether more may come and `wait` (seconds, at most 60)
        waits that long for new output when there is none yet.
        """
        if offset < 0 or max_bytes <= 0 or wait < 0:
            msg = "offset and wait must be >= 0 and max_bytes > 0"
            raise InvalidRequest(msg)
        handle = await (await provider(ctx)).get(sandbox_id)
        if process_id is None:
            data, _ = await _read_range(handle.logs(offset=offset), 0, max_bytes)
            return LogChunk(
                sandbox_id=sandbox_id,
                process_id=None,
                offset=offset,
                next_offset=offset + len(data),
                data=data.decode(errors="replace"),
            )
        data = await _process_range(handle, process_id, offset, max_bytes, min(wait, MAX_LOG_WAIT))
        state = next((p for p in await handle.list_processes() if p.id == process_id), None)
        return LogChunk(
            sandbox_id=sandbox_id,
            process_id=process_id,
            offset=offset,
            next_offset=offset + len(data),
            data=data.decode(errors="replace"),
            running=None if state is None else state.running,
            exit_code=None if state is None else state.exit_code,
        )

    async def expose_port(ctx: Context, sandbox_id: str, port: int) -> PortMapping:
        """Publish a port of the sandbox on the host; returns its URL."""
        handle = await (await provider(ctx)).get(sandbox_id)
        return await handle.expose_port(port)

    async def list_exposed_ports(ctx: Context, sandbox_id: str) -> PortList:
        """The sandbox's published ports and their URLs."""
        handle = await (await provider(ctx)).get(sandbox_id)
        return PortList(ports=await handle.list_ports())

    async def snapshot_sandbox(ctx: Context, sandbox_id: str) -> SnapshotView:
        """Save a sandbox's files as a snapshot (new sandboxes can start from it)."""
        handle = await (await provider(ctx)).get(sandbox_id)
        snap = await handle.snapshot()
        return SnapshotView(
            id=snap.id,
            sandbox_id=snap.sandbox_id,
            backend=snap.backend,
            created_at=snap.created_at,
            size_bytes=snap.size_bytes,
        )

    async def upload_dir(
        ctx: Context,
        sandbox_id: str,
        local_path: str,
        remote_path: str | None = None,
        max_bytes: int = 64 << 20,
    ) -> UploadResult:
        """Copy a directory from this machine into the sandbox (only from the directories
        this server was allowed to share). Symlinks are skipped, not followed."""
        source = _allowed(Path(local_path), roots)
        handle = await (await provider(ctx)).get(sandbox_id)
        target = remote_path or posixpath.join(handle.info.spec.workdir, source.name)
        files, total, skipped = 0, 0, []
        for entry in sorted(source.rglob("*")):
            rel = entry.relative_to(source).as_posix()
            if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
                skipped.append(rel)
                continue
            if entry.is_dir():
                continue
            data = entry.read_bytes()
            total += len(data)
            if total > max_bytes:
                msg = f"{source} holds more than max_bytes={max_bytes} bytes; copied {files} files before stopping"
                raise InvalidRequest(msg)
            await handle.write_file(
                posixpath.join(target, rel), data, mode=entry.stat().st_mode & 0o777
            )
            files += 1
        return UploadResult(remote_path=target, files=files, bytes=total, skipped=skipped)

    async def run_agent(
        ctx: Context,
        sandbox_id: str,
        command: str | list[str],
        task: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessHandle:
        """Start a long-running program (an agent, a server) in the background and return at
        once with its process handle; follow its output with get_logs(process_id=...).

        A string runs under `sh -c`; a list is an exact argv. `task` is written to the
        program's standard input, which is then closed (so a program reading its input never
        waits for more). It keeps running after this call, until it exits.
        """
        handle = await (await provider(ctx)).get(sandbox_id)
        info = await handle.start_process(command, cwd=cwd, env=env, name=name)
        # A program that already finished (it ignored its input) has nothing left to feed.
        with contextlib.suppress(InvalidState):
            await handle.write_stdin(info.id, task or "", close=True)
        return ProcessHandle(
            sandbox_id=sandbox_id,
            process_id=info.id,
            pid=info.pid,
            command=list(info.command),
            name=info.name,
        )

    async def version(ctx: Context) -> VersionView:
        """sandlot's version and where the tools run."""
        return VersionView(version=__version__, mode=mode)

    async def health(ctx: Context) -> Health:
        """Check that sandboxes can be reached; counts the caller's live sandboxes."""
        api = await provider(ctx)
        return Health(status="ok", sandboxes=len(await api.list(limit=1000)))

    _tool(server, create_sandbox, title="Create a sandbox", open_world=True)
    _tool(server, list_sandboxes, title="List sandboxes", read_only=True)
    _tool(server, get_sandbox, title="Show a sandbox", read_only=True)
    _tool(server, delete_sandbox, title="Destroy a sandbox", destructive=True, idempotent=True)
    _tool(server, stop_sandbox, title="Stop a sandbox", destructive=True, idempotent=True)
    _tool(server, keep_alive, title="Extend a sandbox's time to live", idempotent=True)
    _tool(server, exec_command, title="Run a command", destructive=True, open_world=True)
    _tool(server, read_file, title="Read a file", read_only=True)
    _tool(server, write_file, title="Write a file", destructive=True, idempotent=True)
    _tool(server, list_files, title="List a directory", read_only=True)
    _tool(server, get_logs, title="Read output logs", read_only=True)
    _tool(server, expose_port, title="Publish a port", idempotent=True)
    _tool(server, list_exposed_ports, title="List published ports", read_only=True)
    _tool(server, snapshot_sandbox, title="Snapshot a sandbox")
    _tool(server, upload_dir, title="Upload a directory", destructive=True, idempotent=True)
    _tool(server, run_agent, title="Start a background program", destructive=True, open_world=True)
    _tool(server, version, title="sandlot version", read_only=True)
    _tool(server, health, title="Health check", read_only=True)
    return server


# -- helpers ----------------------------------------------------------------------------------


async def _process_range(
    handle: SandboxHandle, process_id: str, offset: int, length: int, wait: float
) -> bytes:
    """Bytes ``offset .. offset + length`` of a process's output (what the sandbox still
    keeps of it), waiting up to ``wait`` seconds for the first new bytes when there are none."""
    out = bytearray()
    position = 0
    chunks = 0
    stream = handle.process_output(process_id)
    try:
        async for chunk in stream:
            chunks = chunk.seq + 1
            start = max(offset - position, 0)
            position += len(chunk.data)
            out += chunk.data[start:]
            if len(out) >= length:
                break
    finally:
        await _aclose(stream)
    if out or wait <= 0:
        return bytes(out[:length])
    following = handle.process_output(process_id, offset=chunks, follow=True)
    try:
        with anyio.move_on_after(wait):
            async for chunk in following:
                start = max(offset - position, 0)
                position += len(chunk.data)
                out += chunk.data[start:]
                if out:
                    break
    finally:
        await _aclose(following)
    return bytes(out[:length])


async def _aclose(stream: AsyncIterator[object]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _read_range(chunks: AsyncIterator[bytes], offset: int, length: int) -> tuple[bytes, bool]:
    """Bytes ``offset .. offset + length`` of a stream, and whether the stream ended there."""
    out = bytearray()
    position = 0
    eof = True
    try:
        async for chunk in chunks:
            start = max(offset - position, 0)
            position += len(chunk)
            if start >= len(chunk):
                continue
            out += chunk[start:]
            if len(out) > length:
                eof = False
                break
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    return bytes(out[:length]), eof


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        msg = "content is not valid base64"
        raise InvalidRequest(msg) from None


def _octal(mode: str | None) -> int | None:
    if mode is None:
        return None
    try:
        bits = int(mode, 8)
    except ValueError:
        msg = f"mode must be octal digits like 644, got {mode!r}"
        raise InvalidRequest(msg) from None
    if not 0 <= bits <= 0o7777:
        msg = f"mode {mode} is out of range"
        raise InvalidRequest(msg)
    return bits


def _allowed(path: Path, roots: Sequence[Path]) -> Path:
    if not roots:
        msg = "upload_dir is disabled here: this server shares no host directories"
        raise InvalidRequest(msg)
    resolved = path.expanduser().resolve()
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        msg = f"{path} is outside the directories this server shares ({', '.join(map(str, roots))})"
        raise InvalidRequest(msg)
    if not resolved.is_dir():
        msg = f"{path} is not a directory"
        raise InvalidRequest(msg)
    return resolved
