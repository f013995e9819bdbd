"""The default root's Python environment: ``pip install`` works and stays in the sandbox.

The host's ``/usr`` is read-only inside and Debian marks its Python ``EXTERNALLY-MANAGED``
(PEP 668), so a plain ``pip install`` failed; the default root carries a virtual environment
over the host's interpreter, active on ``PATH``. The wheel is built here and written into the
sandbox, so nothing needs the network.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from sandlot.backends.local import LocalBackend
from sandlot.backends.local.rootfs import DEFAULT_VENV
from sandlot.models import ExecResult, new_id

PACKAGE = f"sandlot_probe_{os.getpid()}"
DIST = PACKAGE.replace("_", "-")

pytestmark = pytest.mark.skipif(
    not Path("/usr/lib/python3/dist-packages/pip").is_dir(),
    reason="needs pip on the host (Debian package python3-pip)",
)


def _wheel() -> tuple[str, bytes]:
    """A pure-Python wheel with a module and a console script."""
    info = f"{PACKAGE}-1.0.dist-info"
    files = {
        f"{PACKAGE}/__init__.py": b'VALUE = "installed"\n\ndef main():\n    print("script ran")\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: sandlot-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": f"[console_scripts]\n{DIST} = {PACKAGE}:main\n".encode(),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return f"{PACKAGE}-1.0-py3-none-any.whl", buf.getvalue()


async def sh(backend: LocalBackend, ref: str, script: str) -> ExecResult:
    channel = await backend.channel(ref)
    try:
        return await channel.exec(["sh", "-c", script], timeout=120)
    finally:
        await channel.close()


async def install(backend: LocalBackend, ref: str) -> None:
    name, data = _wheel()
    channel = await backend.channel(ref)
    try:
        await channel.write_file(f"/tmp/{name}", data)
    finally:
        await channel.close()
    # As a setup step runs it: a shell finds pip on PATH.
    result = await sh(backend, ref, f"pip install --no-index /tmp/{name}")
    assert result.exit_code == 0, result.stdout + result.stderr


def _host_copies() -> list[str]:
    """Files of the test package wherever the host's pip would have put them."""
    usr = Path("/usr")
    dirs = [usr / "bin", usr / "local" / "bin", *usr.glob("lib/python3*/*-packages")]
    dirs += usr.glob("local/lib/python3*/*-packages")
    return [str(p) for d in dirs for p in d.iterdir() if PACKAGE in p.name or p.name == DIST]


async def test_pip_install_goes_into_the_sandbox_and_nowhere_else(
    backend, isolation, spec_for
) -> None:
    ref = await backend.create(new_id("sb"), spec_for(isolation))
    await install(backend, ref)

    imported = await sh(
        backend, ref, f"python3 -c 'import {PACKAGE} as m; print(m.VALUE, m.__file__)'"
    )
    assert imported.exit_code == 0, imported.stderr
    value, path = imported.stdout.split()
    assert value == "installed"
    assert path.startswith(f"{DEFAULT_VENV}/lib/")
    script = await sh(backend, ref, DIST)
    assert (script.exit_code, script.stdout) == (0, "script ran\n"), script.stderr
    # The host's own packages are still there for the sandbox's Python.
    system = await sh(backend, ref, "python3 -c 'import pip; print(pip.__file__)'")
    assert system.stdout.startswith("/usr/lib/python3/dist-packages/"), system.stderr

    assert _host_copies() == []
    host = subprocess.run(
        ["/usr/bin/python3", "-c", f"import {PACKAGE}"], capture_output=True, check=False
    )
    assert host.returncode != 0


async def test_a_fork_keeps_the_environment_and_what_was_installed(backend, spec_for) -> None:
    spec = spec_for("namespaces")
    ref = await backend.create(new_id("sb"), spec)
    await install(backend, ref)
    snap = await backend.snapshot(ref, new_id("snap"))
    (fork,) = await backend.fork(snap, [new_id("fork")], spec)
    result = await sh(backend, fork, f"command -v pip && python3 -c 'import {PACKAGE}' && {DIST}")
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
