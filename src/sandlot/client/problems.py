"""How the HTTP client turns what a server sent into sandlot's errors, and the small pieces
of request shaping its modules share (path quoting, the idempotency header).

The server sends each error's stable ``code`` (in a problem document, an SSE ``error`` event or
a terminal's control frame); :func:`problem_error` raises the class it names, so an error that
crossed HTTP is the same class as in process. This module imports httpx, :mod:`sandlot.errors`,
:mod:`sandlot.models` and :mod:`sandlot.wire` only.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx

from sandlot.client.sse import Event
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    ExecFailed,
    InvalidRequest,
    NotFound,
    SandboxError,
    error_from_code,
)
from sandlot.models import ExecResult
from sandlot.wire import IDEMPOTENCY_HEADER

__all__ = [
    "StreamEnded",
    "Unreachable",
    "event_error",
    "key_header",
    "problem_error",
    "quote_segment",
    "response_error",
]


def response_error(response: httpx.Response) -> SandboxError:
    """The sandlot error a failed response carries."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = body["code"]
        message = str(body.get("detail") or body.get("title") or code)
        details = body.get("details")
        details = details if isinstance(details, dict) else {}
        return problem_error(code, message, details, body.get("result"))
    text = response.text[:300].strip()
    status = response.status_code
    msg = f"the server answered {status} {response.reason_phrase}" + (f": {text}" if text else "")
    if status == 404:
        return NotFound(msg)
    if status == 413:
        return InvalidRequest(msg)
    if status in (502, 503, 504):
        return BackendUnavailable(msg)
    return BackendError(msg)


def problem_error(
    code: str, message: str, details: dict[str, object], result: object = None
) -> SandboxError:
    if code == ExecFailed.code and isinstance(result, dict):
        return ExecFailed(message, ExecResult.model_validate(result), **details)
    return error_from_code(code, message, details)


def key_header(key: str | None) -> dict[str, str]:
    return {} if key is None else {IDEMPOTENCY_HEADER: key}


def quote_segment(value: str) -> str:
    return quote(value, safe="")


def event_error(ev: Event) -> SandboxError:
    try:
        body = ev.json()
    except ValueError:
        return BackendError(f"the server sent an unreadable error event: {ev.data[:200]}")
    details = body.get("details")
    return problem_error(
        str(body.get("code", "")),
        str(body.get("detail") or body.get("code")),
        details if isinstance(details, dict) else {},
        body.get("result"),
    )


class Unreachable(BackendUnavailable):
    """The server could not be connected to: the request was never sent."""


class StreamEnded(Exception):
    """A job's event stream closed without a result or an error (the server went away)."""
