"""Host uid/gid ranges for sandbox user namespaces: one unprivileged range per sandbox.

When sandlot runs as root, container root of each sandbox is host uid ``H`` of a range of
65,536 ids starting at ``2**20`` or above, so a process that escapes its namespaces is an
unprivileged user that owns nothing but its own sandbox's files. Ranges are recorded in a
host-wide directory (default ``/var/lib/sandlot/uid-ranges``), one file per range created with
``O_EXCL``, so two sandboxes never share a range even when they belong to different sandlot
homes or processes. A record names its owner (the backend state directory and the container
name, which stays the same when a pooled sandbox is claimed); a record whose state directory is
gone (a deleted home) is reclaimed, and a backend frees the leaked records of its own state
directory with :meth:`UidRanges.owned_by`. Ranges listed in ``/etc/subuid`` and
``/etc/subgid`` are skipped. This module imports only :mod:`sandlot.errors`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path

from sandlot.errors import BackendError, QuotaExceeded

__all__ = ["RANGE_SIZE", "UidRanges"]

RANGE_SIZE = 65536
_BASE = 1 << 20
_SLOTS = ((1 << 32) - 2 - _BASE) // RANGE_SIZE


def _subid_ranges() -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                out.append((int(parts[1]), int(parts[2])))
    return out


class UidRanges:
    """Allocates and frees host id ranges, safely across processes and homes."""

    def __init__(self, registry: Path) -> None:
        """Args:
        registry: the host-wide directory holding one record per allocated range.
        """
        self.registry = registry
        self.registry.mkdir(parents=True, exist_ok=True, mode=0o700)

    def allocate(self, state_dir: Path, container: str) -> int:
        """Reserve a free range for ``container`` of the backend at ``state_dir``; its first id.

        The container name also picks where the search starts, so concurrent allocations
        rarely contend for the same slot.

        Raises:
            QuotaExceeded: every range is taken.
        """
        taken = _subid_ranges()
        start = int.from_bytes(hashlib.sha256(container.encode()).digest()[:4], "big") % _SLOTS
        record = f"{state_dir}\n{container}\n".encode()
        for i in range(_SLOTS):
            slot = (start + i) % _SLOTS
            base = _BASE + slot * RANGE_SIZE
            if any(b < base + RANGE_SIZE and base < b + n for b, n in taken):
                continue
            path = self.registry / str(base)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if self._stale(path):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    # Retry this slot once; losing the race to another process is fine.
                    try:
                        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    except FileExistsError:
                        continue
                else:
                    continue
            except OSError as e:
                msg = f"cannot record a uid range in {self.registry}: {e}"
                raise BackendError(msg) from e
            try:
                os.write(fd, record)
            finally:
                os.close(fd)
            return base
        msg = "no free host uid range is left for another sandbox"
        raise QuotaExceeded(msg)

    def release(self, base: int) -> None:
        """Free a range (no error if it was not recorded)."""
        with contextlib.suppress(FileNotFoundError):
            (self.registry / str(base)).unlink()

    def owned_by(self, state_dir: Path) -> dict[int, str]:
        """Ranges recorded for a backend state directory, as ``{base: container}``."""
        out: dict[int, str] = {}
        for entry in self.registry.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                lines = entry.read_text().splitlines()
            except OSError:
                continue
            if len(lines) >= 2 and lines[0] == str(state_dir):
                out[int(entry.name)] = lines[1]
        return out

    def _stale(self, path: Path) -> bool:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        # A record still being written is empty for a moment: not stale.
        if not text:
            return False
        try:
            Path(text.splitlines()[0]).stat()
        except OSError as e:
            return e.errno == errno.ENOENT
        return False
