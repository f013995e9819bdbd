"""Starting a microVM's QEMU: a cold boot from the disk (retried once after a hang), a load of
saved memory (a template's shared RAM file or a full migration stream) left paused, resuming
it until the agent answers; and the QMP steps around them (migrating state to a file, the
``x-ignore-shared`` capability, killing a VM and removing its directory).

Builds on :class:`~sandlot.backends.microvm.guest.GuestAgent` (and the network module for a
QEMU's NIC arguments); must not import the templates, standbys, pool, snapshots or reset
modules, the store or the Manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio
import anyio.abc

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.guest import GuestAgent
from sandlot.backends.microvm.image import ImagePaths
from sandlot.backends.microvm.network import Launch
from sandlot.backends.microvm.qmp import QmpClient, connect_unix
from sandlot.backends.microvm.state import serial_tail, sha256_file
from sandlot.channel.base import Channel
from sandlot.errors import BackendError, BackendUnavailable, SandboxError

__all__ = ["QemuBoot", "create_overlay", "migrate_to", "remove_vm_dir", "set_ignore_shared", "shq"]


class QemuBoot(GuestAgent):
    """QEMU processes: boot, load, resume."""

    async def _qmp(self, vm_dir: Path) -> QmpClient:
        return await QmpClient.connect(vm_dir / qemu.QMP_SOCKET)

    async def _wait_loaded(self, q: QmpClient, timeout: float) -> str:
        """Wait until an incoming migration finished; the resulting run state."""
        with anyio.fail_after(timeout):
            while True:
                status = await q.status()
                if status != "inmigrate":
                    break
                await anyio.sleep(0.002)
        if status not in ("paused", "running"):
            info = await q.execute("query-migrate")
            msg = f"restoring the VM left it {status!r}: {info}"
            raise BackendError(msg)
        return status

    def _note_boot(self, *, retried: bool) -> None:
        path = self._root / "boot-stats.json"
        try:
            stats = json.loads(path.read_text())
        except (OSError, ValueError):
            stats = {"boots": 0, "retries": 0}
        stats["boots"] += 1
        stats["retries"] += int(retried)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stats))
        tmp.replace(path)

    async def _cold_boot(
        self, vm_dir: Path, machine: qemu.MachineConfig, disk: Path, ram: list[str], net: Launch
    ) -> Channel:
        """Boot from the disk until the agent answers; one retry after a hang."""
        last: SandboxError | None = None
        for attempt in range(2):
            with contextlib.suppress(FileNotFoundError):
                (vm_dir / qemu.SERIAL_LOG).unlink()
            argv = machine.argv(vm_dir, disk, ram=ram, netdev=net.netdev)
            await qemu.launch(vm_dir, [*net.prefix, *argv])
            try:
                channel = await self._open_channel(vm_dir, self._boot_timeout)
            except SandboxError as e:
                last = e
                await qemu.kill_vm(vm_dir)
                continue
            self._note_boot(retried=attempt > 0)
            return channel
        tail = serial_tail(vm_dir)
        msg = f"the microvm did not boot (twice): {last}; console: {tail}"
        raise BackendError(msg)

    async def _restore_into(
        self,
        vm_dir: Path,
        machine: qemu.MachineConfig,
        source: Path,
        net: Launch,
    ) -> Channel:
        """Start the VM in ``vm_dir`` from the memory in ``source`` (a template or snapshot
        directory, or the VM's own ``mem.bin``), resume it and connect to its agent."""
        status = await self._load(vm_dir, machine, source, net)
        channel, _ = await self._resume(vm_dir, status)
        return channel

    async def _load(
        self, vm_dir: Path, machine: qemu.MachineConfig, source: Path, net: Launch
    ) -> str:
        """Start QEMU in ``vm_dir`` with the memory in ``source`` loaded, not yet resumed (see
        :meth:`_restore_into`); the run state the load left it in."""
        disk = vm_dir / "disk.qcow2"
        # A stat of our own state directory: microseconds, not worth a thread hop.
        template = source.is_dir() and (source / "state.bin").exists()  # noqa: ASYNC240
        if template:
            ram = machine.ram_file(source / "ram.img", shared=False)
            argv = machine.argv(vm_dir, disk, ram=ram, incoming_defer=True, netdev=net.netdev)
        else:
            mem = source / "mem.bin" if source.is_dir() else source  # noqa: ASYNC240
            argv = machine.argv(
                vm_dir, disk, ram=machine.ram_anonymous(), incoming=mem, netdev=net.netdev
            )
        await qemu.launch(vm_dir, [*net.prefix, *argv])
        try:
            async with await self._qmp(vm_dir) as q:
                if template:
                    await set_ignore_shared(q, True)
                    await q.execute(
                        "migrate-incoming", {"uri": f"exec:cat {shq(source / 'state.bin')}"}
                    )
                return await self._wait_loaded(q, self._restore_timeout)
        except BaseException:
            await qemu.kill_vm(vm_dir)
            raise

    async def _resume(
        self, vm_dir: Path, status: str, *, hash_disk: bool = False
    ) -> tuple[Channel, str | None]:
        """Run a VM that :meth:`_load` left loaded and connect to its agent; with ``hash_disk``,
        the overlay's hash taken before the guest runs."""
        disk_hash: str | None = None
        stream: anyio.abc.ByteStream | None = None
        try:
            async with await self._qmp(vm_dir) as q:
                if hash_disk:
                    disk_hash = await anyio.to_thread.run_sync(sha256_file, vm_dir / "disk.qcow2")
                if status == "paused":
                    # Connected before the guest runs: a VM saved with its host connected (see
                    # leave_agent_idle) then finds one at once, and its agent reads our HELLO
                    # without going through a hang-up and a reconnection first.
                    with contextlib.suppress(OSError):
                        stream = await connect_unix(vm_dir / qemu.AGENT_SOCKET)
                    await q.execute("cont")
            channel = await self._open_channel(vm_dir, self._restore_timeout, stream)
        except BaseException:
            if stream is not None:
                await stream.aclose()  # if _open_channel has not already
            await qemu.kill_vm(vm_dir)
            raise
        return channel, disk_hash


async def remove_vm_dir(path: Path) -> None:
    """Kill the VM served from ``path`` (if any) and remove its directory."""
    await qemu.kill_vm(path)
    shutil.rmtree(path, ignore_errors=True)


def shq(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))


