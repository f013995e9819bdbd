"""Fixtures shared by the integration suites."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import zipfile
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Wheel:
    """A pure-Python wheel built by the test: ``import <package>`` and the ``<dist>`` script."""

    filename: str
    data: bytes
    package: str
    """The importable module; its ``VALUE`` is ``"installed"``."""
    dist: str
    """The distribution name, also a console script printing ``script ran``."""


@pytest.fixture(scope="session")
def probe_wheel() -> Wheel:
    """A wheel made here, so installing it needs no network (``pip install --no-index``)."""
    package = f"sandlot_probe_{os.getpid()}"
    dist = package.replace("_", "-")
    info = f"{package}-1.0.dist-info"
    files = {
        f"{package}/__init__.py": b'VALUE = "installed"\n\ndef main():\n    print("script ran")\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: sandlot-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": f"[console_scripts]\n{dist} = {package}:main\n".encode(),
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
    return Wheel(f"{package}-1.0-py3-none-any.whl", buf.getvalue(), package, dist)
