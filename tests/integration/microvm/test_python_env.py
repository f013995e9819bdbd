"""The guest's Python environment: ``pip install`` works in a microVM as in a local sandbox.

Debian's Python in the guest is PEP 668 ``EXTERNALLY-MANAGED``; the image carries a venv at
``GUEST_VENV`` (the local backend's default root has the same), active on ``PATH``.
"""

from __future__ import annotations

import pytest

from sandlot.backends.local.rootfs import DEFAULT_VENV
from sandlot.backends.microvm import MicrovmBackend
from sandlot.backends.microvm.image import GUEST_VENV
from sandlot.models import SandboxSpec, new_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_both_backends_put_the_environment_in_one_place() -> None:
    assert GUEST_VENV == DEFAULT_VENV


async def test_pip_install_of_a_wheel(
    backend: MicrovmBackend, spec: SandboxSpec, probe_wheel
) -> None:
    ref = await backend.create(new_id("sb"), spec)
    channel = await backend.channel(ref)
    try:
        await channel.write_file(f"/tmp/{probe_wheel.filename}", probe_wheel.data)
        script = (
            f"pip install -q --no-index /tmp/{probe_wheel.filename}"
            f" && python3 -c 'import {probe_wheel.package} as m; print(m.VALUE, m.__file__)'"
            f" && {probe_wheel.dist}"
        )
        result = await channel.exec(["sh", "-c", script], timeout=300)
    finally:
        await channel.close()
    assert result.exit_code == 0, result.stdout + result.stderr
    imported, ran = result.stdout.splitlines()
    value, path = imported.split()
    assert (value, ran) == ("installed", "script ran")
    assert path.startswith(f"{GUEST_VENV}/lib/")
