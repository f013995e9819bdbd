"""The async HTTP client: :class:`AsyncClient` and its :class:`AsyncRemoteSandbox` handles.

    async with AsyncClient("http://127.0.0.1:8470", api_key) as client:
        async with await client.create(setup="pip install requests") as sb:
            result = await sb.exec(["python3", "-c", "print(1)"])

The surface is the in-process SDK's (:class:`sandlot.sdk.AsyncSandlot`), method for method
and signature for signature (a test checks), and errors come back as the same classes: the
server sends each error's stable ``code`` and this module raises the class it names.

Terminals (``open_pty``) are a WebSocket (the ``websockets`` package), with the protocol in
:mod:`sandlot.server.wire`; a background process's output is an event stream that resumes
after its last chunk like a command's.

Commands stream their output as server-sent events. When the connection breaks mid-command,
the client reconnects and asks for the output after the last chunk it has (``Last-Event-ID``),
so nothing is lost or repeated; when the server no longer knows the command (it restarted),
the client raises ``BackendUnavailable`` saying the outcome is unknown. It never sends a
command twice. Files travel with a SHA-256 ``Content-Digest`` that the receiving side checks.

This module speaks HTTP only: it must not import the Manager's dependencies below the SDK
surface (backends, the store).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import hashlib
import inspect
import json as jsonlib
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self, final
from urllib.parse import quote, urlencode

import anyio
import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from sandlot.client.sse import Event, events
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    ExecFailed,
    InvalidRequest,
    InvalidState,
    NotFound,
    SandboxError,
    SandboxTimeout,
    error_from_code,
)
from sandlot.gate.gate import Approval
from sandlot.manager import ReconcileReport
from sandlot.models import (
    Command,
    CommandSpec,
    ExecResult,
    FileInfo,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
)
from sandlot.policy import Explanation
from sandlot.policy.engine import Decision, Outcome, PolicyTrace, ReasonCode, UnitTrace
from sandlot.server.wire import (
    DIGEST_HEADER,
    IDEMPOTENCY_HEADER,
    LAST_EVENT_ID,
    PtyResize,
    b64decode,
    b64encode,
    content_digest,
    parse_digest,
)
from sandlot.shared import Creating, build_spec, file_body, split_output
from sandlot.terminal import AsyncTerminal

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback, Stdin

__all__ = ["AsyncClient", "AsyncRemoteSandbox"]

_log = logging.getLogger("sandlot.client")


def _error(response: httpx.Response) -> SandboxError:
    """The sandlot error a failed response carries."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = body["code"]
        message = str(body.get("detail") or body.get("title") or code)
        details = body.get("details")
        details = details if isinstance(details, dict) else {}
        return _problem_error(code, message, details, body.get("result"))
    text = response.text[:300].strip()
    status = response.status_code
    msg = f"the server answered {status} {response.reason_phrase}" + (f": {text}" if text else "")
    if status == 404:
        return NotFound(msg)
    if status == 413:
        return InvalidRequest(msg)
    if status in (502, 503, 504):
        return BackendUnavailable(msg)
    return BackendError(msg)


def _problem_error(
    code: str, message: str, details: dict[str, object], result: object = None
) -> SandboxError:
    if code == ExecFailed.code and isinstance(result, dict):
        return ExecFailed(message, ExecResult.model_validate(result), **details)
    return error_from_code(code, message, details)


async def _hashing(chunks: AsyncIterator[bytes], digest: hashlib._Hash) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        digest.update(chunk)
        yield chunk


def _key_header(key: str | None) -> dict[str, str]:
    return {} if key is None else {IDEMPOTENCY_HEADER: key}


def _unknown_outcome(what: str, exec_id: str | None, why: str) -> BackendUnavailable:
    msg = (
        f"{what}: {why}; its outcome is unknown (it was not sent again). "
        "Check the sandbox before retrying."
    )
    return BackendUnavailable(msg, outcome="unknown", exec_id=exec_id)


async def _deliver(callback: OutputCallback | None, chunk: OutputChunk) -> None:
    if callback is None:
        return
    result = callback(chunk)
    if inspect.isawaitable(result):
        await result


def _quote(value: str) -> str:
    return quote(value, safe="")


