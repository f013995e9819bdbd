"""The HTTP API: a FastAPI app in which each route is one Manager call.

    app = create_app(manager, ApiKeyStore(url), ServerConfig())
    uvicorn.run(app, host="127.0.0.1", port=8470)

Every request (except ``/healthz``, ``/version`` and, when public, ``/metrics`` and the API's
description, ``/openapi.json`` and ``/docs``) carries
``Authorization: Bearer <api key>``; the key names the tenant and principal the Manager call
acts as, so a tenant never sees, touches, or learns of another tenant's records (they are
``404``, exactly like ids that do not exist). Errors are ``application/problem+json`` with
sandlot's stable ``code`` (:mod:`sandlot.server.problems`).

Commands run as server-side jobs: their output goes to an :class:`ExecOutputLog` and is
streamed to the client as server-sent events numbered by chunk, so a client that loses the
connection resumes with ``Last-Event-ID`` and misses nothing; a command whose stream was lost
is never run twice. Create with ``Accept: text/event-stream`` streams its setup output the
same way. Background processes keep their output in the sandbox, so their event stream is
numbered by the process's own chunks and resumes the same way. Terminals are WebSockets
(``/v1/sandboxes/{id}/pty``, protocol in :mod:`sandlot.server.wire`).

This module composes the Manager, the key store, quotas, metrics and the MCP endpoint; it must
not import concrete backends or the store below the Manager.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import IO, Annotated, TypeVar, final

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi import Depends, FastAPI, Header, Path, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect

from sandlot._version import __version__
from sandlot.channel.base import PtySession
from sandlot.errors import (
    BackendUnavailable,
    InvalidRequest,
    InvalidState,
    NotFound,
    PolicyDenied,
    SandboxError,
)
from sandlot.gate.gate import Approval, hold_listener
from sandlot.manager import Manager
from sandlot.models import (
    Actor,
    Command,
    ExecResult,
    FileInfo,
    NetworkAllowlist,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    SandboxInfo,
    SandboxStatus,
    SnapshotInfo,
    new_id,
)
from sandlot.server.docs_gate import DocsGate
from sandlot.server.follow import ProcessFollowers
from sandlot.server.keys import ApiKeyStore
from sandlot.server.metrics import CONTENT_TYPE, ServerMetrics
from sandlot.server.offer import check_offered, offered
from sandlot.server.outputlog import ExecOutcome, ExecOutputLog, MemoryExecOutputLog
from sandlot.server.problems import PayloadTooLarge, Unauthenticated, problem_body
from sandlot.server.quotas import Admission, Quota, hold_until_exit
from sandlot.server.redact import install as redact_logs
from sandlot.server.replays import admit
from sandlot.server.sessions import KeySessionGuard, KeySessions, note_key
from sandlot.server.wire import (
    DIGEST_HEADER,
    IDEMPOTENCY_HEADER,
    LAST_EVENT_ID,
    PROBLEM_TYPE,
    PTY_CLOSE_ERROR,
    CreateRequest,
    ExecRequest,
    ExecStarted,
    ExplainRequest,
    ExposePortRequest,
    ForkRequest,
    KeepAliveRequest,
    NetworkRequest,
    OutputEnd,
    PtyError,
    PtyExit,
    PtyOpened,
    PtyResize,
    ReconcileRequest,
    ReconcileResponse,
    ResetRequest,
    RestoreRequest,
    SignalRequest,
    StartProcessRequest,
    StopExpiredResponse,
    VersionInfo,
    WaitRequest,
    WriteFilesRequest,
    b64decode,
    b64encode,
    content_digest,
    parse_digest,
    refuse_digest_trailer,
)

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("sandlot.server")
T = TypeVar("T")

_KEEPALIVE = 15.0
"""Seconds between SSE comments on a silent stream, so proxies keep the connection."""
_CHUNK = 1 << 16
_ADMIN = Actor(tenant="*", principal="sandlot-server", admin=True)


@dataclass
class ServerConfig:
    """What a server allows and keeps; every limit here is a plain number to configure.

    Attributes:
        max_upload_bytes: Largest request body (a file upload, a batch of files); more is 413.
        max_download_bytes: Largest file a download serves; more is 413 (never truncated).
        output_retention: Seconds a finished command's output stays for reconnecting clients.
        output_max_bytes: Output kept per command for reconnecting clients (the newest bytes;
            a result whose collected output is bigger is kept without it). Clients streaming
            live get all of it.
        follow_buffer_bytes: Output (as sent) a process's follower may have waiting; a
            follower further behind is dropped with a ``dropped`` event and resumes from there.
        follow_rate_bytes: Bytes per second of events sent to one tenant's followers of
            process output, all of them together (None: no limit).
        quota: Every tenant's quota unless ``tenant_quotas`` names it.
        tenant_quotas: Per-tenant quotas.
        admission_timeout: Seconds a request over quota waits for a slot before 429.
        max_concurrent_uploads: Raw uploads in flight on the whole server (each tenant also
            has its own ``Quota.max_concurrent_uploads``); None: unlimited.
        admission_queue: Requests that may wait per tenant and kind; more get 429 at once.
        metrics_public: Serve ``/metrics`` without a key (default: admin keys only).
        docs_public: Serve ``/openapi.json`` and ``/docs`` without a key (default: any valid
            key).
        stdin_attach_timeout: Seconds a streamed-stdin exec waits for its input to attach.
        sweep_interval: Seconds between sweeps that stop sandboxes past their TTL or idle
            timeout (None: no sweeping; ``reconcile`` still does it).
        mcp: Mount the MCP endpoint at ``/mcp``.
        self_url: This server's own base URL, through which MCP tools call the API with the
            caller's key (default: derived from the first request's server address).
        enable_backends: Development backends (``fake``) tenants may pick; every other backend
            the Manager has is always offered (see :mod:`sandlot.server.offer`).
    """

    max_upload_bytes: int = 256 << 20
    max_download_bytes: int = 1 << 30
    output_retention: float = 300.0
    output_max_bytes: int = 4 << 20
    follow_buffer_bytes: int = 1 << 20
    follow_rate_bytes: int | None = 8 << 20
    quota: Quota = field(default_factory=Quota)
    tenant_quotas: dict[str, Quota] = field(default_factory=dict)
    admission_timeout: float = 30.0
    max_concurrent_uploads: int | None = 16
    admission_queue: int = 64
    metrics_public: bool = False
    docs_public: bool = False
    stdin_attach_timeout: float = 30.0
    sweep_interval: float | None = 30.0
    mcp: bool = True
    self_url: str | None = None
    enable_backends: frozenset[str] = frozenset()

    def quota_for(self, tenant: str) -> Quota:
        """The quota that applies to ``tenant``."""
        return self.tenant_quotas.get(tenant, self.quota)


@dataclass
class _StdinPipe:
    """The input of a streamed-stdin exec, between its PUT request and the command."""

    tenant: str
    send: MemoryObjectSendStream[bytes]
    receive: MemoryObjectReceiveStream[bytes]
    attached: anyio.Event = field(default_factory=anyio.Event)


@final
class _Plane:
    """Everything the routes share (one per app)."""

    def __init__(
        self,
        manager: Manager,
        keys: ApiKeyStore,
        config: ServerConfig,
        output: ExecOutputLog,
    ) -> None:
        self.manager = manager
        self.keys = keys
        self.config = config
        self.output = output
        self.metrics = ServerMetrics()
        self.sessions = KeySessions(keys)
        self.sandboxes = Admission(
            "live sandboxes",
            lambda t: config.quota_for(t).max_live_sandboxes,
            in_use=self._live,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.execs = Admission(
            "concurrent execs",
            lambda t: config.quota_for(t).max_concurrent_execs,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.uploads = Admission(
            "concurrent uploads",
            lambda t: config.quota_for(t).max_concurrent_uploads,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
        )
        self.all_uploads = Admission(
            "concurrent uploads",
            lambda _: config.max_concurrent_uploads,
            timeout=config.admission_timeout,
            max_waiters=config.admission_queue,
            owner="this server",
        )
        self.stdin: dict[str, _StdinPipe] = {}
        self.jobs: dict[str, _Job] = {}
        """Streamed jobs running in this process, by exec id."""
        self.tasks: anyio.abc.TaskGroup | None = None
        self.followers = ProcessFollowers(
            manager,
            self.spawn,
            buffer_bytes=config.follow_buffer_bytes,
            rate=config.follow_rate_bytes,
            keepalive=_KEEPALIVE,
        )

    async def _live(self, tenant: str) -> int:
        limit = self.config.quota_for(tenant).max_live_sandboxes
        records = await self.manager.list(
            actor=Actor(tenant=tenant), limit=None if limit is None else limit + 1
        )
        return len(records)

    async def upload_slot(self, tenant: str) -> Callable[[], None]:
        """One of ``tenant``'s upload slots and one of the server's (the tenant's first, so
        a tenant over its own limit never waits in the server's line)."""
        release = await self.uploads.acquire(tenant)
        try:
            release_all = await self.all_uploads.acquire("*")
        except BaseException:
            release()
            raise

        def both() -> None:
            release_all()
            release()

        return both

    def spawn(self, fn: Callable[[], Coroutine[object, object, None]]) -> None:
        if self.tasks is None:
            msg = "the server is not running (its lifespan has not started)"
            raise SandboxError(msg)
        self.tasks.start_soon(fn)


# -- plumbing: auth, errors, streaming ---------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="An API key from `sandlot api-keys create`.")


def _plane(request: Request) -> _Plane:
    plane: _Plane = request.app.state.plane
    return plane


async def _actor(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Actor:
    if credentials is None or not credentials.credentials:
        msg = "this request needs an API key: send `Authorization: Bearer <key>`"
        raise Unauthenticated(msg)
    info = await _plane(request).keys.identify(credentials.credentials)
    if info is None:
        msg = "the API key is unknown or revoked"
        raise Unauthenticated(msg)
    note_key(request.scope, info.id)
    return info.actor


_IDEMPOTENCY = re.compile(r"^[\x21-\x7e]{1,255}$")


async def _idempotency_key(
    key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_HEADER,
            description="Retry-safe key: a repeat with the same request returns the first outcome (create, exec, file writes, destroy); the same key with another request is a 409.",
        ),
    ] = None,
) -> str | None:
    # The Manager maps this onto the journal's intents (create, exec, write_files, destroy).
    if key is not None and not _IDEMPOTENCY.match(key):
        msg = f"{IDEMPOTENCY_HEADER} must be 1-255 visible ASCII characters"
        raise InvalidRequest(msg)
    return key


