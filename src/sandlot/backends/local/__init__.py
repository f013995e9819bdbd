"""The ``local`` backend: sandboxes on this host under crun (namespaces) or runsc (gVisor).

Re-exports only. :class:`LocalBackend` is the one front door; :mod:`.backend` says what it
enforces and how, and composes it from parts, one module per concern. Each part is a class over
:class:`.state.LocalState`, which declares (typed) the attributes the parts share and the
methods one part calls of another:

================  ===============================================================================
module            owns
================  ===============================================================================
``backend``       ``LocalBackend``: construction, ``capabilities``, availability, ``aclose``
``state``         the sandbox record (``Meta``), the state directory's paths and locks, the base
``lifecycle``     create, start, stop, destroy, inspect, ``list_owned``, ``channel``; refusals
``filesystem``    a sandbox's directory, uid range, layers, writable layer and root mount
``bundle``        the OCI bundle (``config.json``): the agent as init, the interpreter, mounts
``boot``          starting the runtime, recording the init, connecting to the agent
``strict``        strict enforcement's exec gate, wired to ``exec_decider``
``teardown``      halting (signals, OOM note, reaping, unmounting) and removing a sandbox
``snapshots``     snapshot capture, restore, fork and deletion
``reset``         verified resets to the baseline or a snapshot (by the pool when it can)
``verify``        the host-side checks of a sandbox, their report, ``verify``
``pool``          the warm pool: filling, claiming by ``renameat2``, refilling, draining
``network``       a sandbox's network at run time: policy switches, slirp4netns, resolv.conf,
                  ports, egress events
================  ===============================================================================

Beneath the parts: :mod:`.runtime` (crun and runsc), :mod:`.oci` and :mod:`.seccomp` (the
runtime spec), :mod:`.mounts` (host mounts), :mod:`.rootfs` (image and skeleton cache),
:mod:`.layers` (snapshot layers), :mod:`.ids` (uid ranges), :mod:`.rootless` and
:mod:`.userns_helper` (running without root), :mod:`.execgate` (seccomp user notification),
:mod:`.protect` (protected and hidden paths, into the runtime spec),
:mod:`.channel` (the channel handed out) and :mod:`.doctor` (``sandlot doctor``).

Parts reach one another only through ``self`` (what :class:`.state.LocalState` declares); no
part imports another's class, and the only module functions shared between parts are the
resolver file's (:mod:`.network`, used by :mod:`.bundle` and :mod:`.pool`) and the check
report's (:mod:`.verify`, used by :mod:`.reset`). This package must not import the store, the
Manager or front ends (``sandlot.server``, ``sandlot.cli``, ``sandlot.mcp``,
``sandlot.client``, the SDK).
"""

from __future__ import annotations

from sandlot.backends.local.backend import ISOLATIONS, LocalBackend
from sandlot.backends.local.doctor import doctor

__all__ = ["ISOLATIONS", "LocalBackend", "doctor"]
