"""The ``microvm`` backend: QEMU microVMs with the sandlot agent over virtio-serial.

Re-exports only. :class:`MicrovmBackend` is the one front door; it is assembled from mixins over
one typed base, each module a room of its own. Each module imports only those listed before it
(and none imports the store, the Manager or a front end):

- :mod:`.image`: building, finding and loading guest images. :mod:`.qmp`: the QEMU control
  protocol. :mod:`.qemu`: QEMU's command line, processes and the accelerator choice.
- :mod:`.channel`: the channel handed out for a VM with a network (the egress proxy's
  environment added to what it starts).
- :mod:`.state`: the state directory, a VM's record and baseline, file helpers, and
  :class:`~.state.MicrovmState`, the typed base (the backend's attributes, where a VM lives,
  its machine config, the agent connection an operation hands over).
- :mod:`.network`: the host side of a VM's network and policy changes at run time.
- :mod:`.guest`: connecting to the guest agent, guest commands, the descriptor count, the clock.
- :mod:`.boot`: starting QEMU: cold boot, loading saved memory, resuming; QMP migration steps.
- :mod:`.templates`: the booted template per machine config that every VM is cloned from.
- :mod:`.standby`: paused QEMUs made in advance for the next reset or create.
- :mod:`.warm_pool`: ready VMs a create claims (:mod:`.pool` is the detached refill's entry
  point, which imports the backend).
- :mod:`.snapshots`: snapshot, restore, fork, delete.
- :mod:`.reset`: reset to the baseline and verification against it.
- :mod:`.backend`: :class:`MicrovmBackend` itself: construction, capabilities and the lifecycle
  (create, start, stop, destroy, inspect, channel).
- :mod:`.doctor`: what ``sandlot doctor`` checks (tools, image, accelerator); imports no VM code.
"""

from __future__ import annotations

from sandlot.backends.microvm.backend import (
    MicrovmBackend,
    ResetVerificationFailed,
    VerificationCheck,
    VerificationReport,
)
from sandlot.backends.microvm.doctor import doctor
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
