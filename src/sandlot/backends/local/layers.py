"""Snapshot layers: capture a sandbox's writable layer, check it, and use it as a lower layer.

A snapshot is a directory ``<state>/.snapshots/<id>/`` holding

- ``layer/``: the sandbox's overlay upper directory as it was, with owners shifted from the
  sandbox's host uid range back to container-relative ids (so any sandbox can use it through
  its own id-mapped mount), overlay whiteouts and opaque markers kept;
- ``manifest.json``: every entry's type, mode, owner, size and SHA-256 (or link target or
  device number), the lower layers it sits on, and the spec of the sandbox it came from;
- ``manifest.sha256``: the digest of ``manifest.json`` (also carried in the snapshot ref).

:func:`verify` re-walks the layer and fails with a message naming the first difference, so a
corrupted or tampered snapshot is never booted. Layers are immutable once written: restoring and
forking mount them read-only as overlay lower layers, which is what makes both O(1) in the
snapshot's size. This module imports only :mod:`sandlot.errors` and the standard library.
"""

# This module walks every file of a layer with os.walk's string paths and os.* calls; building
# a pathlib object per entry would only add cost in the loop that bounds snapshot and restore.
# ruff: noqa: PTH101, PTH102, PTH115, PTH118, PTH211

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import BackendError

__all__ = [
    "IdRanges",
    "Manifest",
    "UpperManifest",
    "capture",
    "describe_upper",
    "manifest_digest",
    "read_manifest",
    "verify",
]

_FORMAT = 1
_NOBODY = 65534
# Overlay's own bookkeeping on upper entries; only the opaque marker means something once the
# layer is a lower layer, the rest would point at inodes of another mount. An overlay mounted
# by root keeps it in ``trusted.``; one mounted in a user namespace (rootless) in ``user.``.
_OPAQUE = "overlay.opaque"

