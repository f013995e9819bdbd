"""Sandbox lifecycle routes: create, list, get, destroy, stop, resume, keep-alive and reset.

Create takes one of the tenant's live-sandbox slots (a keyed repeat is admitted without one:
:mod:`sandlot.server.replays`); with ``Accept: text/event-stream`` it runs as a job whose setup
output streams as events (:mod:`sandlot.server.jobs`). State changes are shielded from a
client going away. This module must not import backends or the store.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from sandlot.errors import InvalidRequest
from sandlot.models import Actor, OutputChunk, SandboxInfo, SandboxStatus, new_id
from sandlot.server.deps import (
    ActorDep,
    ForgetHost,
    IdemDep,
    PlaneDep,
    SandboxId,
    json_response,
    shielded,
)
from sandlot.server.jobs import SSE_HEADERS, job_events, run_job, sse
from sandlot.server.offer import check_offered
from sandlot.server.plane import Plane
from sandlot.server.replays import admit
from sandlot.server.wire import CreateRequest, ExecStarted, KeepAliveRequest, ResetRequest

__all__ = ["router"]

log = logging.getLogger("sandlot.server")

router = APIRouter()


@router.post(
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
        spec = spec.model_copy(update={"git": spec.git.model_copy(update={"auth": body.git_auth})})
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
        return json_response(info, 201)
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

    plane.spawn(lambda: run_job(plane, job_id, actor.tenant, job, release))
    first = sse("started", ExecStarted(exec_id=job_id, sandbox_id=""))
    return StreamingResponse(
        job_events(plane, job_id, actor.tenant, -1, first),
        status_code=201,
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@router.get("/v1/sandboxes", tags=["sandboxes"], response_model=list[SandboxInfo])
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
    return json_response(items)


@router.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=SandboxInfo)
async def get_sandbox(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response(await plane.manager.get(sandbox_id, actor=actor))


async def _destroy(
    plane: Plane, sandbox_id: str, actor: Actor, key: str | None, forget_host: bool
) -> Response:
    with anyio.CancelScope(shield=True):
        info = await plane.manager.destroy(
            sandbox_id, actor=actor, idempotency_key=key, forget_host=forget_host
        )
    plane.sandboxes.notify(info.tenant)
    return json_response(info)


@router.delete("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=SandboxInfo)
async def delete_sandbox(
    sandbox_id: SandboxId,
    actor: ActorDep,
    plane: PlaneDep,
    key: IdemDep,
    forget_host: ForgetHost = False,
) -> Response:
    return await _destroy(plane, sandbox_id, actor, key, forget_host)


@router.post("/v1/sandboxes/{sandbox_id}/destroy", tags=["sandboxes"], response_model=SandboxInfo)
async def destroy(
    sandbox_id: SandboxId,
    actor: ActorDep,
    plane: PlaneDep,
    key: IdemDep,
    forget_host: ForgetHost = False,
) -> Response:
    return await _destroy(plane, sandbox_id, actor, key, forget_host)


@router.post("/v1/sandboxes/{sandbox_id}/stop", tags=["sandboxes"], response_model=SandboxInfo)
async def stop(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep) -> Response:
    return json_response(await shielded(plane.manager.stop(sandbox_id, actor=actor)))


@router.post("/v1/sandboxes/{sandbox_id}/resume", tags=["sandboxes"], response_model=SandboxInfo)
async def resume(
    sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep, _key: IdemDep
) -> Response:
    return json_response(await shielded(plane.manager.resume(sandbox_id, actor=actor)))


@router.post(
    "/v1/sandboxes/{sandbox_id}/keep-alive", tags=["sandboxes"], response_model=SandboxInfo
)
async def keep_alive(
    sandbox_id: SandboxId, body: KeepAliveRequest, actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(await plane.manager.keep_alive(sandbox_id, body.seconds, actor=actor))


@router.post("/v1/sandboxes/{sandbox_id}/reset", tags=["sandboxes"], response_model=SandboxInfo)
async def reset(
    sandbox_id: SandboxId, body: ResetRequest, actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(
        await shielded(plane.manager.reset(sandbox_id, body.snapshot_id, actor=actor))
    )