ActorDep = Annotated[Actor, Depends(_actor)]
PlaneDep = Annotated[_Plane, Depends(_plane)]
IdemDep = Annotated[str | None, Depends(_idempotency_key)]
SandboxId = Annotated[str, Path(description="Sandbox id.")]
SnapshotId = Annotated[str, Path(description="Snapshot id.")]
ProcessId = Annotated[str, Path(description="Process id (or the name it was started with).")]
FilePath = Annotated[str, Query(description="Absolute path inside the sandbox.")]
ForgetHost = Annotated[
    bool,
    Query(description="Close the record of a sandbox whose host is gone for good (host_lost)."),
]


def _require_admin(actor: Actor) -> None:
    if not actor.admin:
        msg = "this operation needs an admin API key"
        raise PolicyDenied(msg, reason_code="ADMIN_REQUIRED")


def _problem(error: SandboxError) -> JSONResponse:
    return JSONResponse(problem_body(error), status_code=error.status, media_type=PROBLEM_TYPE)


def _json(value: object, status: int = 200) -> Response:
    return Response(_dumps(value), status_code=status, media_type="application/json")


def _dumps(value: object) -> bytes:
    if hasattr(value, "model_dump_json"):
        return str(value.model_dump_json()).encode()
    if isinstance(value, list):
        return b"[" + b",".join(_dumps(v) for v in value) + b"]"
    return json.dumps(value).encode()


