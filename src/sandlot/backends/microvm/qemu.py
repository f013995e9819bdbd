"""QEMU ``-M microvm`` processes: command lines, launching detached, finding and killing them.

This module owns how one VM process is started and found again. Every VM lives in its own
directory, which holds everything needed to reconnect from another process (the CLI is one
process per command)::

    qemu.pid     written by QEMU (-pidfile), which keeps it open: checked via /proc/PID/fd
    qmp.sock     QMP control socket
    agent.sock   the virtio-serial port the guest agent serves (one host connection at a time)
    serial.log   the guest console

QEMU runs with ``-daemonize``: it forks, calls setsid, and its first process exits once the
sockets exist, so a launch returns exactly when the VM can be reached and the VM outlives us.
Sockets are given as names relative to the VM directory (QEMU is started there) because
``sun_path`` is 108 bytes and state directories can be deeper than that; everything else is an
absolute path because a daemonized QEMU changes its directory to ``/``.

A VM made for a network policy has one virtio-net NIC on QEMU's user-mode network
(:func:`user_netdev`): either restricted, so that the guest reaches nothing but one forwarded
address (the egress proxy, over a unix socket the host serves), or unrestricted NAT, then run
inside a network namespace whose firewall decides what the NAT may reach.

It also decides the accelerator: KVM only when a real probe boot under KVM prints the guest's
probe marker in time (a host whose KVM cannot run stock kernels, such as a PVM host, hangs the
guest instead of failing), else TCG. The probe's answer is cached per host.
``$SANDLOT_MICROVM_ACCEL`` forces one; forcing KVM where the probe says it cannot run a guest
is refused before a VM starts, and any other value is refused too. This module must not import
the store.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import anyio

from sandlot import config
from sandlot.backends.base import DoctorCheck
from sandlot.backends.microvm.image import AGENT_PORT_NAME, PROBE_MARKER, ImagePaths
from sandlot.errors import BackendError, BackendUnavailable, InvalidRequest, SandboxError

__all__ = [
    "ACCEL_ENV",
    "AGENT_PORT_ID",
    "AGENT_SOCKET",
    "PROXY_ADDRESS",
    "PROXY_PORT",
    "QEMU_BINARY",
    "QMP_SOCKET",
    "SERIAL_LOG",
    "AccelDecision",
    "MachineConfig",
    "accel_check",
    "decide_accel",
    "forced_accel",
    "is_running",
    "kill_vm",
    "launch",
    "read_pid",
    "user_netdev",
    "vcpus_for",
]

QEMU_BINARY: Final = "qemu-system-x86_64"
QMP_SOCKET: Final = "qmp.sock"
AGENT_SOCKET: Final = "agent.sock"
SERIAL_LOG: Final = "serial.log"
PIDFILE: Final = "qemu.pid"
AGENT_PORT_ID: Final = "agent0"
"""The virtserialport's QEMU id (named in ``VSERPORT_CHANGE`` events)."""

PROXY_ADDRESS: Final = "10.0.2.100"
"""The guest address QEMU forwards to the egress proxy (inside the user-mode subnet)."""
PROXY_PORT: Final = 3128
"""The port of :data:`PROXY_ADDRESS` that is forwarded."""
NETDEV_ID: Final = "net0"
GUEST_MAC: Final = "52:54:00:12:34:56"

# sun_path holds 107 bytes; socat is given a relative name from the socket's directory beyond.
_SUN_PATH_MAX: Final = 107

Accel = Literal["kvm", "tcg"]

_PROBE_TIMEOUT: Final = 10.0
_PROBE_FORMAT: Final = 1


def vcpus_for(vcpus: float | None) -> int:
    """Guest vCPUs for ``resources.vcpus``: fractions round up (0.5 -> 1), default 1.

    A VM cannot have half a CPU; rounding up never gives less than asked, and the host side of
    a fractional quota is not enforced (``capabilities().limits`` says ``vcpus`` means whole
    guest CPUs).
    """
    return 1 if vcpus is None else max(1, math.ceil(vcpus))


