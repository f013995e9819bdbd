"""Service routes: ``/healthz``, ``/version`` and ``/metrics`` (Prometheus).

``/healthz`` and ``/version`` answer without a key; ``/metrics`` needs an admin key unless the
server made it public (:attr:`~sandlot.server.app.ServerConfig.metrics_public`). This module
must not import backends or the store.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials

from sandlot._version import __version__
from sandlot.server.deps import PlaneDep, authenticate, bearer, require_admin
from sandlot.server.metrics import CONTENT_TYPE
from sandlot.server.offer import offered
from sandlot.server.plane import ADMIN
from sandlot.server.wire import VersionInfo

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz", tags=["service"], summary="Liveness and database reachability.")
async def healthz(plane: PlaneDep) -> dict[str, str]:
    await plane.manager.list(actor=ADMIN, limit=1)
    return {"status": "ok"}


@router.get("/version", tags=["service"], response_model=VersionInfo)
async def version(plane: PlaneDep) -> VersionInfo:
    m = plane.manager
    names = offered(m.backends, m.default_backend, plane.config.enable_backends)
    return VersionInfo(version=__version__, backends=names, default_backend=m.default_backend)


@router.get(
    "/metrics",
    tags=["service"],
    summary="Prometheus metrics (admin keys unless the server made them public).",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(
    request: Request,
    plane: PlaneDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Response:
    if not plane.config.metrics_public:
        require_admin(await authenticate(request, credentials))
    records = await plane.manager.list(actor=ADMIN)
    plane.metrics.set_sandboxes((r.status.value, r.backend) for r in records)
    return Response(plane.metrics.render(), media_type=CONTENT_TYPE)
