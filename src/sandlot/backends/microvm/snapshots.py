"""Snapshots of microVMs: saving a running VM's memory and disk (it keeps running), restoring
one into a VM (it becomes the VM's reset baseline), forking new VMs from one, deleting one.

A snapshot with a NIC only restores into a VM with one (QEMU loads device state only into the
same devices). Builds on :class:`~sandlot.backends.microvm.standby.Standbys`; must not import
the pool or reset modules, the store or the Manager.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import anyio
import anyio.abc

from sandlot.backends.base import SnapshotRef
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.boot import migrate_to, remove_vm_dir
from sandlot.backends.microvm.guest import fd_source_of, leave_agent_idle
from sandlot.backends.microvm.network import policy_kind
from sandlot.backends.microvm.standby import Standbys
from sandlot.backends.microvm.state import (
    Baseline,
    NetMode,
    VmRecord,
    copy_file,
    flock,
    sha256_file,
)
from sandlot.errors import BackendError, InvalidRequest, InvalidState, NotFound, NotSupported
from sandlot.models import JsonValue, SandboxSpec

__all__ = ["Snapshots"]


class Snapshots(Standbys):
    """Snapshot, restore, fork, delete."""

    async def snapshot(self, ref: str, snapshot_id: str) -> SnapshotRef:
        """Save memory + disk of a running VM (it keeps running afterwards)."""
        vm_dir = self._vm_dir(ref)
        sdir = self._root / "snapshots" / snapshot_id
        if sdir.exists():
            msg = f"snapshot {snapshot_id} exists already"
            raise InvalidRequest(msg)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            rec = self._record(ref)
            if not qemu.is_running(vm_dir):
                msg = f"microvm {ref} is not running"
                raise InvalidState(msg)
            work = sdir.with_name(f".{snapshot_id}.part")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            try:
                async with await self._qmp(vm_dir) as q:
                    channel = await self._agent(ref, vm_dir)
                    try:
                        await self._guest_sh(channel, "sync")
                        fd_source = fd_source_of(channel)
                        fd_count = await self._fd_count(channel, fd_source)
                        await leave_agent_idle(channel, q)
                        await q.execute("stop")
                        try:
                            await migrate_to(q, work / "mem.bin")
                            # Migration flushed and released the disk: it matches the memory.
                            await anyio.to_thread.run_sync(
                                copy_file, vm_dir / "disk.qcow2", work / "disk.qcow2"
                            )
                        finally:
                            with anyio.CancelScope(shield=True):
                                await q.execute("cont")
                    finally:
                        await channel.close()
                baseline = Baseline(
                    "snapshot",
                    "",
                    sha256_file(work / "disk.qcow2"),
                    fd_count,
                    guest_nat=rec.net_mode == "nat",
                    fd_source=fd_source,
                )
                meta = {
                    "baseline": asdict(baseline),
                    "sandbox_id": ref,
                    "image": rec.image,
                    "memory_mb": rec.memory_mb,
                    "vcpus": rec.vcpus,
                    "accel": rec.accel,
                    "nic": rec.net_mode != "none",
                    # Its disk and memory hold the guest's extra CAs: a fork keeps them.
                    "trust": list(rec.trust),
                    "trust_bundle": rec.trust_bundle,
                }
                (work / "snapshot.json").write_text(json.dumps(meta))
                work.rename(sdir)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        size = sum(p.stat().st_size for p in sdir.iterdir())
        return SnapshotRef(
            ref=snapshot_id,
            size_bytes=size,
            metadata={"disk_sha256": baseline.disk_sha256, "memory_mb": rec.memory_mb},
        )

    def _snapshot_dir(self, snapshot: SnapshotRef) -> tuple[Path, dict[str, JsonValue]]:
        sdir = self._root / "snapshots" / snapshot.ref
        try:
            meta = json.loads((sdir / "snapshot.json").read_text())
        except FileNotFoundError:
            msg = f"no microvm snapshot {snapshot.ref}"
            raise NotFound(msg) from None
        if not isinstance(meta, dict):
            msg = f"snapshot {snapshot.ref} has a bad manifest"
            raise BackendError(msg)
        return sdir, meta

    def _record_from_snapshot(
        self,
        sandbox_id: str,
        sdir: Path,
        meta: dict[str, JsonValue],
        net_mode: NetMode,
        egress_socket: str | None,
    ) -> VmRecord:
        if bool(meta.get("nic", False)) != (net_mode != "none"):
            has = "has a NIC" if meta.get("nic") else "has no NIC (made with deny-all)"
            msg = f"snapshot {sdir.name} {has}; a VM restores only into the same devices, so " + (
                "it needs a network policy other than deny-all"
                if meta.get("nic")
                else "it needs network='deny-all'"
            )
            raise NotSupported(msg, field="network")
        accel = meta["accel"]
        certificates = meta.get("trust")
        return VmRecord(
            sandbox_id,
            str(meta["image"]),
            int(str(meta["memory_mb"])),
            int(str(meta["vcpus"])),
            "kvm" if accel == "kvm" else "tcg",
            self._baseline_of(sdir),
            net_mode=net_mode,
            egress_socket=egress_socket,
            trust=[str(c) for c in certificates] if isinstance(certificates, list) else [],
            trust_bundle=self._trust_bundle_of(sdir),
        )

    async def restore(self, ref: str, snapshot: SnapshotRef, spec: SandboxSpec) -> None:
        """Replace the VM's memory and disk with a snapshot's and run it; the snapshot becomes
        the VM's reset baseline. The VM keeps its network (mode, policy, proxy socket).

        Raises:
            NotSupported: One of the snapshot and the VM has a NIC and the other has not.
        """
        vm_dir = self._vm_dir(ref)
        sdir, meta = self._snapshot_dir(snapshot)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            old = self._record(ref)
            rec = self._record_from_snapshot(ref, sdir, meta, old.net_mode, old.egress_socket)
            await self._discard_standby(vm_dir)
            await qemu.kill_vm(vm_dir)
            with contextlib.suppress(FileNotFoundError):
                (vm_dir / "mem.bin").unlink()
            copy_file(sdir / "disk.qcow2", vm_dir / "disk.qcow2")
            channel = await self._restore_into(
                vm_dir, self._machine(rec), sdir, self._launch_of(rec)
            )
            try:
                await self._sync_clock(
                    channel,
                    rec.net_mode,
                    guest_nat=rec.baseline is not None and rec.baseline.guest_nat,
                )
            except BaseException:
                await channel.close()
                raise
            self._keep(ref, channel)
            rec.save(vm_dir / "vm.json")

    async def fork(
        self, snapshot: SnapshotRef, sandbox_ids: list[str], spec: SandboxSpec
    ) -> list[str]:
        """One new VM per id from a snapshot (made one after another: each restore is CPU-bound
        under TCG), networked for ``spec.network``.

        A snapshot with a NIC forks into ``proxy`` VMs (``nat`` for ``allow-all``; a
        ``deny-all`` fork keeps the NIC and its proxy refuses everything); one without a NIC
        forks only with ``deny-all``.

        Raises:
            NotSupported: The policy needs a NIC the snapshot has not, or cannot be enforced.
        """
        sdir, meta = self._snapshot_dir(snapshot)
        self._require_kind(spec.network)
        mode: NetMode = "none"
        if meta.get("nic"):
            mode = "nat" if policy_kind(spec.network) == "allow-all" else "proxy"
        elif spec.network != "deny-all":
            msg = (
                f"snapshot {snapshot.ref} has no NIC (made with deny-all), and a VM restores only "
                "into the same devices: fork it with network='deny-all'"
            )
            raise NotSupported(msg, field="network")
        refs: list[str] = []
        for sid in sandbox_ids:
            vm_dir = self._vm_dir(sid)
            async with flock(self._root / "vms" / f"{sid}.lock"):
                if (vm_dir / "vm.json").exists():
                    refs.append(sid)
                    continue
                socket = self._new_egress_socket() if mode == "proxy" else None
                rec = self._record_from_snapshot(sid, sdir, meta, mode, socket)
                vm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    await self._prepare_network(sid, mode, spec.network, socket)
                    copy_file(sdir / "disk.qcow2", vm_dir / "disk.qcow2")
                    channel = await self._restore_into(
                        vm_dir, self._machine(rec), sdir, self._launch_of(rec)
                    )
                    try:
                        await self._sync_clock(
                            channel,
                            mode,
                            guest_nat=rec.baseline is not None and rec.baseline.guest_nat,
                        )
                    except BaseException:
                        await channel.close()
                        raise
                    self._keep(sid, channel)
                    rec.save(vm_dir / "vm.json")
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await remove_vm_dir(vm_dir)
                        await self._teardown_network(sid)
                    raise
            refs.append(sid)
        return refs

    async def delete_snapshot(self, snapshot: SnapshotRef) -> None:
        """Remove a snapshot's files (VMs whose baseline it was can no longer be reset)."""
        shutil.rmtree(self._root / "snapshots" / snapshot.ref, ignore_errors=True)
