"""Root filesystems of local sandboxes: the default skeleton and the image cache.

Every layer this module produces is a directory stored with container-relative ownership (root
is uid 0) and never written after it is published: the backend shows it to each sandbox through
an id-mapped, read-only mount as an overlay lower layer. Layers are built in a temporary
directory and renamed into place, so concurrent builders (several processes, several homes
sharing the cache) never see half a layer; the loser of the race throws its copy away.

- The *default root* is a small skeleton: ``bin``/``lib*``/``sbin`` links into ``/usr`` (the
  host's ``/usr`` is bound read-only on top by the backend), an ``/etc`` generated for the
  sandbox (passwd, group, hosts, hostname, resolv.conf, nsswitch.conf) plus a copy of the few
  host ``/etc`` entries that programs in ``/usr`` need to work (the alternatives links, the
  dynamic loader's cache, the Python and TLS configuration; never a secret), and empty
  ``/tmp``, ``/home``, ``/root``, ``/workspace``, ``/var`` directories. It also holds the
  sandbox's own Python environment, :data:`DEFAULT_VENV`: a virtual environment over the host's
  ``python3`` (seeing its packages) whose ``bin`` is first on ``PATH``. The host's ``/usr`` is
  read-only inside and marked ``EXTERNALLY-MANAGED`` (PEP 668), so without it the first
  ``pip install`` a user types fails; in the venv it installs into the sandbox's writable layer
  and can never reach the host. ``pip`` there is the host's (Debian package ``python3-pip``).
- A *trust layer* (:meth:`RootfsCache.trust_layer`) goes over a sandbox's root when it trusts
  extra CAs (:mod:`sandlot.backends.trust`): the root's bundle with them appended and, in an
  image with Debian's ``/usr/local/share/ca-certificates``, a file for each; for a root without
  Debian's bundle, ``/etc/sandlot/ca-certificates.crt``. Its directories copy the root's own
  (owner, mode: the top layer's decide what the sandbox sees), and it is keyed by the root's key
  and the certificates, so a fork or snapshot keeps it like any lower layer. The default root's
  bundle is a copy of the host's, so it starts with whatever the host trusts; its ``/usr`` is
  the host's, so it gets no per-certificate files.
- An *image* is a directory, a rootfs tarball (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.xz``,
  ``.tar.zst``) or an OCI image layout (``oci:PATH:TAG``, unpacked with ``umoci``). It is
  copied or unpacked once into ``<cache>/local/images/<key>``, keyed by its content.

This module imports only :mod:`sandlot.errors`, :mod:`sandlot.backends.trust` and the standard
library.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.backends import trust
from sandlot.errors import BackendError, BackendUnavailable, InvalidRequest

__all__ = [
    "DEFAULT_ROOT_ENV",
    "DEFAULT_VENV",
    "HOSTNAME",
    "TRUST_KEY_PREFIX",
    "Layer",
    "RootfsCache",
    "Storage",
    "trust_bundle",
]

HOSTNAME = "sandbox"
_SKELETON_VERSION = "2"

TRUST_KEY_PREFIX = "trust:"
"""How the keys of trust layers start (a layer chain's extra CAs are found by it)."""
# Bump when what a trust layer holds changes; part of its key.
_TRUST_VERSION = "1"
_TRUST_DEBIAN = "debian"  # the root's own bundle has them (Debian's layout)
_TRUST_OWN = "own"  # sandlot's bundle has them (trust.OWN_BUNDLE)

DEFAULT_VENV = "/opt/sandlot/venv"
"""The default root's Python environment (the microVM guest image has the same one)."""
DEFAULT_ROOT_ENV: tuple[str, ...] = (
    f"PATH={DEFAULT_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    f"VIRTUAL_ENV={DEFAULT_VENV}",
)
"""What a default-root sandbox's processes get: the venv active, as ``activate`` would make it."""

# The host's pip run by the venv's interpreter installs into the venv (pip skips the PEP 668
# check in a virtual environment). ``pip install --upgrade pip`` replaces this with pip's own.
_PIP_SCRIPT = f"""\
#!{DEFAULT_VENV}/bin/python3
import sys
try:
    from pip._internal.cli.main import main
except ModuleNotFoundError:
    sys.exit("pip is not installed on this host (Debian package python3-pip)")
sys.exit(main())
"""

# Host /etc entries that programs under /usr rely on; copied (not bound) so the sandbox can
# replace them in its own layer. Nothing here holds a secret (no shadow, keys, machine-id).
_HOST_ETC = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates.conf",
    "debian_version",
    "environment",
    "ethertypes",
    "gai.conf",
    "host.conf",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "login.defs",
    "magic",
    "magic.mime",
    "mime.types",
    "networks",
    "os-release",
    "profile",
    "profile.d",
    "protocols",
    "services",
    "shells",
    "ssl/certs",
    "ssl/openssl.cnf",
    "timezone",
)
_HOST_ETC_GLOBS = ("python3*", "perl")

