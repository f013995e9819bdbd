"""The OCI runtime configuration (``config.json``) of a local sandbox.

One function per section so each security decision is visible in one place: namespaces
(:func:`namespaces`, which is also the hook the network service uses to put a sandbox into a
prepared network namespace), mounts, capabilities, masked and read-only paths, cgroup resources,
and the seccomp profile from :mod:`.seccomp`. The same bundle runs under ``crun`` and ``runsc``;
the few differences are parameters. This module imports only the models and :mod:`.seccomp`.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.backends.local import seccomp
from sandlot.models import Resources

__all__ = [
    "CAPABILITIES",
    "DEFAULT_PIDS",
    "MASKED_PATHS",
    "READONLY_PATHS",
    "BundleConfig",
    "build",
    "namespaces",
    "resources",
]

# A subset of the runtimes' default set: no CAP_MKNOD (the devices cgroup forbids new nodes
# anyway) and no CAP_NET_RAW (no raw packets, even on the sandbox's own loopback).
CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
)

# The OCI/runc defaults, plus a few files that leak host details.
MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/interrupts",
    "/proc/kallsyms",
    "/proc/sysrq-trigger",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
)

DEFAULT_PIDS = 4096
"""The pids limit when the spec sets none: a fork bomb must never take the host down."""

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class BundleConfig:
    """Everything :func:`build` needs to write one sandbox's ``config.json``."""

    args: list[str]
    """The init process (the agent)."""
    rootfs: Path
    """The mounted root filesystem."""
    uid_base: int | None
    """First id of the sandbox's range in the runtime's user namespace (``None``: map only
    ``caller_uid``/``caller_gid``); rootless, 0 (see ``rootless``)."""
    uid_size: int
    """Size of the range."""
    cgroups_path: str
    """Where the runtime puts the sandbox's cgroups."""
    resources: Resources
    """Limits from the spec."""
    env: list[str] = field(default_factory=list)
    """The init's environment, ``NAME=value``."""
    extra_mounts: list[dict[str, object]] = field(default_factory=list)
    """Bind mounts the backend adds (the agent file, the host Python for images, …)."""
    netns_path: str | None = None
    """Join this network namespace instead of making an empty one."""
    hostname: str = "sandbox"
    """The sandbox's host name."""
    gvisor: bool = False
    """Tune the bundle for runsc (it applies masks and seccomp in its own kernel)."""
    caller_uid: int = 0
    """The host uid/gid mapped to root when ``uid_base`` is None."""
    caller_gid: int = 0
    exec_listener: str | None = None
    """Strict enforcement: the unix socket that receives the exec-notify fd (see
    :func:`.seccomp.profile`)."""
    rootless: bool = False
    """The runtime runs as root of a user namespace whose ids are ``0..uid_size-1`` (the
    caller and its subordinate ids), without cgroups: no cgroup section, and a per-uid process
    limit (``RLIMIT_NPROC``) as the only bound on a fork bomb."""


def namespaces(netns_path: str | None) -> list[dict[str, str]]:
    """The namespace section: everything new, always a user namespace.

    ``netns_path`` joins a network namespace prepared by the network service (the hook for
    egress policies); without it the sandbox gets an empty one with only loopback.
    """
    net: dict[str, str] = {"type": "network"}
    if netns_path is not None:
        net["path"] = netns_path
    return [
        {"type": "pid"},
        {"type": "mount"},
        {"type": "ipc"},
        {"type": "uts"},
        {"type": "cgroup"},
        {"type": "user"},
        net,
    ]


GVISOR_PIDS_BASE = 256
"""Host pids that gVisor's own kernel and gofer need, whatever runs inside."""
GVISOR_PIDS_PER_TASK = 128
"""Host threads per sandbox task under gVisor's ptrace platform: about six idle, 50-65 at the
peak of a fork bomb (measured: 2,400-3,050 host pids for a 48-task bomb), more on a busy host (a
tracing thread per busy task, Go runtime threads). At 64 a bomb on a busy host now and then
reached the bound and the sandbox's kernel died with it; 128 leaves twice the measured peak."""
GVISOR_PIDS_CAP = 8192
"""The host-side bound under gVisor whatever the spec (and at most a quarter of the host's
``pid_max``): beyond it the sandbox's kernel fails (the sandbox dies), never the host."""


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 32768


