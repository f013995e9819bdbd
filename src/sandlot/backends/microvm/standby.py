"""Standbys: a QEMU started in advance with a baseline loaded and left paused, so that the
next reset (a VM's own standby, beside it) or the next create (a paused clone of the template,
shared by the state directory) resumes it instead of starting QEMU (QEMU's own start-up, ~60 ms, is
then off that path). A standby is made while the guest just restored wakes up (:func:`beside_standby`), and
is best effort: one that cannot be made only means a plain restore next time.

Builds on :class:`~sandlot.backends.microvm.boot.QemuBoot` and
:class:`~sandlot.backends.microvm.network.NetworkPlumbing`; must not import the templates,
pool, snapshots or reset modules, the store or the Manager.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.abc

from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.boot import QemuBoot, remove_vm_dir
from sandlot.backends.microvm.network import Launch, NetworkPlumbing
from sandlot.backends.microvm.state import POOLED_SOCKET, VmRecord, copy_file, flock
from sandlot.errors import BackendError

__all__ = ["Standbys", "beside_standby", "standby_attempt"]

# A VM's reset standby (a paused QEMU with its baseline loaded) and the key it was made for.
_STANDBY: Final = "standby"


_STANDBY_KEY: Final = "standby.json"


_T = TypeVar("_T")


_log = logging.getLogger(__name__)


class Standbys(NetworkPlumbing, QemuBoot):
    """Reset standbys (one per VM) and create standbys (one per machine config)."""

    def _standby_key(self, rec: VmRecord) -> str:
        """What a standby must have been made for to stand in for this VM's next reset."""
        base = rec.baseline
        assert base is not None
        parts = [base.dir, base.disk_sha256, rec.net_mode, rec.egress_socket or ""]
        return json.dumps([*parts, self._machine(rec).fingerprint()])

    async def _take_standby(self, vm_dir: Path, key: str) -> bool:
        """Move a ready standby's QEMU into ``vm_dir`` (whose own QEMU is gone); False, and
        the standby discarded, if there is none for ``key``.

        QEMU keeps every file it uses open (disk, log, pid file; see ``auto-read-only`` in
        qemu.py) and its sockets are bound to inodes, so renaming them into ``vm_dir`` hands the
        VM over as it is.
        """
        standby = vm_dir / _STANDBY
        try:
            ready = (standby / _STANDBY_KEY).read_text() == key and qemu.is_running(standby)
        except OSError:
            ready = False
        if not ready:
            await self._discard_standby(vm_dir)
            return False
        for name in ("disk.qcow2", qemu.SERIAL_LOG, qemu.QMP_SOCKET, qemu.AGENT_SOCKET):
            (standby / name).replace(vm_dir / name)
        # The pid file last: from here on kill_vm(vm_dir) finds this QEMU.
        (standby / qemu.PIDFILE).replace(vm_dir / qemu.PIDFILE)
        shutil.rmtree(standby, ignore_errors=True)
        return True

    async def _make_standby(
        self, vm_dir: Path, machine: qemu.MachineConfig, source: Path, net: Launch, key: str
    ) -> None:
        """Start a QEMU beside the VM with ``source`` loaded and paused, for the next reset.

        Best effort: a standby that cannot be made only makes the next reset a plain restore.
        Only for template baselines, whose RAM is a shared file mapping: a paused standby costs
        QEMU's own memory, not a second copy of the guest's.
        """
        work = vm_dir / f".{_STANDBY}"
        async with standby_attempt(work, f"reset standby for {vm_dir.name}"):
            await self._discard_standby(vm_dir)
            work.mkdir(mode=0o700)
            await self._load_paused(work, machine, source, net)
            (work / _STANDBY_KEY).write_text(key)
            work.rename(vm_dir / _STANDBY)

    async def _load_paused(
        self, work: Path, machine: qemu.MachineConfig, source: Path, net: Launch
    ) -> None:
        """A standby in ``work``: its own copy of the baseline overlay, the baseline's memory
        loaded, the VM paused."""
        copy_file(source / "disk.qcow2", work / "disk.qcow2")
        status = await self._load(work, machine, source, net)
        if status != "paused":
            msg = f"a standby must stay paused, and it is {status!r}"
            raise BackendError(msg)

    # A create standby: standby/<fingerprint>/ready, a paused clone of that template. Owned by
    # the state directory (any process's create may claim it); this object removes the ones
    # it made at aclose().

    def _create_standby(self, machine: qemu.MachineConfig) -> Path:
        return self._root / "standby" / machine.fingerprint() / "ready"

    async def _claim_standby(self, machine: qemu.MachineConfig, vm_dir: Path) -> bool:
        """Move a paused clone of the template into ``vm_dir`` (which must not exist)."""
        ready = self._create_standby(machine)
        if not ready.exists():
            return False
        async with flock(ready.parent.with_suffix(".lock")):
            if not ready.exists():
                return False
            if not qemu.is_running(ready):
                await remove_vm_dir(ready)
                return False
            vm_dir.parent.mkdir(parents=True, exist_ok=True)
            ready.rename(vm_dir)
            return True

    async def _make_create_standby(self, machine: qemu.MachineConfig, template: Path) -> None:
        """Load ``template`` into a paused QEMU for the next create of this machine config,
        unless one is ready (best effort, like :meth:`_make_standby`)."""
        ready = self._create_standby(machine)
        if ready.exists():
            return
        work = ready.with_name(f".{secrets.token_hex(4)}")
        async with standby_attempt(work, "create standby"):
            work.mkdir(parents=True, mode=0o700)
            net = Launch()
            if machine.nic:
                # Its proxy socket is served once a sandbox claims it (as for a pooled VM).
                socket = self._new_egress_socket()
                (work / POOLED_SOCKET).write_text(socket)
                net = self._launch(work.name, "proxy", socket)
            await self._load_paused(work, machine, template, net)
            async with flock(ready.parent.with_suffix(".lock")):
                if ready.exists():  # another process made one meanwhile
                    msg = "another create standby is ready"
                    raise FileExistsError(msg)
                work.rename(ready)
            self._create_standbys.add(ready)

    async def _discard_create_standbys(self, readies: list[Path]) -> None:
        for ready in readies:
            if not ready.parent.is_dir():
                continue
            async with flock(ready.parent.with_suffix(".lock")):
                await remove_vm_dir(ready)

    async def _discard_standby(self, vm_dir: Path) -> None:
        """Kill and remove the VM's standby, ready or half made."""
        for path in (vm_dir / _STANDBY, vm_dir / f".{_STANDBY}"):
            if path.exists():
                await remove_vm_dir(path)


