"""The default root's Python environment: ``pip install`` works and stays in the sandbox.

The host's ``/usr`` is read-only inside and Debian marks its Python ``EXTERNALLY-MANAGED``
(PEP 668), so a plain ``pip install`` failed; the default root carries a virtual environment
over the host's interpreter, active on ``PATH``. The wheel is built here and written into the
sandbox, so nothing needs the network.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.backends.local.rootfs import DEFAULT_VENV
from sandlot.models import ExecResult, new_id

pytestmark = pytest.mark.skipif(
    not Path("/usr/lib/python3/dist-packages/pip").is_dir(),
    reason="needs pip on the host (Debian package python3-pip)",
)


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=120)
    finally:
        await channel.close()


async def install(backend: LocalBackend, ref: str, wheel) -> None:
    channel = await backend.channel(ref)
    try:
        await channel.write_file(f"/tmp/{wheel.filename}", wheel.data)
    finally:
        await channel.close()
    # As a setup step runs it: a shell finds pip on PATH.
    result = await sh(backend, ref, f"pip install --no-index /tmp/{wheel.filename}")
    assert result.exit_code == 0, result.stdout + result.stderr


def _host_copies(wheel) -> list[str]:
    """Files of the test package wherever the host's pip would have put them."""
    usr = Path("/usr")
    dirs = [usr / "bin", usr / "local" / "bin", *usr.glob("lib/python3*/*-packages")]
    dirs += usr.glob("local/lib/python3*/*-packages")
    return [
        str(p) for d in dirs for p in d.iterdir() if wheel.package in p.name or p.name == wheel.dist
    ]


async def test_pip_install_goes_into_the_sandbox_and_nowhere_else(
    backend, isolation, spec_for, probe_wheel
) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    await install(backend, ref, probe_wheel)

    imported = await sh(
        backend, ref, f"python3 -c 'import {probe_wheel.package} as m; print(m.VALUE, m.__file__)'"
    )
    assert imported.exit_code == 0, imported.stderr
    value, path = imported.stdout.split()
    assert value == "installed"
    assert path.startswith(f"{DEFAULT_VENV}/lib/")
    script = await sh(backend, ref, probe_wheel.dist)
    assert (script.exit_code, script.stdout) == (0, "script ran\n"), script.stderr
    # The host's own packages are still there for the sandbox's Python.
    system = await sh(backend, ref, "python3 -c 'import pip; print(pip.__file__)'")
    assert system.stdout.startswith("/usr/lib/python3/dist-packages/"), system.stderr

    assert _host_copies(probe_wheel) == []
    host = subprocess.run(
        ["/usr/bin/python3", "-c", f"import {probe_wheel.package}"],
        capture_output=True,
        check=False,
    )
    assert host.returncode != 0


async def test_a_fork_keeps_the_environment_and_what_was_installed(
    backend, spec_for, probe_wheel
) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await install(backend, ref, probe_wheel)
    snap = await backend.snapshot(ref, new_id("snap"))
    (fork,) = await backend.fork(snap, [new_id("fork")], spec)
    result = await sh(
        backend,
        fork,
        f"command -v pip && python3 -c 'import {probe_wheel.package}' && {probe_wheel.dist}",
    )
    assert result.stdout == f"{DEFAULT_VENV}/bin/pip\nscript ran\n", result.stderr


async def test_an_image_keeps_its_own_path(backend, tmp_path: Path, spec_for) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("needs busybox (Debian package busybox-static)")
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    (root / "bin" / "sh").symlink_to("busybox")
    ref = await backend.create(new_id("sb"), spec_for("namespaces", image=str(root)))
    result = await sh(backend, ref, 'echo "$PATH ${VIRTUAL_ENV-unset}"')
    assert DEFAULT_VENV not in result.stdout
    assert result.stdout.endswith(" unset\n")
