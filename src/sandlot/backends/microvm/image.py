"""The microVM guest image: a Debian cloud kernel, a small initramfs and a root disk.

This module owns building, caching and loading guest images. An image is a directory holding a
``manifest.json`` (format :data:`MANIFEST_FORMAT`) and the files it names::

    vmlinuz         the kernel (Debian's ``linux-image-cloud-amd64``, a bzImage)
    initrd.img      a gzip'd newc cpio: static busybox, the virtio modules, /init, the agent
    rootfs.qcow2    an ext4 root filesystem (``mmdebstrap --variant=minbase`` + python3, curl
                    and Debian's CA bundle, and a virtual environment at :data:`GUEST_VENV`,
                    active on ``PATH``)

Guest contract (what a user's own image must also honour): the root disk is ``/dev/vda``, the
initramfs starts the sandlot agent (``sandlot.channel.agent``) serving the virtio-serial port
named ``sandlot.agent`` (``/dev/virtio-ports/sandlot.agent``), and the guest mounts nothing
from the host. For network policies other than ``deny-all`` the VM has one virtio-net NIC: the
guest brings it up as ``eth0`` with :data:`GUEST_ADDRESS`/:data:`GUEST_PREFIX`, no default
route and no IPv6, and keeps a busybox at :data:`GUEST_BUSYBOX` (the host adds the default
route with it under ``allow-all``).
``/init`` with ``sandlot.probe=1`` on the kernel command line prints :data:`PROBE_MARKER` and
powers off before touching any disk: that is how the host tests whether KVM really works.

The image is built from Debian packages only (``apt-get download`` + ``dpkg-deb -x`` for the
kernel and busybox, so the host's own kernel packages are untouched; ``mmdebstrap`` for the
root disk) and cached under ``cache_dir()/microvm/`` in two layers, each keyed by a hash of its
inputs: ``rootfs-<key>/`` (suite, package list, build version: the slow ~45 s part) and
``image-<key>/`` (rootfs key, kernel and busybox package versions, agent hash, init script).
Changing the agent only rebuilds the initramfs. Extra CA certificates (:func:`with_trust`) are
not built into the disk: they are written into each template the backend boots for them, and
only change the image's key. This module must not import the store or other backends.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sandlot import config
from sandlot.backends import trust
from sandlot.errors import BackendError, BackendUnavailable, InvalidRequest

__all__ = [
    "GUEST_ADDRESS",
    "GUEST_BUSYBOX",
    "GUEST_GATEWAY",
    "GUEST_NAMESERVER",
    "GUEST_PREFIX",
    "GUEST_VENV",
    "MANIFEST_FORMAT",
    "PROBE_MARKER",
    "READY_MARKER",
    "ImagePaths",
    "Progress",
    "build_image",
    "default_agent_path",
    "find_cached_image",
    "load_image",
    "resolve_image",
    "verify_image",
    "with_trust",
]

MANIFEST_FORMAT: Final = "sandlot-microvm-image/1"
PROBE_MARKER: Final = "SANDLOT-PROBE-OK"
READY_MARKER: Final = "SANDLOT-INIT-DONE"

# Bump when anything about how an image is assembled changes; it is part of both cache keys.
BUILD_VERSION: Final = "5"

KERNEL_META_PACKAGE: Final = "linux-image-cloud-amd64"
BUSYBOX_PACKAGE: Final = "busybox-static"
SUITE: Final = "bookworm"
# ca-certificates: the Debian trust layout extra CAs are added to (sandlot.backends.trust);
# curl: the HTTPS client agents reach for first, beside Python's.
ROOTFS_PACKAGES: Final = ("python3", "python3-venv", "ca-certificates", "curl")
ROOTFS_SIZE: Final = "4G"

# The cloud kernel builds virtio as modules; they must be loaded in dependency order
# (research/feasibility.md §8). Only what the guest contract needs: no vsock or fs. virtio_net
# needs failover and net_failover; a VM without a NIC loads them and never uses them.
VIRTIO_MODULES: Final = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/char/virtio_console.ko",
    "drivers/block/virtio_blk.ko",
    "net/core/failover.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko",
)

GUEST_ADDRESS: Final = "10.0.2.15"
"""The guest's address on its NIC (QEMU user-mode networking's default guest address)."""
GUEST_PREFIX: Final = 24
"""The guest subnet's prefix length (QEMU's default ``10.0.2.0/24``)."""
GUEST_GATEWAY: Final = "10.0.2.2"
"""QEMU user-mode networking's gateway (the host's NAT), used only under ``allow-all``."""
GUEST_NAMESERVER: Final = "10.0.2.3"
"""QEMU user-mode networking's DNS forwarder, used only under ``allow-all``."""
GUEST_VENV: Final = "/opt/sandlot/venv"
"""The guest's Python environment: a venv over the guest's ``python3`` (seeing its packages)
with its own pip, first on ``PATH``, so ``pip install`` works as it does in a ``local`` sandbox
(the same path as the local backend's default root; Debian's own Python is PEP 668
``EXTERNALLY-MANAGED``)."""
GUEST_BUSYBOX: Final = "/run/sandlot/busybox"
"""A copy of the initramfs' busybox kept in the guest's RAM (``/run`` is a tmpfs) on VMs with a
NIC: the root disk has no ``ip``, and the host configures routes with it."""

