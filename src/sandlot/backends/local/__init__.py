"""The ``local`` backend: sandboxes on this host under crun (namespaces) or runsc (gVisor).

See :mod:`sandlot.backends.local.backend` for what it enforces and how.
"""

from __future__ import annotations

from sandlot.backends.local.backend import ISOLATIONS, LocalBackend
from sandlot.backends.local.doctor import doctor

__all__ = ["ISOLATIONS", "LocalBackend", "doctor"]
