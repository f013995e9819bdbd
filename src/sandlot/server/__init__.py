"""The HTTP control plane: a FastAPI app over the Manager, with API keys, quotas and MCP.

    from sandlot.server import ServerConfig, create_app

:func:`create_app` is imported on first use (PEP 562), so the client can import
:mod:`sandlot.server.wire` without loading FastAPI. This module only re-exports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandlot.server.app import ServerConfig, create_app
    from sandlot.server.keys import ApiKeyStore
    from sandlot.server.quotas import Quota

_LAZY = {
    "ApiKeyStore": "sandlot.server.keys",
    "Quota": "sandlot.server.quotas",
    "ServerConfig": "sandlot.server.app",
    "create_app": "sandlot.server.app",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'sandlot.server' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["ApiKeyStore", "Quota", "ServerConfig", "create_app"]
