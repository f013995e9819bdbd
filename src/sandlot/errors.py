"""The whole error tree of sandlot.

Every error a user can see is a :class:`SandboxError`. Each subclass also inherits the builtin
exception it resembles, so ``except LookupError`` keeps working for code that does not know us,
and each carries a stable ``code`` and an HTTP ``status`` so that an error crosses HTTP and MCP
and comes back as the same class (:func:`error_from_code`)::

    SandboxError                       code             status
    ├── InvalidRequest (ValueError)    invalid_request  422
    ├── Unauthenticated (PermissionError) unauthenticated 401
    ├── NotFound (LookupError)         not_found        404
    ├── OutputExpired                  output_expired   410
    ├── Conflict                       conflict         409
    ├── InvalidState (RuntimeError)    invalid_state    409
    ├── PolicyDenied (PermissionError) policy_denied    403
    ├── SandboxTimeout (TimeoutError)  timeout          504
    ├── QuotaExceeded                  quota_exceeded   429
    ├── NotSupported (NotImplementedError) not_supported 501
    ├── BackendUnavailable             backend_unavailable 503
    ├── BackendError                   backend_error    502
    │   └── VerificationFailed         verification_failed 502
    └── ExecFailed                     exec_failed      422   (only with ``check=True``)

Third-party exceptions are wrapped where they are caught (``raise BackendError(...) from e``);
they never reach users. This module imports nothing from sandlot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from sandlot.models import ExecResult

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "Conflict",
    "ExecFailed",
    "InvalidRequest",
    "InvalidState",
    "NotFound",
    "NotSupported",
    "OutputExpired",
    "PolicyDenied",
    "QuotaExceeded",
    "SandboxError",
    "SandboxTimeout",
    "Unauthenticated",
    "VerificationFailed",
    "error_from_code",
]


class SandboxError(Exception):
    """The root of every error sandlot raises on purpose."""

    code: ClassVar[str] = "sandbox_error"
    status: ClassVar[int] = 500

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, object] = details

    def __str__(self) -> str:
        return self.message

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox the error is about, when it names one (a failed creation names the
        sandbox it left, so ``with client.create(...)`` callers can clean up)."""
        for key in ("sandbox_id", "id"):
            value = self.details.get(key)
            if isinstance(value, str) and value.startswith("sb-"):
                return value
        return None

    def to_dict(self) -> dict[str, object]:
        """The error as JSON-able data (what HTTP and MCP send)."""
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidRequest(SandboxError, ValueError):
    """The request is malformed: a bad spec field, a relative path, a bad port."""

    code = "invalid_request"
    status = 422


class Unauthenticated(SandboxError, PermissionError):
    """The request carried no API key, or one that is unknown or revoked."""

    code = "unauthenticated"
    status = 401


class OutputExpired(SandboxError):
    """The command output a reader asked for is older than the server keeps."""

    code = "output_expired"
    status = 410


class NotFound(SandboxError, LookupError):
    """No such sandbox, process, file or snapshot (or it belongs to someone else)."""

    code = "not_found"
    status = 404


class Conflict(SandboxError):
    """A concurrent change won, or an idempotency key was reused with another request."""

    code = "conflict"
    status = 409


class InvalidState(SandboxError, RuntimeError):
    """The sandbox is in a state that does not allow this operation."""

    code = "invalid_state"
    status = 409


class PolicyDenied(SandboxError, PermissionError):
    """The policy gate denied the operation; nothing reached the sandbox."""

    code = "policy_denied"
    status = 403

    def __init__(
        self, message: str, *, reason_code: str = "POLICY_VIOLATION", receipt_id: str | None = None
    ) -> None:
        super().__init__(message, reason_code=reason_code, receipt_id=receipt_id)
        self.reason_code = reason_code
        self.receipt_id = receipt_id


class SandboxTimeout(SandboxError, TimeoutError):
    """An operation or a state transition took longer than allowed."""

    code = "timeout"
    status = 504


class QuotaExceeded(SandboxError):
    """A tenant's quota stayed exhausted until the request's deadline."""

    code = "quota_exceeded"
    status = 429


class NotSupported(SandboxError, NotImplementedError):
    """The backend cannot honour this call; it never silently downgrades."""

    code = "not_supported"
    status = 501


class BackendUnavailable(SandboxError):
    """The backend's runtime is missing or unreachable on this host."""

    code = "backend_unavailable"
    status = 503


class BackendError(SandboxError):
    """The backend's runtime failed while doing what we asked."""

    code = "backend_error"
    status = 502


class VerificationFailed(BackendError):
    """A verified reset found the sandbox not in the state it was reset to; ``details`` name
    the sources that diverged."""

    code = "verification_failed"
    status = 502


class ExecFailed(SandboxError):
    """A command exited non-zero and the caller asked for ``check=True``."""

    code = "exec_failed"
    status = 422

    def __init__(self, message: str, result: ExecResult, **details: object) -> None:
        details.pop("exit_code", None)
        super().__init__(message, exit_code=result.exit_code, **details)
        self.result = result


_BY_CODE: dict[str, type[SandboxError]] = {
    cls.code: cls
    for cls in (
        SandboxError,
        InvalidRequest,
        NotFound,
        Conflict,
        InvalidState,
        PolicyDenied,
        SandboxTimeout,
        QuotaExceeded,
        NotSupported,
        BackendUnavailable,
        BackendError,
        Unauthenticated,
        OutputExpired,
        VerificationFailed,
    )
}


def error_from_code(
    code: str, message: str, details: dict[str, object] | None = None
) -> SandboxError:
    """Rebuild the error class a remote side raised from its stable code.

    ``ExecFailed`` is not rebuilt here because it carries a result; callers that receive
    ``exec_failed`` build it from the result they also received.
    """
    details = dict(details or {})
    cls = _BY_CODE.get(code, SandboxError)
    if cls is PolicyDenied:
        reason = details.get("reason_code")
        receipt = details.get("receipt_id")
        return PolicyDenied(
            message,
            reason_code=reason if isinstance(reason, str) else "POLICY_VIOLATION",
            receipt_id=receipt if isinstance(receipt, str) else None,
        )
    return cls(message, **details)