def resources(spec: Resources, *, gvisor: bool = False) -> dict[str, object]:
    """The cgroup section for ``spec`` (memory, swap, pids, CPU quota, devices).

    Under gVisor the host cgroup holds the user-space kernel, not the sandbox's processes one
    to one: its pids limit is a generous host-side bound, and the exact per-sandbox limit is
    ``RLIMIT_NPROC``, which gVisor enforces in its own kernel (see :func:`rlimits`).
    """
    pids = spec.pids or DEFAULT_PIDS
    if gvisor:
        cap = min(GVISOR_PIDS_CAP, _pid_max() // 4)
        pids = min(cap, GVISOR_PIDS_BASE + GVISOR_PIDS_PER_TASK * pids)
    out: dict[str, object] = {
        "devices": [{"allow": False, "access": "rwm"}],
        "pids": {"limit": pids},
    }
    if spec.memory_mb is not None:
        limit = spec.memory_mb << 20
        # swap == limit: memory+swap may not exceed the limit, so a hog cannot swap its way out.
        out["memory"] = {"limit": limit, "swap": limit}
    if spec.vcpus is not None:
        period = 100_000
        out["cpu"] = {"quota": max(1000, int(spec.vcpus * period)), "period": period}
    return out


def rlimits(
    spec: Resources, *, gvisor: bool, rootless: bool = False
) -> list[dict[str, object]] | None:
    """Resource limits for the init, or None to inherit ours.

    Never above our own hard limits: root may lack ``CAP_SYS_RESOURCE`` and the runtime would
    fail raising one. Only gVisor gets one (``RLIMIT_NPROC``, its exact pids limit), and a
    rootless sandbox (a default bound per uid inside, counted in the sandbox's own user
    namespace, where no cgroup can hold a fork bomb); under rootful crun the sandbox's pids
    cgroup is exact already.
    """
    if not gvisor and not rootless:
        return None
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    nproc = spec.pids or DEFAULT_PIDS
    if hard != resource.RLIM_INFINITY:
        nproc = min(nproc, hard)
    return [{"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc}]


def _mounts(cfg: BundleConfig) -> list[dict[str, object]]:
    pts = ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]
    if cfg.rootless and cfg.uid_size <= 5:
        pts.remove("gid=5")  # no group 5 among a single-id sandbox's ids
    mounts: list[dict[str, object]] = [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": pts,
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
    ]
    mounts.extend(cfg.extra_mounts)
    return mounts


def _merge_env(entries: list[str]) -> list[str]:
    """One entry per name, the last one given winning (an image's or the spec's ``PATH`` over
    the default): with duplicates, which one a program sees depends on how it reads them."""
    merged: dict[str, str] = {}
    for entry in entries:
        name = entry.partition("=")[0]
        merged[name] = entry
    return list(merged.values())


def build(cfg: BundleConfig) -> dict[str, object]:
    """The whole ``config.json`` document."""
    caps = list(CAPABILITIES)
    if cfg.uid_base is None:
        uid_map = [{"containerID": 0, "hostID": cfg.caller_uid, "size": 1}]
        gid_map = [{"containerID": 0, "hostID": cfg.caller_gid, "size": 1}]
    elif cfg.rootless and cfg.uid_size > 1:
        # The kernel maps each extent of a child's map through a single extent of its parent's,
        # and the helper's namespace has two (the caller, then its subordinate range).
        uid_map = [
            {"containerID": 0, "hostID": cfg.uid_base, "size": 1},
            {"containerID": 1, "hostID": cfg.uid_base + 1, "size": cfg.uid_size - 1},
        ]
        gid_map = [dict(m) for m in uid_map]
    else:
        uid_map = [{"containerID": 0, "hostID": cfg.uid_base, "size": cfg.uid_size}]
        gid_map = [{"containerID": 0, "hostID": cfg.uid_base, "size": cfg.uid_size}]
    env = _merge_env([f"PATH={_PATH}", "HOME=/root", "LANG=C.UTF-8", "TERM=xterm", *cfg.env])
    linux: dict[str, object] = {
        "uidMappings": uid_map,
        "gidMappings": gid_map,
        "namespaces": namespaces(cfg.netns_path),
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
        "seccomp": seccomp.profile(clone3=not cfg.gvisor, listener_path=cfg.exec_listener),
    }
    if not cfg.rootless:
        linux["resources"] = resources(cfg.resources, gvisor=cfg.gvisor)
        linux["cgroupsPath"] = cfg.cgroups_path
    process: dict[str, object] = {
        "terminal": False,
        "user": {"uid": 0, "gid": 0},
        "args": list(cfg.args),
        "env": env,
        "cwd": "/",
        "capabilities": {
            "bounding": caps,
            "effective": caps,
            "permitted": caps,
            "inheritable": [],
            "ambient": [],
        },
        "noNewPrivileges": True,
    }
    limits = rlimits(cfg.resources, gvisor=cfg.gvisor, rootless=cfg.rootless)
    if limits is not None:
        process["rlimits"] = limits
    return {
        "ociVersion": "1.0.2",
        "process": process,
        "root": {"path": str(cfg.rootfs), "readonly": False},
        "hostname": cfg.hostname,
        "mounts": _mounts(cfg),
        "linux": linux,
    }
