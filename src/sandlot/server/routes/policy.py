"""Policy routes: explain what the gate would decide (nothing runs), and list, approve or deny
held operations.

This module must not import backends or the store.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from sandlot.errors import InvalidRequest
from sandlot.server.deps import ActorDep, PlaneDep, SandboxId, json_response, shielded
from sandlot.server.wire import ExplainRequest

__all__ = ["router"]

router = APIRouter()


@router.post(
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
    return json_response(explanation.to_dict())


@router.get("/v1/approvals", tags=["policy"], summary="Held operations, newest first.")
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
    return json_response([a.to_dict() for a in items])


@router.post("/v1/approvals/{approval_id}/approve", tags=["policy"])
async def approve(
    approval_id: Annotated[str, Path()], actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(
        (await shielded(plane.manager.approve(approval_id, actor=actor))).to_dict()
    )


@router.post("/v1/approvals/{approval_id}/deny", tags=["policy"])
async def deny(approval_id: Annotated[str, Path()], actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response((await shielded(plane.manager.deny(approval_id, actor=actor))).to_dict())
