"""Fixtures for the ``local`` backend: real crun and runsc sandboxes on this host.

Every test here needs root (user namespaces with private uid ranges, mounts, cgroups); a test
for gVisor also needs ``runsc``. Missing prerequisites skip the test naming them. Each test gets
its own state directory; the root filesystem cache is shared by the session (building the
default skeleton takes a few hundred milliseconds), and everything a test made is destroyed
after it, pooled sandboxes included.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.models import SandboxSpec

HERE = Path(__file__).parent
ISOLATIONS = ["namespaces", "gvisor"]


def missing(isolation: str = "namespaces") -> str | None:
    """What this host lacks to run local sandboxes with ``isolation`` (None: nothing)."""
    if os.geteuid() != 0:
        return "root (user namespaces with private uid ranges, mounts, cgroups)"
    for tool, pkg in (("crun", "crun"), ("unshare", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {pkg})"
    if isolation == "gvisor" and shutil.which("runsc") is None:
        return "runsc (Debian package runsc)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.needs_root)
            reason = missing()
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"needs {reason}"))


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    reason = missing(request.param)
    if reason:
        pytest.skip(f"needs {reason}")
    return str(request.param)


@pytest.fixture(scope="session")
def rootfs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rootfs-cache")


class BackendFactory:
    """Makes backends on one state directory and cleans up after all of them."""

    def __init__(self, state: Path, cache: Path) -> None:
        self.state = state
        self.cache = cache
        self.made: list[LocalBackend] = []

    def __call__(self, **kwargs: object) -> LocalBackend:
        kwargs.setdefault("cache", self.cache)
        backend = LocalBackend(self.state, **kwargs)  # type: ignore[arg-type]
        self.made.append(backend)
        return backend


@pytest.fixture
async def make_backend(tmp_path: Path, rootfs_cache: Path) -> AsyncIterator[BackendFactory]:
    factory = BackendFactory(tmp_path / "state", rootfs_cache)
    yield factory
    for b in factory.made:
        await cleanup(b)


@pytest.fixture
def backend(make_backend: BackendFactory) -> LocalBackend:
    return make_backend()


async def cleanup(backend: LocalBackend) -> None:
    for ref in (await backend.list_owned()).values():
        await backend.destroy(ref)
    await backend.drain_pool()
    await backend.aclose()


def _spec_for(isolation: str, **kwargs: object) -> SandboxSpec:
    kwargs.setdefault("network", "deny-all")
    kwargs.setdefault("backend_options", {"local": {"isolation": isolation}})
    return SandboxSpec.model_validate(kwargs)


@pytest.fixture
def spec_for() -> Callable[..., SandboxSpec]:
    """``spec_for(isolation, **fields)``: a deny-all spec (the only network policy without the
    network service) on that isolation."""
    return _spec_for