KERNEL_CMDLINE: Final = (
    "console=ttyS0 quiet panic=-1 reboot=t i8042.noaux i8042.nomux i8042.nopnp "
    "i8042.dumbkbd tsc=reliable no_timer_check 8250.nr_uarts=1 random.trust_cpu=on"
)

AGENT_PORT_NAME: Final = "sandlot.agent"
"""The virtserialport's name; the host's QEMU command line must use the same."""
AGENT_DEVICE: Final = f"/dev/virtio-ports/{AGENT_PORT_NAME}"
"""Where the guest agent opens its port (udev's path for a named port)."""

Progress = Callable[[str], None]
"""Called with one human-readable line per build step."""

_INIT_SCRIPT: Final = r"""#!/bin/busybox sh
# sandlot microvm /init: load virtio, mount the root disk, start the agent.
/bin/busybox mkdir -p /proc /sys /dev /newroot /usr/bin /usr/sbin /sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do
    insmod "/modules/$m" || echo "sandlot-init: insmod $m failed"
done
case " $(cat /proc/cmdline) " in
    *" sandlot.probe=1 "*) echo "@PROBE@"; poweroff -f ;;
esac
# Both devices appear asynchronously once their drivers probe. The port's node name
# (vportNpM) follows the virtio device index, so it is found by its name, and linked where
# udev would put it.
find_port() {
    for f in /sys/class/virtio-ports/*/name; do
        [ -e "$f" ] && [ "$(cat "$f")" = "@PORT@" ] && { basename "$(dirname "$f")"; return 0; }
    done
    return 1
}
i=0
# A NIC (virtio device id 1) is there only on VMs made for a network policy.
has_nic() {
    for f in /sys/bus/virtio/devices/*/device; do
        [ -e "$f" ] && [ "$(cat "$f")" = "0x0001" ] && return 0
    done
    return 1
}
while [ ! -b /dev/vda ] || ! port=$(find_port) || [ ! -c "/dev/$port" ] \
        || { has_nic && [ ! -e /sys/class/net/eth0 ]; }; do
    i=$((i + 1))
    if [ "$i" -gt 2000 ]; then
        echo "sandlot-init: no /dev/vda or port @PORT@; /dev has: $(ls /dev | tr '\n' ' ')"
        dmesg | tail -n 20
        poweroff -f
    fi
    usleep 5000
done
mkdir -p /dev/virtio-ports
ln -sf "../$port" "@DEVICE@"
mount -t ext4 -o noatime /dev/vda /newroot || { echo "sandlot-init: cannot mount root"; poweroff -f; }
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/tmp
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /newroot/run
mkdir -p /newroot/run/sandlot /newroot/var/log/sandlot
cp /agent.py /newroot/run/sandlot/agent.py
ip link set lo up
if has_nic; then
    # No default route: only the on-link egress proxy is reachable, and anything else fails at
    # once with "network unreachable" instead of waiting for a timeout. The host adds the route
    # for allow-all. No IPv6: QEMU's user-mode network here is IPv4 only.
    [ -e /proc/sys/net/ipv6/conf/eth0/disable_ipv6 ] && echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6
    ip addr add @GUEST@/@PREFIX@ dev eth0
    ip link set eth0 up
    cp /bin/busybox /newroot@BUSYBOX@
fi
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/dev/shm
[ -e /newroot/dev/ptmx ] || ln -s pts/ptmx /newroot/dev/ptmx
hostname sandlot
echo "@READY@"
export PATH=@VENV@/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
export VIRTUAL_ENV=@VENV@
# The agent is PID 1: it reaps orphans, and the OOM killer never picks PID 1.
exec switch_root /newroot /usr/bin/python3 -I -S /run/sandlot/agent.py --device @DEVICE@ --workdir /workspace
"""


