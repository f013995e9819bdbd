"""Snapshots of ``local`` sandboxes: capture, restore, fork and deletion.

A snapshot is the sandbox's writable layer, captured while the sandbox is frozen (the freezer
cgroup, or ``SIGSTOP`` rootless), kept under ``<state_dir>/.snapshots/<id>/`` with a manifest
(:mod:`.layers`) naming the lower layers it sits on. Restoring or forking re-hashes it against
that manifest first. A deleted snapshot that sandboxes still mount is only marked deleted,
and goes with the last of them. This module must not import the store, the Manager or front
ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

import anyio
import anyio.to_thread

from sandlot.backends.base import SnapshotRef
from sandlot.backends.local import layers, rootless
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.backends.local.mounts import is_mountpoint, umount_tree
from sandlot.backends.local.rootfs import Layer
from sandlot.backends.local.rootless import IdMap
from sandlot.backends.local.runtime import process_alive
from sandlot.backends.local.state import VALID_ID, LocalState, Meta
from sandlot.errors import BackendError, InvalidRequest, NotFound, SandboxError
from sandlot.models import SandboxSpec


class Snapshots(LocalState):
    """Capturing, restoring, forking and deleting snapshots (see the module docstring)."""

    def _snapshot_dir(self, snapshot_id: str) -> Path:
        if not VALID_ID.match(snapshot_id):
            msg = f"snapshot id {snapshot_id!r} must be 1-63 letters, digits, '.', '_' or '-'"
            raise InvalidRequest(msg)
        return self.state_dir / ".snapshots" / snapshot_id

    async def snapshot(self, ref: str, snapshot_id: str) -> SnapshotRef:
        """Capture the writable layer (the sandbox is frozen meanwhile) plus the spec."""
        dest = self._snapshot_dir(snapshot_id)
        async with self._alock(ref):
            d, meta = self._meta(ref)
            if dest.exists():
                msg = f"snapshot {snapshot_id} already exists"
                raise InvalidRequest(msg)
            rt = self._runtimes[meta.runtime]
            running = meta.init is not None and process_alive(meta.init[0], meta.init[1])
            upper = d / "layer" / "upper"
            mounted_here = False
            if not running and meta.disk_mb is not None and not is_mountpoint(d / "layer"):
                await anyio.to_thread.run_sync(self._make_layer, d, meta)
                mounted_here = True
            tmp = dest.with_name(f".{snapshot_id}.tmp-{secrets.token_hex(4)}")
            stopped: list[int] = []
            if running and meta.idmap is not None:
                # No freezer cgroup without root: stop every process instead.
                assert meta.init is not None
                init = meta.init[0]
                stopped = await anyio.to_thread.run_sync(lambda: rootless.freeze(init))
            elif running:
                await rt.pause(meta.container)
            try:
                digest, size = await anyio.to_thread.run_sync(
                    lambda: self._capture(meta, upper, tmp)
                )
                tmp.rename(dest)
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(self._wipe_dir, tmp)
                raise
            finally:
                if stopped:
                    rootless.thaw(stopped)
                elif running:
                    await rt.resume(meta.container)
                if mounted_here:
                    await anyio.to_thread.run_sync(umount_tree, d / "layer")
        return SnapshotRef(
            ref=snapshot_id,
            size_bytes=size,
            metadata={"manifest_sha256": digest, "layers": len(meta.layers) + 1},
        )

    def _capture(self, meta: Meta, upper: Path, tmp: Path) -> tuple[str, int]:
        if meta.idmap is not None:
            # Read (and own the copies) as root of a namespace with the sandbox's ids: the
            # layer keeps the host owners that rootless layers are stored with.
            doc = rootless.run_op(
                IdMap.from_json(meta.idmap),
                "capture",
                {
                    "upper": str(upper),
                    "dest": str(tmp),
                    "base": list(meta.layers),
                    "spec": dict(meta.spec),
                    "sandbox_id": meta.sandbox_id,
                },
            )
            size = doc.get("size")
            return str(doc.get("digest")), size if isinstance(size, int) else 0
        return layers.capture(
            upper,
            tmp,
            uid_base=meta.uid_base or 0,
            uid_size=RANGE_SIZE if meta.uid_base is not None else 1 << 32,
            base=list(meta.layers),
            spec=dict(meta.spec),
            sandbox_id=meta.sandbox_id,
        )

    def _verify_snapshot(self, sdir: Path, digest: str | None = None) -> layers.Manifest:
        if self._idmap is not None:
            rootless.run_op(self._idmap, "verify", {"snapshot": str(sdir), "digest": digest})
            return layers.read_manifest(sdir, digest)
        return layers.verify(sdir, digest)

    def _snapshot_layers(self, snapshot: SnapshotRef) -> tuple[list[Layer], layers.Manifest]:
        sdir = self._snapshot_dir(snapshot.ref)
        if not sdir.is_dir() or (sdir / "deleted").exists():
            msg = f"snapshot {snapshot.ref} does not exist on this host"
            raise NotFound(msg)
        digest = snapshot.metadata.get("manifest_sha256")
        manifest = self._verify_snapshot(sdir, digest if isinstance(digest, str) else None)
        chain = [Layer(sdir / "layer", f"snapshot:{snapshot.ref}")]
        for i, lay in enumerate(manifest.base):
            path = Path(str(lay["path"]))
            if not path.is_dir():
                msg = f"snapshot {snapshot.ref}: the layer it sits on ({lay.get('key')}) is gone"
                raise BackendError(msg)
            default_root = i == len(manifest.base) - 1 and str(lay.get("key", "")).startswith(
                "skeleton:"
            )
            chain.append(Layer(path, str(lay.get("key", "")), default_root=default_root))
        return chain, manifest

    async def restore(self, ref: str, snapshot: SnapshotRef, spec: SandboxSpec) -> None:
        """Reset the sandbox's files to the snapshot (verified first) and boot it."""
        chain, _ = await anyio.to_thread.run_sync(self._snapshot_layers, snapshot)
        self._ensure_subreaper()
        async with self._alock(ref):
            d, meta = self._meta(ref)
            await self._halt(d, meta)
            meta.layers = [{"path": str(lay.path), "key": lay.key} for lay in chain]
            meta.default_root = chain[-1].default_root
            await anyio.to_thread.run_sync(self._reset_layer, d, meta)
            meta.save(d / "meta.json")
            await self._boot(d, meta, spec)

    def _reset_layer(self, d: Path, meta: Meta) -> None:
        if meta.disk_mb is not None:
            self._make_layer(d, meta)
        for sub in ("upper", "work"):
            shutil.rmtree(d / "layer" / sub, ignore_errors=True)
        self._make_layer(d, meta)
        if meta.disk_mb is not None:
            umount_tree(d / "layer")

    async def fork(
        self, snapshot: SnapshotRef, sandbox_ids: list[str], spec: SandboxSpec
    ) -> list[str]:
        """One new sandbox per id from a snapshot, booted in parallel; their refs in order."""
        runtime = self._validate(sandbox_ids[0] if sandbox_ids else "x", spec)
        for sid in sandbox_ids:
            self._validate(sid, spec)
        chain, _ = await anyio.to_thread.run_sync(self._snapshot_layers, snapshot)
        self._ensure_subreaper()
        # A boot spends most of its time waiting on other processes (crun, the agent's start)
        # and on kernel work that sleeps, so two per CPU left the CPUs idle between steps:
        # four per CPU was 15-20% faster in 4 of 5 paired runs of a fork into 100 (2 cores).
        limiter = anyio.CapacityLimiter(max(4, (os.cpu_count() or 2) * 4))
        failures: list[BaseException] = []

        async def one(sid: str) -> None:
            async with limiter:
                try:
                    await self._create_from(sid, spec, runtime, chain)
                except Exception as e:  # collected and re-raised below
                    failures.append(e)

        async with anyio.create_task_group() as tg:
            for sid in sandbox_ids:
                tg.start_soon(one, sid)
        if failures:
            for sid in sandbox_ids:
                with anyio.CancelScope(shield=True):
                    await self.destroy(sid)
            raise failures[0]
        return list(sandbox_ids)

    async def _create_from(
        self, sandbox_id: str, spec: SandboxSpec, runtime: str, chain: list[Layer]
    ) -> None:
        d = self._dir(sandbox_id)
        async with self._alock(sandbox_id):
            if (d / "meta.json").exists():
                await self._adopt(d, spec)
                return
            meta = await anyio.to_thread.run_sync(
                self._provision, d, sandbox_id, f"sl-{sandbox_id}", runtime, spec, chain
            )
            try:
                await self._boot(d, meta, spec, baseline=True)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._destroy_dir(d)
                raise

    async def delete_snapshot(self, snapshot: SnapshotRef) -> None:
        """Remove a snapshot; a missing one is fine.

        Sandboxes restored or forked from it mount its layer, so while any uses it the layer
        stays (marked deleted: it can no longer be restored or forked) and goes with the last
        of them.
        """
        sdir = self._snapshot_dir(snapshot.ref)
        if not sdir.exists():
            return
        (sdir / "deleted").touch()
        await anyio.to_thread.run_sync(self._gc_snapshots)

    def _layers_in_use(self) -> set[str]:
        used: set[str] = set()
        for meta_path in self.state_dir.glob("*/meta.json"):
            with contextlib.suppress(OSError, ValueError, TypeError):
                used.update(str(lay["path"]) for lay in Meta.load(meta_path).layers)
        for meta_path in [
            *(self.state_dir / ".pool").glob("*/*/meta.json"),
            *(self.state_dir / ".trash").glob("*/meta.json"),
        ]:
            with contextlib.suppress(OSError, ValueError, TypeError):
                used.update(str(lay["path"]) for lay in Meta.load(meta_path).layers)
        for manifest in (self.state_dir / ".snapshots").glob("*/manifest.json"):
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(manifest.read_text())
                used.update(str(lay["path"]) for lay in doc.get("base", []))
        return used

    def _gc_snapshots(self) -> None:
        deleted = [p.parent for p in (self.state_dir / ".snapshots").glob("*/deleted")]
        if not deleted:
            return
        # Removing one deleted snapshot may free the layer another deleted one sits on.
        while deleted:
            used = self._layers_in_use()
            free = [sdir for sdir in deleted if str(sdir / "layer") not in used]
            if not free:
                return
            for sdir in free:
                if self._idmap is not None:
                    # Rootless layers hold files of the caller's subordinate ids.
                    with contextlib.suppress(SandboxError):
                        rootless.remove_trees(self._idmap, [sdir])
                else:
                    shutil.rmtree(sdir, ignore_errors=True)
                deleted.remove(sdir)
