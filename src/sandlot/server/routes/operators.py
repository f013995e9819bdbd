"""Operator routes (admin keys only): reconcile records with the backends, and stop expired
sandboxes now.

This module must not import backends or the store.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import Response

from sandlot.server.deps import ActorDep, PlaneDep, json_response, require_admin
from sandlot.server.wire import ReconcileRequest, ReconcileResponse, StopExpiredResponse

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/reconcile", tags=["operators"], response_model=ReconcileResponse)
async def reconcile(body: ReconcileRequest, actor: ActorDep, plane: PlaneDep) -> Response:
    require_admin(actor)
    with anyio.CancelScope(shield=True):
        report = await plane.manager.reconcile(body.ids)
    return json_response(
        ReconcileResponse(
            checked=report.checked,
            updated=report.updated,
            reaped=report.reaped,
            errors=report.errors,
            expired=report.expired,
            discarded=report.discarded,
        )
    )


@router.post("/v1/stop-expired", tags=["operators"], response_model=StopExpiredResponse)
async def stop_expired(actor: ActorDep, plane: PlaneDep) -> Response:
    require_admin(actor)
    with anyio.CancelScope(shield=True):
        report = await plane.manager.stop_expired()
    return json_response(
        StopExpiredResponse(
            checked=report.checked,
            stopped=report.expired,
            discarded=report.discarded,
            errors=report.errors,
        )
    )
