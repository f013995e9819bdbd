"""What every part of the microvm backend shares: the state directory, a VM's record and
baseline, and :class:`MicrovmState`, the typed base its mixins build on.

:class:`MicrovmState` declares the backend's attributes (set by
:class:`~sandlot.backends.microvm.backend.MicrovmBackend`'s constructor) and the helpers every
mixin uses: where a VM lives, its record, its machine config, the agent connection an operation
hands over to the next. Imports only the image and QEMU modules of this package; must not
import the other modules of the backend, the store or the Manager.

State directory layout (everything another process needs to find a VM again)::

    vms/<sandbox_id>/        one VM (the ref is the sandbox id)
        vm.json              machine config + the baseline that reset returns to
        disk.qcow2           the VM's own overlay (backing file: the image's root disk)
        mem.bin              the memory of a stopped VM (present only while stopped)
        qemu.pid qmp.sock agent.sock serial.log   (see qemu.py)
        standby/             a paused QEMU with the baseline loaded, for the next reset
    templates/<fingerprint>/ one booted template per machine config (image + memory + vcpus)
        ram.img              the template's guest RAM, a file QEMU maps
        state.bin            the device state (migrated with x-ignore-shared, ~60 KB)
        disk.qcow2           the template's overlay at the instant it was paused
        template.json        the baseline: disk hash, guest fd count, VMM state
    snapshots/<snapshot_id>/ mem.bin (full migration stream), disk.qcow2, snapshot.json
    pool/<fingerprint>/pool-*/  warm VMs (restored, clock set, exec path warmed) to claim
    standby/<fingerprint>/ready/  a paused clone of the template for the next create (made
                             from an object's second create on)
    egress/<token>.sock      a VM's egress proxy socket (served by the network daemon)
    network/                 the network service's state (:class:`SandboxNetworks`)
    boot-stats.json          cold boots and how many needed the retry after a hang
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import anyio.abc

from sandlot.backends import trust
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.image import ImagePaths, load_image, resolve_image, with_trust
from sandlot.channel.base import Channel
from sandlot.errors import BackendError, InvalidRequest, NotFound, SandboxError
from sandlot.models import SandboxSpec
from sandlot.network.service import SandboxNetworks

__all__ = [
    "DEFAULT_MEMORY_MB",
    "POOLED_SOCKET",
    "Baseline",
    "FdSource",
    "MicrovmState",
    "NetMode",
    "VmRecord",
    "copy_file",
    "flock",
    "manifest_of",
    "pooled_socket",
    "serial_tail",
    "sha256_file",
]

DEFAULT_MEMORY_MB: Final = 512
"""Guest memory when ``resources.memory_mb`` is unset."""


NetMode = Literal["none", "proxy", "nat"]
"""How a VM is networked: no NIC, a NIC that reaches only the egress proxy, or NAT inside a
network namespace (see :mod:`~sandlot.backends.microvm.network`)."""


FdSource = Literal["agent", "shell"]


POOLED_SOCKET: Final = "egress-socket"
"""The file beside a pooled VM (or create standby) naming the proxy socket its QEMU uses."""


@dataclass
class Baseline:
    """What a reset returns to and verifies against: a template or snapshot directory and
    what was recorded when it was made."""

    kind: Literal["template", "snapshot"]
    dir: str
    disk_sha256: str
    fd_count: int
    vmm_status: str = "running"
    guest_nat: bool = False
    """The guest in this memory image has the ``nat`` setup (route, resolver)."""
    fd_source: FdSource = "shell"
    """How ``fd_count`` was taken, and so how it is taken again to compare: the agent's
    ``fd.count`` or, in baselines made before the agent had it, a shell script
    (:mod:`~sandlot.backends.microvm.guest`)."""


@dataclass
class VmRecord:
    """A VM's ``vm.json``: its machine config, network mode and reset baseline."""

    sandbox_id: str
    image: str
    memory_mb: int
    vcpus: int
    accel: Literal["kvm", "tcg"]
    baseline: Baseline | None = None
    created_at: float = field(default_factory=time.time)
    net_mode: NetMode = "none"
    egress_socket: str | None = None
    """The unix socket QEMU forwards the proxy address to (``proxy`` mode)."""
    trust: list[str] = field(default_factory=list)
    """Extra CA certificates (PEM) the guest trusts: part of its machine's image key."""
    trust_bundle: str | None = None
    """Where, in the guest, the bundle with them is (None: no extra CAs)."""

    @classmethod
    def load(cls, path: Path) -> VmRecord:
        raw = json.loads(path.read_text())
        base = raw.pop("baseline", None)
        return cls(**raw, baseline=Baseline(**base) if base else None)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