def _init_script() -> str:
    return (
        _INIT_SCRIPT.replace("@PROBE@", PROBE_MARKER)
        .replace("@READY@", READY_MARKER)
        .replace("@DEVICE@", AGENT_DEVICE)
        .replace("@PORT@", AGENT_PORT_NAME)
        .replace("@GUEST@", GUEST_ADDRESS)
        .replace("@PREFIX@", str(GUEST_PREFIX))
        .replace("@BUSYBOX@", GUEST_BUSYBOX)
        .replace("@VENV@", GUEST_VENV)
    )


@dataclass(frozen=True)
class ImagePaths:
    """A guest image on disk: everything needed to boot one."""

    directory: Path
    """The image directory (holds ``manifest.json``)."""
    kernel: Path
    """The kernel (bzImage)."""
    initrd: Path
    """The initramfs."""
    disk: Path
    """The root disk (read by every sandbox as the backing file of its own overlay)."""
    disk_format: str
    """``qcow2`` or ``raw``."""
    cmdline: str
    """The kernel command line."""
    key: str
    """A hash naming this image's content (inputs for built images, file hashes otherwise)."""
    trust: tuple[str, ...] = ()
    """Extra CA certificates (PEM) a guest of this image trusts, written into the templates
    booted from it; part of :attr:`key` (see :func:`with_trust`)."""


def with_trust(image: ImagePaths, certificates: tuple[str, ...]) -> ImagePaths:
    """``image`` whose guests also trust ``certificates``: the same files under a key of its
    own, so templates, pools and standbys made for it never serve another set."""
    if not certificates:
        return image
    return dataclasses.replace(
        image, trust=certificates, key=f"{image.key}+ca-{trust.key(certificates)}"
    )


def default_agent_path() -> Path:
    """The in-guest agent shipped with sandlot (``sandlot/channel/agent.py``)."""
    return Path(__file__).resolve().parents[2] / "channel" / "agent.py"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _run(argv: list[str], *, cwd: Path | None = None, what: str) -> str:
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        msg = f"cannot build the microvm image: {argv[0]} is not installed ({what})"
        raise BackendUnavailable(
            msg,
            missing=argv[0],
        ) from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        msg = f"{what} failed (exit {proc.returncode}): {tail}"
        raise BackendError(msg, command=argv[0])
    return proc.stdout


def _apt_candidate(package: str) -> tuple[str, str]:
    """Resolve a (meta) package to the concrete package name and version apt would install."""
    name = package
    out = _run(["apt-cache", "depends", "--no-recommends", package], what="apt-cache depends")
    # A meta package (linux-image-cloud-amd64) depends on exactly one versioned image package.
    if package == KERNEL_META_PACKAGE:
        for line in out.splitlines():
            m = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
            if m:
                name = m.group(1)
                break
        else:
            msg = f"apt-cache depends {package} names no kernel package (run apt-get update)"
            raise BackendUnavailable(msg)
    policy = _run(["apt-cache", "policy", name], what="apt-cache policy")
    m = re.search(r"Candidate:\s*(\S+)", policy)
    if not m or m.group(1) == "(none)":
        msg = f"apt knows no installable version of {name} (run apt-get update)"
        raise BackendUnavailable(msg)
    return name, m.group(1)


def _download_deb(name: str, version: str, debs_dir: Path) -> Path:
    """The package's .deb, downloaded once into ``debs_dir`` (kept: the initramfs is rebuilt
    whenever the agent changes, the kernel package is 27 MB)."""
    debs_dir.mkdir(parents=True, exist_ok=True)
    kept = debs_dir / f"{name}_{version.replace(':', '%3a')}.deb"
    if kept.is_file():
        return kept
    with tempfile.TemporaryDirectory(prefix=".download-", dir=debs_dir) as tmp:
        last: BackendError | None = None
        for _attempt in range(3):
            try:
                # APT::Sandbox::User=root: the download directory is private, _apt cannot enter it.
                _run(
                    [
                        "apt-get",
                        "download",
                        "-q",
                        "-o",
                        "APT::Sandbox::User=root",
                        f"{name}={version}",
                    ],
                    cwd=Path(tmp),
                    what=f"apt-get download {name}",
                )
                break
            except BackendError as e:
                last = e
                time.sleep(2)
        else:
            assert last is not None
            raise last
        got = sorted(Path(tmp).glob(f"{name}_*.deb"))
        if not got:
            msg = f"apt-get download {name} produced no .deb file"
            raise BackendError(msg)
        got[-1].replace(kept)
    return kept