def _sse(event: str, data: object, *, id: str | None = None) -> bytes:
    payload = data.model_dump_json() if hasattr(data, "model_dump_json") else json.dumps(data)
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {payload}\n\n".encode()


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SSE_DOC: dict[int | str, dict[str, object]] = {
    200: {
        "description": "Server-sent events (see sandlot.server.wire).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def _last_event_id(value: str | None, default: int = -1) -> int:
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        msg = f"{LAST_EVENT_ID} must be an integer, got {value!r}"
        raise InvalidRequest(msg) from None
    if n < -1:
        msg = f"{LAST_EVENT_ID} must be >= -1, got {n}"
        raise InvalidRequest(msg)
    return n


async def _job_events(
    plane: _Plane, job_id: str, tenant: str, after: int, first: bytes | None
) -> AsyncIterator[bytes]:
    """A job's events from chunk ``after + 1`` on, until its outcome."""
    if first is not None:
        yield first
    while True:
        try:
            page = await plane.output.read(job_id, tenant=tenant, after=after, wait=_KEEPALIVE)
        except SandboxError as e:
            yield _sse("error", problem_body(e))
            return
        for c in page.chunks:
            if c.stream == "notice":
                yield _sse("notice", json.loads(c.data), id=str(c.seq))
            else:
                yield _sse("output", {"stream": c.stream, "data": b64encode(c.data)}, id=str(c.seq))
            after = c.seq
        if page.outcome is not None:
            if page.outcome.error is not None:
                yield _sse("error", page.outcome.error)
            else:
                yield _sse("result", page.outcome.result)
            return
        if not page.chunks:
            yield b": keep-alive\n\n"


@dataclass
class _Job:
    """A streamed job running on the server: whose it is, and how its client cancels it."""

    tenant: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


async def _run_job(
    plane: _Plane,
    job_id: str,
    tenant: str,
    body: Callable[[Callable[[OutputChunk], Awaitable[None]]], Awaitable[dict[str, object]]],
    release: Callable[[], None],
    on_done: Callable[[str], None] | None = None,
) -> None:
    """Run ``body`` detached from any request, writing its output and outcome to the log."""

    async def on_output(chunk: OutputChunk) -> None:
        await plane.output.append(job_id, chunk.stream, chunk.data)

    async def on_hold(approval: Approval) -> None:
        # The client waiting on this job learns at once how to get it approved.
        notice = {"kind": "held", "approval": approval.to_dict()}
        await plane.output.append(job_id, "notice", json.dumps(notice).encode())

    hold_listener.set(on_hold)  # this task's context: only this job's holds
    outcome = "error"
    job = _Job(tenant)
    plane.jobs[job_id] = job
    try:
        try:
            with job.scope:
                result = await body(on_output)
            if job.scope.cancelled_caught:
                # Cancelled by its client (``POST /v1/execs/{id}/cancel``): the command's tree
                # was killed, a creation's half-made sandbox destroyed.
                msg = "cancelled by its client"
                raise InvalidState(msg, exec_id=job_id, cancelled=True)
            outcome = "ok"
            done = ExecOutcome(result=result)
        except SandboxError as e:
            if isinstance(e, PolicyDenied):
                plane.metrics.policy_decisions.labels(outcome="deny").inc()
            done = ExecOutcome(error=problem_body(e))
        except Exception as e:  # a bug below us must still end the stream, with its cause
            log.exception("job %s failed", job_id)
            err = SandboxError(f"internal error: {type(e).__name__}: {e}")
            done = ExecOutcome(error=problem_body(err))
        except BaseException:
            # Cancelled (the server is shutting down): readers learn the outcome is unknown.
            err = BackendUnavailable(
                "the server stopped while the command ran; its outcome is unknown",
                outcome="unknown",
                exec_id=job_id,
            )
            with anyio.CancelScope(shield=True):
                await plane.output.finish(job_id, ExecOutcome(error=problem_body(err)))
            raise
        await plane.output.finish(job_id, done)
    finally:
        plane.jobs.pop(job_id, None)
        release()
        pipe = plane.stdin.pop(job_id, None)
        if pipe is not None:
            # Unblocks a PUT still feeding input the command will never read.
            pipe.receive.close()
        if on_done is not None:
            on_done(outcome)


class _BodyLimit:
    """Refuse request bodies over the limit with 413, before reading them when possible.

    The limit is on file content: a raw upload's body is the content, while a JSON body carries
    it in base64 (4/3 as long, plus the rest of the request), so each is allowed what that same
    content takes, and both refusals name the one configured limit.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        content_limit = self.limit()
        raw = str(scope.get("path", "")).endswith("/files/content")
        limit = content_limit if raw else content_limit * 4 // 3 + 65536
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                msg = _too_large(content_limit, int(value), raw=raw)
                await _problem(PayloadTooLarge(msg, limit=content_limit))(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    msg = _too_large(content_limit, None, raw=raw)
                    raise PayloadTooLarge(msg, limit=content_limit)
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int, size: int | None, *, raw: bool) -> str:
    """One wording for every upload refusal, naming the configured limit."""
    what = "the upload" if raw else "the files in this request (as base64 JSON)"
    how_big = f" ({size} bytes)" if size is not None and raw else ""
    return f"{what}{how_big} is over this server's upload limit of {limit} bytes"


class _Metrics:
    """Count requests and time them to the first response byte, by route template."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ServerMetrics]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")
                m = self.metrics()
                m.requests.labels(
                    method=scope["method"], route=route, status=str(message["status"])
                ).inc()
                m.request_seconds.labels(route=route).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, counted)


# -- the app ------------------------------------------------------------------------------------


