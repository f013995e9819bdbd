"""Real QEMU microVMs under whatever accelerator the host allows (TCG on our build machines).

The guest image comes from the shared cache (``$SANDLOT_CACHE``, default ``~/.cache/sandlot``):
built once (about a minute) and reused, so CI caches that directory. One backend (and so one
template per machine config) serves the whole session; every test destroys what it made.
Only two cores are shared on our machines, so tests run at most two VMs at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandlot.backends.microvm import ImagePaths, MicrovmBackend, build_image
from sandlot.errors import BackendUnavailable
from sandlot.models import SandboxSpec


def _need_tools() -> None:
    for tool, pkg in (
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("qemu-img", "qemu-utils"),
        ("mmdebstrap", "mmdebstrap"),
        ("apt-get", "apt"),
    ):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (apt-get install {pkg})")


@pytest.fixture(scope="session")
def microvm_image() -> ImagePaths:
    _need_tools()
    try:
        return build_image()
    except BackendUnavailable as e:
        pytest.skip(f"needs a buildable microvm image: {e}")


@pytest.fixture(scope="session")
def microvm_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("microvm-state")
    return path


@pytest.fixture
async def backend(microvm_image: ImagePaths, microvm_state: Path) -> AsyncIterator[MicrovmBackend]:
    impl = MicrovmBackend(microvm_state, image=microvm_image)
    yield impl
    for ref in (await impl.list_owned()).values():
        await impl.destroy(ref)
    await impl.aclose()


@pytest.fixture
def spec() -> SandboxSpec:
    return SandboxSpec(network="deny-all")
