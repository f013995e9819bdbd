"""Fixtures for the attack suite: one sandbox per isolation (crun, gVisor) shared by a module.

Every attack must fail under both runtimes. The tests need root and crun (and runsc for the
gVisor half); a missing prerequisite skips naming it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.models import SandboxSpec, new_id

HERE = Path(__file__).parent
SECRET_ENV = "SANDLOT_ATTACK_SUITE_SECRET"


def missing(isolation: str = "namespaces") -> str | None:
    """What this host lacks to run the suite with ``isolation`` (None: nothing)."""
    if os.geteuid() != 0:
        return "root (user namespaces with private uid ranges, mounts, cgroups)"
    for tool, pkg in (("crun", "crun"), ("unshare", "util-linux")):
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


@pytest.fixture(scope="module", params=["namespaces", "gvisor"])
def isolation(request: pytest.FixtureRequest) -> str:
    reason = missing(request.param)
    if reason:
        pytest.skip(f"needs {reason}")
    return str(request.param)


@pytest.fixture(scope="module")
def host_secret() -> str:
    """A secret in this process's environment; no sandbox may learn it."""
    value = new_id("secret")
    os.environ[SECRET_ENV] = value
    return value


@pytest.fixture(scope="module")
async def backend(
    tmp_path_factory: pytest.TempPathFactory, host_secret: str
) -> AsyncIterator[LocalBackend]:
    impl = LocalBackend(tmp_path_factory.mktemp("state"), cache=tmp_path_factory.mktemp("cache"))
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()


def _attack_spec(isolation: str, **kwargs: object) -> SandboxSpec:
    kwargs.setdefault("network", "deny-all")
    kwargs.setdefault("backend_options", {"local": {"isolation": isolation}})
    kwargs.setdefault("resources", {"memory_mb": 256, "pids": 64})
    return SandboxSpec.model_validate(kwargs)


@pytest.fixture(scope="module")
async def sandbox(backend: LocalBackend, isolation: str) -> str:
    """A running sandbox shared by the module's attacks on ``isolation``."""
    return await backend.create(new_id("atk"), _attack_spec(isolation))


@pytest.fixture(scope="module")
def spec_for() -> Callable[..., SandboxSpec]:
    """``spec_for(isolation, **fields)``: deny-all, 256 MiB, 64 pids unless overridden."""
    return _attack_spec
