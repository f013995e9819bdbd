"""Sandbox networking: egress policy, egress proxy, network namespaces and published ports.

Backends use :class:`SandboxNetworks` (in :mod:`sandlot.network.service`); the pure policy
matcher lives in :mod:`sandlot.network.policy`. Names are loaded lazily so that the egress
daemon (``python -m sandlot.network.netd``) does not import pydantic and the models: it must
stay small, one per host. This package must not import backends, the store or front ends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandlot.network.policy import (
        CompiledPolicy,
        EgressEvent,
        Verdict,
        compile_policy,
        suggest,
    )
    from sandlot.network.service import SandboxNetwork, SandboxNetworks, proxy_env

__all__ = [
    "CompiledPolicy",
    "EgressEvent",
    "SandboxNetwork",
    "SandboxNetworks",
    "Verdict",
    "compile_policy",
    "proxy_env",
    "suggest",
]

_WHERE = {
    "CompiledPolicy": "policy",
    "EgressEvent": "policy",
    "Verdict": "policy",
    "compile_policy": "policy",
    "suggest": "policy",
    "SandboxNetwork": "service",
    "SandboxNetworks": "service",
    "proxy_env": "service",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        msg = f"module 'sandlot.network' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(f"sandlot.network.{module}"), name)