@functools.cache
def _host_tsc_khz() -> int | None:
    """The host TSC frequency, when /proc/cpuinfo states it reliably.

    Under TCG the guest reads the host's TSC, and microvm has no HPET or PM timer to calibrate
    it against; the PIT calibration it falls back to fails now and then on a loaded host, and
    then the guest hangs. With ``tsc_early_khz`` it skips calibration.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.M)
    if not flags or not mhz:
        return None
    names = set(flags.group(1).split())
    # "cpu MHz" is the TSC rate only when the TSC is constant and no cpufreq driver reports a
    # current clock instead.
    if "constant_tsc" not in names:
        return None
    if "tsc_known_freq" not in names and Path("/sys/devices/system/cpu/cpu0/cpufreq").exists():
        return None
    return round(float(mhz.group(1)) * 1000)


def _qemu_opt(value: str) -> str:
    """A value inside a QEMU ``key=value,…`` option (a comma is written twice)."""
    return value.replace(",", ",,")


def _relay_command(socket_path: Path) -> str:
    """The command QEMU spawns per forwarded connection: socat between its stdio and the
    proxy's unix socket (QEMU splits it into argv like a shell, without running one)."""
    socat = shutil.which("socat") or "socat"
    path = str(socket_path)
    if len(path.encode()) <= _SUN_PATH_MAX:
        return f"{shlex.quote(socat)} - {shlex.quote('UNIX-CONNECT:' + path)}"
    inner = (
        f"cd {shlex.quote(str(socket_path.parent))} && exec {shlex.quote(socat)} - "
        f"{shlex.quote('UNIX-CONNECT:' + socket_path.name)}"
    )
    return f"/bin/sh -c {shlex.quote(inner)}"


def user_netdev(*, restrict: bool, proxy_socket: Path | None) -> list[str]:
    """QEMU arguments for the VM's NIC on user-mode networking.

    Args:
        restrict: Drop every guest packet that no forwarding rule names (``restrict=on``: no
            NAT, no DNS, nothing to the host); off gives the guest NAT to wherever the QEMU
            process itself can connect.
        proxy_socket: Forward TCP to :data:`PROXY_ADDRESS` port :data:`PROXY_PORT` to this unix
            socket (one ``socat`` per connection); None forwards nothing.
    """
    opts = [f"user,id={NETDEV_ID}", "ipv6=off", "net=10.0.2.0/24"]
    if restrict:
        opts.append("restrict=on")
    if proxy_socket is not None:
        cmd = _relay_command(proxy_socket)
        opts.append(f"guestfwd=tcp:{PROXY_ADDRESS}:{PROXY_PORT}-cmd:{_qemu_opt(cmd)}")
    return [
        "-netdev", ",".join(opts),
        "-device", f"virtio-net-device,netdev={NETDEV_ID},mac={GUEST_MAC}",
    ]  # fmt: skip