@final
class AsyncRemoteSandbox:
    """A handle on one sandbox on a server. ``async with`` destroys it on exit."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        """The record as last seen (``refresh()`` reads it again)."""

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.info.id

    @property
    def status(self) -> SandboxStatus:
        """The status as last seen."""
        return self.info.status

    def __repr__(self) -> str:
        return f"<AsyncRemoteSandbox {self.id} {self.info.status} on {self.info.backend}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a cancelled body is exactly when the sandbox must still go.
        with anyio.CancelScope(shield=True):
            await self.destroy()

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{_quote(self.id)}"

    async def refresh(self) -> SandboxInfo:
        """Read the record again."""
        self.info = await self._client._info("GET", self._path)
        return self.info

    async def exec(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: Stdin = None,
        on_output: OutputCallback | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
        check: bool = False,
        auto_resume: bool = True,
        idempotency_key: str | None = None,
        collect_output: bool = True,
    ) -> ExecResult:
        """Run a command to completion (a string runs under ``sh -c``; a list is an argv).

        Args:
            command: What to run.
            cwd: Working directory (default: the spec's workdir).
            env: Extra environment variables.
            timeout: Seconds before the whole process tree is killed (exit code 124).
            stdin: Input bytes, or an async iterable of chunks (streamed while it runs).
            on_output: Called with each raw output chunk.
            on_stdout: Called with standard output text as it arrives.
            on_stderr: Called with standard error text as it arrives.
            check: Raise ``ExecFailed`` on a non-zero exit.
            auto_resume: Resume a stopped sandbox first (else ``InvalidState``).
            idempotency_key: Run at most once under this key; a repeat returns the first
                result (``Conflict`` if the key was used for another command).
            collect_output: Also keep the output in the result (False: only the callbacks
                see it, so output of any size passes in bounded memory).

        Returns:
            The exit code, the collected output and the duration.
        """
        body: dict[str, object] = {
            "command": _command_json(command),
            "cwd": cwd,
            "env": dict(env or {}),
            "timeout": timeout,
            "check": check,
            "auto_resume": auto_resume,
            "collect_output": collect_output,
        }
        stream: AsyncIterable[bytes] | None = None
        if isinstance(stdin, bytes | bytearray | memoryview):
            body["stdin"] = b64encode(bytes(stdin))
        elif stdin is not None:
            body["stdin_stream"] = True
            stream = stdin
        callback = split_output(on_output, on_stdout, on_stderr)
        data = await self._client._job(
            f"{self._path}/execs", body, callback, stream, key=idempotency_key
        )
        return ExecResult.model_validate(data)

    async def read_file(self, path: str) -> bytes:
        """A file's bytes (checked against the server's SHA-256)."""
        return b"".join([chunk async for chunk in self.stream_file(path)])

    async def stream_file(self, path: str) -> AsyncIterator[bytes]:
        """A file's bytes in chunks, for files too big to hold in memory.

        The SHA-256 the server sent is checked at the end: a mismatch raises ``BackendError``
        after the last chunk.
        """
        async with self._client._stream(
            "GET", f"{self._path}/files/content", params={"path": path}
        ) as response:
            expected = parse_digest(response.headers.get(DIGEST_HEADER))
            digest = hashlib.sha256()
            try:
                async for chunk in response.aiter_bytes():
                    digest.update(chunk)
                    yield chunk
            except httpx.TransportError as e:
                msg = f"the download of {path} broke off: {e}"
                raise BackendUnavailable(msg) from e
        if expected is None:
            msg = f"the server sent {path} without its {DIGEST_HEADER}"
            raise BackendError(msg)
        if digest.digest() != expected:
            msg = f"the download of {path} does not match its SHA-256 (corrupted in transit)"
            raise BackendError(msg)

    async def write_file(
        self,
        path: str,
        data: bytes | str | IO[bytes] | AsyncIterable[bytes],
        *,
        mode: int | None = None,
        idempotency_key: str | None = None,
    ) -> FileInfo:
        """Create or replace a file (parents are made). Text is written as UTF-8; a binary
        file object or an async iterable of chunks is streamed, never held whole in memory."""
        body = file_body(data)
        params: dict[str, str | int] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        headers = {"Content-Type": "application/octet-stream", **_key_header(idempotency_key)}
        digest = hashlib.sha256()
        if isinstance(body, bytes):
            digest.update(body)
            # Known before sending: the server checks it and writes nothing on a mismatch.
            headers[DIGEST_HEADER] = content_digest(digest.digest())
            content: bytes | AsyncIterator[bytes] = body
        else:
            content = _hashing(body, digest)
        response = await self._client._request(
            "PUT", f"{self._path}/files/content", params=params, content=content, headers=headers
        )
        sent = digest.digest()
        if parse_digest(response.headers.get(DIGEST_HEADER)) != sent:
            msg = f"the server stored {path} with a different SHA-256 than was sent"
            raise BackendError(msg)
        return FileInfo.model_validate(response.json())

    async def write_files(
        self, files: Mapping[str, bytes | str], *, idempotency_key: str | None = None
    ) -> builtins.list[FileInfo]:
        """Create or replace several files."""
        payload = [
            {"path": p, "content": b64encode(d.encode() if isinstance(d, str) else bytes(d))}
            for p, d in files.items()
        ]
        response = await self._client._request(
            "POST",
            f"{self._path}/files",
            json={"files": payload},
            headers=_key_header(idempotency_key),
        )
        return [FileInfo.model_validate(f) for f in response.json()]

    async def list_files(self, path: str | None = None) -> builtins.list[FileInfo]:
        """A directory's entries (default: the workdir)."""
        response = await self._client._request(
            "GET", f"{self._path}/files", params={"path": path or self.info.spec.workdir}
        )
        return [FileInfo.model_validate(f) for f in response.json()]

    async def remove_file(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``."""
        await self._client._request(
            "DELETE",
            f"{self._path}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    async def logs(self, *, follow: bool = False, offset: int = 0) -> AsyncIterator[bytes]:
        """The main process's output; ``follow`` keeps tailing it (across reconnects)."""
        deadline: float | None = None
        while True:
            try:
                async with self._client._stream(
                    "GET",
                    f"{self._path}/logs",
                    params={"follow": "true" if follow else "false", "offset": offset},
                    headers={"Accept": "text/event-stream"},
                    read_timeout=None if follow else self._client.timeout,
                ) as response:
                    deadline = None
                    async for ev in events(response):
                        if ev.event == "data":
                            data = b64decode(str(ev.json()["data"]))
                            offset += len(data)
                            yield data
                        elif ev.event == "error":
                            raise _event_error(ev)
                        elif ev.event == "end":
                            return
            except (httpx.TransportError, _Unreachable) as e:
                now = time.monotonic()
                deadline = deadline or now + self._client.reconnect_timeout
                if now > deadline:
                    msg = f"lost the log stream of {self.id} and could not reconnect: {e}"
                    raise BackendUnavailable(msg) from e
                await anyio.sleep(0.2)

    async def start_process(
        self,
        command: Command | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> ProcessInfo:
        """Start a program in the background and return at once (a string runs under
        ``sh -c``; a list is an argv).

        It outlives this call and this client, until it exits, is signalled or the sandbox
        stops; read its output with :meth:`process_output`. A ``name`` held by a running
        process is a ``Conflict``; the id or the name finds it later.
        """
        response = await self._client._request(
            "POST",
            f"{self._path}/processes",
            json={
                "command": _command_json(command),
                "cwd": cwd,
                "env": dict(env or {}),
                "name": name,
            },
        )
        return ProcessInfo.model_validate(response.json())

    async def list_processes(self) -> builtins.list[ProcessInfo]:
        """Background processes (the main process among them), running and recently exited."""
        response = await self._client._request("GET", f"{self._path}/processes")
        return [ProcessInfo.model_validate(p) for p in response.json()]

    async def signal_process(self, process_id: str, signum: int = 15) -> None:
        """Send a signal (default SIGTERM) to a background process's whole tree."""
        await self._client._request(
            "POST", f"{self._process_path(process_id)}/signal", json={"signal": signum}
        )

    async def wait_process(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait until a background process exits; its final record (``SandboxTimeout`` when
        ``timeout`` seconds pass first)."""
        response = await self._client._request(
            "POST",
            f"{self._process_path(process_id)}/wait",
            json={"timeout": timeout},
            # The server answers when the process exits: give it the wait, plus the usual.
            read_timeout=None if timeout is None else timeout + self._client.timeout,
        )
        return ProcessInfo.model_validate(response.json())

    async def process_output(
        self, process_id: str, *, offset: int = 0, follow: bool = False
    ) -> AsyncIterator[OutputChunk]:
        """A background process's output from chunk ``offset``; ``follow`` keeps yielding
        until it exits (across reconnects, resuming after the last chunk received)."""
        deadline: float | None = None
        received = False
        while True:
            headers = {"Accept": "text/event-stream"}
            if received:
                headers[LAST_EVENT_ID] = str(offset - 1)
            try:
                async with self._client._stream(
                    "GET",
                    f"{self._process_path(process_id)}/output",
                    params={"follow": "true" if follow else "false", "offset": offset},
                    headers=headers,
                    read_timeout=None if follow else self._client.timeout,
                ) as response:
                    deadline = None
                    async for ev in events(response):
                        if ev.event == "output":
                            seq = int(ev.id or offset)
                            if seq < offset:
                                continue  # already delivered before a reconnect
                            out = ev.json()
                            stream = "stderr" if out.get("stream") == "stderr" else "stdout"
                            offset, received = seq + 1, True
                            yield OutputChunk(
                                seq=seq, stream=stream, data=b64decode(str(out["data"]))
                            )
                        elif ev.event == "error":
                            raise _event_error(ev)
                        elif ev.event == "end":
                            return
                    msg = "the output stream ended without its end event"
                    raise _StreamEnded(msg)
            except (httpx.TransportError, _Unreachable, _StreamEnded) as e:
                now = time.monotonic()
                deadline = deadline or now + self._client.reconnect_timeout
                if now > deadline:
                    msg = f"lost the output stream of process {process_id} in {self.id} and could not reconnect: {e}"
                    raise BackendUnavailable(msg) from e
                await anyio.sleep(0.2)

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Feed a background process's standard input (strings as UTF-8); ``close`` closes it
        afterwards (the program reads end of file)."""
        await self._client._request(
            "PUT",
            f"{self._process_path(process_id)}/stdin",
            params={"close": "true" if close else "false"},
            content=data.encode() if isinstance(data, str) else bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )

    async def open_pty(
        self,
        command: Command | Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> AsyncTerminal:
        """Start a program (default ``sh``) on a new interactive terminal (over a WebSocket).

        Write keystrokes, read output, resize; the terminal ends when the program exits.
        ``async with`` closes it (the program gets SIGHUP).
        """
        query: list[tuple[str, str]] = [("rows", str(rows)), ("cols", str(cols))]
        argv: list[str] = []
        if isinstance(command, str):
            query.append(("command", command))
        elif isinstance(command, CommandSpec):
            argv = command.argv()
            cwd = cwd or command.cwd
            env = {**command.env, **dict(env or {})}
        elif command is not None:
            argv = [str(a) for a in command]
            if not argv:
                msg = "command: an empty argv"
                raise InvalidRequest(msg)
        query += [("argv", a) for a in argv]
        if cwd is not None:
            query.append(("cwd", cwd))
        query += [("env", f"{k}={v}") for k, v in (env or {}).items()]
        session = await self._client._pty(f"{self._path}/pty?{urlencode(query)}")
        return AsyncTerminal(session, self.id)

    def _process_path(self, process_id: str) -> str:
        return f"{self._path}/processes/{_quote(process_id)}"

    async def stop(self) -> SandboxInfo:
        """Stop every process; the filesystem stays."""
        self.info = await self._client._info("POST", f"{self._path}/stop")
        return self.info

    async def resume(self) -> SandboxInfo:
        """Boot it again and relaunch its ``resume`` command."""
        self.info = await self._client._info("POST", f"{self._path}/resume")
        return self.info

    async def destroy(
        self, *, idempotency_key: str | None = None, forget_host: bool = False
    ) -> SandboxInfo:
        """Remove it for good (the record stays, hidden, with a death certificate);
        ``forget_host`` closes the record of a sandbox whose host is gone for good."""
        self.info = await self._client._info(
            "POST",
            f"{self._path}/destroy",
            params={"forget_host": "true"} if forget_host else None,
            headers=_key_header(idempotency_key),
        )
        return self.info

    async def keep_alive(self, seconds: float) -> SandboxInfo:
        """Push the time to live out to ``seconds`` from now."""
        self.info = await self._client._info(
            "POST", f"{self._path}/keep-alive", json={"seconds": seconds}
        )
        return self.info

    async def snapshot(self) -> SnapshotInfo:
        """Save its state."""
        response = await self._client._request("POST", f"{self._path}/snapshots")
        return SnapshotInfo.model_validate(response.json())

    async def restore(self, snapshot_id: str) -> SandboxInfo:
        """Put it back to a snapshot's state."""
        self.info = await self._client._info(
            "POST", f"{self._path}/restore", json={"snapshot_id": snapshot_id}
        )
        return self.info

    async def fork(self, count: int = 1) -> builtins.list[AsyncRemoteSandbox]:
        """Make ``count`` new sandboxes from its current state."""
        return await self._client.fork(self.id, count)

    async def expose_port(self, port: int) -> PortMapping:
        """Publish a sandbox port on the host."""
        response = await self._client._request("POST", f"{self._path}/ports", json={"port": port})
        await self.refresh()
        return PortMapping.model_validate(response.json())

    async def list_ports(self) -> builtins.list[PortMapping]:
        """Published ports."""
        response = await self._client._request("GET", f"{self._path}/ports")
        return [PortMapping.model_validate(p) for p in response.json()]

    async def reset(self, snapshot_id: str | None = None) -> SandboxInfo:
        """Return to a snapshot (default: the state it was created in), verified; a failed
        verification raises ``VerificationFailed`` naming what diverged."""
        self.info = await self._client._info(
            "POST", f"{self._path}/reset", json={"snapshot_id": snapshot_id}
        )
        return self.info

    async def update_network(self, policy: NetworkPolicy | str) -> SandboxInfo:
        """Change the egress policy (``"deny-all"``, ``"allow-all"`` or an allowlist)."""
        body = policy if isinstance(policy, str) else policy.model_dump(mode="json")
        self.info = await self._client._info("PUT", f"{self._path}/network", json={"network": body})
        return self.info

    async def network_log(self) -> builtins.list[dict[str, JsonValue]]:
        """Every egress decision the sandbox's proxy logged."""
        response = await self._client._request("GET", f"{self._path}/network/log")
        events: list[dict[str, JsonValue]] = response.json()
        return events

    async def suggest_network(self) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the sandbox connected to."""
        response = await self._client._request("GET", f"{self._path}/network/suggest")
        return NetworkAllowlist.model_validate(response.json())

    async def explain(self, action: str, **args: object) -> Explanation:
        """What the policy would decide about an operation here, and why (nothing runs).

        ``sb.explain("exec", command="rm -rf /")``, ``sb.explain("fs.write", path="/etc/x")``.
        """
        response = await self._client._request(
            "POST", f"{self._path}/explain", json={"action": action, "args": args}
        )
        return _explanation(response.json())


def _explanation(body: dict[str, Any]) -> Explanation:
    """An :class:`Explanation` from its ``to_dict`` form."""
    d = body["decision"]
    decision = Decision(
        outcome=Outcome(d["outcome"]),
        reason_code=ReasonCode(d["reason_code"]),
        engine=d["engine"],
        policy_hash=d["policy_hash"],
        matched=tuple(d.get("matched", ())),
        message=d.get("message", ""),
        hold_reason=d.get("hold_reason"),
        errors=tuple(d.get("errors", ())),
        duration_ns=int(d.get("duration_ns", 0)),
    )
    units = tuple(
        UnitTrace(
            label=u["label"],
            context=u.get("context", {}),
            outcome=Outcome(u["outcome"]),
            policies=tuple(PolicyTrace(**p) for p in u.get("policies", ())),
            errors=tuple(u.get("errors", ())),
        )
        for u in body.get("units", ())
    )
    return Explanation(decision=decision, units=units, notes=tuple(body.get("notes", ())))


def _command_json(command: Command | Sequence[str]) -> object:
    if isinstance(command, str):
        return command
    if isinstance(command, CommandSpec):
        return command.model_dump(mode="json")
    return list(command)


def _event_error(ev: Event) -> SandboxError:
    try:
        body = ev.json()
    except ValueError:
        return BackendError(f"the server sent an unreadable error event: {ev.data[:200]}")
    details = body.get("details")
    return _problem_error(
        str(body.get("code", "")),
        str(body.get("detail") or body.get("code")),
        details if isinstance(details, dict) else {},
        body.get("result"),
    )


@final
class AsyncClient:
    """The async SDK against a sandlot server (``sandlot serve``).

    Args:
        url: The server's base URL (default ``$SANDLOT_URL``).
        api_key: An API key from ``sandlot api-keys create`` (default ``$SANDLOT_API_KEY``).
        timeout: Seconds to wait for a response (streams of running commands excepted: they
            carry keep-alives, and a silent one is given this long between them, times four).
        reconnect_timeout: Seconds to keep trying to reconnect a broken command or log stream.
        transport: An httpx transport to use instead of the network (tests).
        on_hold: Called with the pending :class:`Approval` when a streamed operation of this
            client (an exec, a create with setup output) is held for approval, at once.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        reconnect_timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        on_hold: Callable[[Approval], object] | None = None,
    ) -> None:
        url = url or os.environ.get("SANDLOT_URL")
        if not url:
            msg = "no server URL: pass url= or set SANDLOT_URL"
            raise InvalidRequest(msg)
        if not url.startswith(("http://", "https://")):
            msg = f"the server URL must start with http:// or https://, got {url!r}"
            raise InvalidRequest(msg)
        key = api_key if api_key is not None else os.environ.get("SANDLOT_API_KEY")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.on_hold = on_hold
        headers = {"User-Agent": "sandlot-client"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = dict(headers)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"<AsyncClient {self.url}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close connections (sandboxes keep running)."""
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str | int | builtins.list[str]] | None = None,
        content: bytes | AsyncIterator[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        read_timeout: float | None = -1.0,
    ) -> httpx.Response:
        timeout = (
            httpx.USE_CLIENT_DEFAULT
            if read_timeout == -1.0
            else httpx.Timeout(read_timeout, connect=min(self.timeout, 10.0))
        )
        try:
            response = await self._http.request(
                method,
                path,
                json=json,
                params=params,
                content=content,
                headers=headers,
                timeout=timeout,
            )
        except httpx.ConnectError as e:
            msg = f"cannot reach the sandlot server at {self.url}: {e}"
            raise BackendUnavailable(msg) from e
        except httpx.TimeoutException as e:
            msg = f"{method} {path} got no answer from {self.url} within {self.timeout:g}s (it may still take effect)"
            raise SandboxTimeout(msg) from e
        except httpx.TransportError as e:
            msg = f"{method} {path}: the connection to {self.url} broke ({e}); the request may or may not have taken effect"
            raise BackendUnavailable(msg, outcome="unknown") from e
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _stream(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        json: object = None,
        headers: Mapping[str, str] | None = None,
        read_timeout: float | None = -1.0,
    ) -> _Stream:
        timeout = httpx.Timeout(
            self.timeout if read_timeout == -1.0 else read_timeout, connect=min(self.timeout, 10.0)
        )
        request = self._http.build_request(
            method, path, params=params, json=json, headers=headers, timeout=timeout
        )
        return _Stream(self, request)

    async def _pty(self, path: str) -> _WebSocketPty:
        """Open a terminal WebSocket; a refusal raises the error the server's problem names."""
        base = self.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        try:
            ws = await ws_connect(
                base + path,
                additional_headers=self._headers,
                user_agent_header=None,
                open_timeout=self.timeout,
                max_size=1 << 24,
                compression=None,
            )
        except InvalidStatus as e:
            answer = e.response
            raise _error(
                httpx.Response(
                    answer.status_code,
                    content=bytes(answer.body or b""),
                    headers=dict(answer.headers.raw_items()),
                )
            ) from e
        except (OSError, TimeoutError, WebSocketException) as e:
            msg = f"cannot open a terminal on the sandlot server at {self.url}: {e}"
            raise BackendUnavailable(msg) from e
        try:
            first = await ws.recv()
            opened = jsonlib.loads(first) if isinstance(first, str) else {}
        except (ConnectionClosed, ValueError) as e:
            await ws.close()
            msg = f"the server closed the terminal before it opened: {e}"
            raise BackendUnavailable(msg) from e
        if opened.get("type") != "opened":
            await ws.close()
            msg = f"the server opened the terminal with {str(first)[:200]!r} instead of its id"
            raise BackendError(msg)
        return _WebSocketPty(ws, str(opened.get("id", "")))

    async def _info(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        response = await self._request(method, path, json=json, params=params, headers=headers)
        return SandboxInfo.model_validate(response.json())

    async def _job(
        self,
        path: str,
        body: Mapping[str, object],
        callback: OutputCallback | None,
        stdin: AsyncIterable[bytes] | None = None,
        *,
        key: str | None = None,
    ) -> dict[str, object]:
        """Run a streamed job (an exec, or a create with setup output) to its outcome."""
        state = _JobState()
        what = f"POST {path}"
        try:
            try:
                async with self._stream(
                    "POST",
                    path,
                    json=dict(body),
                    headers={"Accept": "text/event-stream", **_key_header(key)},
                    read_timeout=self.timeout * 4,
                ) as response:
                    return await self._follow(response, state, callback, stdin)
            except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
                # The caller gave up (Ctrl-C, a cancelled task): so does the server's job, or it
                # would run on with nobody waiting (a reconnect after a broken connection is
                # another matter: that job is wanted).
                if state.exec_id is not None:
                    with (
                        anyio.CancelScope(shield=True),
                        anyio.move_on_after(10),
                        contextlib.suppress(SandboxError, httpx.HTTPError),
                    ):
                        await self._request("POST", f"/v1/execs/{_quote(state.exec_id)}/cancel")
                raise
        except httpx.TransportError as e:
            if state.exec_id is None:
                raise _unknown_outcome(
                    what, None, f"the connection broke before the server confirmed it ({e})"
                ) from e
            broken: Exception = e
        except _StreamEnded as e:
            if state.exec_id is None:
                raise _unknown_outcome(what, None, "the stream ended before it started") from e
            broken = e
        return await self._resume(state, callback, what, broken)

    async def _notice(self, notice: object) -> None:
        """A server's notice about a job: for now, that it is held for approval."""
        if not isinstance(notice, dict) or notice.get("kind") != "held" or self.on_hold is None:
            return
        data = notice.get("approval")
        if not isinstance(data, dict):
            return
        known = {f.name for f in dataclasses.fields(Approval)}
        try:
            # Fields a newer server adds are left out; a failing callback is the caller's to
            # fix, not a reason to abandon the operation's stream (the gate does the same).
            result = self.on_hold(Approval(**{k: v for k, v in data.items() if k in known}))
            if inspect.isawaitable(result):
                await result
        except Exception:
            _log.exception("the on_hold callback failed")

    async def _resume(
        self,
        state: _JobState,
        callback: OutputCallback | None,
        what: str,
        broken: Exception,
    ) -> dict[str, object]:
        exec_id = state.exec_id
        assert exec_id is not None
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            if time.monotonic() > deadline:
                raise _unknown_outcome(
                    what,
                    exec_id,
                    f"the stream broke ({broken}) and no reconnect succeeded within {self.reconnect_timeout:g}s",
                ) from broken
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
            try:
                async with self._stream(
                    "GET",
                    f"/v1/execs/{_quote(exec_id)}/events",
                    headers={"Accept": "text/event-stream", LAST_EVENT_ID: str(state.after)},
                    read_timeout=self.timeout * 4,
                ) as response:
                    return await self._follow(response, state, callback, None)
            except NotFound as e:
                raise _unknown_outcome(
                    what, exec_id, "the server no longer knows it (did it restart?)"
                ) from e
            except (httpx.TransportError, _StreamEnded, _Unreachable) as e:
                broken = e

    async def _follow(
        self,
        response: httpx.Response,
        state: _JobState,
        callback: OutputCallback | None,
        stdin: AsyncIterable[bytes] | None,
    ) -> dict[str, object]:
        outcome: dict[str, object] | None = None
        failure: SandboxError | None = None
        # Raised outside the task group, so callers see the sandlot error, not a group.
        broken: httpx.TransportError | None = None
        crashed: Exception | None = None
        async with anyio.create_task_group() as tg:
            try:
                async for ev in events(response):
                    if ev.event == "started":
                        state.exec_id = str(ev.json()["exec_id"])
                        if stdin is not None:
                            tg.start_soon(self._send_stdin, state.exec_id, stdin)
                    elif ev.event == "output":
                        seq = int(ev.id or "-1")
                        if seq <= state.after:
                            continue  # already delivered before a reconnect
                        state.after = seq
                        out = ev.json()
                        stream = "stderr" if out.get("stream") == "stderr" else "stdout"
                        chunk = OutputChunk(
                            seq=seq, stream=stream, data=b64decode(str(out["data"]))
                        )
                        await _deliver(callback, chunk)
                    elif ev.event == "notice":
                        seq = int(ev.id or "-1")
                        if seq <= state.after:
                            continue
                        state.after = seq
                        await self._notice(ev.json())
                    elif ev.event == "result":
                        outcome = ev.json()
                        break
                    elif ev.event == "error":
                        failure = _event_error(ev)
                        break
            except httpx.TransportError as e:
                broken = e
            except Exception as e:  # the caller's callback failed: it gets its own error back
                crashed = e
            tg.cancel_scope.cancel()
        if crashed is not None:
            raise crashed
        if broken is not None:
            raise broken
        if failure is not None:
            raise failure
        if outcome is None:
            msg = "the event stream ended without an outcome"
            raise _StreamEnded(msg)
        return outcome

    async def _send_stdin(self, exec_id: str, chunks: AsyncIterable[bytes]) -> None:
        # Failures here are not the command's: a command that exits early stops reading its
        # input, and the outcome stream says how it ended.
        try:
            await self._http.put(
                f"/v1/execs/{_quote(exec_id)}/stdin",
                content=_bytes_only(chunks),
                headers={"Content-Type": "application/octet-stream"},
                timeout=httpx.Timeout(None, connect=10.0),
            )
        except httpx.HTTPError:
            return

    # -- the SDK surface ------------------------------------------------------------------

    def create(
        self,
        spec: SandboxSpec | Mapping[str, JsonValue] | None = None,
        *,
        backend: str | None = None,
        on_setup_output: OutputCallback | None = None,
        idempotency_key: str | None = None,
        **fields: object,
    ) -> Creating[AsyncRemoteSandbox]:
        """Create a sandbox from a spec and/or spec fields (``image=``, ``setup=``, …):
        ``sb = await client.create(…)``, or ``async with client.create(…) as sb:`` to destroy
        it on exit.

        Raises ``InvalidRequest`` naming the bad field, ``NotSupported`` when the backend
        cannot enforce what the spec asks, ``ExecFailed`` when setup fails (the sandbox is then
        ``failed`` and kept for inspection; the error's ``sandbox_id`` names it),
        ``QuotaExceeded`` when the tenant stayed at its limit until the server's admission
        deadline.
        """
        full = build_spec(spec, fields)
        body: dict[str, object] = {"spec": full.model_dump(mode="json"), "backend": backend}
        if full.git is not None and full.git.auth:
            body["git_auth"] = full.git.auth
        return Creating(self._create(body, on_setup_output, idempotency_key))

    async def _create(
        self,
        body: Mapping[str, object],
        on_setup_output: OutputCallback | None,
        idempotency_key: str | None,
    ) -> AsyncRemoteSandbox:
        if on_setup_output is None:
            # Interrupted, this request leaves nothing: a server whose client went away with
            # no key to replay by destroys what it made.
            response = await self._request(
                "POST", "/v1/sandboxes", json=body, headers=_key_header(idempotency_key)
            )
            return AsyncRemoteSandbox(self, SandboxInfo.model_validate(response.json()))
        # Interrupted, a streamed creation is cancelled on the server (see _job), which then
        # destroys what it had made.
        data = await self._job("/v1/sandboxes", body, on_setup_output, key=idempotency_key)
        return AsyncRemoteSandbox(self, SandboxInfo.model_validate(data))

    async def get(self, sandbox_id: str) -> AsyncRemoteSandbox:
        """A handle on an existing sandbox (``NotFound`` names the id)."""
        info = await self._info("GET", f"/v1/sandboxes/{_quote(sandbox_id)}")
        return AsyncRemoteSandbox(self, info)

    async def list(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        status: SandboxStatus | Sequence[SandboxStatus] | None = None,
        backend: str | None = None,
        owner: str | None = None,
        include_destroyed: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Sandbox records, newest first."""
        if limit is not None and limit < 0:
            msg = f"limit must not be negative, got {limit}"
            raise InvalidRequest(msg)
        params: dict[str, str | int | builtins.list[str]] = {
            "include_destroyed": "true" if include_destroyed else "false",
            "offset": offset,
        }
        if labels:
            params["label"] = [f"{k}={v}" for k, v in labels.items()]
        if status is not None:
            statuses = [status] if isinstance(status, SandboxStatus) else list(status)
            params["status"] = [SandboxStatus(s).value for s in statuses]
        if backend is not None:
            params["backend"] = backend
        if owner is not None:
            params["owner"] = owner
        if limit is not None:
            params["limit"] = limit
        response = await self._request("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.model_validate(s) for s in response.json()]

    async def fork(self, source: str, count: int = 1) -> builtins.list[AsyncRemoteSandbox]:
        """New sandboxes from a snapshot id or a sandbox id."""
        kind = "snapshots" if source.startswith("snap-") else "sandboxes"
        response = await self._request(
            "POST", f"/v1/{kind}/{_quote(source)}/fork", json={"count": count}
        )
        return [AsyncRemoteSandbox(self, SandboxInfo.model_validate(s)) for s in response.json()]

    async def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first."""
        params = {"sandbox_id": sandbox_id} if sandbox_id is not None else None
        response = await self._request("GET", "/v1/snapshots", params=params)
        return [SnapshotInfo.model_validate(s) for s in response.json()]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        await self._request("DELETE", f"/v1/snapshots/{_quote(snapshot_id)}")

    async def list_approvals(self, status: str | None = "pending") -> builtins.list[Approval]:
        """Operations held for approval (``status=None`` for all), newest first."""
        response = await self._request("GET", "/v1/approvals", params={"status": status or "all"})
        return [Approval(**a) for a in response.json()]

    async def approve(self, approval_id: str) -> Approval:
        """Let a held operation run."""
        response = await self._request("POST", f"/v1/approvals/{_quote(approval_id)}/approve")
        return Approval(**response.json())

    async def deny(self, approval_id: str) -> Approval:
        """Refuse a held operation."""
        response = await self._request("POST", f"/v1/approvals/{_quote(approval_id)}/deny")
        return Approval(**response.json())

    async def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Sync records with the backends and reap orphans (admin keys only)."""
        response = await self._request(
            "POST", "/v1/reconcile", json={"ids": list(ids) if ids is not None else None}
        )
        body = response.json()
        return ReconcileReport(
            checked=int(body["checked"]),
            updated=dict(body["updated"]),
            reaped=list(body["reaped"]),
            errors=dict(body["errors"]),
            expired=list(body.get("expired", [])),
            discarded=list(body.get("discarded", [])),
        )

    async def stop_expired(self) -> ReconcileReport:
        """Stop sandboxes past their TTL or idle timeout and destroy failed creations kept
        past their time for inspection (admin keys only); what it did and what it could not."""
        response = await self._request("POST", "/v1/stop-expired")
        body = response.json()
        return ReconcileReport(
            checked=int(body.get("checked", 0)),
            expired=[str(i) for i in body["stopped"]],
            discarded=[str(i) for i in body.get("discarded", [])],
            errors=dict(body.get("errors", {})),
        )


@final
class _WebSocketPty:
    """A terminal on the server, over its WebSocket (a :class:`~sandlot.channel.base.PtySession`).

    One task at a time reads the socket (a lock): ``wait`` keeps what it reads past for
    ``read``, so output is never lost whichever is called first.
    """

    def __init__(self, ws: ClientConnection, pty_id: str) -> None:
        self._ws = ws
        self._id = pty_id
        self._lock = anyio.Lock()
        self._pending: collections.deque[bytes] = collections.deque()
        self._exit: int | None = None
        self._error: SandboxError | None = None
        self._ended = False

    @property
    def id(self) -> str:
        return self._id

    async def write(self, data: bytes) -> None:
        try:
            await self._ws.send(bytes(data))
        except ConnectionClosed as e:
            raise self._gone(e) from e

    async def resize(self, rows: int, cols: int) -> None:
        try:
            await self._ws.send(PtyResize(rows=rows, cols=cols).model_dump_json())
        except ConnectionClosed as e:
            raise self._gone(e) from e

    async def read(self) -> bytes:
        async with self._lock:
            while not self._pending:
                if self._ended:
                    self._check_exit()
                    return b""
                await self._receive()
            return self._pending.popleft()

    async def wait(self) -> int:
        async with self._lock:
            while not self._ended:
                await self._receive()
        self._check_exit()
        assert self._exit is not None
        return self._exit

    async def close(self) -> None:
        await self._ws.close()

    async def _receive(self) -> None:
        try:
            message = await self._ws.recv()
        except ConnectionClosed:
            self._ended = True
            return
        if isinstance(message, bytes):
            self._pending.append(message)
            return
        try:
            control = jsonlib.loads(message)
        except ValueError:
            return
        if control.get("type") == "exit":
            self._exit = int(control.get("exit_code", -1))
        elif control.get("type") == "error" and isinstance(control.get("problem"), dict):
            problem = control["problem"]
            details = problem.get("details")
            self._error = _problem_error(
                str(problem.get("code", "")),
                str(problem.get("detail") or problem.get("code")),
                details if isinstance(details, dict) else {},
            )

    def _check_exit(self) -> None:
        if self._exit is None:
            if self._error is not None:
                raise self._error
            msg = f"terminal {self._id}: the connection closed before its program exited"
            raise BackendUnavailable(msg, outcome="unknown")

    def _gone(self, e: ConnectionClosed) -> SandboxError:
        if self._exit is not None:
            return InvalidState(f"terminal {self._id}: its program exited ({self._exit})")
        return self._error or BackendUnavailable(
            f"terminal {self._id}: the connection closed ({e})"
        )


class _Unreachable(BackendUnavailable):
    """The server could not be connected to: the request was never sent."""


class _StreamEnded(Exception):
    """A job's event stream closed without a result or an error (the server went away)."""


class _JobState:
    """Where a streamed job stands, kept across reconnects."""

    def __init__(self) -> None:
        self.exec_id: str | None = None
        self.after = -1


class _Stream:
    """``async with`` a streamed response; failed statuses raise the sandlot error."""

    def __init__(self, client: AsyncClient, request: httpx.Request) -> None:
        self._client = client
        self._request = request
        self._response: httpx.Response | None = None

    async def __aenter__(self) -> httpx.Response:
        try:
            response = await self._client._http.send(self._request, stream=True)
        except httpx.ConnectError as e:
            msg = f"cannot reach the sandlot server at {self._client.url}: {e}"
            raise _Unreachable(msg) from e
        if response.status_code >= 400:
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise _error(response)
        self._response = response
        return response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._response is not None:
            await self._response.aclose()


async def _bytes_only(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        if chunk:
            yield bytes(chunk)
