"""Command routes: run a command to completion, or start one as a job streamed as server-sent
events, resume its stream, cancel it, and stream its standard input.

Every command takes one of the tenant's exec slots (a keyed repeat is admitted without one:
:mod:`sandlot.server.replays`) and calls the same ``Manager.exec`` with the key's actor. The
job machinery (output kept for reconnects, cancellation, stdin pipes) is
:mod:`sandlot.server.jobs`. This module must not import backends or the store.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import Response, StreamingResponse

from sandlot.errors import InvalidRequest, NotFound
from sandlot.models import Actor, ExecResult, OutputChunk, new_id
from sandlot.server.deps import ActorDep, IdemDep, PlaneDep, SandboxId, json_response, resume_point
from sandlot.server.jobs import (
    SSE_DOC,
    SSE_HEADERS,
    StdinPipe,
    job_events,
    run_job,
    sse,
    stdin_chunks,
)
from sandlot.server.plane import Plane
from sandlot.server.replays import admit
from sandlot.server.wire import LAST_EVENT_ID, ExecRequest, ExecStarted, b64decode

__all__ = ["router"]

router = APIRouter()


def _exec_call(
    plane: Plane, sandbox_id: str, body: ExecRequest, actor: Actor, key: str | None
) -> Callable[[Callable[[OutputChunk], Awaitable[None]] | None, object], Awaitable[ExecResult]]:
    """The Manager call an exec request makes, given where output goes and streamed stdin.

    Inline stdin is decoded here, before the caller takes an exec slot, so a bad one is a 422
    that never waits in line.
    """
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


@router.post(
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
        plane.metrics.exec_seconds.labels(outcome=outcome).observe(time.perf_counter() - started)
    return json_response(result)


@router.post(
    "/v1/sandboxes/{sandbox_id}/execs",
    tags=["commands"],
    responses=SSE_DOC,
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
        pipe = StdinPipe(actor.tenant, send, receive)
        plane.stdin[job_id] = pipe
        stdin_iter = stdin_chunks(receive)
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
        plane.metrics.exec_seconds.labels(outcome=outcome).observe(time.perf_counter() - started)

    plane.spawn(lambda: run_job(plane, job_id, actor.tenant, job, release, done))
    first = sse("started", ExecStarted(exec_id=job_id, sandbox_id=sandbox_id))
    return StreamingResponse(
        job_events(plane, job_id, actor.tenant, -1, first),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@router.get(
    "/v1/execs/{exec_id}/events",
    tags=["commands"],
    responses=SSE_DOC,
    response_class=StreamingResponse,
    summary="Resume a command's event stream after the chunk named by Last-Event-ID.",
)
async def exec_events(
    exec_id: Annotated[str, Path(description="From the `started` event.")],
    actor: ActorDep,
    plane: PlaneDep,
    last_event_id: Annotated[str | None, Header(alias=LAST_EVENT_ID)] = None,
) -> StreamingResponse:
    after = resume_point(last_event_id)
    # Raises NotFound / OutputExpired before the stream starts.
    await plane.output.read(exec_id, tenant=actor.tenant, after=after, wait=0)
    return StreamingResponse(
        job_events(plane, exec_id, actor.tenant, after, None),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@router.post(
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


@router.put(
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
