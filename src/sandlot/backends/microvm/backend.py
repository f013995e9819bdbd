"""The ``microvm`` backend: one QEMU ``-M microvm`` guest per sandbox.

This module is the front door, :class:`MicrovmBackend`, and owns the sandbox lifecycle on QEMU:
create from a booted template (or a pooled VM, or a create standby), stop/start with memory,
destroy, inspect, and the channel to a running VM. Its other parts are mixins over one typed
base, each in its own module (see the package's docstring): state, network, guest agent, boot,
templates, standbys, warm pool, snapshots, reset. It never touches the store and imports
nothing above :mod:`sandlot.channel`.

Guest clock: a restored guest's clock resumes from when its memory was saved, so every restore
sets it, with the agent's ``clock.set`` request (no program started; a ``nat`` VM's guest
network setup still needs one exec). Under TCG a fresh QEMU translates every guest code path
once, so the caller's first exec after a create costs a few hundred ms more than later ones; a
warm pool (``pool_size``) pays that in advance: create then renames a ready, warmed VM's
directory (a few ms). Without a pool, each create after an object's first still leaves a
standby: a QEMU with the template loaded and paused (no guest CPU, no RAM copy: the template's
RAM is a shared file), made while the created guest wakes up, which the next create resumes
instead of starting QEMU (~50 ms).
A reset does the same with a standby of its VM's baseline. QEMU keeps using the descriptors it
opened (``auto-read-only=off``), so a started VM's files can be renamed into another directory.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final, final

import anyio
import anyio.abc

from sandlot import config
from sandlot.backends import trust
from sandlot.backends.base import BackendState, Capabilities
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.boot import migrate_to, remove_vm_dir
from sandlot.backends.microvm.channel import NetworkEnvChannel
from sandlot.backends.microvm.image import ImagePaths
from sandlot.backends.microvm.network import mode_for
from sandlot.backends.microvm.reset import (
    Reset,
    ResetVerificationFailed,
    VerificationCheck,
    VerificationReport,
)
from sandlot.backends.microvm.standby import beside_standby
from sandlot.backends.microvm.state import (
    DEFAULT_MEMORY_MB,
    VmRecord,
    copy_file,
    flock,
    pooled_socket,
    serial_tail,
)
from sandlot.backends.microvm.warm_pool import WarmPool
from sandlot.backends.options import check_backend_options
from sandlot.channel.base import Channel
from sandlot.errors import InvalidState, NotSupported
from sandlot.models import NetworkPolicy, PortMapping, SandboxSpec
from sandlot.network.service import SandboxNetworks

__all__ = [
    "DEFAULT_MEMORY_MB",
    "MicrovmBackend",
    "ResetVerificationFailed",
    "VerificationCheck",
    "VerificationReport",
]

_WORKDIR: Final = "/workspace"


@final
class MicrovmBackend(Reset, WarmPool):
    """Sandboxes as QEMU microVMs with a guest agent over virtio-serial.

    Args:
        state_dir: Where VMs, templates and snapshots live (``backend_dir(home, "microvm")``).
        cache_dir: The image cache root; default :func:`sandlot.config.cache_dir`.
        image: The default image; default the newest built one (built on first use).
        boot_timeout: Seconds a cold boot may take to reach the agent before it is retried
            once (a TCG boot hangs now and then; the retry is counted in ``boot-stats.json``).
        restore_timeout: Seconds a restore from memory may take to reach the agent.
        pool_size: How many restored, clock-set and warmed-up VMs to keep ready per machine
            config (0: none). A create then claims one by renaming its directory, and a
            detached process refills the pool. Each costs an idle VM's host memory.
        networks: The network service serving the VMs' egress proxies (and, for ``allow-all``,
            their network namespaces); default one in ``state_dir/network``.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        cache_dir: Path | None = None,
        image: ImagePaths | None = None,
        boot_timeout: float = 45.0,
        restore_timeout: float = 30.0,
        pool_size: int = 0,
        networks: SandboxNetworks | None = None,
    ) -> None:
        self._root = state_dir.absolute()
        self._cache = cache_dir or config.cache_dir()
        self._image = image
        self._boot_timeout = boot_timeout
        self._restore_timeout = restore_timeout
        self._pool_size = max(0, pool_size)
        self._accel: qemu.AccelDecision | None = None
        # The agent connection an operation ended with, handed to the next channel() call:
        # reconnecting right after a close can hit the agent's stale session (see
        # _open_channel), which costs a handshake retry.
        self._handover: dict[str, Channel] = {}
        self._create_standbys: set[Path] = set()  # the ones this object made
        # Creates so far: an object's first create makes no create standby, which a one-shot
        # process (a CLI command) would only remove again at aclose().
        self._creates = 0
        for sub in ("vms", "templates", "snapshots", "pool", "egress"):
            (self._root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        self._networks = networks or SandboxNetworks(self._root / "network")
        self._network_kinds: frozenset[str] | None = None

    # ----------------------------------------------------------------- protocol basics

    @property
    def name(self) -> str:
        """``microvm``."""
        return "microvm"

    def capabilities(self) -> Capabilities:
        """A VM per sandbox: whole vCPUs and guest memory, memory-keeping stop; network
        ``deny-all`` always, allowlists with ``socat``, ``allow-all`` as root with ``ip`` and
        ``nft``."""
        return Capabilities(
            network=self._kinds(),
            limits=frozenset({"vcpus", "memory_mb"}),
            pause_memory=True,
            snapshot=True,
            fork=True,
            ports=False,
            images=True,
            reset=True,
            isolation="vm",
            host_local=True,
        )

    async def aclose(self) -> None:
        """Close the agent connections this object holds (the VMs keep running) and remove the
        create standbys it made."""
        for ref in list(self._handover):
            await self._drop(ref)
        made, self._create_standbys = sorted(self._create_standbys), set()
        await self._discard_create_standbys(made)

    def _check_spec(self, spec: SandboxSpec) -> None:
        # Before any image work: a bad accelerator setting fails every VM alike.
        qemu.forced_accel()
        check_backend_options({"microvm": spec.options_for("microvm")})
        self._require_kind(spec.network)
        if spec.ports:
            msg = "the microvm backend cannot expose ports"
            raise NotSupported(msg, field="ports")
        res = spec.resources
        for name in ("pids", "disk_mb"):
            if getattr(res, name) is not None:
                msg = f"the microvm backend does not enforce resources.{name}"
                raise NotSupported(msg)

    # ----------------------------------------------------------------- lifecycle

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Restore a booted template into a new VM with its own overlay (cold boot once per
        machine config to make the template), networked for ``spec.network``."""
        self._check_spec(spec)
        vm_dir = self._vm_dir(sandbox_id)
        machine = self._machine_for(spec)
        mode = mode_for(spec.network)
        async with flock(self._root / "vms" / f"{sandbox_id}.lock"):
            if (vm_dir / "vm.json").exists():
                # A retried create adopts what the first attempt made.
                if not qemu.is_running(vm_dir):
                    await self._start_locked(sandbox_id, spec.network)
                return sandbox_id
            tdir = await self._template(machine)
            make_standby = mode != "nat" and self._creates > 0
            self._creates += 1
            # A pooled VM with a NIC runs in proxy mode: a nat VM lives in a namespace named
            # after its sandbox, which a pooled one does not know yet.
            if self._pool_size and mode != "nat" and await self._claim(machine, vm_dir):
                try:
                    socket = pooled_socket(vm_dir) if mode == "proxy" else None
                    rec = VmRecord(
                        sandbox_id,
                        str(machine.image.directory),
                        machine.memory_mb,
                        machine.vcpus,
                        machine.accel,
                        self._baseline_of(tdir),
                        net_mode=mode,
                        egress_socket=socket,
                        trust=list(machine.image.trust),
                        trust_bundle=self._trust_bundle_of(tdir),
                    )
                    await self._prepare_network(sandbox_id, mode, spec.network, socket)
                    if spec.workdir != _WORKDIR:
                        channel = await self._agent(sandbox_id, vm_dir)
                        self._keep(sandbox_id, channel)
                        await channel.mkdir(spec.workdir)
                    rec.save(vm_dir / "vm.json")
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._drop(sandbox_id)
                        await remove_vm_dir(vm_dir)
                        await self._teardown_network(sandbox_id)
                    raise
                self._spawn_refill(machine)
                return sandbox_id
            claimed = mode != "nat" and await self._claim_standby(machine, vm_dir)
            if claimed:
                socket = pooled_socket(vm_dir) if mode == "proxy" else None
            else:
                vm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                socket = self._new_egress_socket() if mode == "proxy" else None
            try:
                # The host side first: the listener (or namespace) exists before the guest runs.
                await self._prepare_network(sandbox_id, mode, spec.network, socket)
                status = "paused"  # a standby is checked to be when it is made
                if not claimed:
                    copy_file(tdir / "disk.qcow2", vm_dir / "disk.qcow2")
                    net = self._launch(sandbox_id, mode, socket)
                    status = await self._load(vm_dir, machine, tdir, net)

                async def wake() -> Channel:
                    channel, _ = await self._resume(vm_dir, status)
                    try:
                        await self._sync_clock(channel, mode)
                        if spec.workdir != _WORKDIR:
                            await channel.mkdir(spec.workdir)
                    except BaseException:
                        await channel.close()
                        raise
                    return channel

                standby = (
                    (lambda: self._make_create_standby(machine, tdir)) if make_standby else None
                )
                channel = await beside_standby(standby, wake)
                self._keep(sandbox_id, channel)
                rec = VmRecord(
                    sandbox_id,
                    str(machine.image.directory),
                    machine.memory_mb,
                    machine.vcpus,
                    machine.accel,
                    self._baseline_of(tdir),
                    net_mode=mode,
                    egress_socket=socket,
                    trust=list(machine.image.trust),
                    trust_bundle=self._trust_bundle_of(tdir),
                )
                rec.save(vm_dir / "vm.json")
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await remove_vm_dir(vm_dir)
                    await self._teardown_network(sandbox_id)
                raise
        if self._pool_size and mode != "nat":
            self._spawn_refill(machine)
        return sandbox_id

    async def start(self, ref: str, spec: SandboxSpec) -> None:
        """Resume a stopped VM from its saved memory (cold boot from its disk if none); its
        network serves ``spec.network`` again (rebuilt after a host reboot)."""
        async with flock(self._root / "vms" / f"{ref}.lock"):
            await self._start_locked(ref, spec.network)

    async def _start_locked(self, ref: str, policy: NetworkPolicy) -> None:
        vm_dir = self._vm_dir(ref)
        rec = self._record(ref)
        await self._prepare_network(ref, rec.net_mode, policy, rec.egress_socket)
        if qemu.is_running(vm_dir):
            async with await self._qmp(vm_dir) as q:
                # A snapshot interrupted half-way leaves the VM paused or post-migration.
                if await q.status() in ("paused", "postmigrate"):
                    await q.execute("cont")
            return
        machine = self._machine(rec)
        mem = vm_dir / "mem.bin"
        net = self._launch_of(rec)
        if mem.exists():
            channel = await self._restore_into(vm_dir, machine, mem, net)
            mem.unlink()
        else:
            channel = await self._cold_boot(
                vm_dir, machine, vm_dir / "disk.qcow2", machine.ram_anonymous(), net
            )
        try:
            await self._sync_clock(channel, rec.net_mode)
        except BaseException:
            await channel.close()
            raise
        self._keep(ref, channel)

    async def stop(self, ref: str) -> None:
        """Save the VM's memory to ``mem.bin`` and end QEMU; the disk stays."""
        vm_dir = self._vm_dir(ref)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            self._record(ref)
            await self._drop(ref)
            await self._discard_standby(vm_dir)
            if not qemu.is_running(vm_dir):
                return
            part = vm_dir / "mem.bin.part"
            async with await self._qmp(vm_dir) as q:
                await q.execute("stop")
                await migrate_to(q, part)
            await qemu.kill_vm(vm_dir)
            part.replace(vm_dir / "mem.bin")

    async def destroy(self, ref: str) -> None:
        """Kill QEMU, remove every file of the VM and its network (proxy listener and socket,
        namespace); a missing VM is fine."""
        vm_dir = self._vm_dir(ref)
        async with flock(self._root / "vms" / f"{ref}.lock"):
            await self._drop(ref)
            await self._discard_standby(vm_dir)
            await remove_vm_dir(vm_dir)
            await self._teardown_network(ref)
        with contextlib.suppress(FileNotFoundError):
            (self._root / "vms" / f"{ref}.lock").unlink()

    async def inspect(self, ref: str) -> BackendState:
        """``running`` while QEMU runs (even paused), ``stopped`` while its directory holds it,
        else ``missing``."""
        vm_dir = self._vm_dir(ref)
        if not (vm_dir / "vm.json").exists():
            return BackendState("missing")
        if qemu.is_running(vm_dir):
            return BackendState("running")
        if (vm_dir / "mem.bin").exists():
            return BackendState("stopped", "stopped", "memory saved")
        tail = serial_tail(vm_dir)
        reason = "crashed" if "Kernel panic" in tail else "exited"
        return BackendState("stopped", reason, tail)

    async def list_owned(self) -> dict[str, str]:
        """Every VM directory, with its record or without (a create killed before writing
        vm.json left it, and with no ref recorded the Manager's destroy finds it only here)."""
        vms = self._root / "vms"
        return {d.name: d.name for d in sorted(vms.iterdir()) if d.is_dir()}

    async def channel(self, ref: str) -> Channel:
        """Connect to the guest agent (one host connection per VM at a time: QEMU's socket
        serves one client, a second waits until the first closes). On a VM with a network,
        commands started through it get the egress proxy's environment."""
        vm_dir = self._vm_dir(ref)
        rec = self._record(ref)
        if not qemu.is_running(vm_dir):
            msg = f"microvm {ref} is not running"
            raise InvalidState(msg)
        inner = await self._agent(ref, vm_dir)
        # The extra CAs' variables: the agent's own environment was fixed when the template
        # booted. Under the network's and the caller's (whose own SSL_CERT_FILE wins).
        ca_env = trust.environment(rec.trust_bundle) if rec.trust_bundle else {}
        if rec.net_mode == "none":
            return NetworkEnvChannel(inner, lambda: ca_env) if ca_env else inner
        return NetworkEnvChannel(inner, lambda: {**ca_env, **self._guest_env(rec)})

    async def expose_port(self, ref: str, port: int) -> PortMapping:
        """Not supported: the guest has no network."""
        msg = "the microvm backend cannot expose ports (the guest has no NIC)"
        raise NotSupported(msg)
