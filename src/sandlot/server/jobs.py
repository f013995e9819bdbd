"""Server-side jobs and their event streams: commands (and creations) that outlive a request.

A streamed exec, or a create with ``Accept: text/event-stream``, runs as a job detached from
the request that started it: :func:`run_job` writes its output and finally its outcome to the
server's :class:`~sandlot.server.outputlog.ExecOutputLog`, and :func:`job_events` reads them
back as server-sent events numbered by chunk, so a client that loses the connection resumes
with ``Last-Event-ID`` and misses nothing, and a job whose stream was lost is never run twice.
The server knows each running job by its exec id (:class:`Job`: whose it is and how its
client cancels it) and each streamed-stdin exec's input pipe (:class:`StdinPipe`). This module
also spells the SSE framing every event stream of the API uses (:func:`sse`).

This module must not import backends, the store, or FastAPI's routing (routes import it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sandlot.errors import BackendUnavailable, InvalidState, PolicyDenied, SandboxError
from sandlot.gate.gate import Approval, hold_listener
from sandlot.models import OutputChunk
from sandlot.server.outputlog import ExecOutcome
from sandlot.server.problems import problem_body
from sandlot.server.wire import b64encode

if TYPE_CHECKING:
    from sandlot.server.plane import Plane

__all__ = [
    "KEEPALIVE",
    "SSE_DOC",
    "SSE_HEADERS",
    "Job",
    "JobBody",
    "StdinPipe",
    "job_events",
    "run_job",
    "sse",
    "stdin_chunks",
]

log = logging.getLogger("sandlot.server")

KEEPALIVE = 15.0
"""Seconds between SSE comments on a silent stream, so proxies keep the connection."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DOC: dict[int | str, dict[str, object]] = {
    200: {
        "description": "Server-sent events (see sandlot.server.wire).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}

JobBody = Callable[[Callable[[OutputChunk], Awaitable[None]]], Awaitable[dict[str, object]]]
"""A job's work: given where its output goes, the JSON of its result."""


def sse(event: str, data: object, *, id: str | None = None) -> bytes:
    """One server-sent event (a model is sent as its JSON)."""
    payload = data.model_dump_json() if hasattr(data, "model_dump_json") else json.dumps(data)
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {payload}\n\n".encode()


@dataclass
class Job:
    """A streamed job running on the server: whose it is, and how its client cancels it."""

    tenant: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass
class StdinPipe:
    """The input of a streamed-stdin exec, between its PUT request and the command."""

    tenant: str
    send: MemoryObjectSendStream[bytes]
    receive: MemoryObjectReceiveStream[bytes]
    attached: anyio.Event = field(default_factory=anyio.Event)


async def job_events(
    plane: Plane, job_id: str, tenant: str, after: int, first: bytes | None
) -> AsyncIterator[bytes]:
    """A job's events from chunk ``after + 1`` on, until its outcome."""
    if first is not None:
        yield first
    while True:
        try:
            page = await plane.output.read(job_id, tenant=tenant, after=after, wait=KEEPALIVE)
        except SandboxError as e:
            yield sse("error", problem_body(e))
            return
        for c in page.chunks:
            if c.stream == "notice":
                yield sse("notice", json.loads(c.data), id=str(c.seq))
            else:
                yield sse("output", {"stream": c.stream, "data": b64encode(c.data)}, id=str(c.seq))
            after = c.seq
        if page.outcome is not None:
            if page.outcome.error is not None:
                yield sse("error", page.outcome.error)
            else:
                yield sse("result", page.outcome.result)
            return
        if not page.chunks:
            yield b": keep-alive\n\n"


async def run_job(
    plane: Plane,
    job_id: str,
    tenant: str,
    body: JobBody,
    release: Callable[[], None],
    on_done: Callable[[str], None] | None = None,
) -> None:
    """Run ``body`` detached from any request, writing its output and outcome to the log."""

    async def on_output(chunk: OutputChunk) -> None:
        await plane.output.append(job_id, chunk.stream, chunk.data)

    async def on_hold(approval: Approval) -> None:
        # The client waiting on this job learns at once how to get it approved.
        notice = {"kind": "held", "approval": approval.to_dict()}
        await plane.output.append(job_id, "notice", json.dumps(notice).encode())

    hold_listener.set(on_hold)  # this task's context: only this job's holds
    outcome = "error"
    job = Job(tenant)
    plane.jobs[job_id] = job
    try:
        try:
            with job.scope:
                result = await body(on_output)
            if job.scope.cancelled_caught:
                # Cancelled by its client (``POST /v1/execs/{id}/cancel``): the command's tree
                # was killed, a creation's half-made sandbox destroyed.
                msg = "cancelled by its client"
                raise InvalidState(msg, exec_id=job_id, cancelled=True)
            outcome = "ok"
            done = ExecOutcome(result=result)
        except SandboxError as e:
            if isinstance(e, PolicyDenied):
                plane.metrics.policy_decisions.labels(outcome="deny").inc()
            done = ExecOutcome(error=problem_body(e))
        except Exception as e:  # a bug below us must still end the stream, with its cause
            log.exception("job %s failed", job_id)
            err = SandboxError(f"internal error: {type(e).__name__}: {e}")
            done = ExecOutcome(error=problem_body(err))
        except BaseException:
            # Cancelled (the server is shutting down): readers learn the outcome is unknown.
            err = BackendUnavailable(
                "the server stopped while the command ran; its outcome is unknown",
                outcome="unknown",
                exec_id=job_id,
            )
            with anyio.CancelScope(shield=True):
                await plane.output.finish(job_id, ExecOutcome(error=problem_body(err)))
            raise
        await plane.output.finish(job_id, done)
    finally:
        plane.jobs.pop(job_id, None)
        release()
        pipe = plane.stdin.pop(job_id, None)
        if pipe is not None:
            # Unblocks a PUT still feeding input the command will never read.
            pipe.receive.close()
        if on_done is not None:
            on_done(outcome)


async def stdin_chunks(receive: anyio.abc.ObjectReceiveStream[bytes]) -> AsyncIterator[bytes]:
    """A streamed-stdin exec's input, as the command reads it."""
    async with receive:
        async for chunk in receive:
            yield chunk
