"""The warm pool: restored, clock-set and warmed-up VMs kept ready per machine config, which a
create claims by renaming a directory (a few ms), refilled by a detached process
(:mod:`sandlot.backends.microvm.pool`, the entry point).

Builds on :class:`~sandlot.backends.microvm.templates.Templates` and
:class:`~sandlot.backends.microvm.network.NetworkPlumbing`; must not import the standbys,
snapshots or reset modules, the store or the Manager.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.abc

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.boot import remove_vm_dir
from sandlot.backends.microvm.network import Launch, NetworkPlumbing, mode_for
from sandlot.backends.microvm.state import POOLED_SOCKET, copy_file, flock
from sandlot.backends.microvm.templates import Templates
from sandlot.errors import NotSupported
from sandlot.models import SandboxSpec

__all__ = ["WarmPool"]


class WarmPool(NetworkPlumbing, Templates):
    """Filling, claiming and draining the warm pool."""

    def _pool_dir(self, machine: qemu.MachineConfig) -> Path:
        return self._root / "pool" / machine.fingerprint()

    async def _claim(self, machine: qemu.MachineConfig, vm_dir: Path) -> bool:
        """Take a ready pooled VM by renaming its directory to ``vm_dir`` (atomic: of two
        processes claiming the same one, exactly one rename succeeds)."""
        pool = self._pool_dir(machine)
        try:
            entries = sorted(pool.iterdir())
        except FileNotFoundError:
            return False
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if not qemu.is_running(entry):
                await remove_vm_dir(entry)
                continue
            try:
                entry.rename(vm_dir)
            except OSError:
                continue  # another process claimed it first
            return True
        return False

    async def fill_pool(self, spec: SandboxSpec | None = None) -> int:
        """Top the warm pool for ``spec``'s machine config up to ``pool_size``; returns how
        many VMs it started. Another process already filling it makes this return 0.

        Raises:
            NotSupported: ``spec.network`` is ``allow-all`` (such a VM runs in a network
                namespace named after its sandbox, so it cannot be made in advance).
        """
        spec = spec or SandboxSpec(network="deny-all")
        if mode_for(spec.network) == "nat":
            msg = "allow-all microVMs are not pooled (each runs in its own network namespace)"
            raise NotSupported(msg)
        self._require_kind(spec.network)
        return await self._fill(self._machine_for(spec))

    async def _fill(self, machine: qemu.MachineConfig) -> int:
        pool = self._pool_dir(machine)
        pool.mkdir(parents=True, exist_ok=True)
        lock = os.open(pool.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            tdir = await self._template(machine)
            started = 0
            while True:
                ready = [e for e in pool.iterdir() if not e.name.startswith(".")]
                if len(ready) >= self._pool_size:
                    return started
                name = f"pool-{os.urandom(6).hex()}"
                work = pool / f".{name}"
                work.mkdir()
                try:
                    copy_file(tdir / "disk.qcow2", work / "disk.qcow2")
                    net = Launch()
                    if machine.nic:
                        # Its proxy socket is served once a sandbox claims it.
                        socket = self._new_egress_socket()
                        (work / POOLED_SOCKET).write_text(socket)
                        net = self._launch(name, "proxy", socket)
                    channel = await self._restore_into(work, machine, tdir, net)
                    try:
                        await self._sync_clock(channel)
                        # The first programs in this QEMU pay TCG's translation warm-up; paying
                        # it here means the claimer's first exec does not. A shell and a
                        # coreutils program, as most commands are (``true`` alone would be a
                        # shell builtin and leave the program start-up cold).
                        await self._guest_sh(channel, "date >/dev/null")
                    finally:
                        # No connection is held: the claimer may be another process, and
                        # QEMU's socket serves one client at a time.
                        await channel.close()
                    work.rename(pool / name)
                    started += 1
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await remove_vm_dir(work)
                    raise
        finally:
            os.close(lock)

    def _spawn_refill(self, machine: qemu.MachineConfig) -> None:
        """Refill the pool from a detached process (the CLI exits right after a create)."""
        argv = [
            sys.executable, "-m", "sandlot.backends.microvm.pool",
            str(self._root), str(self._cache), str(machine.image.directory),
            str(machine.memory_mb), str(machine.vcpus), machine.accel, str(self._pool_size),
            "nic" if machine.nic else "none",
        ]  # fmt: skip
        subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    async def drain_pool(self) -> None:
        """Kill every pooled VM (waiting for a running refill to finish first) and every
        create standby."""
        for kind in ("pool", "standby"):
            for lockfile in sorted((self._root / kind).glob("*.lock")):
                async with flock(lockfile):
                    pool = lockfile.with_suffix("")
                    for entry in sorted(pool.iterdir()) if pool.exists() else ():
                        await remove_vm_dir(entry)
