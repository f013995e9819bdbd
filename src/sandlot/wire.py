"""The HTTP API's request and event bodies, shared by the server and the client.

Records (``SandboxInfo``, ``ExecResult``, …) travel as the models in :mod:`sandlot.models`;
this module adds only what is particular to HTTP: request bodies, the exec event stream, the
problem document, and header names. Bytes travel as base64 inside JSON. The request bodies are
also what the one sandbox handle (:mod:`sandlot.handle`) hands its control plane, in process or
over HTTP, so an operation's parameters are spelled once. This module lives outside
:mod:`sandlot.server` so the client imports it without the server package; it imports pydantic,
:mod:`sandlot.models` and :mod:`sandlot.errors` only (:mod:`sandlot.server.wire` re-exports it).

The exec event stream (``text/event-stream``)::

    event: started   data: {"exec_id": "ex-…", "sandbox_id": "sb-…"}     (first, new execs only)
    id: 0  event: output  data: {"stream": "stdout", "data": "<base64>"}
    id: 1  event: output  data: …
    event: result    data: <ExecResult>                                 (last, on success)
    event: error     data: <problem>                                    (last, on failure)

The ``id`` of an output event is the chunk's sequence number; ``GET …/execs/{exec_id}/events``
with ``Last-Event-ID: N`` replays from chunk ``N + 1``.

A background process's output (``GET …/processes/{process_id}/output``) is the same ``output``
events, numbered by the process's own chunk sequence (so ``Last-Event-ID: N`` resumes at chunk
``N + 1``), then ``event: end data: {"next_offset": n}`` (or an ``error`` event). A
``follow=true`` stream that fell too far behind the output ends instead with
``event: dropped data: {"next_offset": n, "buffer_bytes": …, "detail": …}``: resume at ``n``.

A terminal is a WebSocket, ``GET /v1/sandboxes/{id}/pty`` with the usual ``Authorization``
header and the program in the query: ``command`` (a string run under ``sh -c``) or repeated
``argv``, and ``rows``, ``cols``, ``cwd``, repeated ``env=NAME=VALUE``. Everything that can fail
(the key, the sandbox, the policy) fails before the upgrade, as a plain problem response with
its status. Once open, binary frames carry terminal bytes both ways; text frames carry JSON
control messages: the server first sends :class:`PtyOpened`, the client may send
:class:`PtyResize`, and when the program exits the server sends :class:`PtyExit` and closes
(code 1000). A client that disconnects hangs the terminal up (its program gets SIGHUP).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from sandlot.errors import InvalidRequest
from sandlot.models import CommandSpec, JsonValue, NetworkPolicy, SandboxSpec

__all__ = [
    "DIGEST_HEADER",
    "IDEMPOTENCY_HEADER",
    "LAST_EVENT_ID",
    "PROBLEM_TYPE",
    "PTY_CLOSE_ERROR",
    "CreateRequest",
    "ExecRequest",
    "ExecStarted",
    "ExplainRequest",
    "ExposePortRequest",
    "FileUpload",
    "ForkRequest",
    "KeepAliveRequest",
    "LogEvent",
    "NetworkRequest",
    "OutputEnd",
    "OutputEvent",
    "PtyError",
    "PtyExit",
    "PtyOpened",
    "PtyResize",
    "ReconcileRequest",
    "ReconcileResponse",
    "ResetRequest",
    "RestoreRequest",
    "Seconds",
    "SignalRequest",
    "StartProcessRequest",
    "StopExpiredResponse",
    "VersionInfo",
    "WaitRequest",
    "WriteFilesRequest",
    "b64decode",
    "b64encode",
    "content_digest",
    "parse_digest",
    "refuse_digest_trailer",
]

PROBLEM_TYPE = "application/problem+json"
"""Media type of error bodies (RFC 9457)."""
DIGEST_HEADER = "Content-Digest"
"""RFC 9530 digest of a file body, ``sha-256=:<base64>:``; both sides check it."""
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""Accepted on mutating requests; the journal maps it to an intent (not enforced yet)."""
LAST_EVENT_ID = "Last-Event-ID"
"""The SSE resume header: the last output sequence number the client has."""

PTY_CLOSE_ERROR = 4500
"""WebSocket close code after a :class:`PtyError` (the terminal broke, not the program)."""

_MAX_SECONDS = 10 * 365 * 86400.0
"""Longest duration the API accepts (ten years): beyond it, datetime arithmetic overflows."""

Seconds = Annotated[float, Field(gt=0, le=_MAX_SECONDS, allow_inf_nan=False)]


def b64encode(data: bytes) -> str:
    """Bytes as base64 text."""
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    """Base64 text as bytes (``ValueError`` when malformed)."""
    return base64.b64decode(text.encode("ascii"), validate=True)