_PASSWD = """\
root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
bin:x:2:2:bin:/bin:/usr/sbin/nologin
sys:x:3:3:sys:/dev:/usr/sbin/nologin
user:x:1000:1000:sandbox user:/home/user:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
_GROUP = """\
root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
users:x:100:
user:x:1000:
nogroup:x:65534:
"""
_HOSTS = f"""\
127.0.0.1\tlocalhost {HOSTNAME}
::1\tlocalhost ip6-localhost ip6-loopback {HOSTNAME}
"""
_NSSWITCH = """\
passwd:    files
group:     files
shadow:    files
hosts:     files dns
networks:  files
protocols: files
services:  files
"""
_RESOLV_NONE = "# sandlot: this sandbox has no outbound network\n"

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.zst", ".tar.zstd", ".tzst")


@dataclass(frozen=True)
class Layer:
    """A read-only root filesystem layer ready to be an overlay lower directory."""

    path: Path
    """The directory holding the files."""
    key: str
    """Its content key."""
    env: list[str] = field(default_factory=list)
    """Environment the image asks for (``NAME=value``), from an OCI image config; for the
    default root (also as the base of a snapshot), :data:`DEFAULT_ROOT_ENV`."""
    default_root: bool = False
    """True for the default skeleton (the host's ``/usr`` goes on top of it)."""

    def __post_init__(self) -> None:
        if self.default_root and not self.env:
            # Here rather than where the skeleton is built, so that a layer chain rebuilt from a
            # snapshot's manifest (which records paths and keys only) gets it too.
            object.__setattr__(self, "env", list(DEFAULT_ROOT_ENV))


@dataclass(frozen=True)
class Storage:
    """How layers are stored for a rootless caller.

    A rootful sandbox sees a layer through an id-mapped mount, so layers keep
    container-relative owners; an unprivileged user can make no id-mapped mount, so for it a
    layer keeps the *host* owners the sandbox's user namespace maps to (container root is the
    caller), and whatever sets owners (unpacking an image) runs as root of such a namespace.
    """

    key: str
    """Names the mapping; its layers live apart (``<cache>/local/<key>``)."""
    wrap: tuple[str, ...]
    """A command prefix that runs a program as root of a user namespace with the mapping."""
    full: bool
    """The mapping has the ids of a rootful sandbox (0..65535), not only root."""


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


class RootfsCache:
    """Builds and finds layers under ``<cache>/local``."""

    def __init__(
        self, cache: Path, *, host_root: Path = Path("/"), storage: Storage | None = None
    ) -> None:
        """Args:
        cache: the shared cache directory (``sandlot.config.cache_dir()``).
        host_root: where the host's ``/etc`` and ``/usr`` are read from (tests use ``/``).
        storage: how a rootless caller stores layers (None: rootful, container-relative).
        """
        self.root = cache / "local" if storage is None else cache / "local" / storage.key
        self.host_root = host_root
        self.storage = storage
        self._wrap: list[str] = list(storage.wrap) if storage is not None else []
        if storage is not None:
            # Rootless layers keep their owners and modes: a set-uid-root file of an image is
            # set-uid to the caller here, so nobody else may reach into this tree.
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.root.chmod(0o700)
        for sub in ("images", "skeletons", "trust", "tmp", "by-file"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._skeleton: Layer | None = None

    # ------------------------------------------------------------------ the default root

    def skeleton(self) -> Layer:
        """The default-root skeleton for this host, built on first use."""
        if self._skeleton is None:
            inputs = self._host_etc_inputs()
            python = self._host_python() or ""
            key = _digest(
                _SKELETON_VERSION, _PASSWD, _GROUP, _HOSTS, _NSSWITCH, _PIP_SCRIPT, python, *inputs
            )[:32]
            dest = self.root / "skeletons" / key
            if not dest.is_dir():
                self._publish(dest, self._build_skeleton)
            self._skeleton = Layer(dest, f"skeleton:{key}", default_root=True)
        return self._skeleton

    def _host_etc_entries(self) -> list[Path]:
        etc = self.host_root / "etc"
        found = [etc / name for name in _HOST_ETC if os.path.lexists(etc / name)]
        for pattern in _HOST_ETC_GLOBS:
            found.extend(sorted(etc.glob(pattern)))
        return found

    def _host_etc_inputs(self) -> list[str]:
        # Every process's first create computes this (hundreds of CA certificate links), so it
        # works on strings: pathlib objects made it take 15 ms.
        out = []
        for top in self._host_etc_entries():
            paths = [str(top)]
            if top.is_dir() and not top.is_symlink():
                paths.extend(_walk_str(str(top)))
            for path in paths:
                st = os.lstat(path)
                link = stat.S_ISLNK(st.st_mode)
                extra = os.readlink(path) if link else str(st.st_size)  # noqa: PTH115 - see above
                out.append(f"{path}:{st.st_mode}:{st.st_mtime_ns}:{extra}")
        return out

    def _host_python(self) -> str | None:
        """The versioned name of the host's ``/usr/bin/python3`` (``python3.11``), if any."""
        try:
            name = (self.host_root / "usr" / "bin" / "python3").resolve(strict=True).name
        except OSError:
            return None
        return name if name.startswith("python3.") else None

    def _build_venv(self, dest: Path) -> None:
        # Written out (PEP 405: a pyvenv.cfg naming the base interpreter's directory, beside the
        # bin/ holding a link to it) rather than by ``python3 -m venv``, which would start the
        # host's interpreter for twenty files and link it by its path under host_root.
        python = self._host_python()
        if python is None:
            return
        venv = dest / DEFAULT_VENV.lstrip("/")
        (venv / "bin").mkdir(parents=True)
        (venv / "lib" / python / "site-packages").mkdir(parents=True)
        (venv / "lib64").symlink_to("lib")
        (venv / "include").mkdir()
        (venv / "pyvenv.cfg").write_text(
            "home = /usr/bin\n"
            "include-system-site-packages = true\n"
            f"version = {python.removeprefix('python')}\n"
        )
        (venv / "bin" / "python3").symlink_to(f"/usr/bin/{python}")
        for link in ("python", python):
            (venv / "bin" / link).symlink_to("python3")
        for name in ("pip", "pip3", f"pip{python.removeprefix('python')}"):
            script = venv / "bin" / name
            script.write_text(_PIP_SCRIPT)
            script.chmod(0o755)
        for top in [dest / "opt" / "sandlot", venv, *_walk(venv)]:
            if top.is_dir() and not top.is_symlink():
                top.chmod(0o755)

    def _build_skeleton(self, dest: Path) -> None:
        host = self.host_root
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            src = host / name
            if src.is_symlink():
                (dest / name).symlink_to(src.readlink())
            elif src.is_dir():
                # Not a merged-/usr host: the backend binds these directories too.
                (dest / name).mkdir()
        for name, mode in (
            ("usr", 0o755),
            ("etc", 0o755),
            ("tmp", 0o1777),
            ("home", 0o755),
            ("home/user", 0o755),
            ("root", 0o700),
            ("workspace", 0o755),
            ("var", 0o755),
            ("var/tmp", 0o1777),
            ("var/log", 0o755),
            ("var/cache", 0o755),
            ("var/lib", 0o755),
            ("run", 0o755),
            ("mnt", 0o755),
            ("opt", 0o755),
            ("srv", 0o755),
            ("proc", 0o555),
            ("sys", 0o555),
            ("dev", 0o755),
            (".sandlot", 0o755),
        ):
            (dest / name).mkdir(exist_ok=True)
            (dest / name).chmod(mode)
        self._build_venv(dest)
        if self.storage is None:
            os.chown(dest / "home" / "user", 1000, 1000)
        elif self.storage.full:
            _run([*self._wrap, "chown", "1000:1000", str(dest / "home" / "user")], "own /home/user")
        etc = dest / "etc"
        for top in self._host_etc_entries():
            rel = top.relative_to(host / "etc")
            target = etc / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if top.is_symlink() or not top.is_dir():
                _copy_entry(top, target)
            else:
                shutil.copytree(top, target, symlinks=True, copy_function=_copy_entry)
        for name, text in (
            ("passwd", _PASSWD),
            ("group", _GROUP),
            ("hosts", _HOSTS),
            ("hostname", HOSTNAME + "\n"),
            ("nsswitch.conf", _NSSWITCH),
            ("resolv.conf", _RESOLV_NONE),
            ("mtab", None),
        ):
            path = etc / name
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if text is None:
                path.symlink_to("../proc/self/mounts")
            else:
                path.write_text(text)
                path.chmod(0o644)
        if self.storage is None:
            # A rootless caller's copies are its own already: root inside.
            _canonical_owner(dest)

    # ------------------------------------------------------------------ extra CAs

    def trust_layer(self, base: Layer, certificates: tuple[str, ...]) -> Layer:
        """The layer that adds ``certificates`` to ``base``'s system trust, built on first use.

        Its key says where the bundle is inside (:func:`trust_bundle`), so a chain of layers
        rebuilt from a snapshot's manifest (paths and keys) still knows it.

        Raises:
            BackendError: ``base``'s files could not be read or the layer not written.
        """
        debian = _is(base.path / _place_in(base.path, trust.DEBIAN_BUNDLE), stat.S_IFREG)
        digest = _digest("trust", _TRUST_VERSION, base.key, *certificates)[:32]
        dest = self.root / "trust" / digest
        if not dest.is_dir():
            self._publish(dest, lambda tmp: self._build_trust(tmp, base, certificates, debian))
        kind = _TRUST_DEBIAN if debian else _TRUST_OWN
        return Layer(dest, f"{TRUST_KEY_PREFIX}{kind}:{digest}")

    def _build_trust(
        self, tmp: Path, base: Layer, certificates: tuple[str, ...], debian: bool
    ) -> None:
        root = base.path
        files: dict[str, bytes] = {}
        if debian:
            bundle = _place_in(root, trust.DEBIAN_BUNDLE)
            files[bundle] = trust.merge_bundle(_read_bytes(root / bundle), certificates)
            # The default root's /usr is the host's, bound over whatever a layer holds there.
            local = _place_in(root, trust.DEBIAN_CA_DIR)
            if not base.default_root and _is(root / local, stat.S_IFDIR):
                for pem in certificates:
                    files[f"{local}/sandlot/{trust.file_name(pem)}"] = pem.encode()
        else:
            start = None
            for candidate in trust.OTHER_BUNDLES:
                found = _place_in(root, candidate)
                if _is(root / found, stat.S_IFREG):
                    start = _read_bytes(root / found)
                    break
            files[_place_in(root, trust.OWN_BUNDLE)] = trust.merge_bundle(start, certificates)
        ancestors = sorted({str(p) for rel in files for p in Path(rel).parents} - {"."})
        existing = [p for p in ancestors if _is(root / p, stat.S_IFDIR)]
        if existing:
            # The directories as the root has them (owners, modes): in an overlay, the top
            # layer holding a directory decides its metadata. Through tar, so that a rootless
            # layer's owners (subordinate ids) are kept as well.
            keep = ["--numeric-owner"]
            if self.storage is not None and not self.storage.full:
                keep = ["--no-same-owner"]
            _pipe(
                [*self._wrap, "tar", "-C", str(root), "-c", "--no-recursion", "-f", "-", *existing],
                [*self._wrap, "tar", "-C", str(tmp), "-x", "-p", *keep, "-f", "-"],
                "copy the root's certificate directories",
            )
        for rel, data in sorted(files.items()):
            path = tmp / rel
            # Only directories are in tmp (copied ones are real directories), so no symlink
            # can take this write outside the layer.
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            path.write_bytes(data)
            path.chmod(0o644)

    # ------------------------------------------------------------------ images

    def image(self, ref: str) -> Layer:
        """The layer for ``spec.image``: unpacked into the cache on first use.

        Raises:
            InvalidRequest: ``ref`` names nothing usable.
            BackendUnavailable: a tool the format needs (``umoci``, ``zstd``) is missing.
        """
        if ref.startswith("oci:"):
            return self._oci(ref)
        path = Path(ref).expanduser()
        if not path.is_absolute():
            msg = f"spec.image must be an absolute path or oci:PATH:TAG, got {ref!r}"
            raise InvalidRequest(msg)
        if path.is_dir():
            return self._directory(path)
        if path.is_file():
            if not path.name.endswith(_TAR_SUFFIXES):
                msg = f"spec.image {ref!r} is a file but not a tarball ({', '.join(_TAR_SUFFIXES)})"
                raise InvalidRequest(msg)
            return self._tarball(path)
        msg = f"spec.image {ref!r} does not exist"
        raise InvalidRequest(msg)

    def _directory(self, path: Path) -> Layer:
        # Keyed by a walk of names, owners, modes, sizes and mtimes: cheap next to copying, and
        # a changed directory gets a new layer instead of corrupting running sandboxes.
        h = hashlib.sha256(b"dir\0")
        for entry in [path, *_walk(path)]:
            st = entry.lstat()
            extra = str(entry.readlink()) if entry.is_symlink() else ""
            h.update(
                f"{entry.relative_to(path)}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0"
                f"{st.st_size}\0{st.st_mtime_ns}\0{extra}\n".encode(errors="surrogateescape")
            )
        key = h.hexdigest()[:32]
        dest = self.root / "images" / key

        def build(tmp: Path) -> None:
            if self.storage is None:
                tmp.rmdir()
                _run(["cp", "-a", "--reflink=auto", str(path), str(tmp)], f"copy {path}")
                return
            # Rootless: read as the caller (host owners recorded as they are, as a rootful
            # copy keeps them), write as root of the sandboxes' namespace so that those owners
            # become container ids; no device node can be made there (a sandbox's /dev is a
            # tmpfs of its own anyway), and with a single id there are no owners to keep.
            keep = "--numeric-owner" if self.storage.full else "--no-same-owner"
            _pipe(
                [
                    "tar",
                    "-C",
                    str(path),
                    "-c",
                    "--numeric-owner",
                    "--exclude=./dev/*",
                    "-f",
                    "-",
                    ".",
                ],
                [*self._wrap, "tar", "-C", str(tmp), "-x", "-p", keep, "-f", "-"],
                f"copy {path}",
            )

        if not dest.is_dir():
            self._publish(dest, build)
        return Layer(dest, f"dir:{key}")

    def _tarball(self, path: Path) -> Layer:
        st = path.stat()
        file_key = _digest("file", str(path.resolve()), str(st.st_size), str(st.st_mtime_ns))
        pointer = self.root / "by-file" / file_key
        try:
            key = pointer.read_text().strip()
        except FileNotFoundError:
            h = hashlib.sha256(b"tar\0")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            key = h.hexdigest()[:32]
            _write_atomic(pointer, key)
        dest = self.root / "images" / key
        if not dest.is_dir():
            name = path.name
            argv = [*self._wrap, "tar", "-x", "--numeric-owner", "-p", "-f", str(path)]
            if self.storage is not None:
                # No device node can be made in a user namespace, and a sandbox's /dev is a
                # tmpfs of its own anyway; with one id there are no owners to keep.
                argv += ["--exclude=./dev/*", "--exclude=dev/*"]
                if not self.storage.full:
                    argv.append("--no-same-owner")
            if name.endswith((".tar.zst", ".tar.zstd", ".tzst")):
                if shutil.which("zstd") is None:
                    msg = "unpacking a .tar.zst image needs zstd (Debian package zstd)"
                    raise BackendUnavailable(msg)
                argv.insert(len(self._wrap) + 2, "--zstd")

            def build(tmp: Path) -> None:
                _run([*argv, "-C", str(tmp)], f"unpack {path}")

            self._publish(dest, build)
        return Layer(dest, f"tar:{key}")

    def _oci(self, ref: str) -> Layer:
        body = ref[len("oci:") :]
        layout, sep, tag = body.rpartition(":")
        if not sep or not layout or not tag:
            msg = f"spec.image {ref!r} must look like oci:PATH:TAG"
            raise InvalidRequest(msg)
        index_path = Path(layout) / "index.json"
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as e:
            msg = f"spec.image {ref!r}: {index_path} is not an OCI image index ({e})"
            raise InvalidRequest(msg) from e
        digest = None
        for m in index.get("manifests", []):
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
                digest = m.get("digest")
        if not isinstance(digest, str):
            msg = f"spec.image {ref!r}: no tag {tag!r} in {index_path}"
            raise InvalidRequest(msg)
        key = _digest("oci", digest)[:32]
        dest = self.root / "images" / key
        env_file = self.root / "images" / f"{key}.env.json"
        if not dest.is_dir():
            if shutil.which("umoci") is None:
                msg = "OCI image layouts need umoci (Debian package umoci)"
                raise BackendUnavailable(msg)
            env_holder: list[list[str]] = []

            def build(tmp: Path) -> None:
                bundle = tmp.parent / (tmp.name + ".bundle")
                try:
                    rootless = ["--rootless"] if self.storage and not self.storage.full else []
                    _run(
                        [
                            *self._wrap,
                            "umoci",
                            "unpack",
                            *rootless,
                            "--image",
                            f"{layout}:{tag}",
                            str(bundle),
                        ],
                        f"unpack {ref}",
                    )
                    config = json.loads((bundle / "config.json").read_text())
                    env_holder.append(list(config.get("process", {}).get("env", [])))
                    tmp.rmdir()
                    (bundle / "rootfs").rename(tmp)
                finally:
                    shutil.rmtree(bundle, ignore_errors=True)

            self._publish(dest, build)
            if env_holder:
                _write_atomic(env_file, json.dumps(env_holder[0]))
        env: list[str] = []
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(env_file.read_text())
            env = [e for e in loaded if isinstance(e, str)]
        return Layer(dest, f"oci:{key}", env=env)

    # ------------------------------------------------------------------ helpers

    def _publish(self, dest: Path, build: object) -> None:
        assert callable(build)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=self.root / "tmp"))
        try:
            build(tmp)
            if self.storage is not None and tmp.lstat().st_uid != os.geteuid():
                # Rootless: unpacking gave the top directory the image's owner (one of our
                # subordinate ids), and we could not even move it into place.
                _run(
                    [*self._wrap, "sh", "-c", 'chown 0:0 "$1" && chmod 0755 "$1"', "sh", str(tmp)],
                    "own the image's top directory",
                )
            else:
                tmp.chmod(0o755)
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def trust_bundle(keys: list[str]) -> str | None:
    """Where, inside a sandbox on layers with these keys, the bundle with its extra CAs is
    (None: it has none)."""
    for key in keys:
        kind, _, _ = key.removeprefix(TRUST_KEY_PREFIX).partition(":")
        if key.startswith(TRUST_KEY_PREFIX):
            return trust.DEBIAN_BUNDLE if kind == _TRUST_DEBIAN else trust.OWN_BUNDLE
    return None


