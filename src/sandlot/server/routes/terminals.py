"""The terminal route: a PTY over a WebSocket (``/v1/sandboxes/{id}/pty``; frames in
:mod:`sandlot.server.wire`).

A refusal (no key, a bad parameter, a policy denial) is a plain problem response before the
upgrade; an open terminal holds one of the tenant's exec slots until it closes, and relays
bytes both ways until its program exits or the client goes away. This module must not import
backends or the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import anyio
from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocketDisconnect

from sandlot.channel.base import PtySession
from sandlot.errors import InvalidRequest, PolicyDenied, SandboxError
from sandlot.models import Actor, Command
from sandlot.server.deps import problem
from sandlot.server.plane import Plane
from sandlot.server.problems import Unauthenticated, problem_body
from sandlot.server.sessions import note_key
from sandlot.server.wire import PTY_CLOSE_ERROR, PtyError, PtyExit, PtyOpened, PtyResize

__all__ = ["router"]

router = APIRouter()


@router.websocket("/v1/sandboxes/{sandbox_id}/pty")
async def pty(websocket: WebSocket, sandbox_id: str) -> None:
    plane: Plane = websocket.app.state.plane
    await _pty_session(plane, websocket, sandbox_id)


_PTY_PARAMS = frozenset({"command", "argv", "rows", "cols", "cwd", "env"})


async def _ws_actor(plane: Plane, websocket: WebSocket) -> Actor:
    scheme, _, key = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        msg = "this request needs an API key: send `Authorization: Bearer <key>`"
        raise Unauthenticated(msg)
    info = await plane.keys.identify(key.strip())
    if info is None:
        msg = "the API key is unknown or revoked"
        raise Unauthenticated(msg)
    note_key(websocket.scope, info.id)
    return info.actor


def _pty_params(
    query: QueryParams,
) -> tuple[Command | list[str] | None, int, int, str | None, dict[str, str]]:
    """``(command, rows, cols, cwd, env)`` from a terminal's query string."""
    unknown = set(query.keys()) - _PTY_PARAMS
    if unknown:
        msg = f"unknown terminal parameters: {', '.join(sorted(unknown))} (known: {', '.join(sorted(_PTY_PARAMS))})"
        raise InvalidRequest(msg)
    argv = query.getlist("argv")
    command = query.get("command")
    if argv and command is not None:
        msg = "give the terminal's program as command or as argv, not both"
        raise InvalidRequest(msg)
    size = []
    for name, default in (("rows", 24), ("cols", 80)):
        raw = query.get(name)
        if raw is None:
            size.append(default)
            continue
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            msg = f"{name} must be 1..65535, got {raw!r}"
            raise InvalidRequest(msg)
        size.append(int(raw))
    env = {}
    for pair in query.getlist("env"):
        name, sep, value = pair.partition("=")
        if not sep or not name:
            msg = f"env must be NAME=VALUE, got {pair!r}"
            raise InvalidRequest(msg)
        env[name] = value
    return argv or command, size[0], size[1], query.get("cwd"), env


async def _pty_session(plane: Plane, websocket: WebSocket, sandbox_id: str) -> None:
    """Serve one terminal: refuse before the upgrade (a plain problem response) or relay
    bytes both ways until the program exits or the client goes away."""
    try:
        actor = await _ws_actor(plane, websocket)
        command, rows, cols, cwd, env = _pty_params(websocket.query_params)
        # An open terminal holds one of the tenant's exec slots until it closes.
        release = await plane.execs.acquire(actor.tenant)
        try:
            session = await plane.manager.open_pty(
                sandbox_id, command, actor=actor, rows=rows, cols=cols, cwd=cwd, env=env
            )
        except BaseException:
            release()
            raise
    except SandboxError as e:
        if isinstance(e, PolicyDenied):
            plane.metrics.policy_decisions.labels(outcome="deny").inc()
        try:
            await websocket.send_denial_response(problem(e))
        except RuntimeError:
            # A server without the denial-response extension: refuse the upgrade (403).
            await websocket.close(1008, e.message[:120])
        return
    sending = anyio.Lock()

    async def send(text: str | None = None, data: bytes | None = None) -> None:
        async with sending:
            if data is not None:
                await websocket.send_bytes(data)
            else:
                await websocket.send_text(text or "")

    try:
        await websocket.accept()
        await send(PtyOpened(id=session.id).model_dump_json())
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pty_output, websocket, session, send, tg.cancel_scope)
            await _pty_input(websocket, session, send)
            tg.cancel_scope.cancel()
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client went away: the terminal is hung up below
    finally:
        try:
            with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError, OSError):
                await session.close()
        finally:
            release()


async def _pty_output(
    websocket: WebSocket,
    session: PtySession,
    send: Callable[..., Awaitable[None]],
    scope: anyio.CancelScope,
) -> None:
    try:
        try:
            while data := await session.read():
                await send(data=data)
            code = await session.wait()
        except SandboxError as e:
            await send(PtyError(problem=problem_body(e)).model_dump_json())
            await websocket.close(PTY_CLOSE_ERROR)
        else:
            await send(PtyExit(exit_code=code).model_dump_json())
            await websocket.close(1000)
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client is gone; nobody is left to tell
    scope.cancel()


async def _pty_input(
    websocket: WebSocket, session: PtySession, send: Callable[..., Awaitable[None]]
) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("bytes")
        if data is not None:
            with contextlib.suppress(SandboxError):
                # Keystrokes after the program exited go nowhere; the output side reports
                # the exit.
                await session.write(data)
            continue
        try:
            resize = PtyResize.model_validate_json(message.get("text") or "")
            await session.resize(resize.rows, resize.cols)
        except ValidationError as e:
            error = InvalidRequest(f"not a terminal control message: {e.errors()[0]['msg']}")
            await send(PtyError(problem=problem_body(error)).model_dump_json())
        except SandboxError as e:
            await send(PtyError(problem=problem_body(e)).model_dump_json())