@dataclass(frozen=True)
class MachineConfig:
    """Everything that shapes a VM's hardware and boot (a template is only reusable for an
    identical one)."""

    image: ImagePaths
    memory_mb: int
    vcpus: int
    accel: Accel
    nic: bool = False
    """One virtio-net NIC (VMs for a network policy other than ``deny-all``). Its host side is
    given per launch (:func:`user_netdev`); a memory image only loads into a VM that has the
    same devices, so templates and snapshots with and without a NIC never mix."""

    def kernel_cmdline(self) -> str:
        """The kernel command line, with host-specific additions."""
        line = self.image.cmdline
        if self.accel == "tcg":
            # TCG does not execute speculatively, so the guest's Spectre/Meltdown mitigations
            # (retpolines, barriers, RSB filling) protect nothing there and only cost: each
            # retpoline is an indirect jump TCG cannot chain, on every syscall and interrupt.
            # Under KVM the guest runs on a real CPU and keeps them.
            line += " mitigations=off"
            # QEMU 7.2's x86 TCG keys translated code by virtual address, so with address
            # space randomization every program start maps ld.so and libc somewhere new and
            # translates them again: a warm `true` costs ~45 ms with it, ~12 ms without. Inside
            # a disposable guest that is already running the agent's commands as root,
            # randomization defends little; the VM boundary is the isolation. Under KVM the
            # guest keeps it.
            line += " norandmaps"
            khz = _host_tsc_khz()
            if khz:
                line += f" tsc_early_khz={khz}"
        return line

    def ram_anonymous(self) -> list[str]:
        """Guest RAM as anonymous host memory (a VM booted or restored from a stream)."""
        return ["-object", f"memory-backend-ram,id=ram,size={self.memory_mb}M"]

    def ram_file(self, path: Path, *, shared: bool) -> list[str]:
        """Guest RAM mapped from a file: ``shared`` writes through to it (a template being
        made); otherwise it is a private copy-on-write mapping (a clone of the template)."""
        share = "on" if shared else "off"
        return [
            "-object",
            f"memory-backend-file,id=ram,size={self.memory_mb}M,mem-path={path},share={share}",
        ]

    def argv(
        self,
        vm_dir: Path,
        disk: Path,
        *,
        ram: list[str],
        incoming: Path | None = None,
        incoming_defer: bool = False,
        netdev: list[str] | None = None,
    ) -> list[str]:
        """The QEMU command line for a VM in ``vm_dir`` (run with that as working directory).

        Args:
            vm_dir: The VM's directory (pid file; QEMU must be started there for the sockets).
            disk: The VM's own qcow2 overlay.
            ram: The RAM backend (:meth:`ram_anonymous` or :meth:`ram_file`); its id is always
                ``ram`` so that a migration stream fits either.
            incoming: A migration stream file to restore instead of booting.
            incoming_defer: Wait for ``migrate-incoming`` over QMP (to set capabilities first).
            netdev: The NIC's arguments (:func:`user_netdev`); required exactly when ``nic``.

        Raises:
            ValueError: ``netdev`` given without ``nic``, or missing with it.
        """
        if self.nic != (netdev is not None):
            msg = "a NIC's netdev is given exactly when the machine has a NIC"
            raise ValueError(msg)
        accel = (
            ["-accel", "kvm", "-cpu", "host"]
            if self.accel == "kvm"
            else ["-accel", "tcg", "-cpu", "max"]
        )
        argv = [
            QEMU_BINARY,
            "-name", f"sandlot-{vm_dir.name}",
            *ram,
            "-M", "microvm,memory-backend=ram",
            *accel,
            "-m", f"{self.memory_mb}M",
            "-smp", str(self.vcpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(self.image.kernel),
            "-initrd", str(self.image.initrd),
            "-append", self.kernel_cmdline(),
            "-chardev", f"file,id=serial0,path={vm_dir / SERIAL_LOG}",
            "-serial", "chardev:serial0",
            # auto-read-only=off: QEMU would otherwise reopen the file read-only by its path when
            # a migration ends (stop, snapshot), and a VM's files move after start (a claimed
            # pool VM, a reset standby); with it, QEMU keeps using the descriptor it opened.
            "-drive", f"if=none,id=root,file={disk},format=qcow2,discard=unmap,file.auto-read-only=off",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={AGENT_SOCKET},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME},id={AGENT_PORT_ID}",
            "-qmp", f"unix:{QMP_SOCKET},server=on,wait=off",
            *(netdev if netdev is not None else ["-nic", "none"]),
            # Deny what a VMM never needs. Spawning stays allowed (exec: migration needs it), and so do
            # privilege changes: elevateprivileges=deny makes -daemonize fail silently (QEMU 7.2).
            "-sandbox", "on,obsolete=deny,resourcecontrol=deny",
            "-daemonize",
            "-pidfile", str(vm_dir / PIDFILE),
        ]  # fmt: skip
        if incoming is not None:
            argv += ["-incoming", f"exec:cat {shlex.quote(str(incoming))}"]
        elif incoming_defer:
            argv += ["-incoming", "defer"]
        return argv

    def fingerprint(self) -> str:
        """A hash of everything a memory snapshot depends on (hardware, kernel, boot)."""
        try:
            st = Path(shutil.which(QEMU_BINARY) or QEMU_BINARY).stat()
            qemu_id = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            qemu_id = "?"
        parts = [
            _TEMPLATE_RECIPE,
            qemu_id,
            self.image.key,
            str(self.memory_mb),
            str(self.vcpus),
            self.accel,
            self.kernel_cmdline(),
        ]
        if self.nic:
            parts.append("nic:virtio-net")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_TEMPLATE_RECIPE: Final = "template-recipe/2"
"""Part of every fingerprint: raise it when how a template is made changes (what runs in it
before its memory is saved), so that templates made the old way are not reused."""


