"""The HTTP :class:`~sandlot.handle.ControlPlane`: :class:`HttpPlane` carries each operation of
a sandbox handle to a sandlot server through its :class:`~sandlot.client.remote.AsyncClient`.

Requests are the HTTP API's routes (``/v1/sandboxes/{id}/…``), their bodies the models of
:mod:`sandlot.wire`. Files travel with a SHA-256 ``Content-Digest`` that the receiving side
checks; a log or a process's output is an event stream that, broken, reconnects and resumes
after its last chunk; a command's stream is the client's (:meth:`AsyncClient._job`), which
never sends a command twice. This module speaks HTTP only: it must not import the Manager,
the store, backends or the server package.
"""

from __future__ import annotations

import builtins
import hashlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, final
from urllib.parse import urlencode

import anyio
import httpx

from sandlot.client.problems import (
    StreamEnded,
    Unreachable,
    event_error,
    key_header,
    quote_segment,
)
from sandlot.client.sse import events
from sandlot.errors import BackendError, BackendUnavailable, InvalidRequest
from sandlot.models import (
    Command,
    CommandSpec,
    Decision,
    ExecResult,
    Explanation,
    FileInfo,
    JsonValue,
    NetworkAllowlist,
    NetworkPolicy,
    Outcome,
    OutputChunk,
    PolicyTrace,
    PortMapping,
    ProcessInfo,
    ReasonCode,
    SandboxInfo,
    SnapshotInfo,
    UnitTrace,
)
from sandlot.wire import (
    DIGEST_HEADER,
    LAST_EVENT_ID,
    ExecRequest,
    StartProcessRequest,
    b64decode,
    b64encode,
    content_digest,
    parse_digest,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterable

    from sandlot.channel.base import OutputCallback, PtySession, Stdin
    from sandlot.client.remote import AsyncClient

__all__ = ["HttpPlane"]


def _path(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{quote_segment(sandbox_id)}"


def _process_path(sandbox_id: str, process_id: str) -> str:
    return f"{_path(sandbox_id)}/processes/{quote_segment(process_id)}"


@final
class HttpPlane:
    """Sandbox operations as requests to a server, through ``client``'s connection pool."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._client._info("GET", _path(sandbox_id))

    async def exec(
        self,
        sandbox_id: str,
        request: ExecRequest,
        *,
        stdin: Stdin,
        on_output: OutputCallback | None,
        idempotency_key: str | None,
    ) -> ExecResult:
        body: dict[str, object] = {
            "command": _command_json(request.command),
            "cwd": request.cwd,
            "env": dict(request.env),
            "timeout": request.timeout,
            "check": request.check,
            "auto_resume": request.auto_resume,
            "collect_output": request.collect_output,
        }
        stream: AsyncIterable[bytes] | None = None
        if isinstance(stdin, bytes | bytearray | memoryview):
            body["stdin"] = b64encode(bytes(stdin))
        elif stdin is not None:
            body["stdin_stream"] = True
            stream = stdin
        data = await self._client._job(
            f"{_path(sandbox_id)}/execs", body, on_output, stream, key=idempotency_key
        )
        return ExecResult.model_validate(data)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.stream_file(sandbox_id, path)])

    async def stream_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async with self._client._stream(
            "GET", f"{_path(sandbox_id)}/files/content", params={"path": path}
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
        sandbox_id: str,
        path: str,
        body: bytes | AsyncIterator[bytes],
        *,
        mode: int | None,
        idempotency_key: str | None,
    ) -> FileInfo:
        params: dict[str, str | int] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        headers = {"Content-Type": "application/octet-stream", **key_header(idempotency_key)}
        digest = hashlib.sha256()
        if isinstance(body, bytes):
            digest.update(body)
            # Known before sending: the server checks it and writes nothing on a mismatch.
            headers[DIGEST_HEADER] = content_digest(digest.digest())
            content: bytes | AsyncIterator[bytes] = body
        else:
            content = _hashing(body, digest)
        response = await self._client._request(
            "PUT",
            f"{_path(sandbox_id)}/files/content",
            params=params,
            content=content,
            headers=headers,
        )
        sent = digest.digest()
        if parse_digest(response.headers.get(DIGEST_HEADER)) != sent:
            msg = f"the server stored {path} with a different SHA-256 than was sent"
            raise BackendError(msg)
        return FileInfo.model_validate(response.json())

    async def write_files(
        self,
        sandbox_id: str,
        files: Mapping[str, bytes | str],
        *,
        idempotency_key: str | None,
    ) -> builtins.list[FileInfo]:
        payload = [
            {"path": p, "content": b64encode(d.encode() if isinstance(d, str) else bytes(d))}
            for p, d in files.items()
        ]
        response = await self._client._request(
            "POST",
            f"{_path(sandbox_id)}/files",
            json={"files": payload},
            headers=key_header(idempotency_key),
        )
        return [FileInfo.model_validate(f) for f in response.json()]

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        response = await self._client._request(
            "GET", f"{_path(sandbox_id)}/files", params={"path": path}
        )
        return [FileInfo.model_validate(f) for f in response.json()]

    async def remove_file(self, sandbox_id: str, path: str, *, recursive: bool) -> None:
        await self._client._request(
            "DELETE",
            f"{_path(sandbox_id)}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    async def logs(self, sandbox_id: str, *, follow: bool, offset: int) -> AsyncIterator[bytes]:
        deadline: float | None = None
        while True:
            try:
                async with self._client._stream(
                    "GET",
                    f"{_path(sandbox_id)}/logs",
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
                            raise event_error(ev)
                        elif ev.event == "end":
                            return
            except (httpx.TransportError, Unreachable) as e:
                now = time.monotonic()
                deadline = deadline or now + self._client.reconnect_timeout
                if now > deadline:
                    msg = f"lost the log stream of {sandbox_id} and could not reconnect: {e}"
                    raise BackendUnavailable(msg) from e
                await anyio.sleep(0.2)

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        response = await self._client._request(
            "POST",
            f"{_path(sandbox_id)}/processes",
            json={
                "command": _command_json(request.command),
                "cwd": request.cwd,
                "env": dict(request.env),
                "name": request.name,
            },
        )
        return ProcessInfo.model_validate(response.json())

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        response = await self._client._request("GET", f"{_path(sandbox_id)}/processes")
        return [ProcessInfo.model_validate(p) for p in response.json()]

    async def signal_process(self, sandbox_id: str, process_id: str, signum: int) -> None:
        await self._client._request(
            "POST", f"{_process_path(sandbox_id, process_id)}/signal", json={"signal": signum}
        )

    async def wait_process(
        self, sandbox_id: str, process_id: str, *, timeout: float | None
    ) -> ProcessInfo:
        response = await self._client._request(
            "POST",
            f"{_process_path(sandbox_id, process_id)}/wait",
            json={"timeout": timeout},
            # The server answers when the process exits: give it the wait, plus the usual.
            read_timeout=None if timeout is None else timeout + self._client.timeout,
        )
        return ProcessInfo.model_validate(response.json())

    async def process_output(
        self, sandbox_id: str, process_id: str, *, offset: int, follow: bool
    ) -> AsyncIterator[OutputChunk]:
        deadline: float | None = None
        received = False
        while True:
            headers = {"Accept": "text/event-stream"}
            if received:
                headers[LAST_EVENT_ID] = str(offset - 1)
            try:
                async with self._client._stream(
                    "GET",
                    f"{_process_path(sandbox_id, process_id)}/output",
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
                            raise event_error(ev)
                        elif ev.event == "end":
                            return
                    msg = "the output stream ended without its end event"
                    raise StreamEnded(msg)
            except (httpx.TransportError, Unreachable, StreamEnded) as e:
                now = time.monotonic()
                deadline = deadline or now + self._client.reconnect_timeout
                if now > deadline:
                    msg = f"lost the output stream of process {process_id} in {sandbox_id} and could not reconnect: {e}"
                    raise BackendUnavailable(msg) from e
                await anyio.sleep(0.2)

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, close: bool
    ) -> None:
        await self._client._request(
            "PUT",
            f"{_process_path(sandbox_id, process_id)}/stdin",
            params={"close": "true" if close else "false"},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    async def open_pty(
        self,
        sandbox_id: str,
        command: Command | Sequence[str] | None,
        *,
        rows: int,
        cols: int,
        cwd: str | None,
        env: Mapping[str, str] | None,
    ) -> PtySession:
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
        return await self._client._pty(f"{_path(sandbox_id)}/pty?{urlencode(query)}")

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return await self._client._info("POST", f"{_path(sandbox_id)}/stop")

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._client._info("POST", f"{_path(sandbox_id)}/resume")

    async def destroy(
        self, sandbox_id: str, *, idempotency_key: str | None, forget_host: bool
    ) -> SandboxInfo:
        return await self._client._info(
            "POST",
            f"{_path(sandbox_id)}/destroy",
            params={"forget_host": "true"} if forget_host else None,
            headers=key_header(idempotency_key),
        )

    async def keep_alive(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        return await self._client._info(
            "POST", f"{_path(sandbox_id)}/keep-alive", json={"seconds": seconds}
        )

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        response = await self._client._request("POST", f"{_path(sandbox_id)}/snapshots")
        return SnapshotInfo.model_validate(response.json())

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        return await self._client._info(
            "POST", f"{_path(sandbox_id)}/restore", json={"snapshot_id": snapshot_id}
        )

    async def fork(self, source: str, count: int) -> builtins.list[SandboxInfo]:
        kind = "snapshots" if source.startswith("snap-") else "sandboxes"
        response = await self._client._request(
            "POST", f"/v1/{kind}/{quote_segment(source)}/fork", json={"count": count}
        )
        return [SandboxInfo.model_validate(s) for s in response.json()]

    async def expose_port(self, sandbox_id: str, port: int) -> PortMapping:
        response = await self._client._request(
            "POST", f"{_path(sandbox_id)}/ports", json={"port": port}
        )
        return PortMapping.model_validate(response.json())

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortMapping]:
        response = await self._client._request("GET", f"{_path(sandbox_id)}/ports")
        return [PortMapping.model_validate(p) for p in response.json()]

    async def reset(self, sandbox_id: str, snapshot_id: str | None) -> SandboxInfo:
        return await self._client._info(
            "POST", f"{_path(sandbox_id)}/reset", json={"snapshot_id": snapshot_id}
        )

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy | str) -> SandboxInfo:
        body = policy if isinstance(policy, str) else policy.model_dump(mode="json")
        return await self._client._info(
            "PUT", f"{_path(sandbox_id)}/network", json={"network": body}
        )

    async def network_log(self, sandbox_id: str) -> builtins.list[dict[str, JsonValue]]:
        response = await self._client._request("GET", f"{_path(sandbox_id)}/network/log")
        logged: list[dict[str, JsonValue]] = response.json()
        return logged

    async def suggest_network(self, sandbox_id: str) -> NetworkAllowlist:
        response = await self._client._request("GET", f"{_path(sandbox_id)}/network/suggest")
        return NetworkAllowlist.model_validate(response.json())

    async def explain(self, sandbox_id: str, action: str, args: dict[str, object]) -> Explanation:
        response = await self._client._request(
            "POST", f"{_path(sandbox_id)}/explain", json={"action": action, "args": args}
        )
        return _explanation(response.json())


async def _hashing(chunks: AsyncIterator[bytes], digest: hashlib._Hash) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        digest.update(chunk)
        yield chunk


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
