"""Entry point of the detached process that refills the microvm warm pool.

``python -m sandlot.backends.microvm.pool STATE CACHE IMAGE MEMORY_MB VCPUS ACCEL SIZE NIC`` tops
up one machine config's pool and exits (``NIC`` is ``nic`` or ``none``).
:meth:`MicrovmBackend.create` starts it after claiming a pooled VM; it runs in its own session so
the CLI process that created a sandbox can exit. It imports only the microvm backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from sandlot.backends.microvm.backend import MicrovmBackend
from sandlot.backends.microvm.image import load_image
from sandlot.backends.microvm.qemu import MachineConfig

_DELAY = 2.0


async def _main(argv: list[str]) -> int:
    state, cache, image, memory, vcpus, accel, size, nic = argv
    if accel not in ("kvm", "tcg") or nic not in ("nic", "none"):
        return 2
    backend = MicrovmBackend(Path(state), cache_dir=Path(cache), pool_size=int(size))
    machine = MachineConfig(
        load_image(Path(image)),
        int(memory),
        int(vcpus),
        "kvm" if accel == "kvm" else "tcg",
        nic=nic == "nic",
    )
    # Start late: the sandbox just claimed is about to run its first commands, and a restore
    # competing for the same cores would slow them down.
    await anyio.sleep(_DELAY)
    await backend._fill(machine)
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(_main, sys.argv[1:]))