def create_app(
    manager: Manager,
    keys: ApiKeyStore,
    config: ServerConfig | None = None,
    *,
    output_log: ExecOutputLog | None = None,
    close_on_shutdown: bool = False,
) -> FastAPI:
    """The HTTP API over ``manager``.

    Args:
        manager: The Manager every route calls (tests hand in one on a ``FakeBackend``).
        keys: Where API keys are checked.
        config: Limits, quotas and options (defaults: :class:`ServerConfig`).
        output_log: Where exec output waits for readers (default: in memory).
        close_on_shutdown: Close ``manager`` and ``keys`` when the app shuts down.
    """
    cfg = config or ServerConfig()
    output = output_log or MemoryExecOutputLog(
        retention=cfg.output_retention, max_bytes=cfg.output_max_bytes
    )
    # A key sent where it does not belong (a query string) must not reach the access log.
    redact_logs()
    # The server sweeps on its own schedule (``sweep_interval``), never inline in a request.
    manager.sweep_every = None
    plane = _Plane(manager, keys, cfg, output)
    mcp_endpoint = None
    if cfg.mcp:
        from sandlot.server.mcp_http import McpEndpoint

        mcp_endpoint = McpEndpoint(keys, cfg.self_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if mcp_endpoint is not None:
                await stack.enter_async_context(mcp_endpoint.running())
            async with anyio.create_task_group() as tg:
                plane.tasks = tg
                tg.start_soon(plane.sessions.watch)
                if cfg.sweep_interval:
                    tg.start_soon(_sweep, manager, cfg.sweep_interval)
                tg.start_soon(output.run_upkeep)
                try:
                    yield
                finally:
                    plane.tasks = None
                    tg.cancel_scope.cancel()
        if close_on_shutdown:
            with anyio.CancelScope(shield=True):
                await keys.aclose()
                await manager.aclose()

    app = FastAPI(
        title="sandlot",
        version=__version__,
        summary="Disposable computers for AI agents: the control-plane API.",
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.plane = plane
    app.add_middleware(_BodyLimit, limit=lambda: cfg.max_upload_bytes)
    app.add_middleware(_Metrics, metrics=lambda: plane.metrics)
    app.add_middleware(KeySessionGuard, sessions=lambda: plane.sessions)
    app.add_middleware(DocsGate, keys=keys, public=cfg.docs_public)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        if isinstance(exc, PolicyDenied) and exc.reason_code != "ADMIN_REQUIRED":
            plane.metrics.policy_decisions.labels(outcome="deny").inc()
        return _problem(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}: {str(err.get('msg', '')).removeprefix('Value error, ')}")
        return _problem(InvalidRequest("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err: SandboxError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path}")
        else:
            err = InvalidRequest(str(exc.detail))
        response = _problem(err)
        response.status_code = exc.status_code
        return response

    @app.exception_handler(OverflowError)
    async def _overflow(request: Request, exc: OverflowError) -> JSONResponse:
        # Dates and durations far beyond any sane value (a TTL of 1e300 seconds).
        return _problem(InvalidRequest(f"a number is out of range: {exc}"))

    _routes(app)
    if mcp_endpoint is not None:
        app.router.routes.append(
            Route("/mcp", mcp_endpoint, methods=["GET", "POST", "DELETE"], include_in_schema=False)
        )
    return app


def _routes(app: FastAPI) -> None:
    # -- service ---------------------------------------------------------------------------

    @app.get("/healthz", tags=["service"], summary="Liveness and database reachability.")
    async def healthz(plane: PlaneDep) -> dict[str, str]:
        await plane.manager.list(actor=_ADMIN, limit=1)
        return {"status": "ok"}

    @app.get("/version", tags=["service"], response_model=VersionInfo)
    async def version(plane: PlaneDep) -> VersionInfo:
        m = plane.manager
        names = offered(m.backends, m.default_backend, plane.config.enable_backends)
        return VersionInfo(version=__version__, backends=names, default_backend=m.default_backend)

    @app.get(
        "/metrics",
        tags=["service"],
        summary="Prometheus metrics (admin keys unless the server made them public).",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(
        request: Request,
        plane: PlaneDep,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Response:
        if not plane.config.metrics_public:
            _require_admin(await _actor(request, credentials))
        records = await plane.manager.list(actor=_ADMIN)
        plane.metrics.set_sandboxes((r.status.value, r.backend) for r in records)
        return Response(plane.metrics.render(), media_type=CONTENT_TYPE)

    # -- sandboxes --------------------------------------------------------------------------

    @app.post(
        "/v1/sandboxes",
        tags=["sandboxes"],
        status_code=201,
        response_model=SandboxInfo,
        responses={
            201: {
                "content": {
                    "application/json": {},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
                "description": "The new sandbox; with `Accept: text/event-stream`, setup output then the sandbox as a `result` event.",
            }
        },
    )
    async def create(
        body: CreateRequest, request: Request, actor: ActorDep, plane: PlaneDep, key: IdemDep
    ) -> Response:
        m = plane.manager
        enabled = plane.config.enable_backends
        check_offered(body.backend or m.default_backend, m.backends, m.default_backend, enabled)
        spec = body.spec
        if body.git_auth is not None:
            if spec.git is None:
                msg = "git_auth was given but the spec has no git source"
                raise InvalidRequest(msg)
            spec = spec.model_copy(
                update={"git": spec.git.model_copy(update={"auth": body.git_auth})}
            )
        release = await admit(plane.sandboxes, plane.manager.journal, actor.tenant, key)
        if "text/event-stream" not in request.headers.get("accept", ""):
            try:
                with anyio.CancelScope(shield=True):
                    info = await plane.manager.create(
                        spec, backend=body.backend, actor=actor, idempotency_key=key
                    )
                    if key is None and await request.is_disconnected():
                        # Its client went away (Ctrl-C) and, with no key, can never learn
                        # the id: nothing of it may be left behind.
                        log.info("creation of %s outlived its client; destroying it", info.id)
                        info = await plane.manager.destroy(info.id, actor=actor)
            finally:
                release()
            return _json(info, 201)
        job_id = new_id("ex")
        await plane.output.open(job_id, tenant=actor.tenant, sandbox_id="")

        async def job(on_output: Callable[[OutputChunk], Awaitable[None]]) -> dict[str, object]:
            info = await plane.manager.create(
                spec,
                backend=body.backend,
                actor=actor,
                on_setup_output=on_output,
                idempotency_key=key,
            )
            return info.model_dump(mode="json")

        plane.spawn(lambda: _run_job(plane, job_id, actor.tenant, job, release))
        first = _sse("started", ExecStarted(exec_id=job_id, sandbox_id=""))
        return StreamingResponse(
            _job_events(plane, job_id, actor.tenant, -1, first),
            status_code=201,
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    @app.get("/v1/sandboxes", tags=["sandboxes"], response_model=list[SandboxInfo])
    async def list_sandboxes(
        actor: ActorDep,
        plane: PlaneDep,
        label: Annotated[
            list[str] | None, Query(description="`key=value`; repeat for several.")
        ] = None,
        status: Annotated[list[SandboxStatus] | None, Query()] = None,
        backend: str | None = None,
        owner: str | None = None,
        include_destroyed: bool = False,
        limit: Annotated[int | None, Query(ge=0, le=100_000)] = None,
        offset: Annotated[int, Query(ge=0, le=1 << 40)] = 0,
    ) -> Response:
        labels = {}
        for pair in label or []:
            k, sep, v = pair.partition("=")
            if not sep or not k:
                msg = f"label must be key=value, got {pair!r}"
                raise InvalidRequest(msg)
            labels[k] = v
        items = await plane.manager.list(
            actor=actor,
            labels=labels,
            status=status or None,
            backend=backend,
            owner=owner,
            include_destroyed=include_destroyed,
            limit=limit,
            offset=offset,
        )
        return _json(items)

    @app.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=SandboxInfo)
    async def get_sandbox(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
        return _json(await plane.manager.get(sandbox_id, actor=actor))

    async def _destroy(
        plane: _Plane, sandbox_id: str, actor: Actor, key: str | None, forget_host: bool
    ) -> Response:
        with anyio.CancelScope(shield=True):
            info = await plane.manager.destroy(
                sandbox_id, actor=actor, idempotency_key=key, forget_host=forget_host
            )
        plane.sandboxes.notify(info.tenant)
        return _json(info)

    @app.delete("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=SandboxInfo)
    async def delete_sandbox(
        sandbox_id: SandboxId,
        actor: ActorDep,
        plane: PlaneDep,
        key: IdemDep,
        forget_host: ForgetHost = False,
    ) -> Response:
        return await _destroy(plane, sandbox_id, actor, key, forget_host)

    @app.post("/v1/sandboxes/{sandbox_id}/destroy", tags=["sandboxes"], response_model=SandboxInfo)
    async def destroy(
        sandbox_id: SandboxId,
        actor: ActorDep,
        plane: PlaneDep,
        key: IdemDep,
        forget_host: ForgetHost = False,
    ) -> Response:
        return await _destroy(plane, sandbox_id, actor, key, forget_host)

    @app.post("/v1/sandboxes/{sandbox_id}/stop", tags=["sandboxes"], response_model=SandboxInfo)
    async def stop(
        sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        return _json(await _shielded(plane.manager.stop(sandbox_id, actor=actor)))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", tags=["sandboxes"], response_model=SandboxInfo)
    async def resume(
        sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        return _json(await _shielded(plane.manager.resume(sandbox_id, actor=actor)))

    @app.post(
        "/v1/sandboxes/{sandbox_id}/keep-alive", tags=["sandboxes"], response_model=SandboxInfo
    )
    async def keep_alive(
        sandbox_id: SandboxId, body: KeepAliveRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json(await plane.manager.keep_alive(sandbox_id, body.seconds, actor=actor))

    @app.post("/v1/sandboxes/{sandbox_id}/reset", tags=["sandboxes"], response_model=SandboxInfo)
    async def reset(
        sandbox_id: SandboxId, body: ResetRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json(
            await _shielded(plane.manager.reset(sandbox_id, body.snapshot_id, actor=actor))
        )

    # -- network -------------------------------------------------------------------------

    @app.put("/v1/sandboxes/{sandbox_id}/network", tags=["network"], response_model=SandboxInfo)
    async def update_network(
        sandbox_id: SandboxId, body: NetworkRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json(await plane.manager.update_network(sandbox_id, body.network, actor=actor))

    @app.get("/v1/sandboxes/{sandbox_id}/network/log", tags=["network"])
    async def network_log(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
        return _json(await plane.manager.network_log(sandbox_id, actor=actor))

    @app.get(
        "/v1/sandboxes/{sandbox_id}/network/suggest",
        tags=["network"],
        response_model=NetworkAllowlist,
    )
    async def suggest_network(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
        return _json(await plane.manager.suggest_network(sandbox_id, actor=actor))

    # -- commands ------------------------------------------------------------------------

    def _exec_call(
        plane: _Plane, sandbox_id: str, body: ExecRequest, actor: Actor, key: str | None
    ) -> Callable[[Callable[[OutputChunk], Awaitable[None]] | None, object], Awaitable[ExecResult]]:
        try:
            stdin_bytes = b64decode(body.stdin) if body.stdin is not None else None
        except ValueError:
            msg = "stdin must be base64"
            raise InvalidRequest(msg) from None

        def call(
            on_output: Callable[[OutputChunk], Awaitable[None]] | None, stdin: object
        ) -> Awaitable[ExecResult]:
            return plane.manager.exec(
                sandbox_id,
                body.command,
                actor=actor,
                cwd=body.cwd,
                env=body.env,
                timeout=body.timeout,
                stdin=stdin if stdin is not None else stdin_bytes,  # type: ignore[arg-type]
                on_output=on_output,
                check=body.check,
                auto_resume=body.auto_resume,
                idempotency_key=key,
                collect_output=body.collect_output,
            )

        return call

    @app.post(
        "/v1/sandboxes/{sandbox_id}/exec",
        tags=["commands"],
        response_model=ExecResult,
        summary="Run a command to completion and return its result (no streaming).",
    )
    async def exec_once(
        sandbox_id: SandboxId, body: ExecRequest, actor: ActorDep, plane: PlaneDep, key: IdemDep
    ) -> Response:
        if body.stdin_stream:
            msg = "stdin_stream needs the streaming endpoint (POST …/execs)"
            raise InvalidRequest(msg)
        call = _exec_call(plane, sandbox_id, body, actor, key)
        started = time.perf_counter()
        outcome = "error"
        try:
            release = await admit(plane.execs, plane.manager.journal, actor.tenant, key)
            try:
                result = await call(None, None)
            finally:
                release()
            outcome = "ok"
        finally:
            plane.metrics.exec_seconds.labels(outcome=outcome).observe(
                time.perf_counter() - started
            )
        return _json(result)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/execs",
        tags=["commands"],
        responses=_SSE_DOC,
        response_class=StreamingResponse,
        summary="Start a command and stream its output as server-sent events.",
    )
    async def exec_stream(
        sandbox_id: SandboxId, body: ExecRequest, actor: ActorDep, plane: PlaneDep, key: IdemDep
    ) -> StreamingResponse:
        # Checked before the stream starts, so a foreign or unknown id is a plain 404.
        await plane.manager.get(sandbox_id, actor=actor)
        call = _exec_call(plane, sandbox_id, body, actor, key)
        release = await admit(plane.execs, plane.manager.journal, actor.tenant, key)
        job_id = new_id("ex")
        await plane.output.open(job_id, tenant=actor.tenant, sandbox_id=sandbox_id)
        stdin_iter: AsyncIterator[bytes] | None = None
        if body.stdin_stream:
            send, receive = anyio.create_memory_object_stream[bytes](16)
            pipe = _StdinPipe(actor.tenant, send, receive)
            plane.stdin[job_id] = pipe
            stdin_iter = _stdin_chunks(receive)
            timeout = plane.config.stdin_attach_timeout

            async def unattached() -> None:
                with anyio.move_on_after(timeout):
                    await pipe.attached.wait()
                if not pipe.attached.is_set():
                    await pipe.send.aclose()

            plane.spawn(unattached)
        started = time.perf_counter()

        async def job(on_output: Callable[[OutputChunk], Awaitable[None]]) -> dict[str, object]:
            result = await call(on_output, stdin_iter)
            return result.model_dump(mode="json")

        def done(outcome: str) -> None:
            plane.metrics.exec_seconds.labels(outcome=outcome).observe(
                time.perf_counter() - started
            )

        plane.spawn(lambda: _run_job(plane, job_id, actor.tenant, job, release, done))
        first = _sse("started", ExecStarted(exec_id=job_id, sandbox_id=sandbox_id))
        return StreamingResponse(
            _job_events(plane, job_id, actor.tenant, -1, first),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    @app.get(
        "/v1/execs/{exec_id}/events",
        tags=["commands"],
        responses=_SSE_DOC,
        response_class=StreamingResponse,
        summary="Resume a command's event stream after the chunk named by Last-Event-ID.",
    )
    async def exec_events(
        exec_id: Annotated[str, Path(description="From the `started` event.")],
        actor: ActorDep,
        plane: PlaneDep,
        last_event_id: Annotated[str | None, Header(alias=LAST_EVENT_ID)] = None,
    ) -> StreamingResponse:
        after = _last_event_id(last_event_id)
        # Raises NotFound / OutputExpired before the stream starts.
        await plane.output.read(exec_id, tenant=actor.tenant, after=after, wait=0)
        return StreamingResponse(
            _job_events(plane, exec_id, actor.tenant, after, None),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    @app.post(
        "/v1/execs/{exec_id}/cancel",
        tags=["commands"],
        status_code=204,
        summary="Cancel a streamed job: kill its command's tree, or undo its creation.",
    )
    async def exec_cancel(
        exec_id: Annotated[str, Path()], actor: ActorDep, plane: PlaneDep
    ) -> Response:
        job = plane.jobs.get(exec_id)
        if job is None or job.tenant != actor.tenant:
            msg = f"no exec {exec_id!r} running on this server"
            raise NotFound(msg, exec_id=exec_id)
        job.scope.cancel()
        return Response(status_code=204)

    @app.put(
        "/v1/execs/{exec_id}/stdin",
        tags=["commands"],
        status_code=204,
        summary="Stream a command's standard input (for execs started with stdin_stream).",
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                }
            }
        },
    )
    async def exec_stdin(
        exec_id: Annotated[str, Path()], request: Request, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        pipe = plane.stdin.get(exec_id)
        if pipe is None or pipe.tenant != actor.tenant or pipe.attached.is_set():
            msg = f"no exec {exec_id!r} waiting for streamed input"
            raise NotFound(msg, exec_id=exec_id)
        pipe.attached.set()
        async with pipe.send as send:
            try:
                async for chunk in request.stream():
                    if chunk:
                        await send.send(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the command exited before reading all its input
        return Response(status_code=204)

    # -- processes and terminals -----------------------------------------------------------

    @app.post(
        "/v1/sandboxes/{sandbox_id}/processes",
        tags=["processes"],
        status_code=201,
        response_model=ProcessInfo,
        summary="Start a program in the background; it outlives this request.",
    )
    async def start_process(
        sandbox_id: SandboxId, body: StartProcessRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        # A running background process holds one of the tenant's exec slots until it exits.
        release = await plane.execs.acquire(actor.tenant)
        try:
            # Shielded: a client that goes away must not leave a started process unrecorded.
            info = await _shielded(
                plane.manager.start_process(
                    sandbox_id,
                    body.command,
                    actor=actor,
                    cwd=body.cwd,
                    env=body.env,
                    name=body.name,
                )
            )
        except BaseException:
            release()
            raise
        if plane.config.quota_for(actor.tenant).max_concurrent_execs is not None:
            plane.spawn(
                lambda: hold_until_exit(plane.manager, actor.tenant, sandbox_id, info, release)
            )
        return _json(info, 201)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/processes",
        tags=["processes"],
        response_model=list[ProcessInfo],
        summary="Background processes, running and recently exited, in start order.",
    )
    async def list_processes(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
        return _json(await plane.manager.list_processes(sandbox_id, actor=actor))

    @app.post(
        "/v1/sandboxes/{sandbox_id}/processes/{process_id}/signal",
        tags=["processes"],
        status_code=204,
        summary="Send a signal to a background process's whole tree.",
    )
    async def signal_process(
        sandbox_id: SandboxId,
        process_id: ProcessId,
        body: SignalRequest,
        actor: ActorDep,
        plane: PlaneDep,
    ) -> Response:
        await _shielded(
            plane.manager.signal_process(sandbox_id, process_id, body.signal, actor=actor)
        )
        return Response(status_code=204)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/processes/{process_id}/wait",
        tags=["processes"],
        response_model=ProcessInfo,
        summary="Wait until a background process exits (504 `timeout` when the timeout passes).",
    )
    async def wait_process(
        sandbox_id: SandboxId,
        process_id: ProcessId,
        body: WaitRequest,
        actor: ActorDep,
        plane: PlaneDep,
    ) -> Response:
        info = await plane.manager.wait_process(
            sandbox_id, process_id, actor=actor, timeout=body.timeout
        )
        return _json(info)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/processes/{process_id}/output",
        tags=["processes"],
        responses=_SSE_DOC,
        response_class=StreamingResponse,
        summary="A background process's output as events; each event's id is its chunk number.",
    )
    async def process_output(
        sandbox_id: SandboxId,
        process_id: ProcessId,
        actor: ActorDep,
        plane: PlaneDep,
        follow: bool = False,
        offset: Annotated[int, Query(ge=0, le=1 << 50)] = 0,
        last_event_id: Annotated[str | None, Header(alias=LAST_EVENT_ID)] = None,
    ) -> StreamingResponse:
        start = _last_event_id(last_event_id, offset - 1) + 1
        # Checked before the stream starts, so a foreign or unknown id is a plain 404.
        await plane.manager.get(sandbox_id, actor=actor)
        return StreamingResponse(
            # Followers share one reader of the process (sandlot.server.follow).
            plane.followers.events(sandbox_id, process_id, actor, start)
            if follow
            else _process_events(plane, sandbox_id, process_id, actor, start, follow),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    @app.put(
        "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin",
        tags=["processes"],
        status_code=204,
        summary="Write to a background process's standard input (`close=true` closes it after).",
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                }
            }
        },
    )
    async def process_stdin(
        sandbox_id: SandboxId,
        process_id: ProcessId,
        request: Request,
        actor: ActorDep,
        plane: PlaneDep,
        close: bool = False,
    ) -> Response:
        limit = plane.config.max_upload_bytes
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                msg = f"the input is over this server's limit of {limit} bytes"
                raise PayloadTooLarge(msg, limit=limit)
            parts.append(chunk)
        await _shielded(
            plane.manager.write_stdin(
                sandbox_id, process_id, b"".join(parts), actor=actor, close=close
            )
        )
        return Response(status_code=204)

    @app.websocket("/v1/sandboxes/{sandbox_id}/pty")
    async def pty(websocket: WebSocket, sandbox_id: str) -> None:
        plane: _Plane = websocket.app.state.plane
        await _pty_session(plane, websocket, sandbox_id)

    # -- files -----------------------------------------------------------------------------

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/content",
        tags=["files"],
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
                "description": f"The file; `{DIGEST_HEADER}` has its SHA-256.",
            }
        },
    )
    async def download(
        sandbox_id: SandboxId, path: FilePath, actor: ActorDep, plane: PlaneDep
    ) -> StreamingResponse:
        limit = plane.config.max_download_bytes
        spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed by the response
        try:
            digest = hashlib.sha256()
            size = 0
            async for chunk in plane.manager.stream_file(sandbox_id, path, actor=actor):
                size += len(chunk)
                if size > limit:
                    msg = f"{path} is over this server's download limit of {limit} bytes"
                    raise PayloadTooLarge(msg, limit=limit)
                digest.update(chunk)
                await anyio.to_thread.run_sync(spool.write, chunk)
            await anyio.to_thread.run_sync(spool.seek, 0)
        except BaseException:
            spool.close()
            raise
        return StreamingResponse(
            _spooled(spool),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size), DIGEST_HEADER: content_digest(digest.digest())},
        )

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files/content",
        tags=["files"],
        response_model=FileInfo,
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                }
            }
        },
    )
    async def upload(
        sandbox_id: SandboxId,
        path: FilePath,
        request: Request,
        actor: ActorDep,
        plane: PlaneDep,
        key: IdemDep,
        mode: Annotated[int | None, Query(ge=0, le=0o7777, description="Permission bits.")] = None,
        digest_header: Annotated[str | None, Header(alias=DIGEST_HEADER)] = None,
    ) -> Response:
        limit = plane.config.max_upload_bytes
        refuse_digest_trailer(request.headers.get("trailer"))
        expected = parse_digest(digest_header)
        if digest_header and expected is None:
            msg = f"{DIGEST_HEADER} must be sha-256=:<base64>:"
            raise InvalidRequest(msg)
        digest = hashlib.sha256()
        size = 0
        release = await plane.upload_slot(actor.tenant)
        # Spooled to disk past 1 MiB, not held in memory, and only then written: a body that
        # does not match its digest (or breaks off) writes nothing.
        spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed below
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(_too_large(limit, None, raw=True), limit=limit)
                digest.update(chunk)
                await anyio.to_thread.run_sync(spool.write, chunk)
            if expected is not None and expected != digest.digest():
                msg = f"the upload of {path} does not match its {DIGEST_HEADER} (corrupted in transit); nothing was written"
                raise InvalidRequest(msg)
            await anyio.to_thread.run_sync(spool.seek, 0)
            (info,) = await plane.manager.write_files(
                sandbox_id,
                {path: _spooled(spool)},
                actor=actor,
                mode=mode,
                idempotency_key=key,
                digests={path: "sha256:" + digest.hexdigest()},
            )
        finally:
            spool.close()
            release()
        response = _json(info)
        response.headers[DIGEST_HEADER] = content_digest(digest.digest())
        return response

    @app.post("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_model=list[FileInfo])
    async def write_files(
        sandbox_id: SandboxId,
        body: WriteFilesRequest,
        actor: ActorDep,
        plane: PlaneDep,
        key: IdemDep,
    ) -> Response:
        files: dict[str, bytes] = {}
        for f in body.files:
            try:
                files[f.path] = b64decode(f.content)
            except ValueError:
                msg = f"content of {f.path} must be base64"
                raise InvalidRequest(msg) from None
        limit = plane.config.max_upload_bytes
        if sum(len(b) for b in files.values()) > limit:
            raise PayloadTooLarge(_too_large(limit, None, raw=False), limit=limit)
        return _json(
            await plane.manager.write_files(
                sandbox_id, files, actor=actor, mode=body.mode, idempotency_key=key
            )
        )

    @app.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_model=list[FileInfo])
    async def list_files(
        sandbox_id: SandboxId, path: FilePath, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json(await plane.manager.list_files(sandbox_id, path, actor=actor))

    @app.delete("/v1/sandboxes/{sandbox_id}/files", tags=["files"], status_code=204)
    async def remove_file(
        sandbox_id: SandboxId,
        path: FilePath,
        actor: ActorDep,
        plane: PlaneDep,
        recursive: bool = False,
    ) -> Response:
        await plane.manager.remove_file(sandbox_id, path, actor=actor, recursive=recursive)
        return Response(status_code=204)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/logs",
        tags=["files"],
        responses=_SSE_DOC,
        response_class=StreamingResponse,
        summary="The main process's log as events; each event's id is the byte offset after it.",
    )
    async def logs(
        sandbox_id: SandboxId,
        actor: ActorDep,
        plane: PlaneDep,
        follow: bool = False,
        offset: Annotated[int, Query(ge=0, le=1 << 50)] = 0,
        last_event_id: Annotated[str | None, Header(alias=LAST_EVENT_ID)] = None,
    ) -> StreamingResponse:
        start = _last_event_id(last_event_id, offset)
        start = max(start, 0)
        # Checked before the stream starts, so a foreign or unknown id is a plain 404.
        await plane.manager.get(sandbox_id, actor=actor)
        return StreamingResponse(
            _log_events(plane, sandbox_id, actor, start, follow),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    # -- snapshots, fork, ports ------------------------------------------------------------

    @app.post(
        "/v1/sandboxes/{sandbox_id}/snapshots",
        tags=["snapshots"],
        status_code=201,
        response_model=SnapshotInfo,
    )
    async def snapshot(
        sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        return _json(await _shielded(plane.manager.snapshot(sandbox_id, actor=actor)), 201)

    @app.get("/v1/snapshots", tags=["snapshots"], response_model=list[SnapshotInfo])
    async def list_snapshots(
        actor: ActorDep, plane: PlaneDep, sandbox_id: str | None = None
    ) -> Response:
        return _json(await plane.manager.list_snapshots(sandbox_id, actor=actor))

    @app.delete("/v1/snapshots/{snapshot_id}", tags=["snapshots"], status_code=204)
    async def delete_snapshot(
        snapshot_id: SnapshotId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        with anyio.CancelScope(shield=True):
            await plane.manager.delete_snapshot(snapshot_id, actor=actor)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/restore", tags=["snapshots"], response_model=SandboxInfo)
    async def restore(
        sandbox_id: SandboxId,
        body: RestoreRequest,
        actor: ActorDep,
        plane: PlaneDep,
        _key: IdemDep,
    ) -> Response:
        return _json(
            await _shielded(plane.manager.restore(sandbox_id, body.snapshot_id, actor=actor))
        )

    async def _fork(plane: _Plane, source: str, body: ForkRequest, actor: Actor) -> Response:
        async with plane.sandboxes.slot(actor.tenant, body.count):
            with anyio.CancelScope(shield=True):
                infos = await plane.manager.fork(
                    source, body.count, actor=actor, labels=body.labels
                )
        return _json(infos, 201)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/fork",
        tags=["snapshots"],
        status_code=201,
        response_model=list[SandboxInfo],
        summary="New sandboxes from a sandbox's current state.",
    )
    async def fork_sandbox(
        sandbox_id: SandboxId, body: ForkRequest, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        if sandbox_id.startswith("snap-"):
            msg = f"{sandbox_id} is a snapshot id: use /v1/snapshots/{{id}}/fork"
            raise NotFound(msg, id=sandbox_id)
        return await _fork(plane, sandbox_id, body, actor)

    @app.post(
        "/v1/snapshots/{snapshot_id}/fork",
        tags=["snapshots"],
        status_code=201,
        response_model=list[SandboxInfo],
        summary="New sandboxes from a snapshot.",
    )
    async def fork_snapshot(
        snapshot_id: SnapshotId, body: ForkRequest, actor: ActorDep, plane: PlaneDep, _key: IdemDep
    ) -> Response:
        if not snapshot_id.startswith("snap-"):
            msg = f"no snapshot {snapshot_id!r}"
            raise NotFound(msg, id=snapshot_id)
        return await _fork(plane, snapshot_id, body, actor)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/ports",
        tags=["ports"],
        response_model=PortMapping,
        summary="Publish a sandbox port on the host.",
    )
    async def expose_port(
        sandbox_id: SandboxId, body: ExposePortRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json(await plane.manager.expose_port(sandbox_id, body.port, actor=actor))

    @app.get("/v1/sandboxes/{sandbox_id}/ports", tags=["ports"], response_model=list[PortMapping])
    async def list_ports(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
        return _json(await plane.manager.list_ports(sandbox_id, actor=actor))

    # -- policy ----------------------------------------------------------------------------

    @app.post(
        "/v1/sandboxes/{sandbox_id}/explain",
        tags=["policy"],
        summary="What the policy would decide about an operation here, and why (nothing runs).",
    )
    async def explain(
        sandbox_id: SandboxId, body: ExplainRequest, actor: ActorDep, plane: PlaneDep
    ) -> Response:
        clash = {"action", "sandbox_id", "actor"} & body.args.keys()
        if clash:
            msg = f"args may not be named {', '.join(sorted(clash))}"
            raise InvalidRequest(msg)
        explanation = await plane.manager.explain(body.action, sandbox_id, actor=actor, **body.args)
        return _json(explanation.to_dict())

    @app.get("/v1/approvals", tags=["policy"], summary="Held operations, newest first.")
    async def list_approvals(
        actor: ActorDep,
        plane: PlaneDep,
        status: Annotated[
            str, Query(description="pending, approved, denied, expired, or all.", max_length=16)
        ] = "pending",
    ) -> Response:
        items = await plane.manager.list_approvals(
            actor=actor, status=None if status == "all" else status
        )
        return _json([a.to_dict() for a in items])

    @app.post("/v1/approvals/{approval_id}/approve", tags=["policy"])
    async def approve(
        approval_id: Annotated[str, Path()], actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json((await _shielded(plane.manager.approve(approval_id, actor=actor))).to_dict())

    @app.post("/v1/approvals/{approval_id}/deny", tags=["policy"])
    async def deny(
        approval_id: Annotated[str, Path()], actor: ActorDep, plane: PlaneDep
    ) -> Response:
        return _json((await _shielded(plane.manager.deny(approval_id, actor=actor))).to_dict())

    # -- operators -------------------------------------------------------------------------

    @app.post("/v1/reconcile", tags=["operators"], response_model=ReconcileResponse)
    async def reconcile(body: ReconcileRequest, actor: ActorDep, plane: PlaneDep) -> Response:
        _require_admin(actor)
        with anyio.CancelScope(shield=True):
            report = await plane.manager.reconcile(body.ids)
        return _json(
            ReconcileResponse(
                checked=report.checked,
                updated=report.updated,
                reaped=report.reaped,
                errors=report.errors,
                expired=report.expired,
                discarded=report.discarded,
            )
        )

    @app.post("/v1/stop-expired", tags=["operators"], response_model=StopExpiredResponse)
    async def stop_expired(actor: ActorDep, plane: PlaneDep) -> Response:
        _require_admin(actor)
        with anyio.CancelScope(shield=True):
            report = await plane.manager.stop_expired()
        return _json(
            StopExpiredResponse(
                checked=report.checked,
                stopped=report.expired,
                discarded=report.discarded,
                errors=report.errors,
            )
        )


async def _sweep(manager: Manager, interval: float) -> None:
    """Stop expired sandboxes now and then (the server is the long-lived process that can)."""
    while True:
        await anyio.sleep(interval)
        try:
            with anyio.CancelScope(shield=True):
                report = await manager.stop_expired()
                await manager.record_egress()
        except SandboxError as e:
            log.error("sweeping expired sandboxes failed: %s", e)
            continue
        if report.expired:
            log.info("stopped expired sandboxes: %s", ", ".join(report.expired))
        if report.discarded:
            log.info("destroyed failed sandboxes: %s", ", ".join(report.discarded))


async def _shielded(call: Awaitable[T]) -> T:
    """Finish a state change even if the client goes away: a half-done transition would
    leave the sandbox for reconcile to settle."""
    with anyio.CancelScope(shield=True):
        result = await call
    return result


async def _stdin_chunks(receive: anyio.abc.ObjectReceiveStream[bytes]) -> AsyncIterator[bytes]:
    async with receive:
        async for chunk in receive:
            yield chunk


async def _spooled(spool: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(spool.read, _CHUNK)
            if not chunk:
                return
            yield chunk
    finally:
        spool.close()


async def _log_events(
    plane: _Plane, sandbox_id: str, actor: Actor, offset: int, follow: bool
) -> AsyncIterator[bytes]:
    try:
        async for chunk in plane.manager.logs(
            sandbox_id, actor=actor, follow=follow, offset=offset
        ):
            offset += len(chunk)
            yield _sse("data", {"data": b64encode(chunk)}, id=str(offset))
    except SandboxError as e:
        yield _sse("error", problem_body(e))
        return
    yield _sse("end", {"offset": offset})


async def _process_events(
    plane: _Plane, sandbox_id: str, process_id: str, actor: Actor, offset: int, follow: bool
) -> AsyncIterator[bytes]:
    next_offset = offset
    try:
        async for chunk in plane.manager.process_output(
            sandbox_id, process_id, actor=actor, offset=offset, follow=follow
        ):
            next_offset = chunk.seq + 1
            yield _sse(
                "output", {"stream": chunk.stream, "data": b64encode(chunk.data)}, id=str(chunk.seq)
            )
    except SandboxError as e:
        yield _sse("error", problem_body(e))
        return
    yield _sse("end", OutputEnd(next_offset=next_offset))


# -- terminals ------------------------------------------------------------------------------

_PTY_PARAMS = frozenset({"command", "argv", "rows", "cols", "cwd", "env"})


async def _ws_actor(plane: _Plane, websocket: WebSocket) -> Actor:
    scheme, _, key = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        msg = "this request needs an API key: send `Authorization: Bearer <key>`"
        raise Unauthenticated(msg)
    info = await plane.keys.identify(key.strip())
    if info is None:
        msg = "the API key is unknown or revoked"
        raise Unauthenticated(msg)
    note_key(websocket.scope, info.id)
    return info.actor


def _pty_params(
    query: QueryParams,
) -> tuple[Command | list[str] | None, int, int, str | None, dict[str, str]]:
    """``(command, rows, cols, cwd, env)`` from a terminal's query string."""
    unknown = set(query.keys()) - _PTY_PARAMS
    if unknown:
        msg = f"unknown terminal parameters: {', '.join(sorted(unknown))} (known: {', '.join(sorted(_PTY_PARAMS))})"
        raise InvalidRequest(msg)
    argv = query.getlist("argv")
    command = query.get("command")
    if argv and command is not None:
        msg = "give the terminal's program as command or as argv, not both"
        raise InvalidRequest(msg)
    size = []
    for name, default in (("rows", 24), ("cols", 80)):
        raw = query.get(name)
        if raw is None:
            size.append(default)
            continue
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            msg = f"{name} must be 1..65535, got {raw!r}"
            raise InvalidRequest(msg)
        size.append(int(raw))
    env = {}
    for pair in query.getlist("env"):
        name, sep, value = pair.partition("=")
        if not sep or not name:
            msg = f"env must be NAME=VALUE, got {pair!r}"
            raise InvalidRequest(msg)
        env[name] = value
    return argv or command, size[0], size[1], query.get("cwd"), env


async def _pty_session(plane: _Plane, websocket: WebSocket, sandbox_id: str) -> None:
    """Serve one terminal: refuse before the upgrade (a plain problem response) or relay
    bytes both ways until the program exits or the client goes away."""
    try:
        actor = await _ws_actor(plane, websocket)
        command, rows, cols, cwd, env = _pty_params(websocket.query_params)
        # An open terminal holds one of the tenant's exec slots until it closes.
        release = await plane.execs.acquire(actor.tenant)
        try:
            session = await plane.manager.open_pty(
                sandbox_id, command, actor=actor, rows=rows, cols=cols, cwd=cwd, env=env
            )
        except BaseException:
            release()
            raise
    except SandboxError as e:
        if isinstance(e, PolicyDenied):
            plane.metrics.policy_decisions.labels(outcome="deny").inc()
        try:
            await websocket.send_denial_response(_problem(e))
        except RuntimeError:
            # A server without the denial-response extension: refuse the upgrade (403).
            await websocket.close(1008, e.message[:120])
        return
    sending = anyio.Lock()

    async def send(text: str | None = None, data: bytes | None = None) -> None:
        async with sending:
            if data is not None:
                await websocket.send_bytes(data)
            else:
                await websocket.send_text(text or "")

    try:
        await websocket.accept()
        await send(PtyOpened(id=session.id).model_dump_json())
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pty_output, websocket, session, send, tg.cancel_scope)
            await _pty_input(websocket, session, send)
            tg.cancel_scope.cancel()
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client went away: the terminal is hung up below
    finally:
        try:
            with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError, OSError):
                await session.close()
        finally:
            release()


async def _pty_output(
    websocket: WebSocket,
    session: PtySession,
    send: Callable[..., Awaitable[None]],
    scope: anyio.CancelScope,
) -> None:
    try:
        try:
            while data := await session.read():
                await send(data=data)
            code = await session.wait()
        except SandboxError as e:
            await send(PtyError(problem=problem_body(e)).model_dump_json())
            await websocket.close(PTY_CLOSE_ERROR)
        else:
            await send(PtyExit(exit_code=code).model_dump_json())
            await websocket.close(1000)
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client is gone; nobody is left to tell
    scope.cancel()


async def _pty_input(
    websocket: WebSocket, session: PtySession, send: Callable[..., Awaitable[None]]
) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("bytes")
        if data is not None:
            with contextlib.suppress(SandboxError):
                # Keystrokes after the program exited go nowhere; the output side reports
                # the exit.
                await session.write(data)
            continue
        try:
            resize = PtyResize.model_validate_json(message.get("text") or "")
            await session.resize(resize.rows, resize.cols)
        except ValidationError as e:
            error = InvalidRequest(f"not a terminal control message: {e.errors()[0]['msg']}")
            await send(PtyError(problem=problem_body(error)).model_dump_json())
        except SandboxError as e:
            await send(PtyError(problem=problem_body(e)).model_dump_json())


def route_table(app: FastAPI) -> Mapping[str, frozenset[str]]:
    """Every API route's path and methods (tests walk it so no route escapes a check)."""
    out: dict[str, frozenset[str]] = {}
    for route in app.routes:
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None)
        if isinstance(path, str) and methods:
            out[path] = frozenset(methods) | out.get(path, frozenset())
    return out
