"""``sandlot doctor`` for the local backend: what this host has, without changing it.

As root, sandboxes get private uid ranges, cgroup limits and the network service; as a normal
user they run rootless (:mod:`.rootless`), and the checks then say what that mode has here and
what it lacks: subordinate ids, ``newuidmap``, ``slirp4netns`` and a usable TUN device for
``allow-all``, and cgroup delegation for limits. Must not import the backend object or the store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from sandlot.backends.base import DoctorCheck
from sandlot.backends.local import rootless
from sandlot.errors import BackendUnavailable

__all__ = ["doctor"]


def _version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{binary}: {e}"
    return (
        (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else binary
    )


_VERSIONED = frozenset({"crun", "runsc", "umoci", "nft", "unshare", "slirp4netns"})


def _tool(binary: str, package: str, why: str, *, required: bool = True) -> DoctorCheck:
    path = shutil.which(binary)
    return DoctorCheck(
        f"{binary} installed ({why})",
        path is not None,
        (_version(binary) if binary in _VERSIONED else path) if path else "not found",
        f"apt-get install {package}",
        required,
    )


def _hybrid() -> bool:
    return Path("/sys/fs/cgroup/unified").is_dir() and Path("/sys/fs/cgroup/memory").is_dir()


def _cgroups() -> DoctorCheck:
    if not _hybrid():
        return DoctorCheck("cgroups", True, "unified or v1 hierarchy")
    mounted = Path("/sys/fs/cgroup/hugetlb/tasks").exists()
    detail = (
        "v1/v2 hybrid; hugetlb hierarchy mounted"
        if mounted
        else "v1/v2 hybrid; sandlot mounts the hugetlb hierarchy crun needs at first use"
    )
    return DoctorCheck("cgroups", mounted or os.geteuid() == 0, detail, "run as root")


def _userns() -> DoctorCheck:
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = 0
    detail = f"max_user_namespaces={limit}"
    ok = limit > 0
    fix = "sysctl -w user.max_user_namespaces=65536"
    try:
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0":
            ok, detail = False, f"{detail}, unprivileged_userns_clone=0"
            fix = "sysctl -w kernel.unprivileged_userns_clone=1"
    except OSError:
        pass
    return DoctorCheck("user namespaces", ok, detail, fix)


def _python() -> DoctorCheck:
    found = Path("/usr/bin/python3").exists()
    return DoctorCheck(
        "/usr/bin/python3 (the in-sandbox agent's interpreter)",
        found,
        "found" if found else "missing",
        "apt-get install python3-minimal",
    )


def _delegation() -> str:
    """Whether this user could write any cgroup of its own (what limits would need)."""
    if _hybrid() or not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "no delegated cgroups: this is a cgroup v1/v2 hybrid host"
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "no delegated cgroups"
    own = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "")
    path = Path("/sys/fs/cgroup") / own.lstrip("/")
    if own and os.access(path / "cgroup.subtree_control", os.W_OK):
        return f"{path} is delegated to this user, but rootless sandboxes do not use it yet"
    return f"no delegated cgroup ({path} is not writable by this user)"


def _rootless_checks() -> list[DoctorCheck]:
    uid = os.geteuid()
    idmap, why_single = rootless.detect()
    checks = [
        DoctorCheck(
            "rootless mode",
            True,
            f"uid {uid}: root inside a sandbox is uid {uid} on the host; as root, each sandbox "
            "would get a private uid range, limits and network policies instead",
        )
    ]
    if idmap.full:
        assert idmap.sub_uid is not None
        assert idmap.sub_gid is not None
        checks.append(
            DoctorCheck(
                "subordinate ids (65,536 ids per sandbox)",
                True,
                f"ids 1-65535 inside are host uids {idmap.sub_uid}-{idmap.sub_uid + 65534}, "
                f"gids {idmap.sub_gid}-{idmap.sub_gid + 65534} (newuidmap/newgidmap)",
            )
        )
    else:
        fix = (
            "apt-get install uidmap"
            if "uidmap" in why_single
            else f"as root: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 "
            f"$(id -un {uid})"
        )
        checks.append(
            DoctorCheck(
                "subordinate ids (65,536 ids per sandbox)",
                False,
                f"{why_single}: sandboxes have one id (root); chown to other users fails inside",
                fix,
                required=False,
            )
        )
    slirp = rootless.slirp_problem() or ""
    fix = next(
        (
            f
            for word, f in (
                ("slirp4netns is not", "apt-get install slirp4netns"),
                ("/dev/net/tun", "as root: chmod 0666 /dev/net/tun"),
                ("nft is not", "apt-get install nftables"),
                ("nsenter is not", "apt-get install util-linux"),
            )
            if word in slirp
        ),
        "",
    )
    checks.append(
        DoctorCheck(
            "network allow-all (slirp4netns)",
            not slirp,
            f"deny-all only: {slirp}"
            if slirp
            else "deny-all always; allow-all through slirp4netns, fenced like rootful allow-all "
            "(not the host's loopback or addresses, link-local or multicast)",
            fix,
            required=False,
        )
    )
    checks.append(
        DoctorCheck(
            "network allowlists and ports",
            False,
            "need root (the egress proxy's namespaces, nftables, port forwards)",
            "run sandlot as root",
            required=False,
        )
    )
    checks.append(
        DoctorCheck(
            "resource limits (memory_mb, pids, vcpus, disk_mb)",
            False,
            f"refused: {_delegation()}; disk_mb needs a loop mount (root)",
            "run sandlot as root for enforced limits",
            required=False,
        )
    )
    checks.append(
        DoctorCheck(
            "isolation=gvisor",
            False,
            "runs only as root in this backend",
            "run sandlot as root",
            required=False,
        )
    )
    try:
        base = rootless.runtime_base(create=False)
        checks.append(DoctorCheck("runtime directory", True, str(base)))
    except BackendUnavailable as e:
        checks.append(
            DoctorCheck(
                "runtime directory", False, e.message, "set XDG_RUNTIME_DIR to a dir of yours"
            )
        )
    return checks


def doctor() -> list[DoctorCheck]:
    """The local backend's prerequisites on this host."""
    if os.geteuid() != 0:
        return [
            *_rootless_checks(),
            _tool("crun", "crun", "the OCI runtime"),
            _userns(),
            _python(),
            _tool("umoci", "umoci", "oci: images", required=False),
        ]
    return [
        DoctorCheck(
            "running as root",
            True,
            "each sandbox gets its own unprivileged uid range",
        ),
        _tool("crun", "crun", "the OCI runtime"),
        _tool("unshare", "util-linux", "id-mapped mounts"),
        _userns(),
        _cgroups(),
        _python(),
        _tool("mkfs.ext4", "e2fsprogs", "resources.disk_mb"),
        _tool("runsc", "runsc", "isolation=gvisor", required=False),
        _tool("umoci", "umoci", "oci: images", required=False),
        _tool("nft", "nftables", "network policies and ports", required=False),
        _tool("ip", "iproute2", "network policies and ports", required=False),
    ]
