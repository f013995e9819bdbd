"""Backends by name, constructed on first use.

A home (``$SANDLOT_HOME``) may hold sandboxes on several backends; an existing sandbox is
always found by id whatever its backend, so the Manager gets every backend this host knows,
and each is built only when something touches it. This is the only module that imports
concrete backends.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import final

from sandlot.backends.base import Backend
from sandlot.config import backend_dir
from sandlot.errors import InvalidRequest

__all__ = ["BACKEND_NAMES", "Backends", "default_backend_name"]


def _fake(home: Path, **options: object) -> Backend:
    from sandlot.backends.fake import FakeBackend

    # The CLI is one process per command, so the fake keeps its sandboxes in a file there.
    return FakeBackend(state_file=backend_dir(home, "fake") / "state.json")


def _local(home: Path, **options: object) -> Backend:
    from sandlot.backends.local import LocalBackend
    from sandlot.network.service import SandboxNetworks

    state = backend_dir(home, "local")
    return LocalBackend(state, networks=SandboxNetworks(state / "network"), **options)  # type: ignore[arg-type]


def _microvm(home: Path, **options: object) -> Backend:
    from sandlot.backends.microvm import MicrovmBackend

    return MicrovmBackend(backend_dir(home, "microvm"), **options)  # type: ignore[arg-type]


_FACTORIES: dict[str, Callable[..., Backend]] = {
    "fake": _fake,
    "local": _local,
    "microvm": _microvm,
}

BACKEND_NAMES = tuple(_FACTORIES)
"""Every backend name this build knows."""


def _importable(name: str) -> bool:
    return name == "fake" or importlib.util.find_spec(f"sandlot.backends.{name}") is not None


def default_backend_name(explicit: str | None = None) -> str:
    """``explicit``, else ``$SANDLOT_BACKEND``, else ``local`` (``fake`` where this build has
    no ``local`` backend)."""
    name = (
        explicit
        or os.environ.get("SANDLOT_BACKEND")
        or ("local" if _importable("local") else "fake")
    )
    if name not in _FACTORIES:
        msg = f"unknown backend {name!r}; known backends: {', '.join(BACKEND_NAMES)}"
        raise InvalidRequest(msg)
    return name


@final
class Backends(Mapping[str, Backend]):
    """A mapping of backend name to backend that builds each one on first access.

    Iterating yields the backends in use on this home (built already, or with a state
    directory), so ``reconcile`` visits exactly those.
    """

    def __init__(
        self,
        home: Path,
        *,
        extra: Mapping[str, Backend] | None = None,
        config: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        self.home = home
        self.config: Mapping[str, Mapping[str, object]] = dict(config or {})
        """Constructor options per backend name (``{"local": {"pool": {"namespaces": 2}}}``),
        from the settings' backend tables."""
        self._built: dict[str, Backend] = dict(extra or {})

    def __getitem__(self, name: str) -> Backend:
        backend = self._built.get(name)
        if backend is None:
            factory = _FACTORIES.get(name)
            if factory is None or not _importable(name):
                raise KeyError(name)
            backend = factory(self.home, **self.config.get(name, {}))
            self._built[name] = backend
        return backend

    def __contains__(self, name: object) -> bool:
        return name in self._built or (
            isinstance(name, str) and name in _FACTORIES and _importable(name)
        )

    def _in_use(self) -> list[str]:
        used = set(self._built)
        root = self.home / "backends"
        if root.is_dir():
            used |= {p.name for p in root.iterdir() if p.name in _FACTORIES and _importable(p.name)}
        return sorted(used)

    def __iter__(self) -> Iterator[str]:
        return iter(self._in_use())

    def __len__(self) -> int:
        return len(self._in_use())

    def built(self) -> list[Backend]:
        """The backends constructed so far."""
        return list(self._built.values())
