"""File routes: download and upload a file (streamed, spooled to disk, with a SHA-256
``Content-Digest``), write several files (base64 JSON), list, remove, and the main process's
log as events.

Uploads take one of the tenant's upload slots and one of the server's; every upload refusal
names the one configured limit (:func:`sandlot.server.middleware.too_large`). This module must
not import backends or the store.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from sandlot.errors import InvalidRequest, SandboxError
from sandlot.models import Actor, FileInfo
from sandlot.server.deps import (
    ActorDep,
    FilePath,
    IdemDep,
    PlaneDep,
    SandboxId,
    json_response,
    resume_point,
    spooled,
)
from sandlot.server.jobs import SSE_DOC, SSE_HEADERS, sse
from sandlot.server.middleware import too_large
from sandlot.server.plane import Plane
from sandlot.server.problems import PayloadTooLarge, problem_body
from sandlot.server.wire import (
    DIGEST_HEADER,
    LAST_EVENT_ID,
    WriteFilesRequest,
    b64decode,
    b64encode,
    content_digest,
    parse_digest,
    refuse_digest_trailer,
)

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/v1/sandboxes/{sandbox_id}/files/content",
    tags=["files"],
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "description": f"The file; `{DIGEST_HEADER}` has its SHA-256.",
        }
    },
)
async def download(
    sandbox_id: SandboxId, path: FilePath, actor: ActorDep, plane: PlaneDep
) -> StreamingResponse:
    limit = plane.config.max_download_bytes
    spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed by the response
    try:
        digest = hashlib.sha256()
        size = 0
        async for chunk in plane.manager.stream_file(sandbox_id, path, actor=actor):
            size += len(chunk)
            if size > limit:
                msg = f"{path} is over this server's download limit of {limit} bytes"
                raise PayloadTooLarge(msg, limit=limit)
            digest.update(chunk)
            await anyio.to_thread.run_sync(spool.write, chunk)
        await anyio.to_thread.run_sync(spool.seek, 0)
    except BaseException:
        spool.close()
        raise
    return StreamingResponse(
        spooled(spool),
        media_type="application/octet-stream",
        headers={"Content-Length": str(size), DIGEST_HEADER: content_digest(digest.digest())},
    )


@router.put(
    "/v1/sandboxes/{sandbox_id}/files/content",
    tags=["files"],
    response_model=FileInfo,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            }
        }
    },
)
async def upload(
    sandbox_id: SandboxId,
    path: FilePath,
    request: Request,
    actor: ActorDep,
    plane: PlaneDep,
    key: IdemDep,
    mode: Annotated[int | None, Query(ge=0, le=0o7777, description="Permission bits.")] = None,
    digest_header: Annotated[str | None, Header(alias=DIGEST_HEADER)] = None,
) -> Response:
    limit = plane.config.max_upload_bytes
    refuse_digest_trailer(request.headers.get("trailer"))
    expected = parse_digest(digest_header)
    if digest_header and expected is None:
        msg = f"{DIGEST_HEADER} must be sha-256=:<base64>:"
        raise InvalidRequest(msg)
    digest = hashlib.sha256()
    size = 0
    release = await plane.upload_slot(actor.tenant)
    # Spooled to disk past 1 MiB, not held in memory, and only then written: a body that
    # does not match its digest (or breaks off) writes nothing.
    spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed below
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(too_large(limit, None, raw=True), limit=limit)
            digest.update(chunk)
            await anyio.to_thread.run_sync(spool.write, chunk)
        if expected is not None and expected != digest.digest():
            msg = f"the upload of {path} does not match its {DIGEST_HEADER} (corrupted in transit); nothing was written"
            raise InvalidRequest(msg)
        await anyio.to_thread.run_sync(spool.seek, 0)
        (info,) = await plane.manager.write_files(
            sandbox_id,
            {path: spooled(spool)},
            actor=actor,
            mode=mode,
            idempotency_key=key,
            digests={path: "sha256:" + digest.hexdigest()},
        )
    finally:
        spool.close()
        release()
    response = json_response(info)
    response.headers[DIGEST_HEADER] = content_digest(digest.digest())
    return response


@router.post("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_model=list[FileInfo])
async def write_files(
    sandbox_id: SandboxId,
    body: WriteFilesRequest,
    actor: ActorDep,
    plane: PlaneDep,
    key: IdemDep,
) -> Response:
    limit = plane.config.max_upload_bytes
    # Held in memory (the JSON, its strings, the decoded bytes), so it counts as an upload
    # against the tenant's and the server's concurrent uploads, like a streamed one.
    release = await plane.upload_slot(actor.tenant)
    try:
        files: dict[str, bytes] = {}
        size = 0
        for f in body.files:
            try:
                files[f.path] = b64decode(f.content)
            except ValueError:
                msg = f"content of {f.path} must be base64"
                raise InvalidRequest(msg) from None
            size += len(files[f.path])
            if size > limit:
                raise PayloadTooLarge(too_large(limit, None, raw=False), limit=limit)
        infos = await plane.manager.write_files(
            sandbox_id, files, actor=actor, mode=body.mode, idempotency_key=key
        )
    finally:
        release()
    return json_response(infos)


@router.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_model=list[FileInfo])
async def list_files(
    sandbox_id: SandboxId, path: FilePath, actor: ActorDep, plane: PlaneDep
) -> Response:
    return json_response(await plane.manager.list_files(sandbox_id, path, actor=actor))


@router.delete("/v1/sandboxes/{sandbox_id}/files", tags=["files"], status_code=204)
async def remove_file(
    sandbox_id: SandboxId,
    path: FilePath,
    actor: ActorDep,
    plane: PlaneDep,
    recursive: bool = False,
) -> Response:
    await plane.manager.remove_file(sandbox_id, path, actor=actor, recursive=recursive)
    return Response(status_code=204)


@router.get(
    "/v1/sandboxes/{sandbox_id}/logs",
    tags=["files"],
    responses=SSE_DOC,
    response_class=StreamingResponse,
    summary="The main process's log as events; each event's id is the byte offset after it.",
)
async def logs(
    sandbox_id: SandboxId,
    actor: ActorDep,
    plane: PlaneDep,
    follow: bool = False,
    offset: Annotated[int, Query(ge=0, le=1 << 50)] = 0,
    last_event_id: Annotated[str | None, Header(alias=LAST_EVENT_ID)] = None,
) -> StreamingResponse:
    start = resume_point(last_event_id, offset)
    start = max(start, 0)
    # Checked before the stream starts, so a foreign or unknown id is a plain 404.
    await plane.manager.get(sandbox_id, actor=actor)
    return StreamingResponse(
        _log_events(plane, sandbox_id, actor, start, follow),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _log_events(
    plane: Plane, sandbox_id: str, actor: Actor, offset: int, follow: bool
) -> AsyncIterator[bytes]:
    try:
        async for chunk in plane.manager.logs(
            sandbox_id, actor=actor, follow=follow, offset=offset
        ):
            offset += len(chunk)
            yield sse("data", {"data": b64encode(chunk)}, id=str(offset))
    except SandboxError as e:
        yield sse("error", problem_body(e))
        return
    yield sse("end", {"offset": offset})
