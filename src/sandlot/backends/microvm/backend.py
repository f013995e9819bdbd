"""The ``microvm`` backend: one QEMU ``-M microvm`` guest per sandbox.

This module owns the sandbox lifecycle on QEMU: create from a booted template, stop/start with
memory, snapshot/restore/fork, destroy, and reset with verification. It never touches the store
and imports nothing above :mod:`sandlot.channel`.

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

Reset returns a VM to its baseline (the template for a fresh VM, the snapshot it was last
restored from otherwise) and verifies three independent sources against what was recorded when
that baseline was made: the SHA-256 of the overlay file (checked while the restored VM is still
paused, so the guest cannot have written), QEMU's run state (``query-status``), and the number
of open file descriptors in the guest (asked over the agent). Any disagreement raises
:class:`ResetVerificationFailed` naming the source; there is no quorum.

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

Network. A ``deny-all`` VM has no NIC at all. Any other policy gives the VM one virtio-net NIC
on QEMU's user-mode network, in one of two modes fixed at create:

- ``proxy`` (allowlists): the user-mode network is restricted (``restrict=on``), so the guest
  reaches nothing but :data:`~sandlot.backends.microvm.qemu.PROXY_ADDRESS`, which QEMU forwards
  (one ``socat`` per connection) to a unix socket where the network daemon's egress proxy for
  this sandbox listens (:meth:`SandboxNetworks.prepare_unix`). Raw TCP is reset, UDP and DNS are
  dropped, and the guest has no default route. Needs ``socat``, not root.
- ``nat`` (``allow-all``): unrestricted user-mode NAT, with QEMU started inside the sandbox's
  own network namespace from :meth:`SandboxNetworks.prepare`, so the namespace's firewall
  (no host, loopback, link-local, other sandboxes) decides what the NAT reaches; the gateway
  address that user-mode networking maps to "the host's loopback" is the namespace's empty one.
  Needs root, ``ip`` and ``nft``. Any policy kind can follow at run time: the namespace is
  re-prepared (an allowlist then reaches the proxy on the namespace's veth through the NAT).

The guest's side (address, no default route, no IPv6) is set by the image's ``/init``, so one
template with a NIC serves both modes; ``nat`` adds the default route and a resolver after every
restore. A template or snapshot with a NIC only restores into a VM with one (QEMU loads device
state only into the same devices): the template fingerprint includes the NIC, and restoring or
forking across the two fails with :class:`NotSupported`. Commands started through
:meth:`MicrovmBackend.channel` get ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` (both cases).

Agent connections: QEMU's socket for the virtio-serial port serves one host connection at a
time, and the guest only learns that the host hung up when its read returns end-of-file. The
agent therefore starts a new session when a new host's preamble arrives where a frame of the old
session should (docs/agent-protocol.md), and ends its session on ``session.detach``, which the
host sends before a VM's memory is saved. The connection an operation ends with is handed to
the next :meth:`channel` call of the same object (no reconnection at all), and
:meth:`_open_channel` retries the handshake for agents without these.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, final

import anyio
import anyio.abc

from sandlot import config
from sandlot.backends import trust
from sandlot.backends.base import BackendState, Capabilities, DoctorCheck, SnapshotRef
from sandlot.backends.microvm import qemu
from sandlot.backends.microvm.channel import NetworkEnvChannel
from sandlot.backends.microvm.image import (
    GUEST_BUSYBOX,
    GUEST_GATEWAY,
    GUEST_NAMESERVER,
    ImagePaths,
    load_image,
    resolve_image,
    with_trust,
)
from sandlot.backends.microvm.qmp import QmpClient, connect_unix
from sandlot.backends.options import check_backend_options
from sandlot.channel.base import Channel
from sandlot.channel.client import AgentChannel, connect_stream
from sandlot.errors import (
    BackendError,
    BackendUnavailable,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    SandboxError,
    SandboxTimeout,
    VerificationFailed,
)
from sandlot.models import JsonValue, NetworkAllowlist, NetworkPolicy, PortMapping, SandboxSpec
from sandlot.network.service import SandboxNetworks, proxy_env

__all__ = [
    "DEFAULT_MEMORY_MB",
    "MicrovmBackend",
    "ResetVerificationFailed",
    "VerificationCheck",
    "VerificationReport",
]

DEFAULT_MEMORY_MB: Final = 512
"""Guest memory when ``resources.memory_mb`` is unset."""

_WORKDIR: Final = "/workspace"

NetMode = Literal["none", "proxy", "nat"]
"""How a VM is networked: no NIC, a NIC that reaches only the egress proxy, or NAT inside a
network namespace (see the module docstring)."""

FdSource = Literal["agent", "shell"]

_T = TypeVar("_T")

_log = logging.getLogger(__name__)

_PROXY_URL: Final = f"http://{qemu.PROXY_ADDRESS}:{qemu.PROXY_PORT}"
_POOLED_SOCKET: Final = "egress-socket"
# A VM's reset standby (a paused QEMU with its baseline loaded) and the key it was made for.
_STANDBY: Final = "standby"
_STANDBY_KEY: Final = "standby.json"

# Run in the guest after every restore of a ``nat`` VM (the template has neither): the default
# route through user-mode networking's gateway, and its DNS forwarder as the resolver, bound over
# /etc/resolv.conf from RAM so that the disk (whose hash reset verifies) is not written.
_NAT_GUEST_SETUP: Final = (
    f"B={GUEST_BUSYBOX}; $B ip route replace default via {GUEST_GATEWAY} dev eth0 && "
    "{ $B grep -q ' /etc/resolv.conf ' /proc/mounts || "
    f"{{ echo 'nameserver {GUEST_NAMESERVER}' > /run/sandlot/resolv.conf && "
    "$B mount --bind /run/sandlot/resolv.conf /etc/resolv.conf; }; }"
)
# The reverse, for a ``proxy`` VM restored from a snapshot of a ``nat`` one.
_NAT_GUEST_UNDO: Final = (
    f"B={GUEST_BUSYBOX}; $B ip route del default 2>/dev/null; "
    "$B umount /etc/resolv.conf 2>/dev/null; true"
)

# Run once in a template before its memory is saved (see _make_template).
_TEMPLATE_WARMUP: Final = (
    "for p in true env ls cat cp mv rm mkdir date id uname head tail grep sed bash python3; do "
    "command -v $p >/dev/null && $p --version >/dev/null 2>&1; done; true"
)

# Counts every open descriptor of every process except the counting shell itself, with shell
# builtins only (no pipeline whose other half may or may not have started: that raced).
_FD_COUNT_SCRIPT: Final = (
    'cd /proc; n=0; for p in [0-9]*; do [ "$p" = "$$" ] && continue; '
    'for f in "$p"/fd/*; do { [ -e "$f" ] || [ -L "$f" ]; } && n=$((n+1)); done; done; echo "$n"'
)


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


@dataclass
class _Baseline:
    kind: Literal["template", "snapshot"]
    dir: str
    disk_sha256: str
    fd_count: int
    vmm_status: str = "running"
    guest_nat: bool = False
    """The guest in this memory image has the ``nat`` setup (route, resolver)."""
    fd_source: FdSource = "shell"
    """How ``fd_count`` was taken, and so how it is taken again to compare: the agent's
    ``fd.count`` or, in baselines made before the agent had it, :data:`_FD_COUNT_SCRIPT`."""


@dataclass
class _VmRecord:
    sandbox_id: str
    image: str
    memory_mb: int
    vcpus: int
    accel: Literal["kvm", "tcg"]
    baseline: _Baseline | None = None
    created_at: float = field(default_factory=time.time)
    net_mode: NetMode = "none"
    egress_socket: str | None = None
    """The unix socket QEMU forwards the proxy address to (``proxy`` mode)."""
    trust: list[str] = field(default_factory=list)
    """Extra CA certificates (PEM) the guest trusts: part of its machine's image key."""
    trust_bundle: str | None = None
    """Where, in the guest, the bundle with them is (None: no extra CAs)."""

    @classmethod
    def load(cls, path: Path) -> _VmRecord:
        raw = json.loads(path.read_text())
        base = raw.pop("baseline", None)
        return cls(**raw, baseline=_Baseline(**base) if base else None)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