def content_digest(sha256: bytes) -> str:
    """An RFC 9530 ``Content-Digest`` value from a raw SHA-256 digest."""
    return f"sha-256=:{b64encode(sha256)}:"


def refuse_digest_trailer(trailer: str | None) -> None:
    """Refuse a request that announces its ``Content-Digest`` as a trailer.

    Trailers of a chunked body never reach the application (ASGI has no place for them), so
    a digest sent there would be silently unchecked: a corrupted upload would be written.
    """
    names = {name.strip().lower() for name in (trailer or "").split(",")}
    if DIGEST_HEADER.lower() in names:
        msg = (
            f"{DIGEST_HEADER} was announced as a trailer, which this server cannot check: "
            f"send it as a header (computed before the body)"
        )
        raise InvalidRequest(msg)


def parse_digest(value: str | None) -> bytes | None:
    """The raw SHA-256 digest in a ``Content-Digest`` value (None when absent or not sha-256)."""
    if not value:
        return None
    for part in value.split(","):
        name, _, rest = part.strip().partition("=")
        if name.strip().lower() == "sha-256" and rest.startswith(":") and rest.endswith(":"):
            try:
                raw = b64decode(rest[1:-1])
            except ValueError:
                return None
            return raw if len(raw) == hashlib.sha256().digest_size else None
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class CreateRequest(_Body):
    """``POST /v1/sandboxes``."""

    spec: SandboxSpec = Field(default_factory=SandboxSpec)
    """What to create."""
    backend: str | None = Field(default=None, max_length=64)
    """Backend name (default: the server's)."""
    git_auth: str | None = Field(default=None, max_length=8192)
    """``spec.git.auth``, which a spec never serializes: sent once, never stored."""


class ExecRequest(_Body):
    """``POST /v1/sandboxes/{id}/exec`` and ``…/execs``."""

    command: str | CommandSpec | list[Annotated[str, Field(max_length=1 << 16)]]
    """A string runs under ``sh -c``; a list or a CommandSpec is an exact argv."""
    cwd: str | None = Field(default=None, max_length=4096)
    """Working directory (default: the spec's workdir)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables."""
    timeout: Seconds | None = None
    """Seconds before the whole process tree is killed (exit code 124)."""
    stdin: str | None = None
    """Input, base64; for input streamed while the command runs, use ``stdin_stream``."""
    stdin_stream: bool = False
    """Input arrives by ``PUT …/execs/{exec_id}/stdin`` (streamed execs only)."""
    check: bool = False
    """Fail with ``exec_failed`` (carrying the result) on a non-zero exit."""
    auto_resume: bool = True
    """Resume a stopped sandbox first (else ``invalid_state``)."""
    collect_output: bool = True
    """Put the output in the result too (false: only stream it, for output too big to hold;
    the result's ``stdout``/``stderr`` are then empty)."""


class StartProcessRequest(_Body):
    """``POST /v1/sandboxes/{id}/processes``: a program started in the background."""

    command: str | CommandSpec | list[Annotated[str, Field(max_length=1 << 16)]]
    """A string runs under ``sh -c``; a list or a CommandSpec is an exact argv."""
    cwd: str | None = Field(default=None, max_length=4096)
    """Working directory (default: the spec's workdir)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables."""
    name: str | None = Field(default=None, min_length=1, max_length=128)
    """A name to find it by (unique among running processes)."""


class SignalRequest(_Body):
    """``POST /v1/sandboxes/{id}/processes/{process_id}/signal``."""

    signal: int = Field(default=15, ge=1, le=64)
    """Signal number (default SIGTERM); it goes to the process's whole tree."""


class WaitRequest(_Body):
    """``POST /v1/sandboxes/{id}/processes/{process_id}/wait``."""

    timeout: Seconds | None = None
    """Seconds to wait before ``timeout`` (504); default: until it exits."""


class OutputEnd(_Body):
    """The ``end`` event of a process's output stream."""

    next_offset: int
    """The offset to read on from (one past the last chunk sent)."""


class PtyOpened(_Body):
    """The server's first text frame on a terminal WebSocket."""

    type: Literal["opened"] = "opened"
    id: str
    """The terminal's handle."""


class PtyResize(_Body):
    """A text frame from the client: change the window size."""

    type: Literal["resize"] = "resize"
    rows: int = Field(ge=1, le=65535)
    """Rows."""
    cols: int = Field(ge=1, le=65535)
    """Columns."""


class PtyExit(_Body):
    """The server's last text frame: the program exited."""

    type: Literal["exit"] = "exit"
    exit_code: int
    """Its exit code (``128 + N`` when killed by signal N)."""