def _place_in(root: Path, path: str) -> str:
    """Where ``path`` is, or would be made, in the tree at ``root``, relative to it: its
    symlinks followed as they would be inside (an absolute target starts again at ``root``,
    ``..`` stops there), so that nothing written there can land outside ``root``. A symlink
    loop leaves the path as it is (writing there then fails on the loop)."""
    todo = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    missing = False
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        if not missing:
            here = root.joinpath(*done, part)
            try:
                st = here.lstat()
            except OSError:
                missing = True  # nothing below can be a symlink
            else:
                if stat.S_ISLNK(st.st_mode) and hops < 40:  # 40: the kernel's loop limit
                    hops += 1
                    target = str(here.readlink())
                    if target.startswith("/"):
                        done = []
                    todo = [p for p in target.split("/") if p] + todo
                    continue
        done.append(part)
    return "/".join(done)


def _is(path: Path, kind: int) -> bool:
    """Whether ``path`` is itself (not through a symlink) a file of ``kind`` (``S_IFREG``…)."""
    try:
        return stat.S_IFMT(path.lstat().st_mode) == kind
    except OSError:
        return False


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        msg = f"cannot read {path} to add CA certificates to it: {e.strerror or e}"
        raise BackendError(msg) from e


def _walk(top: Path) -> list[Path]:
    return [Path(p) for p in _walk_str(str(top))]