@contextlib.asynccontextmanager
async def _flock(path: Path) -> AsyncIterator[None]:
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


def _kind(policy: NetworkPolicy) -> Literal["allow-all", "deny-all", "allowlist"]:
    if isinstance(policy, NetworkAllowlist):
        return "allowlist"
    return policy


def _mode_for(policy: NetworkPolicy) -> NetMode:
    kind = _kind(policy)
    if kind == "deny-all":
        return "none"
    return "proxy" if kind == "allowlist" else "nat"


@dataclass(frozen=True)
class _Launch:
    """How one QEMU process is networked: its NIC's arguments and the command prefix that puts
    it into a network namespace."""

    netdev: list[str] | None = None
    prefix: tuple[str, ...] = ()


@final
class MicrovmBackend:
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

    def _kinds(self) -> frozenset[str]:
        if self._network_kinds is None:
            kinds = {"deny-all"}
            if shutil.which("socat"):
                kinds.add("allowlist")
            if "allow-all" in self._networks.capabilities() and shutil.which("nsenter"):
                kinds.add("allow-all")
            self._network_kinds = frozenset(kinds)
        return self._network_kinds

    @property
    def networks(self) -> SandboxNetworks:
        """The network service this backend's VMs use."""
        return self._networks

    async def aclose(self) -> None:
        """Close the agent connections this object holds (the VMs keep running) and remove the
        create standbys it made."""
        for ref in list(self._handover):
            await self._drop(ref)
        made, self._create_standbys = sorted(self._create_standbys), set()
        await self._discard_create_standbys(made)

    def _keep(self, ref: str, channel: Channel) -> None:
        self._handover[ref] = channel

    async def _drop(self, ref: str) -> None:
        channel = self._handover.pop(ref, None)
        if channel is not None:
            with contextlib.suppress(SandboxError, OSError):
                await channel.close()

    async def _agent(self, ref: str, vm_dir: Path) -> Channel:
        """This process's connection to the VM's agent, opened if needed.

        QEMU's agent socket serves one client at a time, so every user in this process (the
        channels handed out, snapshots, resets) shares one multiplexed connection instead of
        queueing behind each other. Closing a handed-out channel closes it for all; the next
        call here reconnects.
        """
        channel = self._handover.get(ref)
        if channel is not None and not getattr(channel, "closed", False):
            return channel
        channel = await self._open_channel(vm_dir, self._restore_timeout)
        self._handover[ref] = channel
        return channel

    # ----------------------------------------------------------------- helpers

    def _vm_dir(self, ref: str) -> Path:
        if not ref or "/" in ref or ref.startswith("."):
            msg = f"not a microvm ref: {ref!r}"
            raise InvalidRequest(msg)
        return self._root / "vms" / ref

    def _record(self, ref: str) -> _VmRecord:
        path = self._vm_dir(ref) / "vm.json"
        try:
            return _VmRecord.load(path)
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

    def _machine(self, rec: _VmRecord) -> qemu.MachineConfig:
        return qemu.MachineConfig(
            with_trust(load_image(Path(rec.image)), tuple(rec.trust)),
            rec.memory_mb,
            rec.vcpus,
            rec.accel,
            nic=rec.net_mode != "none",
        )

    def _require_kind(self, policy: NetworkPolicy) -> None:
        kind = _kind(policy)
        if kind in self._kinds():
            return
        why = {
            "allowlist": "network allowlists need socat on the host (apt-get install socat)",
            "allow-all": (
                "network='allow-all' needs root with ip and nft (QEMU's NAT runs inside a "
                "network namespace whose firewall keeps the host and link-local addresses out)"
            ),
        }.get(kind, f"network policy {kind!r} is not enforced")
        msg = f"the microvm backend cannot enforce this here: {why}"
        raise NotSupported(msg, field="network")

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

    async def _open_channel(
        self, vm_dir: Path, timeout: float, stream: anyio.abc.ByteStream | None = None
    ) -> Channel:
        """Connect to the guest agent (the first attempt on ``stream`` when given, a connection
        made already); returns once its HELLO arrived.

        The handshake is retried on a fresh connection. Our agent takes a HELLO that lands in
        the session of an earlier connection (over virtio-serial the guest cannot tell two host
        connections apart unless it read end-of-file in between) as a new host's, but an older
        agent in a user's image answers it with a protocol error or drops it, and a guest still
        booting has no agent yet. Each retry closes, lets the agent see the hang-up, and says
        HELLO again.
        """
        deadline = anyio.current_time() + timeout
        attempt_timeout = 1.0
        last: Exception | None = None
        while True:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            try:
                if stream is None:
                    stream = await connect_unix(vm_dir / qemu.AGENT_SOCKET)
            except OSError as e:
                if not qemu.is_running(vm_dir):
                    msg = f"microvm {vm_dir.name} exited; console: {_serial_tail(vm_dir)}"
                    raise BackendError(msg) from e
                last = e
                await anyio.sleep(0.02)
                continue
            try:
                return await connect_stream(stream, timeout=min(attempt_timeout, remaining))
            except SandboxError as e:
                last = e
            stream = None
            if not qemu.is_running(vm_dir):
                msg = f"microvm {vm_dir.name} exited; console: {_serial_tail(vm_dir)}"
                raise BackendError(msg) from last
            attempt_timeout = min(attempt_timeout * 2, 8.0)
            await anyio.sleep(0.05)
        msg = f"the guest agent in {vm_dir.name} did not answer within {timeout:.0f} s: {last}"
        raise SandboxTimeout(msg) from last

    async def _guest_sh(self, channel: Channel, script: str, timeout: float = 30.0) -> str:
        result = await channel.exec(["/bin/sh", "-c", script], timeout=timeout)
        if result.exit_code != 0:
            msg = f"guest command failed (exit {result.exit_code}): {result.stderr.strip()[-300:]}"
            raise BackendError(msg)
        return result.stdout

    async def _fd_count(self, channel: Channel, source: FdSource) -> int:
        """The guest's open descriptors, counted the way ``source`` says."""
        if source == "agent":
            if not _serves(channel, "fd.count"):
                msg = "the guest agent does not serve fd.count, which this baseline was made with"
                raise BackendError(msg)
            assert isinstance(channel, AgentChannel)
            return await channel.count_fds()
        out = await self._guest_sh(channel, _FD_COUNT_SCRIPT)
        try:
            return int(out.strip())
        except ValueError:
            msg = f"the guest fd count is not a number: {out!r}"
            raise BackendError(msg) from None

    def _settle_script(self, net_mode: NetMode, *, guest_nat: bool = False) -> str:
        """What a guest needs after a restore: the clock (it resumes from the instant its
        memory was saved) and the ``nat`` guest setup (or its removal from a ``nat`` image)."""
        script = f"date -s @{time.time():.6f} >/dev/null"
        if net_mode == "nat":
            script += f"; {_NAT_GUEST_SETUP}"
        elif guest_nat:
            script += f"; {_NAT_GUEST_UNDO}"
        return f"{{ {script}; }}"

    async def _sync_clock(
        self, channel: Channel, net_mode: NetMode = "none", *, guest_nat: bool = False
    ) -> None:
        if net_mode != "nat" and not guest_nat and _serves(channel, "clock.set"):
            # One request the agent answers itself: under TCG, the first programs a restored
            # guest starts cost a few hundred ms of code translation, which a ``date -s`` exec
            # would put on the create path (the caller's first exec pays it only once).
            assert isinstance(channel, AgentChannel)
            await channel.set_clock(time.time())
            return
        await self._guest_sh(channel, self._settle_script(net_mode, guest_nat=guest_nat))

    # ----------------------------------------------------------------- network plumbing

    def _new_egress_socket(self) -> str:
        # Not in the VM directory: a pooled VM's directory is renamed when it is claimed, and
        # QEMU keeps the path it was started with. Short, so socat can use it as it is.
        return str(self._root / "egress" / f"{secrets.token_hex(6)}.sock")

    def _launch(self, ref: str, net_mode: NetMode, egress_socket: str | None) -> _Launch:
        if net_mode == "none":
            return _Launch()
        if net_mode == "proxy":
            sock = Path(egress_socket) if egress_socket else None
            return _Launch(qemu.user_netdev(restrict=True, proxy_socket=sock))
        netns_path = self._networks.get(ref).netns_path
        return _Launch(
            qemu.user_netdev(restrict=False, proxy_socket=None),
            ("nsenter", f"--net={netns_path}", "--"),
        )

    def _launch_of(self, rec: _VmRecord) -> _Launch:
        return self._launch(rec.sandbox_id, rec.net_mode, rec.egress_socket)

    async def _prepare_network(
        self, ref: str, net_mode: NetMode, policy: NetworkPolicy, egress_socket: str | None
    ) -> None:
        """Make the host side of the VM's network serve ``policy`` (idempotent: also after a
        host reboot or a crashed daemon)."""
        if net_mode == "proxy":
            assert egress_socket is not None
            await self._networks.prepare_unix(ref, policy, Path(egress_socket))
        elif net_mode == "nat":
            await self._networks.prepare(ref, policy)

    def _has_network(self, ref: str) -> bool:
        try:
            self._networks.get(ref)
        except NotFound:
            return False
        return True

    async def _teardown_network(self, ref: str) -> None:
        if self._has_network(ref):
            await self._networks.teardown(ref)

    def _guest_env(self, rec: _VmRecord) -> dict[str, str]:
        if rec.net_mode == "proxy":
            return proxy_env(_PROXY_URL)
        try:
            # Read per command: a nat VM's policy (and so its proxy) can change at run time.
            return self._networks.env(rec.sandbox_id)
        except NotFound:
            return {}

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
        self, vm_dir: Path, machine: qemu.MachineConfig, disk: Path, ram: list[str], net: _Launch
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
        tail = _serial_tail(vm_dir)
        msg = f"the microvm did not boot (twice): {last}; console: {tail}"
        raise BackendError(msg)

    # ----------------------------------------------------------------- templates

    async def _template(self, machine: qemu.MachineConfig) -> Path:
        """The booted template for this machine config, made on first use."""
        fp = machine.fingerprint()
        tdir = self._root / "templates" / fp
        if (tdir / "template.json").exists():
            return tdir
        async with _flock(self._root / "templates" / f"{fp}.lock"):
            if (tdir / "template.json").exists():
                return tdir
            work = self._root / "templates" / f".{fp}.{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            try:
                await self._make_template(machine, work)
                work.rename(tdir)
            finally:
                await _remove_vm_dir(work)
        return tdir

    async def _make_template(self, machine: qemu.MachineConfig, work: Path) -> None:
        disk = work / "disk.qcow2"
        await _create_overlay(machine.image, disk)
        ram = machine.ram_file(work / "ram.img", shared=True)
        # A NIC on a restricted network forwarding nothing: the guest configures it at boot
        # and the device state is what every clone's NIC loads, whatever its mode.
        net = (
            _Launch(qemu.user_netdev(restrict=True, proxy_socket=None))
            if machine.nic
            else _Launch()
        )
        channel = await self._cold_boot(work, machine, disk, ram, net)
        bundle: str | None = None
        async with await self._qmp(work) as q:
            try:
                if machine.image.trust:
                    # Here, once per set of CAs, rather than in every clone: what a clone
                    # starts with is its baseline, which resets and verification return to.
                    bundle = await _install_trust(channel, machine.image.trust)
                # Every clone starts with this page cache: the common programs are in it, so a
                # clone's first command reads nothing from disk (under TCG the block I/O path
                # costs a clone ~40 ms of code translation the first time it runs).
                await self._guest_sh(channel, _TEMPLATE_WARMUP)
                # Dirty pages written now land in the overlay before it is frozen, not later in
                # every clone (which would make each clone's disk differ from the baseline).
                await self._guest_sh(channel, "sync")
                fd_source = _fd_source(channel)
                fd_count = await self._fd_count(channel, fd_source)
                await _leave_agent_idle(channel, q)
                await q.execute("stop")
                await _migrate_to(q, work / "state.bin", ignore_shared=True)
            finally:
                await channel.close()
        await qemu.kill_vm(work)
        baseline = _Baseline(
            "template", "", _sha256(disk), fd_count, "running", fd_source=fd_source
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

    # ----------------------------------------------------------------- restore paths

    async def _restore_into(
        self,
        vm_dir: Path,
        machine: qemu.MachineConfig,
        source: Path,
        net: _Launch,
    ) -> Channel:
        """Start the VM in ``vm_dir`` from the memory in ``source`` (a template or snapshot
        directory, or the VM's own ``mem.bin``), resume it and connect to its agent."""
        status = await self._load(vm_dir, machine, source, net)
        channel, _ = await self._resume(vm_dir, status)
        return channel

    async def _load(
        self, vm_dir: Path, machine: qemu.MachineConfig, source: Path, net: _Launch
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
                    await _set_ignore_shared(q, True)
                    await q.execute(
                        "migrate-incoming", {"uri": f"exec:cat {_shq(source / 'state.bin')}"}
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
                    disk_hash = await anyio.to_thread.run_sync(_sha256, vm_dir / "disk.qcow2")
                if status == "paused":
                    # Connected before the guest runs: a VM saved with its host connected (see
                    # _leave_agent_idle) then finds one at once, and its agent reads our HELLO
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

    def _baseline_of(self, source: Path) -> _Baseline:
        raw = _manifest_of(source)["baseline"]
        base = _Baseline(**raw)
        base.dir = str(source)
        return base

    def _trust_bundle_of(self, source: Path) -> str | None:
        """Where the guest's bundle with its extra CAs is, in a template or snapshot."""
        bundle = _manifest_of(source).get("trust_bundle")
        return bundle if isinstance(bundle, str) else None

    # ----------------------------------------------------------------- lifecycle

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> str:
        """Restore a booted template into a new VM with its own overlay (cold boot once per
        machine config to make the template), networked for ``spec.network``."""
        self._check_spec(spec)
        vm_dir = self._vm_dir(sandbox_id)
        machine = self._machine_for(spec)
        mode = _mode_for(spec.network)
        async with _flock(self._root / "vms" / f"{sandbox_id}.lock"):
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
                    socket = _pooled_socket(vm_dir) if mode == "proxy" else None
                    rec = _VmRecord(
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
                        await _remove_vm_dir(vm_dir)
                        await self._teardown_network(sandbox_id)
                    raise
                self._spawn_refill(machine)
                return sandbox_id
            claimed = mode != "nat" and await self._claim_standby(machine, vm_dir)
            if claimed:
                socket = _pooled_socket(vm_dir) if mode == "proxy" else None
            else:
                vm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                socket = self._new_egress_socket() if mode == "proxy" else None
            try:
                # The host side first: the listener (or namespace) exists before the guest runs.
                await self._prepare_network(sandbox_id, mode, spec.network, socket)
                status = "paused"  # a standby is checked to be when it is made
                if not claimed:
                    _copy(tdir / "disk.qcow2", vm_dir / "disk.qcow2")
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
                channel = await _beside_standby(standby, wake)
                self._keep(sandbox_id, channel)
                rec = _VmRecord(
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
                    await _remove_vm_dir(vm_dir)
                    await self._teardown_network(sandbox_id)
                raise
        if self._pool_size and mode != "nat":
            self._spawn_refill(machine)
        return sandbox_id

    # ----------------------------------------------------------------- warm pool

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
                await _remove_vm_dir(entry)
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
        if _mode_for(spec.network) == "nat":
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
                    _copy(tdir / "disk.qcow2", work / "disk.qcow2")
                    net = _Launch()
                    if machine.nic:
                        # Its proxy socket is served once a sandbox claims it.
                        socket = self._new_egress_socket()
                        (work / _POOLED_SOCKET).write_text(socket)
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
                        await _remove_vm_dir(work)
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
                async with _flock(lockfile):
                    pool = lockfile.with_suffix("")
                    for entry in sorted(pool.iterdir()) if pool.exists() else ():
                        await _remove_vm_dir(entry)

    async def start(self, ref: str, spec: SandboxSpec) -> None:
        """Resume a stopped VM from its saved memory (cold boot from its disk if none); its
        network serves ``spec.network`` again (rebuilt after a host reboot)."""
        async with _flock(self._root / "vms" / f"{ref}.lock"):
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
        async with _flock(self._root / "vms" / f"{ref}.lock"):
            self._record(ref)
            await self._drop(ref)
            await self._discard_standby(vm_dir)
            if not qemu.is_running(vm_dir):
                return
            part = vm_dir / "mem.bin.part"
            async with await self._qmp(vm_dir) as q:
                await q.execute("stop")
                await _migrate_to(q, part)
            await qemu.kill_vm(vm_dir)
            part.replace(vm_dir / "mem.bin")

    async def destroy(self, ref: str) -> None:
        """Kill QEMU, remove every file of the VM and its network (proxy listener and socket,
        namespace); a missing VM is fine."""
        vm_dir = self._vm_dir(ref)
        async with _flock(self._root / "vms" / f"{ref}.lock"):
            await self._drop(ref)
            await self._discard_standby(vm_dir)
            await _remove_vm_dir(vm_dir)
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
        tail = _serial_tail(vm_dir)
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

    # ----------------------------------------------------------------- network control

    async def update_network(self, ref: str, policy: NetworkPolicy) -> None:
        """Change a VM's egress policy; new connections follow it at once.

        A ``proxy`` VM (made with an allowlist) takes any allowlist or ``deny-all`` (the proxy
        then refuses everything); a ``nat`` VM (made with ``allow-all``) takes any policy.

        Raises:
            NotSupported: The VM has no NIC (made with ``deny-all``) and the policy is not
                ``deny-all``, or a ``proxy`` VM is asked for ``allow-all``.
        """
        rec = self._record(ref)
        kind = _kind(policy)
        if rec.net_mode == "none":
            if kind == "deny-all":
                return
            msg = (
                f"microvm {ref} was created with network='deny-all' and has no NIC, which cannot "
                "be added to a running VM; create it with an allowlist (even an empty one) to "
                "change its policy later"
            )
            raise NotSupported(msg, field="network")
        if rec.net_mode == "proxy" and kind == "allow-all":
            msg = (
                f"microvm {ref} was created with an allowlist: its NIC reaches only the egress "
                "proxy; allow-all needs a VM created with allow-all"
            )
            raise NotSupported(msg, field="network")
        self._require_kind(policy)
        await self._networks.update_policy(ref, policy)

    def network_events(self, ref: str, offset: int = 0) -> tuple[list[dict[str, JsonValue]], int]:
        """The egress proxy's decisions for this VM since byte ``offset`` (none for a VM
        without a NIC)."""
        self._record(ref)
        events, nxt = self._networks.read_events(ref, offset)
        return [e.to_json() for e in events], nxt

    def suggest_network(self, ref: str) -> NetworkAllowlist:
        """The least-privilege allowlist covering what the VM connected to."""
        self._record(ref)
        return self._networks.suggest(ref)

    # ----------------------------------------------------------------- snapshots

    async def snapshot(self, ref: str, snapshot_id: str) -> SnapshotRef:
        """Save memory + disk of a running VM (it keeps running afterwards)."""
        vm_dir = self._vm_dir(ref)
        sdir = self._root / "snapshots" / snapshot_id
        if sdir.exists():
            msg = f"snapshot {snapshot_id} exists already"
            raise InvalidRequest(msg)
        async with _flock(self._root / "vms" / f"{ref}.lock"):
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
                        fd_source = _fd_source(channel)
                        fd_count = await self._fd_count(channel, fd_source)
                        await _leave_agent_idle(channel, q)
                        await q.execute("stop")
                        try:
                            await _migrate_to(q, work / "mem.bin")
                            # Migration flushed and released the disk: it matches the memory.
                            await anyio.to_thread.run_sync(
                                _copy, vm_dir / "disk.qcow2", work / "disk.qcow2"
                            )
                        finally:
                            with anyio.CancelScope(shield=True):
                                await q.execute("cont")
                    finally:
                        await channel.close()
                baseline = _Baseline(
                    "snapshot",
                    "",
                    _sha256(work / "disk.qcow2"),
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
    ) -> _VmRecord:
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
        return _VmRecord(
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
        async with _flock(self._root / "vms" / f"{ref}.lock"):
            old = self._record(ref)
            rec = self._record_from_snapshot(ref, sdir, meta, old.net_mode, old.egress_socket)
            await self._discard_standby(vm_dir)
            await qemu.kill_vm(vm_dir)
            with contextlib.suppress(FileNotFoundError):
                (vm_dir / "mem.bin").unlink()
            _copy(sdir / "disk.qcow2", vm_dir / "disk.qcow2")
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
            mode = "nat" if _kind(spec.network) == "allow-all" else "proxy"
        elif spec.network != "deny-all":
            msg = (
                f"snapshot {snapshot.ref} has no NIC (made with deny-all), and a VM restores only "
                "into the same devices: fork it with network='deny-all'"
            )
            raise NotSupported(msg, field="network")
        refs: list[str] = []
        for sid in sandbox_ids:
            vm_dir = self._vm_dir(sid)
            async with _flock(self._root / "vms" / f"{sid}.lock"):
                if (vm_dir / "vm.json").exists():
                    refs.append(sid)
                    continue
                socket = self._new_egress_socket() if mode == "proxy" else None
                rec = self._record_from_snapshot(sid, sdir, meta, mode, socket)
                vm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    await self._prepare_network(sid, mode, spec.network, socket)
                    _copy(sdir / "disk.qcow2", vm_dir / "disk.qcow2")
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
                        await _remove_vm_dir(vm_dir)
                        await self._teardown_network(sid)
                    raise
            refs.append(sid)
        return refs

    async def delete_snapshot(self, snapshot: SnapshotRef) -> None:
        """Remove a snapshot's files (VMs whose baseline it was can no longer be reset)."""
        shutil.rmtree(self._root / "snapshots" / snapshot.ref, ignore_errors=True)

    async def expose_port(self, ref: str, port: int) -> PortMapping:
        """Not supported: the guest has no network."""
        msg = "the microvm backend cannot expose ports (the guest has no NIC)"
        raise NotSupported(msg)

    # ----------------------------------------------------------------- reset

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
        async with _flock(self._root / "vms" / f"{ref}.lock"):
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
                _copy(source / "disk.qcow2", vm_dir / "disk.qcow2")
                await self._load(vm_dir, machine, source, net)
            report = await _beside_standby(
                (lambda: self._make_standby(vm_dir, machine, source, net, standby_key))
                if base.kind == "template"
                else None,
                lambda: self._resume_verified(vm_dir, rec, base, started),
            )
            if not report.ok:
                raise _verification_error(ref, report)
            return report

    async def _resume_verified(
        self, vm_dir: Path, rec: _VmRecord, base: _Baseline, started: float
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

    # ----------------------------------------------------------------- reset standby

    def _standby_key(self, rec: _VmRecord) -> str:
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
        self, vm_dir: Path, machine: qemu.MachineConfig, source: Path, net: _Launch, key: str
    ) -> None:
        """Start a QEMU beside the VM with ``source`` loaded and paused, for the next reset.

        Best effort: a standby that cannot be made only makes the next reset a plain restore.
        Only for template baselines, whose RAM is a shared file mapping: a paused standby costs
        QEMU's own memory, not a second copy of the guest's.
        """
        work = vm_dir / f".{_STANDBY}"
        async with _standby_attempt(work, f"reset standby for {vm_dir.name}"):
            await self._discard_standby(vm_dir)
            work.mkdir(mode=0o700)
            await self._load_paused(work, machine, source, net)
            (work / _STANDBY_KEY).write_text(key)
            work.rename(vm_dir / _STANDBY)

    async def _load_paused(
        self, work: Path, machine: qemu.MachineConfig, source: Path, net: _Launch
    ) -> None:
        """A standby in ``work``: its own copy of the baseline overlay, the baseline's memory
        loaded, the VM paused."""
        _copy(source / "disk.qcow2", work / "disk.qcow2")
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
        async with _flock(ready.parent.with_suffix(".lock")):
            if not ready.exists():
                return False
            if not qemu.is_running(ready):
                await _remove_vm_dir(ready)
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
        async with _standby_attempt(work, "create standby"):
            work.mkdir(parents=True, mode=0o700)
            net = _Launch()
            if machine.nic:
                # Its proxy socket is served once a sandbox claims it (as for a pooled VM).
                socket = self._new_egress_socket()
                (work / _POOLED_SOCKET).write_text(socket)
                net = self._launch(work.name, "proxy", socket)
            await self._load_paused(work, machine, template, net)
            async with _flock(ready.parent.with_suffix(".lock")):
                if ready.exists():  # another process made one meanwhile
                    msg = "another create standby is ready"
                    raise FileExistsError(msg)
                work.rename(ready)
            self._create_standbys.add(ready)

    async def _discard_create_standbys(self, readies: list[Path]) -> None:
        for ready in readies:
            if not ready.parent.is_dir():
                continue
            async with _flock(ready.parent.with_suffix(".lock")):
                await _remove_vm_dir(ready)

    async def _discard_standby(self, vm_dir: Path) -> None:
        """Kill and remove the VM's standby, ready or half made."""
        for path in (vm_dir / _STANDBY, vm_dir / f".{_STANDBY}"):
            if path.exists():
                await _remove_vm_dir(path)

    async def verify(self, ref: str) -> VerificationReport:
        """Compare the running VM with its baseline, without reverting anything.

        Raises:
            ResetVerificationFailed: A source disagreed with its baseline.
        """
        vm_dir = self._vm_dir(ref)
        async with _flock(self._root / "vms" / f"{ref}.lock"):
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
                raise _verification_error(ref, report)
            return report

    async def _verify(
        self,
        vm_dir: Path,
        base: _Baseline,
        channel: Channel,
        disk_hash: str | None,
        started: float,
    ) -> VerificationReport:
        if disk_hash is None:
            disk_hash = await anyio.to_thread.run_sync(_sha256, vm_dir / "disk.qcow2")
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


def _manifest_of(source: Path) -> dict[str, Any]:
    """A template's or snapshot's JSON record."""
    meta = source / ("template.json" if (source / "template.json").exists() else "snapshot.json")
    raw = json.loads(meta.read_text())
    if not isinstance(raw, dict):
        msg = f"{meta} is not a JSON object"
        raise BackendError(msg)
    return raw


async def _install_trust(channel: Channel, certificates: tuple[str, ...]) -> str:
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


async def _remove_vm_dir(path: Path) -> None:
    """Kill the VM served from ``path`` (if any) and remove its directory."""
    await qemu.kill_vm(path)
    shutil.rmtree(path, ignore_errors=True)


async def _beside_standby(
    standby: Callable[[], Coroutine[Any, Any, None]] | None, body: Callable[[], Awaitable[_T]]
) -> _T:
    """``body()``, with ``standby()`` making the next create's or reset's standby beside it
    while this guest wakes up (CPU-bound on one core under TCG).

    A failure of ``body`` cancels the standby and is raised as itself, not inside an exception
    group: callers catch ``ResetVerificationFailed`` and the like by type. The standby's own
    failures never surface (:func:`_standby_attempt`).
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
async def _standby_attempt(work: Path, what: str) -> AsyncIterator[None]:
    """Make a standby in ``work``, best effort: on a failure its QEMU and files go and the
    error is logged, not raised (without a standby the next create or reset restores as
    usual); only cancellation goes through."""
    try:
        yield
    except BaseException as e:
        with anyio.CancelScope(shield=True):
            await _remove_vm_dir(work)
        if not isinstance(e, Exception):
            raise
        if not isinstance(e, FileExistsError):  # FileExistsError: another one is ready
            _log.warning("microvm: no %s: %s", what, e)


def _serves(channel: Channel, op: str) -> bool:
    """Whether ``channel`` is a direct agent connection whose agent serves ``op``."""
    return isinstance(channel, AgentChannel) and op in channel.agent_info.ops


def _fd_source(channel: Channel) -> FdSource:
    """How a new baseline counts the guest's descriptors: by the agent where it can (no
    program start, so a verified reset stays cheap under TCG)."""
    return "agent" if _serves(channel, "fd.count") else "shell"


def _pooled_socket(vm_dir: Path) -> str:
    """The proxy socket a pooled VM's QEMU was started with (recorded beside it)."""
    try:
        return (vm_dir / _POOLED_SOCKET).read_text().strip()
    except OSError as e:
        msg = f"the pooled VM {vm_dir.name} does not say where its proxy socket is"
        raise BackendError(msg) from e


def _verification_error(ref: str, report: VerificationReport) -> ResetVerificationFailed:
    return ResetVerificationFailed(
        f"microvm {ref} differs from its baseline in: {', '.join(report.diverged)}",
        verification=report.to_dict(),
        diverged=report.diverged,
    )


def _shq(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))


def _serial_tail(vm_dir: Path, lines: int = 12) -> str:
    try:
        text = (vm_dir / qemu.SERIAL_LOG).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


async def _create_overlay(image: ImagePaths, disk: Path) -> None:
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


async def _leave_agent_idle(channel: Channel, q: QmpClient, timeout: float = 5.0) -> None:
    """Leave the guest agent waiting for a new host; ``channel`` is of no more use after.

    A memory snapshot must hold such an agent: one still inside our session would take the next
    host's HELLO for a frame of that old session. An agent that serves ``session.detach`` is
    there once it answers, and the connection stays up while the memory is saved: a VM restored
    with its host connected before it runs then sees no hang-up and reconnection (see
    :meth:`MicrovmBackend._resume`). An agent without it closes its port when it reads our
    hang-up, which QEMU reports as ``VSERPORT_CHANGE`` (rate-limited to one a second per port,
    so waiting for it can take that long).
    """
    if _serves(channel, "session.detach"):
        assert isinstance(channel, AgentChannel)
        await channel.detach()
        return
    await channel.close()
    with anyio.move_on_after(timeout):
        while True:
            event = await q.wait_event("VSERPORT_CHANGE")
            data = event.get("data")
            if (
                isinstance(data, dict)
                and data.get("id") == qemu.AGENT_PORT_ID
                and not data.get("open")
            ):
                return


async def _set_ignore_shared(q: QmpClient, on: bool) -> None:
    await q.execute(
        "migrate-set-capabilities",
        {"capabilities": [{"capability": "x-ignore-shared", "state": on}]},
    )


async def _migrate_to(
    q: QmpClient, path: Path, *, ignore_shared: bool = False, timeout: float = 120.0
) -> None:
    """Migrate the (stopped) VM's state into a file and wait until it is complete.

    The capability is always set explicitly: a VM restored from a template was started with
    ``x-ignore-shared`` on, and a stream saved with it on cannot be loaded without it.
    """
    await _set_ignore_shared(q, ignore_shared)
    await q.execute("migrate", {"uri": f"exec:cat > {_shq(path)}"})
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


def doctor(cache_dir: Path | None = None) -> list[DoctorCheck]:
    """What ``sandlot doctor`` reports for the microvm backend: tools, image, accelerator
    (``socat`` is optional: only network allowlists need it)."""
    checks: list[DoctorCheck] = []
    for tool, pkg in (
        (qemu.QEMU_BINARY, "qemu-system-x86"),
        ("qemu-img", "qemu-utils"),
        ("mmdebstrap", "mmdebstrap"),
    ):
        found = shutil.which(tool)
        checks.append(
            DoctorCheck(f"{tool} installed", bool(found), found or "", f"apt-get install {pkg}")
        )
    socat = shutil.which("socat")
    checks.append(
        DoctorCheck(
            "socat installed (network allowlists for microVMs)",
            bool(socat),
            socat or "",
            "apt-get install socat",
            required=False,
        )
    )
    from sandlot.backends.microvm.image import find_cached_image

    image = find_cached_image(cache_dir)
    checks.append(
        DoctorCheck(
            "microvm guest image built",
            image is not None,
            str(image.directory) if image else "none in the cache",
            "sandlot images build microvm",
        )
    )
    if shutil.which(qemu.QEMU_BINARY):
        checks.append(qemu.accel_check(image, cache_dir))
    return checks
