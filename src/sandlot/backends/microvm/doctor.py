"""What ``sandlot doctor`` reports for the microvm backend: tools, image, accelerator.

Imports only the image and QEMU modules of this package; must not import the backend itself
(a doctor run starts no VM), the store or the Manager.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sandlot.backends.base import DoctorCheck
from sandlot.backends.microvm import qemu

__all__ = ["doctor"]


def doctor(cache_dir: Path | None = None) -> list[DoctorCheck]:
    """What ``sandlot doctor`` reports for the microvm backend: tools, image, accelerator
    (``socat`` is optional: only network allowlists need it)."""
    checks: list[DoctorCheck] = []
    for tool, pkg in (
        (qemu.QEMU_BINARY, "qemu-system-x86"),
        ("qemu-img", "qemu-utils"),
        ("mmdebstrap", "mmdebstrap"),
    ):
        found = shutil.which(tool)
        checks.append(
            DoctorCheck(f"{tool} installed", bool(found), found or "", f"apt-get install {pkg}")
        )
    socat = shutil.which("socat")
    checks.append(
        DoctorCheck(
            "socat installed (network allowlists for microVMs)",
            bool(socat),
            socat or "",
            "apt-get install socat",
            required=False,
        )
    )
    from sandlot.backends.microvm.image import find_cached_image

    image = find_cached_image(cache_dir)
    checks.append(
        DoctorCheck(
            "microvm guest image built",
            image is not None,
            str(image.directory) if image else "none in the cache",
            "sandlot images build microvm",
        )
    )
    if shutil.which(qemu.QEMU_BINARY):
        checks.append(qemu.accel_check(image, cache_dir))
    return checks
