"""Network and port routes: a sandbox's network policy, its egress log and suggested allowlist,
and the ports it publishes on the host.

This module must not import backends or the store.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from sandlot.models import NetworkAllowlist, PortMapping, SandboxInfo
from sandlot.server.deps import ActorDep, PlaneDep, SandboxId, json_response
from sandlot.server.wire import ExposePortRequest, NetworkRequest

__all__ = ["router"]

router = APIRouter()


@router.put("/v1/sandboxes/{sandbox_id}/network", tags=["network"], response_model=SandboxInfo)
async def update_network(
    sandbox_id: SandboxId, body: NetworkRequest, actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(await plane.manager.update_network(sandbox_id, body.network, actor=actor))


@router.get("/v1/sandboxes/{sandbox_id}/network/log", tags=["network"])
async def network_log(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response(await plane.manager.network_log(sandbox_id, actor=actor))


@router.get(
    "/v1/sandboxes/{sandbox_id}/network/suggest",
    tags=["network"],
    response_model=NetworkAllowlist,
)
async def suggest_network(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response(await plane.manager.suggest_network(sandbox_id, actor=actor))


@router.post(
    "/v1/sandboxes/{sandbox_id}/ports",
    tags=["ports"],
    response_model=PortMapping,
    summary="Publish a sandbox port on the host.",
)
async def expose_port(
    sandbox_id: SandboxId, body: ExposePortRequest, actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(await plane.manager.expose_port(sandbox_id, body.port, actor=actor))


@router.get("/v1/sandboxes/{sandbox_id}/ports", tags=["ports"], response_model=list[PortMapping])
async def list_ports(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response(await plane.manager.list_ports(sandbox_id, actor=actor))