async def beside_standby(
    standby: Callable[[], Coroutine[Any, Any, None]] | None, body: Callable[[], Awaitable[_T]]
) -> _T:
    """``body()``, with ``standby()`` making the next create's or reset's standby beside it
    while this guest wakes up (CPU-bound on one core under TCG).

    A failure of ``body`` cancels the standby and is raised as itself, not inside an exception
    group: callers catch ``ResetVerificationFailed`` and the like by type. The standby's own
    failures never surface (:func:`standby_attempt`).
    """
    failure: BaseException | None = None
    async with anyio.create_task_group() as tg:
        if standby is not None:
            tg.start_soon(standby)
        try:
            result = await body()
        except BaseException as e:
            failure = e
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


@contextlib.asynccontextmanager
async def standby_attempt(work: Path, what: str) -> AsyncIterator[None]:
    """Make a standby in ``work``, best effort: on a failure its QEMU and files go and the
    error is logged, not raised (without a standby the next create or reset restores as
    usual); only cancellation goes through."""
    try:
        yield
    except BaseException as e:
        with anyio.CancelScope(shield=True):
            await remove_vm_dir(work)
        if not isinstance(e, Exception):
            raise
        if not isinstance(e, FileExistsError):  # FileExistsError: another one is ready
            _log.warning("microvm: no %s: %s", what, e)