class _Cpio:
    """A minimal writer of the ``newc`` cpio format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._ino = 1

    def _entry(self, name: str, mode: int, data: bytes) -> None:
        encoded = name.encode() + b"\0"
        header = "070701" + "".join(
            f"{v:08x}"
            for v in (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        )
        self._ino += 1
        self._buf.write(header.encode() + encoded)
        self._pad()
        self._buf.write(data)
        self._pad()

    def _pad(self) -> None:
        self._buf.write(b"\0" * (-self._buf.tell() % 4))

    def directory(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755, b"")

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0, b"")
        return self._buf.getvalue()


def _build_initrd(kernel_root: Path, busybox_root: Path, agent: Path, out: Path) -> None:
    modules_dirs = list((kernel_root / "lib" / "modules").iterdir())
    if len(modules_dirs) != 1:
        msg = f"expected one kernel module tree in the package, got {modules_dirs}"
        raise BackendError(msg)
    mod_root = modules_dirs[0] / "kernel"
    cpio = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "modules"):
        cpio.directory(d)
    cpio.file("bin/busybox", (busybox_root / "bin" / "busybox").read_bytes(), 0o755)
    order = []
    for rel in VIRTIO_MODULES:
        src = mod_root / rel
        if not src.exists():
            msg = f"the kernel package has no {rel}; is it a cloud kernel?"
            raise BackendError(msg)
        cpio.file(f"modules/{src.name}", src.read_bytes())
        order.append(src.name)
    cpio.file("modules.order", ("\n".join(order) + "\n").encode())
    cpio.file("init", _init_script().encode(), 0o755)
    cpio.file("agent.py", agent.read_bytes())
    # mtime=0 keeps the initrd byte-identical for identical inputs.
    out.write_bytes(gzip.compress(cpio.finish(), compresslevel=6, mtime=0))


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def _publish(tmp: Path, final: Path) -> None:
    try:
        tmp.rename(final)
    except OSError:
        # Another builder won the race; theirs is equivalent (same key), keep it.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "manifest.json").exists():
            raise


def _key(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _rootfs_inputs(sources: Path) -> dict[str, str]:
    return {
        "build": BUILD_VERSION,
        "suite": SUITE,
        "packages": ",".join(ROOTFS_PACKAGES),
        "size": ROOTFS_SIZE,
        "sources": hashlib.sha256(sources.read_bytes()).hexdigest() if sources.exists() else "",
    }


def _apt_sources() -> Path:
    deb822 = Path("/etc/apt/sources.list.d/debian.sources")
    return deb822 if deb822.exists() else Path("/etc/apt/sources.list")


def _build_rootfs(final: Path, progress: Progress) -> None:
    tmp = _atomic_dir(final)
    try:
        raw = tmp / "rootfs.raw"
        progress(f"building the root disk with mmdebstrap ({SUITE}, {', '.join(ROOTFS_PACKAGES)})")
        started = time.monotonic()
        # The root disk is made inside mmdebstrap's hook so that ownership is right even in its
        # rootless (unshare) mode; the tarball it would write is not needed.
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--include=" + ",".join(ROOTFS_PACKAGES),
                "--aptopt=Acquire::Check-Valid-Until false",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                "--dpkgopt=path-exclude=/usr/share/info/*",
                '--customize-hook=mkdir -p "$1/workspace" "$1/var/log/sandlot"',
                '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
                '--customize-hook=echo sandlot > "$1/etc/hostname"',
                f'--customize-hook=chroot "$1" python3 -m venv --system-site-packages {GUEST_VENV}',
                # In root mode /proc, /sys and /dev are mounted into the chroot while hooks run;
                # copying with --one-file-system leaves their contents out of the disk.
                f'--customize-hook=cp -a --one-file-system "$1" {tmp}/tree',
                "--customize-hook=mke2fs -q -t ext4 -L sandlot-root -m 0 -E root_owner=0:0 "
                f"-d {tmp}/tree -F {raw} {ROOTFS_SIZE}",
                f"--customize-hook=rm -rf {tmp}/tree",
                SUITE,
                "/dev/null",
                str(_apt_sources()),
            ],
            what="mmdebstrap",
        )
        progress(f"root filesystem ready in {time.monotonic() - started:.1f} s; converting")
        _run(
            ["qemu-img", "convert", "-q", "-O", "qcow2", str(raw), str(tmp / "rootfs.qcow2")],
            what="qemu-img convert",
        )
        raw.unlink()
        (tmp / "manifest.json").write_text(
            json.dumps(
                {
                    "inputs": _rootfs_inputs(_apt_sources()),
                    "sha256": {"rootfs.qcow2": _sha256_file(tmp / "rootfs.qcow2")},
                    "build_seconds": round(time.monotonic() - started, 1),
                },
                indent=2,
            )
        )
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_image(
    cache_dir: Path | None = None,
    *,
    progress: Progress | None = None,
    agent: Path | None = None,
    force: bool = False,
) -> ImagePaths:
    """Build the default guest image, or return the cached one whose inputs match.

    Args:
        cache_dir: The cache root; default :func:`sandlot.config.cache_dir`. The image lands in
            ``<cache_dir>/microvm/image-<key>/``.
        progress: Called with a line per step (for the CLI's progress display).
        agent: The agent file copied into the initramfs; default :func:`default_agent_path`.
        force: Rebuild even when a cached image matches.

    Returns:
        The image's paths.

    Raises:
        BackendUnavailable: A build tool (mmdebstrap, apt-get, qemu-img) is missing or apt has no
            package lists.
        BackendError: A build step failed.
    """
    say = progress or (lambda _line: None)
    root = (cache_dir or config.cache_dir()) / "microvm"
    agent_path = agent or default_agent_path()
    if not agent_path.is_file():
        msg = f"the guest agent {agent_path} does not exist"
        raise BackendUnavailable(msg)
    started = time.monotonic()
    kernel_pkg, kernel_ver = _apt_candidate(KERNEL_META_PACKAGE)
    busybox_pkg, busybox_ver = _apt_candidate(BUSYBOX_PACKAGE)
    rootfs_key = _key(_rootfs_inputs(_apt_sources()))
    inputs = {
        "build": BUILD_VERSION,
        "rootfs": rootfs_key,
        "kernel": f"{kernel_pkg}={kernel_ver}",
        "busybox": f"{busybox_pkg}={busybox_ver}",
        "agent": _sha256_file(agent_path),
        "init": hashlib.sha256(_init_script().encode()).hexdigest(),
        "modules": ",".join(VIRTIO_MODULES),
        "cmdline": KERNEL_CMDLINE,
    }
    final = root / f"image-{_key(inputs)}"
    if force:
        shutil.rmtree(final, ignore_errors=True)
    elif (final / "manifest.json").exists():
        say(f"cached image {final}")
        return load_image(final)

    rootfs_dir = root / f"rootfs-{rootfs_key}"
    if force or not (rootfs_dir / "manifest.json").exists():
        shutil.rmtree(rootfs_dir, ignore_errors=True)
        _build_rootfs(rootfs_dir, say)
    else:
        say(f"cached root disk {rootfs_dir}")

    tmp = _atomic_dir(final)
    try:
        with tempfile.TemporaryDirectory(prefix="sandlot-debs-") as work_s:
            work = Path(work_s)
            for pkg, ver in ((kernel_pkg, kernel_ver), (busybox_pkg, busybox_ver)):
                say(f"downloading {pkg} {ver}")
                deb = _download_deb(pkg, ver, root / "debs")
                _run(["dpkg-deb", "-x", str(deb), str(work / pkg)], what=f"dpkg-deb -x {pkg}")
            kernels = sorted((work / kernel_pkg / "boot").glob("vmlinuz-*"))
            if not kernels:
                msg = f"{kernel_pkg} holds no /boot/vmlinuz-*"
                raise BackendError(msg)
            shutil.copyfile(kernels[0], tmp / "vmlinuz")
            say("assembling the initramfs")
            _build_initrd(work / kernel_pkg, work / busybox_pkg, agent_path, tmp / "initrd.img")
        _link_or_copy(rootfs_dir / "rootfs.qcow2", tmp / "rootfs.qcow2")
        files = ("vmlinuz", "initrd.img", "rootfs.qcow2")
        manifest = {
            "format": MANIFEST_FORMAT,
            "kernel": "vmlinuz",
            "initrd": "initrd.img",
            "disk": "rootfs.qcow2",
            "disk_format": "qcow2",
            "cmdline": KERNEL_CMDLINE,
            "key": _key(inputs),
            "inputs": inputs,
            "sha256": {f: _sha256_file(tmp / f) for f in files},
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"image ready in {time.monotonic() - started:.1f} s: {final}")
    return load_image(final)


def load_image(directory: Path) -> ImagePaths:
    """Read an image directory's ``manifest.json`` (a built one or a user's own).

    A user's manifest needs ``kernel``, ``initrd`` and ``disk`` (paths relative to the
    directory or absolute); ``disk_format`` (default ``qcow2``), ``cmdline`` (default the
    built-in one) and ``sha256`` are optional.

    Raises:
        InvalidRequest: The directory has no readable manifest or names missing files.
    """
    directory = directory.expanduser().absolute()
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        msg = f"{directory} has no readable microvm manifest.json: {e}"
        raise InvalidRequest(msg) from None
    if not isinstance(manifest, dict):
        msg = f"{directory}/manifest.json is not a JSON object"
        raise InvalidRequest(msg)

    def path_of(field: str) -> Path:
        value = manifest.get(field)
        if not isinstance(value, str) or not value:
            msg = f"{directory}/manifest.json lacks {field!r}"
            raise InvalidRequest(msg)
        p = directory / value
        if not p.is_file():
            msg = f"the image's {field} {p} does not exist"
            raise InvalidRequest(msg)
        return p

    kernel, initrd, disk = path_of("kernel"), path_of("initrd"), path_of("disk")
    disk_format = manifest.get("disk_format", "qcow2")
    if disk_format not in ("qcow2", "raw"):
        msg = f"disk_format must be qcow2 or raw, got {disk_format!r}"
        raise InvalidRequest(msg)
    cmdline = manifest.get("cmdline", KERNEL_CMDLINE)
    key = manifest.get("key")
    if not isinstance(key, str):
        # A user's image: name it by what it holds (size and mtime, cheap; not the content).
        ident = [str(directory)] + [
            f"{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in (kernel, initrd, disk)
        ]
        key = "user-" + hashlib.sha256("|".join(ident).encode()).hexdigest()[:16]
    return ImagePaths(
        directory=directory,
        kernel=kernel,
        initrd=initrd,
        disk=disk,
        disk_format=str(disk_format),
        cmdline=str(cmdline),
        key=key,
    )


def verify_image(image: ImagePaths) -> list[str]:
    """Check the image's files against the SHA-256 hashes in its manifest.

    Returns:
        The names of files whose hash differs (empty when all match or none are recorded).
    """
    manifest = json.loads((image.directory / "manifest.json").read_text())
    hashes = manifest.get("sha256") or {}
    return [
        name
        for name, digest in sorted(hashes.items())
        if _sha256_file(image.directory / name) != digest
    ]


def find_cached_image(
    cache_dir: Path | None = None, agent: Path | None = None
) -> ImagePaths | None:
    """The newest cached image built by this version for this agent, without asking apt.

    Returns ``None`` when there is none (then :func:`build_image` makes one).
    """
    root = (cache_dir or config.cache_dir()) / "microvm"
    agent_path = agent or default_agent_path()
    want = {
        "build": BUILD_VERSION,
        "agent": _sha256_file(agent_path) if agent_path.is_file() else "",
        "init": hashlib.sha256(_init_script().encode()).hexdigest(),
        "modules": ",".join(VIRTIO_MODULES),
    }
    best: tuple[float, Path] | None = None
    for manifest in root.glob("image-*/manifest.json") if root.exists() else ():
        try:
            inputs = json.loads(manifest.read_text()).get("inputs", {})
            mtime = manifest.stat().st_mtime
        except (OSError, ValueError):
            continue
        if all(inputs.get(k) == v for k, v in want.items()) and (best is None or mtime > best[0]):
            best = (mtime, manifest.parent)
    return load_image(best[1]) if best else None


def resolve_image(image: str | None, cache_dir: Path | None = None) -> ImagePaths:
    """Turn ``spec.image`` into an image.

    ``None`` means the default image: the newest cached one for this sandlot and agent (apt is
    not asked, so this is fast and works offline), built when there is none. Otherwise
    ``microvm:DIR`` or ``DIR``: a directory with a ``manifest.json`` (see :func:`load_image`).
    """
    if image is None:
        return find_cached_image(cache_dir) or build_image(cache_dir)
    return load_image(Path(image.removeprefix("microvm:")))
