"""Background process routes: start, list, signal, wait, read output (events, or followed), and
write standard input.

A running background process holds one of the tenant's exec slots until it exits
(:func:`~sandlot.server.quotas.hold_until_exit`); followers of one process share one reader
(:mod:`sandlot.server.follow`). This module must not import backends or the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from sandlot.errors import SandboxError
from sandlot.models import Actor, ProcessInfo
from sandlot.server.deps import (
    ActorDep,
    PlaneDep,
    ProcessId,
    SandboxId,
    json_response,
    resume_point,
    shielded,
)
from sandlot.server.jobs import SSE_DOC, SSE_HEADERS, sse
from sandlot.server.middleware import too_large
from sandlot.server.plane import Plane
from sandlot.server.problems import PayloadTooLarge, problem_body
from sandlot.server.quotas import hold_until_exit
from sandlot.server.wire import (
    LAST_EVENT_ID,
    OutputEnd,
    SignalRequest,
    StartProcessRequest,
    WaitRequest,
    b64encode,
)

__all__ = ["router"]

router = APIRouter()


@router.post(
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
        info = await shielded(
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
        plane.spawn(lambda: hold_until_exit(plane.manager, actor.tenant, sandbox_id, info, release))
    return json_response(info, 201)


@router.get(
    "/v1/sandboxes/{sandbox_id}/processes",
    tags=["processes"],
    response_model=list[ProcessInfo],
    summary="Background processes, running and recently exited, in start order.",
)
async def list_processes(sandbox_id: SandboxId, actor: ActorDep, plane: PlaneDep) -> Response:
    return json_response(await plane.manager.list_processes(sandbox_id, actor=actor))


@router.post(
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
    await shielded(plane.manager.signal_process(sandbox_id, process_id, body.signal, actor=actor))
    return Response(status_code=204)


@router.post(
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
    return json_response(info)


@router.get(
    "/v1/sandboxes/{sandbox_id}/processes/{process_id}/output",
    tags=["processes"],
    responses=SSE_DOC,
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
    start = resume_point(last_event_id, offset - 1) + 1
    # Checked before the stream starts, so a foreign or unknown id is a plain 404.
    await plane.manager.get(sandbox_id, actor=actor)
    return StreamingResponse(
        # Followers share one reader of the process (sandlot.server.follow).
        plane.followers.events(sandbox_id, process_id, actor, start)
        if follow
        else _process_events(plane, sandbox_id, process_id, actor, start, follow),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@router.put(
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
    # Held in memory until written, so it counts as an upload (the tenant's and the server's
    # concurrent uploads) and is capped like one.
    release = await plane.upload_slot(actor.tenant)
    try:
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                msg = too_large(limit, None, raw=True, what="the input")
                raise PayloadTooLarge(msg, limit=limit)
            parts.append(chunk)
        await shielded(
            plane.manager.write_stdin(
                sandbox_id, process_id, b"".join(parts), actor=actor, close=close
            )
        )
    finally:
        release()
    return Response(status_code=204)


async def _process_events(
    plane: Plane, sandbox_id: str, process_id: str, actor: Actor, offset: int, follow: bool
) -> AsyncIterator[bytes]:
    next_offset = offset
    try:
        async for chunk in plane.manager.process_output(
            sandbox_id, process_id, actor=actor, offset=offset, follow=follow
        ):
            next_offset = chunk.seq + 1
            yield sse(
                "output", {"stream": chunk.stream, "data": b64encode(chunk.data)}, id=str(chunk.seq)
            )
    except SandboxError as e:
        yield sse("error", problem_body(e))
        return
    yield sse("end", OutputEnd(next_offset=next_offset))
