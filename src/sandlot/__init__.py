"""sandlot: disposable computers for AI agents.

One API over several isolation backends, with records in a real database. Start with
:class:`Sandlot` (sync) or :class:`AsyncSandlot` (async). This module only re-exports.
"""

from __future__ import annotations

import importlib

from sandlot._version import __version__

# Not typing.TYPE_CHECKING: importing typing is most of what `sandlot --version` would cost
# (type checkers treat any name TYPE_CHECKING as true).
TYPE_CHECKING = False

if TYPE_CHECKING:
    from sandlot.api import SandboxAPI, SandlotAPI
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
    from sandlot.facade import Sandbox
    from sandlot.handle import AsyncSandbox
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
    from sandlot.sdk import AsyncSandlot
    from sandlot.sync import Sandlot
    from sandlot.terminal import AsyncTerminal, Terminal

# Imported on first use (PEP 562), so that `import sandlot.x` for a small piece (the agent,
# the network daemon) does not pay for pydantic, SQLAlchemy and the SDK.
_LAZY = {
    "Actor": "sandlot.models",
    # The handles come from their own light modules: importing one loads no Manager.
    "AsyncSandbox": "sandlot.handle",
    "AsyncSandlot": "sandlot.sdk",
    "AsyncTerminal": "sandlot.terminal",
    "BackendError": "sandlot.errors",
    "BackendUnavailable": "sandlot.errors",
    "CommandSpec": "sandlot.models",
    "Conflict": "sandlot.errors",
    "DeathCertificate": "sandlot.models",
    "ExecFailed": "sandlot.errors",
    "ExecResult": "sandlot.models",
    "FileInfo": "sandlot.models",
    "GitSource": "sandlot.models",
    "InvalidRequest": "sandlot.errors",
    "InvalidState": "sandlot.errors",
    "NetworkAllowlist": "sandlot.models",
    "NotFound": "sandlot.errors",
    "NotSupported": "sandlot.errors",
    "OutputChunk": "sandlot.models",
    "PolicyDenied": "sandlot.errors",
    "PortMapping": "sandlot.models",
    "ProcessInfo": "sandlot.models",
    "QuotaExceeded": "sandlot.errors",
    "Resources": "sandlot.models",
    "Sandbox": "sandlot.facade",
    "SandboxAPI": "sandlot.api",
    "SandboxError": "sandlot.errors",
    "SandboxInfo": "sandlot.models",
    "SandboxSpec": "sandlot.models",
    "SandboxStatus": "sandlot.models",
    "SandboxTimeout": "sandlot.errors",
    "Sandlot": "sandlot.sync",
    "SandlotAPI": "sandlot.api",
    "SnapshotInfo": "sandlot.models",
    "Terminal": "sandlot.terminal",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'sandlot' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Actor",
    "AsyncSandbox",
    "AsyncSandlot",
    "AsyncTerminal",
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
    "SandboxAPI",
    "SandboxError",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxTimeout",
    "Sandlot",
    "SandlotAPI",
    "SnapshotInfo",
    "Terminal",
    "__version__",
]
