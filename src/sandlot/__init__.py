"""sandlot: disposable computers for AI agents.

One API over several isolation backends, with records in a real database. Start with
:class:`Sandlot` (sync) or :class:`AsyncSandlot` (async). This module only re-exports.
"""

from sandlot._version import __version__
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    Conflict,
    ExecFailed,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    PolicyDenied,
    QuotaExceeded,
    SandboxError,
    SandboxTimeout,
)
from sandlot.models import (
    Actor,
    CommandSpec,
    DeathCertificate,
    ExecResult,
    FileInfo,
    GitSource,
    NetworkAllowlist,
    OutputChunk,
    PortMapping,
    ProcessInfo,
    Resources,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
)
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.sync import Sandbox, Sandlot

__all__ = [
    "Actor",
    "AsyncSandbox",
    "AsyncSandlot",
    "BackendError",
    "BackendUnavailable",
    "CommandSpec",
    "Conflict",
    "DeathCertificate",
    "ExecFailed",
    "ExecResult",
    "FileInfo",
    "GitSource",
    "InvalidRequest",
    "InvalidState",
    "NetworkAllowlist",
    "NotFound",
    "NotSupported",
    "OutputChunk",
    "PolicyDenied",
    "PortMapping",
    "ProcessInfo",
    "QuotaExceeded",
    "Resources",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxTimeout",
    "Sandlot",
    "SnapshotInfo",
    "__version__",
]