async def create_overlay(image: ImagePaths, disk: Path) -> None:
    argv = [
        "qemu-img", "create", "-q", "-f", "qcow2",
        "-b", str(image.disk), "-F", image.disk_format, str(disk),
    ]  # fmt: skip
    try:
        proc = await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        msg = "qemu-img is not installed (apt-get install qemu-utils)"
        raise BackendUnavailable(msg) from e
    if proc.returncode != 0:
        msg = f"qemu-img create failed: {proc.stderr.decode(errors='replace').strip()}"
        raise BackendError(msg)


async def set_ignore_shared(q: QmpClient, on: bool) -> None:
    await q.execute(
        "migrate-set-capabilities",
        {"capabilities": [{"capability": "x-ignore-shared", "state": on}]},
    )


async def migrate_to(
    q: QmpClient, path: Path, *, ignore_shared: bool = False, timeout: float = 120.0
) -> None:
    """Migrate the (stopped) VM's state into a file and wait until it is complete.

    The capability is always set explicitly: a VM restored from a template was started with
    ``x-ignore-shared`` on, and a stream saved with it on cannot be loaded without it.
    """
    await set_ignore_shared(q, ignore_shared)
    await q.execute("migrate", {"uri": f"exec:cat > {shq(path)}"})
    with anyio.fail_after(timeout):
        while True:
            info = await q.execute("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                err = info.get("error-desc", "") if isinstance(info, dict) else ""
                msg = f"saving the VM state failed: {err}"
                raise BackendError(msg)
            await anyio.sleep(0.005)