def _walk_str(top: str) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        out.extend(f"{dirpath}/{d}" for d in dirnames)
        out.extend(f"{dirpath}/{f}" for f in sorted(filenames))
    return out


def _copy_entry(src: str | Path, dst: str | Path) -> None:
    src, dst = Path(src), Path(dst)
    if src.is_symlink():
        dst.symlink_to(src.readlink())
    elif src.is_file():
        shutil.copy2(src, dst)
    # Sockets, fifos and devices have no place in a generated /etc.


def _canonical_owner(top: Path) -> None:
    # The skeleton's files are host-root owned copies; a layer stores container-relative
    # owners, and root is 0 on both sides, so only non-root owners would need a shift.
    os.lchown(top, 0, 0)
    for path in _walk(top):
        st = path.lstat()
        if st.st_uid not in (0, 1000):
            os.lchown(path, 0, 0)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _pipe(reader: list[str], writer: list[str], what: str) -> None:
    """``reader | writer``, failing with the stderr of whichever failed."""
    try:
        with subprocess.Popen(reader, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as src:
            assert src.stdout is not None
            dst = subprocess.run(writer, stdin=src.stdout, capture_output=True, check=False)
            src.stdout.close()
            err = src.stderr.read() if src.stderr else b""
            src.wait()
    except FileNotFoundError as e:
        msg = f"cannot {what}: {e.filename} is missing"
        raise BackendUnavailable(msg) from e
    for rc, out in ((src.returncode, err), (dst.returncode, dst.stderr)):
        if rc != 0:
            detail = out.decode(errors="replace").strip()[-2000:] or f"exit {rc}"
            msg = f"cannot {what}: {detail}"
            raise BackendError(msg)


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, check=False)
    except FileNotFoundError as e:
        msg = f"cannot {what}: {argv[0]} is missing"
        raise BackendUnavailable(msg) from e
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-2000:]
        msg = f"cannot {what}: {err or f'{argv[0]} exited {proc.returncode}'}"
        raise BackendError(msg)
