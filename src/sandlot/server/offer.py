"""Which backends a server offers its tenants.

Every backend the Manager knows is offered, except development backends, which an operator
must enable (``ServerConfig.enable_backends``, ``sandlot serve --enable-backend fake``): the
``fake`` backend keeps every file a tenant writes in the server's memory and rewrites one
JSON file with all of them on every write, so any tenant could exhaust the server. Embedded
use (the SDK, tests handing in backends) is not a server and is not limited here.

This module must not import the Manager's internals, concrete backends or a web framework.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sandlot.backends.registry import BACKEND_NAMES
from sandlot.errors import InvalidRequest

__all__ = ["DEVELOPMENT_BACKENDS", "check_offered", "offered"]

DEVELOPMENT_BACKENDS = frozenset({"fake"})
"""Backends a server offers only when its operator enables them."""


def _is_offered(name: str, enabled: Collection[str]) -> bool:
    return name not in DEVELOPMENT_BACKENDS or name in enabled


def offered(backends: Mapping[str, object], default: str, enabled: Collection[str]) -> list[str]:
    """The backend names tenants may pick, sorted (``backends``: the Manager's)."""
    names = {default, *backends, *(n for n in BACKEND_NAMES if n in backends)}
    return sorted(n for n in names if _is_offered(n, enabled))


def check_offered(
    name: str, backends: Mapping[str, object], default: str, enabled: Collection[str]
) -> None:
    """Raise ``InvalidRequest`` naming the offered backends unless ``name`` is one."""
    if _is_offered(name, enabled):
        return
    available = ", ".join(offered(backends, default, enabled)) or "none"
    msg = (
        f"backend {name!r} is not enabled on this server (its operator enables it with "
        f"--enable-backend {name}); enabled backends: {available}"
    )
    raise InvalidRequest(msg, backend=name)
