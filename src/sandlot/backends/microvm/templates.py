"""Booted templates: one per machine config (image, memory, vCPUs, NIC), cold-booted once,
warmed up, and saved so that every VM of that config is a clone of it.

How a clone stays consistent with its template. The template boots once, the agent answers,
the guest runs ``sync``, our agent connection closes, then QEMU is paused and its device state
migrated while its RAM stays in ``ram.img`` (the ``x-ignore-shared`` capability skips RAM that
is a shared file mapping). The template's overlay is copied at that instant, and that frozen
copy is what the template's memory "saw". Every clone gets its own copy of that frozen overlay
(a few hundred KB), maps ``ram.img`` privately (``share=off``: copy-on-write, so clones never
write into it and share its unmodified pages in the host page cache) and loads the device state.
The template files are written once and never changed: a private mapping would see later changes
to the file. A VM restored from a full migration stream (stop/start, snapshots) uses anonymous
RAM instead; both name their RAM block ``ram``, so streams move between the two.

Builds on :class:`~sandlot.backends.microvm.boot.QemuBoot`; must not import the standbys,
pool, snapshots or reset modules, the store or the Manager.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Final

from sandlot.backends import trust
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.boot import QemuBoot, create_overlay, migrate_to, remove_vm_dir
from sandlot.backends.microvm.guest import fd_source_of, leave_agent_idle
from sandlot.backends.microvm.network import Launch
from sandlot.backends.microvm.state import Baseline, flock, sha256_file
from sandlot.channel.base import Channel
from sandlot.errors import NotFound

__all__ = ["Templates", "install_trust"]

# Run once in a template before its memory is saved (see _make_template).
_TEMPLATE_WARMUP: Final = (
    "for p in true env ls cat cp mv rm mkdir date id uname head tail grep sed bash python3; do "
    "command -v $p >/dev/null && $p --version >/dev/null 2>&1; done; true"
)


class Templates(QemuBoot):
    """The booted template of each machine config, made on first use."""

    async def _template(self, machine: qemu.MachineConfig) -> Path:
        """The booted template for this machine config, made on first use."""
        fp = machine.fingerprint()
        tdir = self._root / "templates" / fp
        if (tdir / "template.json").exists():
            return tdir
        async with flock(self._root / "templates" / f"{fp}.lock"):
            if (tdir / "template.json").exists():
                return tdir
            work = self._root / "templates" / f".{fp}.{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            try:
                await self._make_template(machine, work)
                work.rename(tdir)
            finally:
                await remove_vm_dir(work)
        return tdir

    async def _make_template(self, machine: qemu.MachineConfig, work: Path) -> None:
        disk = work / "disk.qcow2"
        await create_overlay(machine.image, disk)
        ram = machine.ram_file(work / "ram.img", shared=True)
        # A NIC on a restricted network forwarding nothing: the guest configures it at boot
        # and the device state is what every clone's NIC loads, whatever its mode.
        net = (
            Launch(qemu.user_netdev(restrict=True, proxy_socket=None)) if machine.nic else Launch()
        )
        channel = await self._cold_boot(work, machine, disk, ram, net)
        bundle: str | None = None
        async with await self._qmp(work) as q:
            try:
                if machine.image.trust:
                    # Here, once per set of CAs, rather than in every clone: what a clone
                    # starts with is its baseline, which resets and verification return to.
                    bundle = await install_trust(channel, machine.image.trust)
                # Every clone starts with this page cache: the common programs are in it, so a
                # clone's first command reads nothing from disk (under TCG the block I/O path
                # costs a clone ~40 ms of code translation the first time it runs).
                await self._guest_sh(channel, _TEMPLATE_WARMUP)
                # Dirty pages written now land in the overlay before it is frozen, not later in
                # every clone (which would make each clone's disk differ from the baseline).
                await self._guest_sh(channel, "sync")
                fd_source = fd_source_of(channel)
                fd_count = await self._fd_count(channel, fd_source)
                await leave_agent_idle(channel, q)
                await q.execute("stop")
                await migrate_to(q, work / "state.bin", ignore_shared=True)
            finally:
                await channel.close()
        await qemu.kill_vm(work)
        baseline = Baseline(
            "template", "", sha256_file(disk), fd_count, "running", fd_source=fd_source
        )
        (work / "template.json").write_text(
            json.dumps(
                {
                    "baseline": asdict(baseline),
                    "fingerprint": machine.fingerprint(),
                    "trust_bundle": bundle,
                }
            )
        )


async def install_trust(channel: Channel, certificates: tuple[str, ...]) -> str:
    """Add ``certificates`` to a booted guest's system trust (:mod:`sandlot.backends.trust`)
    with file operations of the agent alone; the bundle's path in the guest."""

    async def read(path: str) -> bytes | None:
        try:
            return b"".join([chunk async for chunk in channel.read_file(path)])
        except NotFound:
            return None

    files: dict[str, bytes] = {}
    base = await read(trust.DEBIAN_BUNDLE)
    debian = base is not None
    if debian:
        files[trust.DEBIAN_BUNDLE] = trust.merge_bundle(base, certificates)
        try:
            local = await channel.stat(trust.DEBIAN_CA_DIR)
        except NotFound:
            local = None
        if local is not None and local.type == "dir":
            for pem in certificates:
                files[f"{trust.DEBIAN_CA_DIR}/sandlot/{trust.file_name(pem)}"] = pem.encode()
    else:
        start = None
        for candidate in trust.OTHER_BUNDLES:
            start = await read(candidate)
            if start is not None:
                break
        files[trust.OWN_BUNDLE] = trust.merge_bundle(start, certificates)
    for path, data in files.items():
        await channel.write_file(path, data, mode=0o644)
    return trust.bundle_path(debian)
