"""The HTTP API's routes, one :class:`fastapi.APIRouter` per resource.

:data:`ROUTERS` is the order :func:`sandlot.server.app.create_app` includes them in. Each
route is one Manager call, reaching the app's shared state through
:data:`sandlot.server.deps.PlaneDep`. No module here may import backends or the store.
"""

from __future__ import annotations

from fastapi import APIRouter

from sandlot.server.routes import (
    execs,
    files,
    network,
    operators,
    policy,
    processes,
    sandboxes,
    service,
    snapshots,
    terminals,
)

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (
    service.router,
    sandboxes.router,
    network.router,
    execs.router,
    processes.router,
    terminals.router,
    files.router,
    snapshots.router,
    policy.router,
    operators.router,
)
