"""``sandlot doctor`` for the local backend: what this host has, without changing it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from sandlot.backends.base import DoctorCheck

__all__ = ["doctor"]


def _version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{binary}: {e}"
    return (
        (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else binary
    )


_VERSIONED = frozenset({"crun", "runsc", "umoci", "nft", "unshare"})


def _tool(binary: str, package: str, why: str, *, required: bool = True) -> DoctorCheck:
    path = shutil.which(binary)
    return DoctorCheck(
        f"{binary} installed ({why})",
        path is not None,
        (_version(binary) if binary in _VERSIONED else path) if path else "not found",
        f"apt-get install {package}",
        required,
    )


def _cgroups() -> DoctorCheck:
    hybrid = Path("/sys/fs/cgroup/unified").is_dir() and Path("/sys/fs/cgroup/memory").is_dir()
    if not hybrid:
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
    return DoctorCheck(
        "user namespaces",
        limit > 0,
        f"max_user_namespaces={limit}",
        "sysctl -w user.max_user_namespaces=65536",
    )


def doctor() -> list[DoctorCheck]:
    """The local backend's prerequisites on this host."""
    root = os.geteuid() == 0
    return [
        DoctorCheck(
            "running as root",
            root,
            "each sandbox gets its own unprivileged uid range" if root else f"uid {os.geteuid()}",
            "run as root (rootless mode is not implemented yet)",
        ),
        _tool("crun", "crun", "the OCI runtime"),
        _tool("unshare", "util-linux", "id-mapped mounts"),
        _userns(),
        _cgroups(),
        DoctorCheck(
            "/usr/bin/python3 (the in-sandbox agent's interpreter)",
            Path("/usr/bin/python3").exists(),
            "found" if Path("/usr/bin/python3").exists() else "missing",
            "apt-get install python3-minimal",
        ),
        _tool("mkfs.ext4", "e2fsprogs", "resources.disk_mb"),
        _tool("runsc", "runsc", "isolation=gvisor", required=False),
        _tool("umoci", "umoci", "oci: images", required=False),
        _tool("nft", "nftables", "network policies and ports", required=False),
        _tool("ip", "iproute2", "network policies and ports", required=False),
    ]