def read_pid(vm_dir: Path) -> int | None:
    """The pid of the QEMU that serves ``vm_dir``, or ``None`` if it is not running.

    The pid file alone is not trusted (pids are reused): the process must hold that very file
    open, as QEMU does (it keeps its pid file open and locked while it runs). Checking open
    files rather than the command line keeps working after the VM directory was renamed (a
    pooled VM is claimed by renaming its directory).
    """
    pidfile = vm_dir / PIDFILE
    try:
        pid = int(pidfile.read_text().strip())
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (OSError, ValueError):
        return None
    for fd in fds:
        try:
            if fd.readlink() == pidfile:
                return pid if _alive(pid) else None
        except OSError:
            continue
    return None


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X")


def is_running(vm_dir: Path) -> bool:
    """True when the VM's QEMU process exists (running or paused)."""
    return read_pid(vm_dir) is not None


def _reap(pid: int) -> None:
    # Daemonized QEMU is re-parented to the nearest subreaper, which may be this process.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


async def launch(vm_dir: Path, argv: list[str]) -> int:
    """Start a daemonized QEMU; return its pid once its sockets exist.

    Raises:
        BackendUnavailable: QEMU is not installed.
        BackendError: QEMU refused to start (its message is included).
    """
    for name in (QMP_SOCKET, AGENT_SOCKET, PIDFILE):
        with contextlib.suppress(FileNotFoundError):
            (vm_dir / name).unlink()
    try:
        proc = await anyio.run_process(argv, cwd=vm_dir, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        msg = f"{QEMU_BINARY} is not installed (apt-get install qemu-system-x86)"
        raise BackendUnavailable(msg) from e
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        msg_0 = f"QEMU failed to start: {msg}"
        raise BackendError(msg_0)
    pid = read_pid(vm_dir)
    if pid is None:
        msg_0 = f"QEMU started but is gone; see {vm_dir / SERIAL_LOG}"
        raise BackendError(msg_0)
    return pid


async def kill_vm(vm_dir: Path, *, timeout: float = 5.0) -> None:
    """Kill the VM's QEMU (SIGKILL: nothing in it needs a clean shutdown) and wait until it is
    gone; a VM that is not running is not an error."""
    pid = read_pid(vm_dir)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while True:
            _reap(pid)
            if not _alive(pid):
                break
            if time.monotonic() > deadline:
                msg = f"QEMU pid {pid} survived SIGKILL for {timeout} s"
                raise BackendError(msg)
            await anyio.sleep(0.002)
    for name in (QMP_SOCKET, AGENT_SOCKET, PIDFILE):
        with contextlib.suppress(FileNotFoundError):
            (vm_dir / name).unlink()


@dataclass(frozen=True)
class AccelDecision:
    """Which accelerator VMs use on this host, and why."""

    mode: Accel
    reason: str


def _probe_key(image: ImagePaths) -> str:
    try:
        st = Path(shutil.which(QEMU_BINARY) or QEMU_BINARY).stat()
        qemu_id = f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        qemu_id = "?"
    # The boot id changes on every host reboot: a kernel or KVM module change forces a new probe.
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "?"
    parts = [str(_PROBE_FORMAT), os.uname().release, boot_id, qemu_id, image.key]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _probe_kvm(image: ImagePaths) -> tuple[bool, str]:
    argv = [
        QEMU_BINARY, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", image.cmdline + " sandlot.probe=1", "-serial", "stdio", "-nic", "none",
    ]  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv, capture_output=True, timeout=_PROBE_TIMEOUT, check=False, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return False, (
            f"a probe boot under KVM printed nothing within {_PROBE_TIMEOUT:.0f} s (a KVM that "
            "cannot run stock guest kernels, such as a PVM host)"
        )
    except FileNotFoundError:
        return False, f"{QEMU_BINARY} is not installed"
    out = proc.stdout.decode(errors="replace")
    if PROBE_MARKER in out:
        return (
            True,
            f"a probe boot under KVM reached the guest in {time.monotonic() - started:.2f} s",
        )
    tail = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    return False, f"a probe boot under KVM failed: {tail}"


ACCEL_ENV: Final = "SANDLOT_MICROVM_ACCEL"
"""The environment variable that forces an accelerator (``kvm`` or ``tcg``) over the probe."""
_TCG_FALLBACK: Final = "; using TCG emulation"


def forced_accel() -> Accel | None:
    """The accelerator ``$SANDLOT_MICROVM_ACCEL`` forces, or None when it is unset or empty.

    Raises:
        InvalidRequest: It is set to something other than ``kvm`` or ``tcg`` (a typo would
            otherwise quietly mean "probe").
    """
    raw = os.environ.get(ACCEL_ENV, "").strip()
    if not raw:
        return None
    value = raw.lower()
    if value == "kvm":
        return "kvm"
    if value == "tcg":
        return "tcg"
    msg = f"{ACCEL_ENV} must be kvm or tcg (or unset, to let sandlot probe), got {raw!r}"
    raise InvalidRequest(msg)


def _kvm_works(image: ImagePaths, cache_dir: Path | None) -> tuple[bool, str, bool]:
    """Whether KVM runs a guest here, why, and whether the answer came from the cache (the
    probe runs once per host boot, QEMU binary and image)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is absent or not accessible", False
    cache = (cache_dir or config.cache_dir()) / "microvm" / "kvm-probe.json"
    key = _probe_key(image)
    with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
        cached = json.loads(cache.read_text())
        if cached["key"] == key and cached["mode"] in ("kvm", "tcg"):
            return cached["mode"] == "kvm", cached["reason"].removesuffix(_TCG_FALLBACK), True
    ok, why = _probe_kvm(image)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    # The cached reason keeps the form it had before the forced case existed, so caches written
    # by earlier versions stay valid.
    reason = why if ok else why + _TCG_FALLBACK
    tmp.write_text(json.dumps({"key": key, "mode": "kvm" if ok else "tcg", "reason": reason}))
    tmp.replace(cache)
    return ok, why, False


def decide_accel(image: ImagePaths, cache_dir: Path | None = None) -> AccelDecision:
    """KVM when a real probe boot works, else TCG; the probe runs once per host boot and image.

    ``$SANDLOT_MICROVM_ACCEL`` (``kvm`` or ``tcg``) overrides the choice. Forcing ``kvm``
    still consults the probe: on a host whose KVM cannot run a guest (a PVM host) every VM
    would die or hang at boot, so that is refused here, before any VM is started.

    Raises:
        InvalidRequest: ``$SANDLOT_MICROVM_ACCEL`` is neither ``kvm`` nor ``tcg``.
        BackendUnavailable: It is ``kvm`` and KVM cannot run a guest on this host.
    """
    forced = forced_accel()
    if forced == "tcg":
        return AccelDecision("tcg", f"set by {ACCEL_ENV}")
    ok, why, cached = _kvm_works(image, cache_dir)
    seen = " (cached)" if cached else ""
    if forced == "kvm":
        if not ok:
            msg = (
                f"{ACCEL_ENV}=kvm, but KVM cannot run a guest on this host ({why}); "
                "unset it to let sandlot use TCG, or set it to tcg"
            )
            raise BackendUnavailable(msg)
        return AccelDecision("kvm", f"set by {ACCEL_ENV}; {why}{seen}")
    if ok:
        return AccelDecision("kvm", why + seen)
    return AccelDecision("tcg", why + _TCG_FALLBACK + seen)


def accel_check(image: ImagePaths | None, cache_dir: Path | None = None) -> DoctorCheck:
    """What ``sandlot doctor`` says of the accelerator: the one VMs will use and why, or a
    failed check when ``$SANDLOT_MICROVM_ACCEL`` asks for one that cannot work. Without a
    guest image there is nothing to probe with, so only the setting itself is checked."""
    try:
        if image is None:
            forced = forced_accel()
            how = f"{forced}, set by {ACCEL_ENV}" if forced else "probed"
            return DoctorCheck("accelerator", True, f"{how}; checked once a guest image is built")
        decision = decide_accel(image, cache_dir)
    except SandboxError as e:
        return DoctorCheck(
            "accelerator",
            False,
            e.message,
            f"unset {ACCEL_ENV} to let sandlot choose, or set it to tcg",
        )
    return DoctorCheck(f"accelerator: {decision.mode}", True, decision.reason)
