"""The HTTP API's app factory: a FastAPI app in which each route is one Manager call.

    app = create_app(manager, ApiKeyStore(url), ServerConfig())
    uvicorn.run(app, host="127.0.0.1", port=8470)

Every request (except ``/healthz``, ``/version`` and, when public, ``/metrics`` and the API's
description, ``/openapi.json`` and ``/docs``) carries
``Authorization: Bearer <api key>``; the key names the tenant and principal the Manager call
acts as, so a tenant never sees, touches, or learns of another tenant's records (they are
``404``, exactly like ids that do not exist). Errors are ``application/problem+json`` with
sandlot's stable ``code`` (:mod:`sandlot.server.problems`).

This module owns :class:`ServerConfig` and :func:`create_app`, which wires the pieces: the
shared state (:mod:`sandlot.server.plane`, in ``app.state.plane``), the middleware (body cap,
metrics, key sessions, the docs gate), the error handlers, the routers by resource
(:mod:`sandlot.server.routes`), the MCP endpoint (:mod:`sandlot.server.mcp_http`) and the
lifespan's background duties (revocation watch, expiry sweep, output upkeep). Commands run as
server-side jobs whose output clients resume after a disconnect (:mod:`sandlot.server.jobs`);
starting a server from the command line is :mod:`sandlot.server.serve`. This module must not
import concrete backends or the store below the Manager.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route

from sandlot._version import __version__
from sandlot.errors import InvalidRequest, NotFound, PolicyDenied, SandboxError
from sandlot.manager import Manager
from sandlot.server.deps import problem
from sandlot.server.docs_gate import DocsGate
from sandlot.server.keys import ApiKeyStore
from sandlot.server.middleware import BodyLimit, RequestMetrics
from sandlot.server.outputlog import ExecOutputLog, MemoryExecOutputLog
from sandlot.server.plane import Plane
from sandlot.server.quotas import Quota
from sandlot.server.redact import install as redact_logs
from sandlot.server.routes import ROUTERS
from sandlot.server.sessions import KeySessionGuard

if TYPE_CHECKING:
    from sandlot.server.mcp_http import McpEndpoint

__all__ = ["ServerConfig", "create_app", "route_table"]

log = logging.getLogger("sandlot.server")


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
        self_url: Unused: MCP tools call the app in process, not through a URL (kept so a
            configuration that sets it still loads).
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
    plane = Plane(manager, keys, cfg, output)
    mcp_endpoint: McpEndpoint | None = None  # made below, once there is an app to call

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
    app.add_middleware(BodyLimit, limit=lambda: cfg.max_upload_bytes)
    app.add_middleware(RequestMetrics, metrics=lambda: plane.metrics)
    app.add_middleware(KeySessionGuard, sessions=lambda: plane.sessions)
    app.add_middleware(DocsGate, keys=keys, public=cfg.docs_public)

    _handle_errors(app)
    if cfg.mcp:
        from sandlot.server.inprocess import AppTransport
        from sandlot.server.mcp_http import McpEndpoint

        # The tools call this very app, with the caller's key, as one more client.
        mcp_endpoint = McpEndpoint(keys, AppTransport(app, plane.spawn))
    for router in ROUTERS:
        app.include_router(router)
    if mcp_endpoint is not None:
        app.router.routes.append(
            Route("/mcp", mcp_endpoint, methods=["GET", "POST", "DELETE"], include_in_schema=False)
        )
    return app


def _handle_errors(app: FastAPI) -> None:
    """Answer every error as ``application/problem+json`` with sandlot's stable code."""

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        if isinstance(exc, PolicyDenied) and exc.reason_code != "ADMIN_REQUIRED":
            plane: Plane = request.app.state.plane
            plane.metrics.policy_decisions.labels(outcome="deny").inc()
        return problem(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}: {str(err.get('msg', '')).removeprefix('Value error, ')}")
        return problem(InvalidRequest("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err: SandboxError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path}")
        else:
            err = InvalidRequest(str(exc.detail))
        response = problem(err)
        response.status_code = exc.status_code
        return response

    @app.exception_handler(OverflowError)
    async def _overflow(request: Request, exc: OverflowError) -> JSONResponse:
        # Dates and durations far beyond any sane value (a TTL of 1e300 seconds).
        return problem(InvalidRequest(f"a number is out of range: {exc}"))


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


def route_table(app: FastAPI) -> Mapping[str, frozenset[str]]:
    """Every API route's path and methods (tests walk it so no route escapes a check)."""
    out: dict[str, frozenset[str]] = {}
    for route in _flat(app.routes):
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None)
        if isinstance(path, str) and methods:
            out[path] = frozenset(methods) | out.get(path, frozenset())
    return out


def _flat(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """``routes`` with each included router's own routes in its place.

    Newer FastAPI keeps an included router as one entry that matches on its behalf (older
    versions copy its routes in); ours carry no prefix, so their routes' paths are the API's.
    """
    for route in routes:
        router = getattr(route, "original_router", None)
        if router is not None:
            yield from _flat(router.routes)
        else:
            yield route