IdRanges = Sequence[tuple[int, int, int]]
"""An id map as ``(first id inside, first id on the host, count)`` ranges."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """A parsed, digest-checked manifest."""

    entries: list[dict[str, object]]
    base: list[dict[str, object]]
    spec: dict[str, object]
    sandbox_id: str


def _xattrs(path: str, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    name = f"{prefix}.{_OPAQUE}"
    with contextlib.suppress(OSError):
        out[name] = os.getxattr(path, name, follow_symlinks=False).decode(errors="replace")
    return out


def _shift(uid: int, base: int, size: int) -> int:
    return uid - base if base <= uid < base + size else _NOBODY


def _shift_ranges(host_id: int, ranges: IdRanges) -> int:
    for inside, outside, count in ranges:
        if outside <= host_id < outside + count:
            return inside + host_id - outside
    return _NOBODY


class _Shifter:
    """Host ids to container-relative ones: one contiguous range, or explicit ranges."""

    def __init__(
        self,
        uid_base: int,
        uid_size: int,
        uid_ranges: IdRanges | None,
        gid_ranges: IdRanges | None,
    ) -> None:
        self._base, self._size = uid_base, uid_size
        self._uids, self._gids = uid_ranges, gid_ranges

    def uid(self, host: int) -> int:
        if self._uids is not None:
            return _shift_ranges(host, self._uids)
        return _shift(host, self._base, self._size)

    def gid(self, host: int) -> int:
        if self._gids is not None:
            return _shift_ranges(host, self._gids)
        return _shift(host, self._base, self._size)


def _hash_copy(src: str, dst: str | None) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    # The walk saw a regular file; open exactly that (no symlink, no FIFO swapped in since),
    # so a sandbox process that outlived the freeze cannot make us copy a host file.
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{src} is no longer a regular file")
    with open(fd, "rb") as fin:
        fout = open(dst, "wb") if dst is not None else None  # noqa: SIM115 - optional target
        try:
            while chunk := fin.read(_CHUNK):
                h.update(chunk)
                n += len(chunk)
                if fout is not None:
                    fout.write(chunk)
        finally:
            if fout is not None:
                fout.close()
    return h.hexdigest(), n


def _describe(
    path: str, rel: str, st: os.stat_result, *, uid: int, gid: int, xattr_prefix: str
) -> dict[str, object]:
    mode = st.st_mode
    entry: dict[str, object] = {
        "path": rel,
        "mode": stat.S_IMODE(mode),
        "uid": uid,
        "gid": gid,
    }
    if stat.S_ISDIR(mode):
        entry["type"] = "d"
    elif stat.S_ISLNK(mode):
        entry["type"] = "l"
        entry["target"] = os.readlink(path)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        entry["type"] = "c" if stat.S_ISCHR(mode) else "b"
        entry["rdev"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    elif stat.S_ISFIFO(mode):
        entry["type"] = "p"
    elif stat.S_ISREG(mode):
        entry["type"] = "f"
    else:
        entry["type"] = "s"
    xattrs = _xattrs(path, xattr_prefix)
    if xattrs:
        entry["xattrs"] = xattrs
    return entry


def _raise_denied(err: OSError) -> None:
    # os.walk skips a directory it cannot list; for a digest or a copy that would be a silent
    # hole (a rootless caller cannot list what the sandbox made private to another uid).
    if isinstance(err, PermissionError):
        raise err


def _walk(top: str) -> list[tuple[str, str]]:
    """(absolute, relative) for every entry below ``top``, parents before children, sorted."""
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(top, onerror=_raise_denied):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, top)
        for name in [*dirnames, *sorted(filenames)]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            out.append((os.path.join(dirpath, name), rel))
    return out


def capture(
    upper: Path,
    dest: Path,
    *,
    uid_base: int,
    uid_size: int,
    base: Sequence[Mapping[str, object]],
    spec: Mapping[str, object],
    sandbox_id: str,
    xattr_prefix: str = "trusted",
) -> tuple[str, int]:
    """Copy ``upper`` into ``dest/layer`` with shifted owners and write the manifest.

    Returns the manifest's SHA-256 and the layer's size in bytes. ``dest`` must not exist.
    ``xattr_prefix``: the namespace of the overlay's markers (``user`` for an overlay mounted
    in a user namespace).
    """
    layer = dest / "layer"
    layer.mkdir(parents=True)
    entries: list[dict[str, object]] = []
    total = 0
    dirs: list[tuple[str, os.stat_result]] = []
    ust = os.lstat(upper)
    os.chmod(layer, stat.S_IMODE(ust.st_mode))
    root_uid, root_gid = (
        _shift(ust.st_uid, uid_base, uid_size),
        _shift(ust.st_gid, uid_base, uid_size),
    )
    os.chown(layer, root_uid, root_gid)
    for src, rel in _walk(str(upper)):
        st = os.lstat(src)
        dst = os.path.join(layer, rel)
        uid, gid = _shift(st.st_uid, uid_base, uid_size), _shift(st.st_gid, uid_base, uid_size)
        entry = _describe(src, rel, st, uid=uid, gid=gid, xattr_prefix=xattr_prefix)
        kind = entry["type"]
        if kind == "d":
            os.mkdir(dst, 0o700)
            dirs.append((dst, st))
        elif kind == "l":
            os.symlink(str(entry["target"]), dst)
        elif kind in ("c", "b", "p"):
            os.mknod(dst, st.st_mode, st.st_rdev)
        elif kind == "f":
            digest, n = _hash_copy(src, dst)
            entry["sha256"] = digest
            entry["size"] = n
            total += n
        else:
            continue  # sockets do not survive a snapshot (nothing listens on them any more)
        for name, value in dict(entry.get("xattrs", {})).items():  # type: ignore[call-overload]
            os.setxattr(dst, name, str(value).encode(), follow_symlinks=False)
        os.lchown(dst, uid, gid)
        if kind != "l":
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        entries.append(entry)
    # Directory times last: creating their children changed them.
    for dst, st in reversed(dirs):
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    doc = {
        "format": _FORMAT,
        "sandbox_id": sandbox_id,
        "root": {"mode": stat.S_IMODE(ust.st_mode), "uid": root_uid, "gid": root_gid},
        "base": [dict(b) for b in base],
        "spec": dict(spec),
        "entries": entries,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(raw).hexdigest()
    (dest / "manifest.json").write_bytes(raw)
    (dest / "manifest.sha256").write_text(digest + "\n")
    return digest, total


@dataclass(frozen=True)
class UpperManifest:
    """What a live writable layer holds, owners shifted to container-relative ids."""

    digest: str
    """SHA-256 of the canonical entry list (independent of the sandbox's host uid range and of
    timestamps, so the same content always gives the same digest)."""
    entries: list[dict[str, object]]
    """Every entry as in a snapshot manifest (type, mode, owner, size and SHA-256, ...)."""


def describe_upper(
    upper: Path,
    *,
    uid_base: int,
    uid_size: int,
    uid_ranges: IdRanges | None = None,
    gid_ranges: IdRanges | None = None,
    xattr_prefix: str = "trusted",
) -> UpperManifest:
    """Describe a sandbox's overlay upper directory for verification.

    The walk is the same one a snapshot manifest uses; a reset sandbox's upper directory holds
    a handful of entries, so this costs well under a millisecond there. Host owners are shifted
    by ``uid_base``/``uid_size`` (one range for both), or by ``uid_ranges`` and ``gid_ranges``
    when given (a rootless sandbox: the caller, then its subordinate ids).

    Raises:
        PermissionError: an entry is unreadable by this process (a rootless caller outside the
            sandbox's user namespace).
    """
    shifter = _Shifter(uid_base, uid_size, uid_ranges, gid_ranges)
    entries: list[dict[str, object]] = []
    for src, rel in _walk(str(upper)):
        st = os.lstat(src)
        uid, gid = shifter.uid(st.st_uid), shifter.gid(st.st_gid)
        entry = _describe(src, rel, st, uid=uid, gid=gid, xattr_prefix=xattr_prefix)
        if entry["type"] == "f":
            entry["sha256"], entry["size"] = _hash_copy(src, None)
        entries.append(entry)
    raw = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return UpperManifest(hashlib.sha256(raw).hexdigest(), entries)


def manifest_digest(snapshot_dir: Path) -> str:
    """The recorded digest of a snapshot's manifest."""
    return (snapshot_dir / "manifest.sha256").read_text().strip()


def verify(
    snapshot_dir: Path, expected_digest: str | None = None, *, xattr_prefix: str = "trusted"
) -> Manifest:
    """Check a snapshot against its manifest; the parsed manifest.

    Raises:
        BackendError: something is missing, extra or different (the message names it).
    """
    name = snapshot_dir.name
    manifest = read_manifest(snapshot_dir, expected_digest)
    layer = snapshot_dir / "layer"
    expected = {str(e["path"]): e for e in manifest.entries}
    seen: set[str] = set()
    for src, rel in _walk(str(layer)):
        want = expected.get(rel)
        if want is None:
            msg = f"snapshot {name} is corrupt: unexpected file {rel}"
            raise BackendError(msg)
        seen.add(rel)
        st = os.lstat(src)
        got = _describe(src, rel, st, uid=st.st_uid, gid=st.st_gid, xattr_prefix=xattr_prefix)
        if got["type"] == "f":
            got["sha256"], got["size"] = _hash_copy(src, None)
        for key in ("type", "mode", "uid", "gid", "target", "rdev", "sha256", "size", "xattrs"):
            if got.get(key) != want.get(key):
                what = "content" if key in ("sha256", "size") else key
                msg = f"snapshot {name} is corrupt: {rel} has a different {what}"
                raise BackendError(msg)
    missing = sorted(set(expected) - seen)
    if missing:
        msg = f"snapshot {name} is corrupt: {missing[0]} is missing"
        raise BackendError(msg)
    return manifest


def read_manifest(snapshot_dir: Path, expected_digest: str | None = None) -> Manifest:
    """A snapshot's manifest, checked against its recorded digest (not the files: see
    :func:`verify`).

    Raises:
        BackendError: the manifest is missing, unreadable or does not match its digest.
    """
    name = snapshot_dir.name
    try:
        raw = (snapshot_dir / "manifest.json").read_bytes()
        recorded = manifest_digest(snapshot_dir)
    except OSError as e:
        msg = f"snapshot {name} is incomplete: {e}"
        raise BackendError(msg) from e
    digest = hashlib.sha256(raw).hexdigest()
    if digest != recorded or (expected_digest is not None and digest != expected_digest):
        msg = f"snapshot {name} is corrupt: its manifest does not match its checksum"
        raise BackendError(msg)
    doc = json.loads(raw)
    if doc.get("format") != _FORMAT:
        msg = f"snapshot {name} has an unknown format {doc.get('format')!r}"
        raise BackendError(msg)
    return Manifest(
        entries=list(doc["entries"]),
        base=list(doc["base"]),
        spec=dict(doc["spec"]),
        sandbox_id=str(doc["sandbox_id"]),
    )
