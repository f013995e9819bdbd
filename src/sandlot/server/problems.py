"""Errors as RFC 9457 problem documents, carrying sandlot's stable error ``code``.

The client reads ``code`` back into the same exception class the in-process SDK raises
(:func:`sandlot.errors.error_from_code`); ``exec_failed`` also carries the command's
``result``, so ``ExecFailed.result`` survives the trip. This module must not import the
Manager, backends or a web framework.
"""

from __future__ import annotations

import json

from sandlot.errors import ExecFailed, InvalidRequest, SandboxError, Unauthenticated

__all__ = ["PayloadTooLarge", "Unauthenticated", "problem_body"]


class PayloadTooLarge(InvalidRequest):
    """A body (or a file to download) is bigger than the server's configured limit.

    It keeps ``invalid_request`` as its code, so a client raises ``InvalidRequest`` (a
    ``ValueError``), while the HTTP status says 413.
    """

    status = 413


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def problem_body(error: SandboxError) -> dict[str, object]:
    """The problem document for ``error``."""
    body: dict[str, object] = {
        "type": f"urn:sandlot:error:{error.code}",
        "title": type(error).__name__,
        "status": error.status,
        "detail": error.message,
        "code": error.code,
        "details": {k: _jsonable(v) for k, v in error.details.items()},
    }
    if isinstance(error, ExecFailed):
        body["result"] = error.result.model_dump(mode="json")
    return body
