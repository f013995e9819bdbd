"""The ``microvm`` backend: QEMU microVMs with the sandlot agent over virtio-serial.

Re-exports only; see :mod:`.backend` (lifecycle, reset), :mod:`.image` (guest image build),
:mod:`.qemu` (VM processes, accelerator choice) and :mod:`.qmp` (QEMU control protocol).
"""

from __future__ import annotations

from sandlot.backends.microvm.backend import (
    MicrovmBackend,
    ResetVerificationFailed,
    VerificationCheck,
    VerificationReport,
    doctor,
)
from sandlot.backends.microvm.image import ImagePaths, build_image, load_image, resolve_image

__all__ = [
    "ImagePaths",
    "MicrovmBackend",
    "ResetVerificationFailed",
    "VerificationCheck",
    "VerificationReport",
    "build_image",
    "doctor",
    "load_image",
    "resolve_image",
]
