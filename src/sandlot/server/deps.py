"""What the routes take from a request and how they answer: keys, shared state, JSON.

The dependencies every route declares: the caller's :class:`~sandlot.models.Actor` from its
bearer key (checked against the database on every request, and noted so a revoked key's
streams end: :mod:`sandlot.server.sessions`), the app's :class:`~sandlot.server.plane.Plane`,
the ``Idempotency-Key`` header, and the path and query parameters several routes spell alike.
Also the response helpers they share: JSON bodies, problem responses, shielded state changes
and spooled file bodies.

This module must not import backends or the store.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable
from typing import IO, Annotated, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError
from sandlot.models import Actor
from sandlot.server.plane import Plane
from sandlot.server.problems import Unauthenticated, problem_body
from sandlot.server.sessions import note_key
from sandlot.server.wire import IDEMPOTENCY_HEADER, LAST_EVENT_ID, PROBLEM_TYPE

__all__ = [
    "ActorDep",
    "FilePath",
    "ForgetHost",
    "IdemDep",
    "PlaneDep",
    "ProcessId",
    "SandboxId",
    "SnapshotId",
    "authenticate",
    "bearer",
    "json_response",
    "problem",
    "require_admin",
    "resume_point",
    "shielded",
    "spooled",
]

T = TypeVar("T")

_CHUNK = 1 << 16
_IDEMPOTENCY = re.compile(r"^[\x21-\x7e]{1,255}$")

bearer = HTTPBearer(auto_error=False, description="An API key from `sandlot api-keys create`.")


def _plane(request: Request) -> Plane:
    plane: Plane = request.app.state.plane
    return plane


async def authenticate(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Actor:
    """Who the request acts as, from its bearer key (401 without a valid one)."""
    if credentials is None or not credentials.credentials:
        msg = "this request needs an API key: send `Authorization: Bearer <key>`"
        raise Unauthenticated(msg)
    info = await _plane(request).keys.identify(credentials.credentials)
    if info is None:
        msg = "the API key is unknown or revoked"
        raise Unauthenticated(msg)
    note_key(request.scope, info.id)
    return info.actor


async def _idempotency_key(
    key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_HEADER,
            description="Retry-safe key: a repeat with the same request returns the first outcome (create, exec, file writes, destroy); the same key with another request is a 409.",
        ),
    ] = None,
) -> str | None:
    # The Manager maps this onto the journal's intents (create, exec, write_files, destroy).
    if key is not None and not _IDEMPOTENCY.match(key):
        msg = f"{IDEMPOTENCY_HEADER} must be 1-255 visible ASCII characters"
        raise InvalidRequest(msg)
    return key


ActorDep = Annotated[Actor, Depends(authenticate)]
PlaneDep = Annotated[Plane, Depends(_plane)]
IdemDep = Annotated[str | None, Depends(_idempotency_key)]
SandboxId = Annotated[str, Path(description="Sandbox id.")]
SnapshotId = Annotated[str, Path(description="Snapshot id.")]
ProcessId = Annotated[str, Path(description="Process id (or the name it was started with).")]
FilePath = Annotated[str, Query(description="Absolute path inside the sandbox.")]
ForgetHost = Annotated[
    bool,
    Query(description="Close the record of a sandbox whose host is gone for good (host_lost)."),
]


def require_admin(actor: Actor) -> None:
    """Refuse (403 ``ADMIN_REQUIRED``) unless ``actor`` holds an admin key."""
    if not actor.admin:
        msg = "this operation needs an admin API key"
        raise PolicyDenied(msg, reason_code="ADMIN_REQUIRED")


def problem(error: SandboxError) -> JSONResponse:
    """``error`` as an ``application/problem+json`` response with its status."""
    return JSONResponse(problem_body(error), status_code=error.status, media_type=PROBLEM_TYPE)


def json_response(value: object, status: int = 200) -> Response:
    """``value`` (a model, a list of them, or plain JSON) as a JSON response."""
    return Response(_dumps(value), status_code=status, media_type="application/json")


def _dumps(value: object) -> bytes:
    if hasattr(value, "model_dump_json"):
        return str(value.model_dump_json()).encode()
    if isinstance(value, list):
        return b"[" + b",".join(_dumps(v) for v in value) + b"]"
    return json.dumps(value).encode()


def resume_point(value: str | None, default: int = -1) -> int:
    """The ``Last-Event-ID`` a client resumes after (``default`` when it sent none)."""
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        msg = f"{LAST_EVENT_ID} must be an integer, got {value!r}"
        raise InvalidRequest(msg) from None
    if n < -1:
        msg = f"{LAST_EVENT_ID} must be >= -1, got {n}"
        raise InvalidRequest(msg)
    return n


async def shielded(call: Awaitable[T]) -> T:
    """Finish a state change even if the client goes away: a half-done transition would
    leave the sandbox for reconcile to settle."""
    with anyio.CancelScope(shield=True):
        result = await call
    return result


async def spooled(spool: IO[bytes]) -> AsyncIterator[bytes]:
    """A spooled file's bytes, read off the event loop; closes the spool when done."""
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(spool.read, _CHUNK)
            if not chunk:
                return
            yield chunk
    finally:
        spool.close()
