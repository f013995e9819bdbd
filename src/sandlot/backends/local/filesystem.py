"""A ``local`` sandbox's files on the host: its directory, record, layers and root mount.

A new sandbox gets ``<state_dir>/<sandbox_id>/`` with its record (``meta.json``), a host uid
range (as root, :mod:`.ids`) and a writable layer (``layer/upper`` and ``layer/work``; for
``disk_mb``, a loop-mounted ext4 image of that size) over read-only lower layers from the
root filesystem cache (:mod:`.rootfs`): its image or the default skeleton, under the trust
layer of extra CAs. As root the overlay is mounted on the host through id-mapped mounts, with
the host's ``/usr`` bound read-only for a default root; rootless, the helper of
:mod:`.userns_helper` mounts it in the namespace the runtime starts in. This module must not
import the store, the Manager or front ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

from sandlot.backends.local import layers, rootless
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.backends.local.mounts import bind_idmapped, is_mountpoint, mount_overlay, umount_tree
from sandlot.backends.local.rootfs import Layer
from sandlot.backends.local.rootless import IdMap
from sandlot.backends.local.state import LocalState, Meta
from sandlot.errors import BackendError, BackendUnavailable
from sandlot.models import SandboxSpec


class Filesystem(LocalState):
    """Making and mounting a sandbox's files (see the module docstring)."""

    def _base_layer(self, spec: SandboxSpec) -> Layer:
        cache = self._cache()
        return cache.image(spec.image) if spec.image else cache.skeleton()

    def _lowers(self, spec: SandboxSpec, certificates: tuple[str, ...]) -> list[Layer]:
        """The layers a new sandbox of ``spec`` sits on, top first: the trust layer of its
        extra CAs (:func:`trust.certificates_for`), if any, over its root."""
        base = self._base_layer(spec)
        if not certificates:
            return [base]
        return [self._cache().trust_layer(base, certificates), base]

    def _provision(
        self,
        d: Path,
        sandbox_id: str,
        container: str,
        runtime: str,
        spec: SandboxSpec,
        lowers: list[Layer],
    ) -> Meta:
        # Rootless: the sandbox's ids are the caller's own (and its subordinate range).
        base = self._uids.allocate(self.state_dir, container) if self._idmap is None else None
        try:
            d.mkdir(mode=0o711)
        except BaseException:
            if base is not None:
                self._uids.release(base)
            raise
        meta = Meta(
            sandbox_id=sandbox_id,
            container=container,
            runtime=runtime,
            uid_base=base,
            layers=[{"path": str(lay.path), "key": lay.key} for lay in lowers],
            spec=spec.model_dump(mode="json"),
            default_root=lowers[-1].default_root,
            image_env=list(lowers[-1].env),
            disk_mb=spec.resources.disk_mb,
            net_key=sandbox_id if self._networks is not None else None,
            idmap=dict(self._idmap.to_json()) if self._idmap is not None else None,
        )
        try:
            meta.save(d / "meta.json")
            for sub in ("layer", "logs"):
                (d / sub).mkdir(mode=0o711 if sub != "logs" else 0o700)
            self._make_layer(d, meta)
        except BaseException:
            if base is not None:
                self._uids.release(base)
            raise
        return meta

    def _make_layer(self, d: Path, meta: Meta) -> None:
        layer = d / "layer"
        if meta.disk_mb is not None:
            img = d / "layer.img"
            if not img.exists():
                with open(img, "wb") as f:
                    f.truncate(meta.disk_mb << 20)
                owner = meta.uid_base or 0
                _check_run(
                    [
                        "mkfs.ext4",
                        "-q",
                        "-F",
                        "-m",
                        "0",
                        "-E",
                        f"root_owner={owner}:{owner}",
                        str(img),
                    ],
                    "make the size-limited writable layer (Debian package e2fsprogs)",
                )
            if not is_mountpoint(layer):
                _check_run(
                    ["mount", "-o", "loop,nosuid,nodev", str(img), str(layer)],
                    "mount the size-limited writable layer",
                )
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(layer / "lost+found")
        uid = meta.uid_base or 0
        for sub in ("upper", "work"):
            p = layer / sub
            p.mkdir(exist_ok=True, mode=0o755)
            if meta.idmap is None:
                os.chown(p, uid, uid)
        if meta.idmap is None:
            # Rootless: the caller made them, and the caller is the sandbox's root.
            os.chown(layer, uid, uid)

    def _mount(self, d: Path, meta: Meta) -> None:
        rootfs = self._mnt(meta.container) / "rootfs"
        try:
            rootfs.mkdir(parents=True, mode=0o711)
            fresh = True
        except FileExistsError:
            fresh = False
        if meta.idmap is not None:
            # Rootless: the helper mounts the overlay in the namespace the runtime starts in.
            self._make_layer(d, meta)
            self._lower_paths(meta)
            return
        # A directory made just now has nothing mounted on it: the mount table (hundreds of
        # lines while many sandboxes run, read in full) is consulted only for an older one.
        if not fresh and is_mountpoint(rootfs):
            return
        self._make_layer(d, meta)
        userns = self._userns.fd(meta.uid_base, RANGE_SIZE) if meta.uid_base is not None else None
        lowers = self._lower_paths(meta)
        mount_overlay(rootfs, lowers, d / "layer" / "upper", d / "layer" / "work", userns)
        try:
            if meta.default_root:
                bind_idmapped(Path("/usr"), rootfs / "usr", userns, readonly=True)
            self._ensure_workdir(rootfs, meta)
        except BaseException:
            umount_tree(rootfs)
            raise

    def _lower_paths(self, meta: Meta) -> list[Path]:
        lowers = [Path(str(lay["path"])) for lay in meta.layers]
        for lower in lowers:
            if not lower.is_dir():
                msg = f"sandbox {meta.sandbox_id}: its layer {lower} is gone"
                raise BackendError(msg)
        return lowers

    def _rootless_wrapper(self, d: Path, meta: Meta) -> list[str]:
        """The helper command line that mounts the sandbox's root and then runs the runtime."""
        assert meta.idmap is not None
        idmap = IdMap.from_json(meta.idmap)
        return rootless.helper_argv(
            idmap,
            overlay=str(self._mnt(meta.container) / "rootfs"),
            lower=[str(p) for p in self._lower_paths(meta)],
            upper=str(d / "layer" / "upper"),
            work=str(d / "layer" / "work"),
            workdir=str(meta.spec.get("workdir") or "/workspace"),
        )

    def _ensure_workdir(self, rootfs: Path, meta: Meta) -> None:
        workdir = str(meta.spec.get("workdir") or "/workspace")
        uid = meta.uid_base or 0
        path = rootfs
        for part in Path(workdir).parts[1:]:
            path = path / part
            try:
                st = path.lstat()
            except FileNotFoundError:
                path.mkdir(mode=0o755)
                os.lchown(path, uid, uid)
                continue
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                # A symlink here could lead the host outside; the agent makes it from inside.
                return

    def _describe_upper(self, d: Path, meta: Meta) -> layers.UpperManifest:
        upper = d / "layer" / "upper"
        if meta.idmap is not None:
            idmap = IdMap.from_json(meta.idmap)
            try:
                return layers.describe_upper(
                    upper,
                    uid_base=0,
                    uid_size=0,
                    uid_ranges=idmap.uid_ranges(),
                    gid_ranges=idmap.gid_ranges(),
                    xattr_prefix="user",
                )
            except PermissionError:
                # Files the sandbox kept from its root (another uid's, or mode 000): read them
                # as root of a namespace with the sandbox's ids.
                doc = rootless.run_op(idmap, "describe", {"upper": str(upper)})
                entries = doc.get("entries")
                return layers.UpperManifest(
                    str(doc.get("digest")),
                    [e for e in entries if isinstance(e, dict)]
                    if isinstance(entries, list)
                    else [],
                )
        return layers.describe_upper(
            upper,
            uid_base=meta.uid_base or 0,
            uid_size=RANGE_SIZE if meta.uid_base is not None else 1 << 32,
        )


def _check_run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, check=False)
    except FileNotFoundError as e:
        msg = f"cannot {what}: {argv[0]} is missing"
        raise BackendUnavailable(msg) from e
    if proc.returncode != 0:
        msg = f"cannot {what}: {proc.stderr.decode(errors='replace').strip()}"
        raise BackendError(msg)
