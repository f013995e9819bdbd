"""Reset and verification of microVMs.

Reset returns a VM to its baseline (the template for a fresh VM, the snapshot it was last
restored from otherwise) and verifies three independent sources against what was recorded when
that baseline was made: the SHA-256 of the overlay file (checked while the restored VM is still
paused, so the guest cannot have written), QEMU's run state (``query-status``), and the number
of open file descriptors in the guest (asked over the agent). Any disagreement raises
:class:`ResetVerificationFailed` naming the source; there is no quorum.

A VM whose baseline is a template is reset by resuming its standby
(:mod:`~sandlot.backends.microvm.standby`). Builds on
:class:`~sandlot.backends.microvm.snapshots.Snapshots` (a reset to a snapshot is a restore);
must not import the pool module, the store or the Manager.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc

from sandlot.backends.base import SnapshotRef
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.snapshots import Snapshots
from sandlot.backends.microvm.standby import beside_standby
from sandlot.backends.microvm.state import Baseline, VmRecord, copy_file, flock, sha256_file
from sandlot.channel.base import Channel
from sandlot.errors import InvalidState, SandboxError, VerificationFailed
from sandlot.models import JsonValue, SandboxSpec

__all__ = ["Reset", "ResetVerificationFailed", "VerificationCheck", "VerificationReport"]


class ResetVerificationFailed(VerificationFailed):
    """A reset (or verify) found the sandbox different from its baseline.

    ``details["verification"]`` is the report as JSON data; ``details["diverged"]`` lists the
    sources that disagreed (``disk``, ``vmm``, ``guest_fds``).
    """


@dataclass(frozen=True)
class VerificationCheck:
    """One source compared against its baseline."""

    source: Literal["disk", "vmm", "guest_fds"]
    expected: str
    actual: str

    @property
    def ok(self) -> bool:
        """True when the source matches its baseline."""
        return self.expected == self.actual


@dataclass(frozen=True)
class VerificationReport:
    """The outcome of a verification: every source, whether it matched, and how long it took."""

    checks: tuple[VerificationCheck, ...]
    duration_ms: float
    restore_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every source matched."""
        return all(c.ok for c in self.checks)

    @property
    def diverged(self) -> list[str]:
        """The sources that did not match."""
        return [c.source for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, JsonValue]:
        """The report as JSON data."""
        return {
            "ok": self.ok,
            "diverged": list(self.diverged),
            "duration_ms": round(self.duration_ms, 2),
            "restore_ms": round(self.restore_ms, 2),
            "checks": [{**asdict(c), "ok": c.ok} for c in self.checks],
        }


class Reset(Snapshots):
    """Reset to the baseline (or a snapshot), and verification against it."""

    async def reset(
        self, ref: str, snapshot: SnapshotRef | None, spec: SandboxSpec
    ) -> dict[str, JsonValue]:
        """The Backend protocol's reset: to ``snapshot`` (which becomes the baseline) or to the
        current baseline, verified either way; the report as JSON data."""
        if snapshot is None:
            report = await self.reset_to_baseline(ref)
        else:
            await self.restore(ref, snapshot, spec)
            report = await self.verify(ref)
        return report.to_dict()

    async def reset_to_baseline(self, ref: str) -> VerificationReport:
        """Revert the VM to its baseline and verify disk, VMM state and guest fds.

        A VM whose baseline is a template is reset by resuming a standby: a QEMU started beside
        it with the baseline loaded and left paused (:meth:`_make_standby`). Each reset starts
        the next standby while the guest it resumed wakes up, so QEMU's own start-up (~60 ms)
        is off the next reset's path; a missing or stale standby means a plain restore.

        Raises:
            ResetVerificationFailed: A source disagreed with its baseline (details name it).
            InvalidState: The VM has no baseline (its snapshot was deleted).
        """
        vm_dir = self._vm_dir(ref)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            rec = self._record(ref)
            base = rec.baseline
            if base is None or not Path(base.dir).is_dir():  # noqa: ASYNC240
                msg = f"microvm {ref} has no baseline to reset to"
                raise InvalidState(msg)
            started = time.perf_counter()
            source, machine, net = Path(base.dir), self._machine(rec), self._launch_of(rec)
            standby_key = self._standby_key(rec)
            await self._drop(ref)
            await qemu.kill_vm(vm_dir)
            with contextlib.suppress(FileNotFoundError):
                (vm_dir / "mem.bin").unlink()
            if not await self._take_standby(vm_dir, standby_key):
                copy_file(source / "disk.qcow2", vm_dir / "disk.qcow2")
                await self._load(vm_dir, machine, source, net)
            report = await beside_standby(
                (lambda: self._make_standby(vm_dir, machine, source, net, standby_key))
                if base.kind == "template"
                else None,
                lambda: self._resume_verified(vm_dir, rec, base, started),
            )
            if not report.ok:
                raise verification_error(ref, report)
            return report

    async def _resume_verified(
        self, vm_dir: Path, rec: VmRecord, base: Baseline, started: float
    ) -> VerificationReport:
        """Run the VM :meth:`reset_to_baseline` loaded, verify it, set its clock."""
        channel, disk_hash = await self._resume(vm_dir, "paused", hash_disk=True)
        restored = time.perf_counter()
        try:
            report = await self._verify(vm_dir, base, channel, disk_hash, started)
            # The baseline's clock is in the past; set after the descriptors were counted,
            # because a nat VM's guest network setup starts programs.
            await self._sync_clock(channel, rec.net_mode, guest_nat=base.guest_nat)
        except BaseException:
            await channel.close()
            raise
        self._keep(rec.sandbox_id, channel)
        return VerificationReport(report.checks, report.duration_ms, (restored - started) * 1000)

    async def verify(self, ref: str) -> VerificationReport:
        """Compare the running VM with its baseline, without reverting anything.

        Raises:
            ResetVerificationFailed: A source disagreed with its baseline.
        """
        vm_dir = self._vm_dir(ref)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            rec = self._record(ref)
            if rec.baseline is None:
                msg = f"microvm {ref} has no baseline"
                raise InvalidState(msg)
            if not qemu.is_running(vm_dir):
                msg = f"microvm {ref} is not running"
                raise InvalidState(msg)
            started = time.perf_counter()
            channel = await self._agent(ref, vm_dir)
            try:
                report = await self._verify(vm_dir, rec.baseline, channel, None, started)
            except BaseException:
                await channel.close()
                raise
            self._keep(ref, channel)
            if not report.ok:
                raise verification_error(ref, report)
            return report

    async def _verify(
        self,
        vm_dir: Path,
        base: Baseline,
        channel: Channel,
        disk_hash: str | None,
        started: float,
    ) -> VerificationReport:
        if disk_hash is None:
            disk_hash = await anyio.to_thread.run_sync(sha256_file, vm_dir / "disk.qcow2")
        async with await self._qmp(vm_dir) as q:
            status = await q.status()
        try:
            fds = str(await self._fd_count(channel, base.fd_source))
        except SandboxError as e:
            fds = f"error: {e}"
        checks = (
            VerificationCheck("disk", base.disk_sha256, disk_hash),
            VerificationCheck("vmm", base.vmm_status, status),
            VerificationCheck("guest_fds", str(base.fd_count), fds),
        )
        return VerificationReport(checks, (time.perf_counter() - started) * 1000)


def verification_error(ref: str, report: VerificationReport) -> ResetVerificationFailed:
    return ResetVerificationFailed(
        f"microvm {ref} differs from its baseline in: {', '.join(report.diverged)}",
        verification=report.to_dict(),
        diverged=report.diverged,
    )
