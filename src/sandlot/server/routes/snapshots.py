"""Snapshot routes: snapshot a sandbox, list and delete snapshots, restore, and fork (from a
sandbox or a snapshot, counted against the tenant's live-sandbox quota).

This module must not import backends or the store.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import Response

from sandlot.errors import NotFound
from sandlot.models import Actor, SandboxInfo, SnapshotInfo
from sandlot.server.deps import (
    ActorDep,
    IdemDep,
    PlaneDep,
    SandboxId,
    SnapshotId,
    json_response,
    shielded,
)
from sandlot.server.plane import Plane
from sandlot.server.wire import ForkRequest, RestoreRequest

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/sandboxes/{sandbox_id}/snapshots",
    tags=["snapshots"],
    status_code=201,
    response_model=SnapshotInfo,
)
async def snapshot(
    sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
) -> Response:
    return json_response(await shielded(plane.manager.snapshot(sandbox_id, actor=actor)), 201)


@router.get("/v1/snapshots", tags=["snapshots"], response_model=list[SnapshotInfo])
async def list_snapshots(
    actor: ActorDep, plane: PlaneDep, sandbox_id: str | None = None
) -> Response:
    return json_response(await plane.manager.list_snapshots(sandbox_id, actor=actor))


@router.delete("/v1/snapshots/{snapshot_id}", tags=["snapshots"], status_code=204)
async def delete_snapshot(
    snapshot_id: SnapshotId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
) -> Response:
    with anyio.CancelScope(shield=True):
        await plane.manager.delete_snapshot(snapshot_id, actor=actor)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/restore", tags=["snapshots"], response_model=SandboxInfo)
async def restore(
    sandbox_id: SandboxId,
    body: RestoreRequest,
    actor: ActorDep,
    plane: PlaneDep,
    _key: IdemDep,
) -> Response:
    return json_response(
        await shielded(plane.manager.restore(sandbox_id, body.snapshot_id, actor=actor))
    )


async def _fork(plane: Plane, source: str, body: ForkRequest, actor: Actor) -> Response:
    async with plane.sandboxes.slot(actor.tenant, body.count):
        with anyio.CancelScope(shield=True):
            infos = await plane.manager.fork(source, body.count, actor=actor, labels=body.labels)
    return json_response(infos, 201)


@router.post(
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


@router.post(
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