class PtyError(_Body):
    """A text frame from the server: a control message was refused, or (before a close with
    :data:`PTY_CLOSE_ERROR`) the terminal broke."""

    type: Literal["error"] = "error"
    problem: dict[str, JsonValue]
    """The problem document (with sandlot's ``code``)."""


class ExecStarted(_Body):
    """The first event of a new exec stream."""

    exec_id: str
    """Handle to resume the stream with."""
    sandbox_id: str
    """The sandbox it runs in."""


class OutputEvent(_Body):
    """An ``output`` event."""

    stream: Literal["stdout", "stderr"]
    """Which stream."""
    data: str
    """The bytes, base64."""


class LogEvent(_Body):
    """A ``data`` event of the log stream; its SSE id is the byte offset after it."""

    data: str
    """The bytes, base64."""


class FileUpload(_Body):
    """One file of ``POST /v1/sandboxes/{id}/files``."""

    path: str = Field(max_length=4096)
    """Absolute path inside the sandbox."""
    content: str
    """The bytes, base64."""


class WriteFilesRequest(_Body):
    """``POST /v1/sandboxes/{id}/files``: several files at once."""

    files: list[FileUpload] = Field(max_length=10_000)
    """The files."""
    mode: int | None = Field(default=None, ge=0, le=0o7777)
    """Permission bits for every file (default: 0644 for new files)."""


class KeepAliveRequest(_Body):
    """``POST /v1/sandboxes/{id}/keep-alive``."""

    seconds: Seconds
    """New time to live, from now (never shortens it)."""


class RestoreRequest(_Body):
    """``POST /v1/sandboxes/{id}/restore``."""

    snapshot_id: str = Field(max_length=64)
    """The snapshot to go back to."""


class ResetRequest(_Body):
    """``POST /v1/sandboxes/{id}/reset``."""

    snapshot_id: str | None = Field(default=None, max_length=64)
    """The snapshot to go back to (default: the state the sandbox was created in)."""


class NetworkRequest(_Body):
    """``PUT /v1/sandboxes/{id}/network``."""

    network: NetworkPolicy
    """``"allow-all"``, ``"deny-all"`` or an allowlist."""


class ForkRequest(_Body):
    """``POST /v1/sandboxes/{id}/fork`` and ``/v1/snapshots/{id}/fork``."""

    count: int = Field(default=1, ge=1, le=1000)
    """How many sandboxes to make."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels laid over the source's."""


class ExposePortRequest(_Body):
    """``POST /v1/sandboxes/{id}/ports``."""

    port: int = Field(ge=1, le=65535)
    """Port inside the sandbox."""


class ReconcileRequest(_Body):
    """``POST /v1/reconcile`` (admin keys only)."""

    ids: list[Annotated[str, Field(max_length=64)]] | None = None
    """Only these sandboxes (default: all, and reap orphans)."""


class ReconcileResponse(_Body):
    """What reconcile changed."""

    checked: int = 0
    """Records looked at."""
    updated: dict[str, str] = Field(default_factory=dict)
    """Sandbox id -> what happened."""
    reaped: list[str] = Field(default_factory=list)
    """Orphans destroyed."""
    errors: dict[str, str] = Field(default_factory=dict)
    """What could not be checked, stopped or destroyed, and why."""
    expired: list[str] = Field(default_factory=list)
    """Sandboxes past their TTL or idle timeout, stopped (a full reconcile sweeps too)."""
    discarded: list[str] = Field(default_factory=list)
    """Failed creations whose time for inspection ran out, destroyed."""


class StopExpiredResponse(_Body):
    """``POST /v1/stop-expired`` (admin keys only): the sweep."""

    checked: int = 0
    """Sandboxes that were due."""
    stopped: list[str] = Field(default_factory=list)
    """Ids of the sandboxes stopped past their TTL or idle timeout."""
    discarded: list[str] = Field(default_factory=list)
    """Failed creations whose time for inspection ran out, destroyed."""
    errors: dict[str, str] = Field(default_factory=dict)
    """Sandboxes that could not be stopped or destroyed, and why."""


class ExplainRequest(_Body):
    """``POST /v1/sandboxes/{id}/explain``: a dry run of the policy."""

    action: str = Field(min_length=1, max_length=64)
    """The operation (``exec``, ``fs.write``, …)."""
    args: dict[str, JsonValue] = Field(default_factory=dict)
    """Its arguments (``command``, ``path``, …)."""


class VersionInfo(_Body):
    """``GET /version``."""

    version: str
    """sandlot's version."""
    api: str = "v1"
    """The HTTP API's version."""
    backends: list[str] = Field(default_factory=list)
    """Backends this server offers."""
    default_backend: str = ""
    """Where new sandboxes go unless asked."""