@contextlib.asynccontextmanager
async def flock(path: Path) -> AsyncIterator[None]:
    """An exclusive lock between processes (the CLI is one process per command)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            await anyio.to_thread.run_sync(fcntl.flock, fd, fcntl.LOCK_EX, abandon_on_cancel=True)
        yield
    finally:
        os.close(fd)


def manifest_of(source: Path) -> dict[str, Any]:
    """A template's or snapshot's JSON record."""
    meta = source / ("template.json" if (source / "template.json").exists() else "snapshot.json")
    raw = json.loads(meta.read_text())
    if not isinstance(raw, dict):
        msg = f"{meta} is not a JSON object"
        raise BackendError(msg)
    return raw


def serial_tail(vm_dir: Path, lines: int = 12) -> str:
    try:
        text = (vm_dir / qemu.SERIAL_LOG).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def pooled_socket(vm_dir: Path) -> str:
    """The proxy socket a pooled VM's QEMU was started with (recorded beside it)."""
    try:
        return (vm_dir / POOLED_SOCKET).read_text().strip()
    except OSError as e:
        msg = f"the pooled VM {vm_dir.name} does not say where its proxy socket is"
        raise BackendError(msg) from e


class MicrovmState:
    """The state of a :class:`~sandlot.backends.microvm.backend.MicrovmBackend` and the helpers
    every one of its parts uses (set by its constructor; see its arguments)."""

    _root: Path
    _cache: Path
    _image: ImagePaths | None
    _boot_timeout: float
    _restore_timeout: float
    _pool_size: int
    _accel: qemu.AccelDecision | None
    _handover: dict[str, Channel]
    """The agent connection an operation ended with, per VM, handed to the next user."""
    _create_standbys: set[Path]
    _creates: int
    _networks: SandboxNetworks
    _network_kinds: frozenset[str] | None

    def _keep(self, ref: str, channel: Channel) -> None:
        self._handover[ref] = channel

    async def _drop(self, ref: str) -> None:
        channel = self._handover.pop(ref, None)
        if channel is not None:
            with contextlib.suppress(SandboxError, OSError):
                await channel.close()

    def _vm_dir(self, ref: str) -> Path:
        if not ref or "/" in ref or ref.startswith("."):
            msg = f"not a microvm ref: {ref!r}"
            raise InvalidRequest(msg)
        return self._root / "vms" / ref

    def _record(self, ref: str) -> VmRecord:
        path = self._vm_dir(ref) / "vm.json"
        try:
            return VmRecord.load(path)
        except FileNotFoundError:
            msg = f"no microvm sandbox {ref}"
            raise NotFound(msg) from None
        except (ValueError, TypeError) as e:
            msg = f"the record of microvm {ref} is unreadable: {e}"
            raise BackendError(msg) from e

    def _default_image(self) -> ImagePaths:
        if self._image is None:
            self._image = resolve_image(None, self._cache)
        return self._image

    def _accel_for(self, image: ImagePaths) -> Literal["kvm", "tcg"]:
        if self._accel is None:
            self._accel = qemu.decide_accel(image, self._cache)
        return self._accel.mode

    def _machine(self, rec: VmRecord) -> qemu.MachineConfig:
        return qemu.MachineConfig(
            with_trust(load_image(Path(rec.image)), tuple(rec.trust)),
            rec.memory_mb,
            rec.vcpus,
            rec.accel,
            nic=rec.net_mode != "none",
        )

    def _machine_for(self, spec: SandboxSpec) -> qemu.MachineConfig:
        # First: a bad SANDLOT_CA_CERTS fails before any image work.
        certificates = trust.certificates_for(spec)
        image = resolve_image(spec.image, self._cache) if spec.image else self._default_image()
        image = with_trust(image, certificates)
        memory = spec.resources.memory_mb or DEFAULT_MEMORY_MB
        if memory < 128:
            msg = "resources.memory_mb must be at least 128 for a microvm"
            raise InvalidRequest(msg)
        return qemu.MachineConfig(
            image,
            memory,
            qemu.vcpus_for(spec.resources.vcpus),
            self._accel_for(image),
            nic=spec.network != "deny-all",
        )

    def _baseline_of(self, source: Path) -> Baseline:
        raw = manifest_of(source)["baseline"]
        base = Baseline(**raw)
        base.dir = str(source)
        return base

    def _trust_bundle_of(self, source: Path) -> str | None:
        """Where the guest's bundle with its extra CAs is, in a template or snapshot."""
        bundle = manifest_of(source).get("trust_bundle")
        return bundle if isinstance(bundle, str) else None
