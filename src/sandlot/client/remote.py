"""The async HTTP client: :class:`AsyncClient`, whose sandboxes are the SDK's own handle class.

    async with AsyncClient("http://127.0.0.1:8470", api_key) as client:
        async with await client.create(setup="pip install requests") as sb:
            result = await sb.exec(["python3", "-c", "print(1)"])

The surface is :class:`sandlot.api.SandlotAPI`, the in-process SDK's (a test checks name for
name and signature for signature), and its sandboxes are :class:`sandlot.handle.AsyncSandbox`,
the one handle class, over an :class:`~sandlot.client.plane.HttpPlane`
(:data:`AsyncRemoteSandbox` is another name for it). Errors come back as the same classes: the
server sends each error's stable ``code`` and :mod:`sandlot.client.problems` raises the class
it names.

Terminals (``open_pty``) are a WebSocket (the ``websockets`` package), with the protocol in
:mod:`sandlot.server.wire`; a background process's output is an event stream that resumes
after its last chunk like a command's.

Commands stream their output as server-sent events. When the connection breaks mid-command,
the client reconnects and asks for the output after the last chunk it has (``Last-Event-ID``),
so nothing is lost or repeated; when the server no longer knows the command (it restarted),
the client raises ``BackendUnavailable`` saying the outcome is unknown. It never sends a
command twice. Files travel with a SHA-256 ``Content-Digest`` that the receiving side checks.

This module speaks HTTP only: it must not import the Manager, the store, backends, the policy
engines, the gate or the server package (``tests/unit/test_thin_client.py`` checks what
``import sandlot.client`` loads, and an import-linter contract states it).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import inspect
import json as jsonlib
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self, final

import anyio
import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from sandlot.client.plane import HttpPlane
from sandlot.client.problems import (
    StreamEnded,
    Unreachable,
    event_error,
    key_header,
    problem_error,
    quote_segment,
    response_error,
)
from sandlot.client.sse import events
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    InvalidState,
    NotFound,
    SandboxError,
    SandboxTimeout,
)
from sandlot.handle import AsyncSandbox
from sandlot.models import (
    Approval,
    JsonValue,
    OutputChunk,
    ReconcileReport,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
)
from sandlot.shared import Creating, build_spec
from sandlot.wire import LAST_EVENT_ID, PtyResize, b64decode

if TYPE_CHECKING:
    from sandlot.channel.base import OutputCallback

__all__ = ["AsyncClient", "AsyncRemoteSandbox"]

AsyncRemoteSandbox = AsyncSandbox
"""The HTTP client's sandbox handle: the in-process SDK's class (kept as a name for callers
that import it)."""

_log = logging.getLogger("sandlot.client")


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
        self._plane = HttpPlane(self)

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
            raise response_error(response)
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
            raise response_error(
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
                    headers={"Accept": "text/event-stream", **key_header(key)},
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
                        await self._request(
                            "POST", f"/v1/execs/{quote_segment(state.exec_id)}/cancel"
                        )
                raise
        except httpx.TransportError as e:
            if state.exec_id is None:
                raise _unknown_outcome(
                    what, None, f"the connection broke before the server confirmed it ({e})"
                ) from e
            broken: Exception = e
        except StreamEnded as e:
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
                    f"/v1/execs/{quote_segment(exec_id)}/events",
                    headers={"Accept": "text/event-stream", LAST_EVENT_ID: str(state.after)},
                    read_timeout=self.timeout * 4,
                ) as response:
                    return await self._follow(response, state, callback, None)
            except NotFound as e:
                raise _unknown_outcome(
                    what, exec_id, "the server no longer knows it (did it restart?)"
                ) from e
            except (httpx.TransportError, StreamEnded, Unreachable) as e:
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
                        failure = event_error(ev)
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
            raise StreamEnded(msg)
        return outcome

    async def _send_stdin(self, exec_id: str, chunks: AsyncIterable[bytes]) -> None:
        # Failures here are not the command's: a command that exits early stops reading its
        # input, and the outcome stream says how it ended.
        try:
            await self._http.put(
                f"/v1/execs/{quote_segment(exec_id)}/stdin",
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
    ) -> Creating[AsyncSandbox]:
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
    ) -> AsyncSandbox:
        if on_setup_output is None:
            # Interrupted, this request leaves nothing: a server whose client went away with
            # no key to replay by destroys what it made.
            response = await self._request(
                "POST", "/v1/sandboxes", json=body, headers=key_header(idempotency_key)
            )
            return AsyncSandbox(self._plane, SandboxInfo.model_validate(response.json()))
        # Interrupted, a streamed creation is cancelled on the server (see _job), which then
        # destroys what it had made.
        data = await self._job("/v1/sandboxes", body, on_setup_output, key=idempotency_key)
        return AsyncSandbox(self._plane, SandboxInfo.model_validate(data))

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox (``NotFound`` names the id)."""
        return AsyncSandbox(self._plane, await self._plane.get(sandbox_id))

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

    async def fork(self, source: str, count: int = 1) -> builtins.list[AsyncSandbox]:
        """New sandboxes from a snapshot id or a sandbox id."""
        return [AsyncSandbox(self._plane, i) for i in await self._plane.fork(source, count)]

    async def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first."""
        params = {"sandbox_id": sandbox_id} if sandbox_id is not None else None
        response = await self._request("GET", "/v1/snapshots", params=params)
        return [SnapshotInfo.model_validate(s) for s in response.json()]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        await self._request("DELETE", f"/v1/snapshots/{quote_segment(snapshot_id)}")

    async def list_approvals(self, status: str | None = "pending") -> builtins.list[Approval]:
        """Operations held for approval (``status=None`` for all), newest first."""
        response = await self._request("GET", "/v1/approvals", params={"status": status or "all"})
        return [Approval(**a) for a in response.json()]

    async def approve(self, approval_id: str) -> Approval:
        """Let a held operation run."""
        response = await self._request(
            "POST", f"/v1/approvals/{quote_segment(approval_id)}/approve"
        )
        return Approval(**response.json())

    async def deny(self, approval_id: str) -> Approval:
        """Refuse a held operation."""
        response = await self._request("POST", f"/v1/approvals/{quote_segment(approval_id)}/deny")
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
            self._error = problem_error(
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
            raise Unreachable(msg) from e
        if response.status_code >= 400:
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise response_error(response)
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


if TYPE_CHECKING:
    from sandlot.api import SandlotAPI
    from sandlot.handle import ControlPlane

    # mypy checks these against their protocols here, member by member.
    _IMPLEMENTS: type[SandlotAPI] = AsyncClient
    _PLANE: type[ControlPlane] = HttpPlane
