"""Snapshots and what is made from them: snapshot, list, delete, restore, fork, and reset
(back to a snapshot, by default the sandbox's baseline, verified).

A host-local backend's snapshot lives on the host of the sandbox it was taken from; operations
on it elsewhere are refused. Must not import a front end.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Mapping
from datetime import timedelta

from sandlot.backends.base import Backend, SnapshotRef
from sandlot.errors import InvalidRequest, NotFound, NotSupported, SandboxError, VerificationFailed
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import _Outcome
from sandlot.models import (
    LOCAL_ACTOR,
    Actor,
    SandboxInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
    new_id,
    utcnow,
)
from sandlot.policy.request import Resource

S = SandboxStatus


class Snapshots(ManagerCore):
    """Snapshots, and putting a sandbox back to one: restore, fork, reset."""

    async def snapshot(
        self, sandbox_id: str, *, actor: Actor = LOCAL_ACTOR, auto_resume: bool = True
    ) -> SnapshotInfo:
        """Save the sandbox's state; new sandboxes can be made from it."""
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        if not impl.capabilities().snapshot:
            msg = f"backend {sb.backend!r} cannot snapshot"
            raise NotSupported(msg)
        snapshot_id = new_id("snap")
        async with self._gated(actor, "snapshot", sb, snapshot_id=snapshot_id) as outcome:
            sb = await self._ready(sandbox_id, actor, auto_resume, sb)
            assert sb.backend_ref is not None
            ref = await impl.snapshot(sb.backend_ref, snapshot_id)
            outcome.detail = {"size_bytes": ref.size_bytes}
        info = SnapshotInfo(
            id=snapshot_id,
            sandbox_id=sb.id,
            backend=sb.backend,
            ref=ref.ref,
            size_bytes=ref.size_bytes,
            spec=sb.spec,
            metadata=dict(ref.metadata),
        )
        return await self.store.insert_snapshot(info, tenant=sb.tenant)

    async def list_snapshots(
        self, sandbox_id: str | None = None, *, actor: Actor = LOCAL_ACTOR
    ) -> builtins.list[SnapshotInfo]:
        """Snapshots, newest first (of one sandbox when given)."""
        return await self.store.list_snapshots(
            sandbox_id=sandbox_id, tenant=None if actor.admin else actor.tenant
        )

    async def delete_snapshot(self, snapshot_id: str, *, actor: Actor = LOCAL_ACTOR) -> None:
        """Remove a snapshot and its data."""
        snap = await self.store.get_snapshot(
            snapshot_id, tenant=None if actor.admin else actor.tenant
        )
        await self._require_snapshot_here(snap)
        target = await self._snapshot_resource(snap, actor)
        async with self._gated(actor, "snapshot.delete", target, snapshot_id=snap.id):
            await self._backend(snap.backend).delete_snapshot(_snapshot_ref(snap))
            await self.store.delete_snapshot(snap.id)

    async def _require_snapshot_here(self, snap: SnapshotInfo) -> None:
        """A host-local backend's snapshot lives on the host of the sandbox it was taken
        from: deleting or forking it elsewhere would find nothing (or drop only the record)."""
        if not self._backend(snap.backend).capabilities().host_local:
            return
        with contextlib.suppress(NotFound):
            self._require_here(await self.store.get(snap.sandbox_id))

    async def _snapshot_resource(self, snap: SnapshotInfo, actor: Actor) -> Resource:
        """What a snapshot operation targets: the sandbox it was taken from (which may be gone)."""
        try:
            return Resource.of(await self.store.get(snap.sandbox_id))
        except NotFound:
            spec = snap.spec or SandboxSpec()
            return Resource.for_spec(
                snap.sandbox_id, spec, backend=snap.backend, tenant=actor.tenant
            )

    async def restore(
        self, sandbox_id: str, snapshot_id: str, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Put a sandbox back to a snapshot's state (its main process is relaunched)."""
        sb = await self.get(sandbox_id, actor=actor)
        async with self._gated(actor, "restore", sb, snapshot_id=snapshot_id):
            return await self._drive([sb.id], self._restore(sb, snapshot_id, actor))

    async def _restore(self, sb: SandboxInfo, snapshot_id: str, actor: Actor) -> SandboxInfo:
        sb = await self._settled(sb)
        snap = await self.store.get_snapshot(
            snapshot_id, tenant=None if actor.admin else actor.tenant
        )
        if snap.backend != sb.backend:
            msg = f"snapshot {snap.id} is from backend {snap.backend}, sandbox is on {sb.backend}"
            raise InvalidRequest(msg)
        await self._require_snapshot_here(snap)
        impl = self._backend_of(sb)
        if not impl.capabilities().snapshot:
            msg = f"backend {sb.backend!r} cannot restore snapshots"
            raise NotSupported(msg)
        sb = await self._begin(sb, {S.RUNNING, S.STOPPED, S.FAILED}, S.RESUMING)
        await self._drop_channel(sb.id)
        assert sb.backend_ref is not None
        try:
            await impl.restore(sb.backend_ref, _snapshot_ref(snap), sb.spec)
            command = sb.spec.resume_command()
            if command is not None:
                await self._launch_main(sb, actor, await self._channel(sb), command)
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"restore failed: {e}")
            raise
        return await self._cas(
            sb, status=S.RUNNING, transition_owner=None, transition_deadline=None, error=None
        )

    async def fork(
        self,
        source: str,
        count: int = 1,
        *,
        actor: Actor = LOCAL_ACTOR,
        labels: Mapping[str, str] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Make ``count`` new sandboxes from a snapshot id, or from a sandbox id (snapshotted
        first). Each starts with the snapshot's files and runs its ``resume`` command."""
        if not 1 <= count <= 1000:
            msg = f"fork count must be 1..1000, got {count}"
            raise InvalidRequest(msg)
        tenant = None if actor.admin else actor.tenant
        if source.startswith("snap-"):
            snap = await self.store.get_snapshot(source, tenant=tenant)
        else:
            impl = self._backend((await self.get(source, actor=actor)).backend)
            if not impl.capabilities().fork:
                msg = f"backend {impl.name!r} cannot fork"
                raise NotSupported(msg)
            snap = await self.snapshot(source, actor=actor)
        impl = self._backend(snap.backend)
        if not impl.capabilities().fork:
            msg = f"backend {snap.backend!r} cannot fork"
            raise NotSupported(msg)
        await self._require_snapshot_here(snap)
        target = await self._snapshot_resource(snap, actor)
        async with self._gated(actor, "fork", target, snapshot_id=snap.id, count=count) as outcome:
            forked = await self._fork(snap, impl, count, actor, labels)
            outcome.detail = {"sandboxes": [f.id for f in forked]}
            return forked

    async def _fork(
        self,
        snap: SnapshotInfo,
        impl: Backend,
        count: int,
        actor: Actor,
        labels: Mapping[str, str] | None,
    ) -> builtins.list[SandboxInfo]:
        spec = (snap.spec or SandboxSpec()).model_copy(
            update={"labels": {**(snap.spec.labels if snap.spec else {}), **dict(labels or {})}}
        )
        now = utcnow()
        records = [
            SandboxInfo(
                id=new_id("sb"),
                backend=snap.backend,
                host=self.host if impl.capabilities().host_local else None,
                status=S.PROVISIONING,
                spec=spec,
                tenant=actor.tenant,
                setup_done=True,
                created_at=now,
                updated_at=now,
                last_active_at=now,
                expires_at=now + timedelta(seconds=spec.timeout) if spec.timeout else None,
                transition_owner=self.instance,
                transition_deadline=now + timedelta(seconds=self.create_timeout),
                metadata={"forked_from": snap.id},
            )
            for _ in range(count)
        ]
        for r in records:
            await self.store.insert(r)
        return await self._drive(
            [r.id for r in records], self._fork_body(snap, impl, records, spec, actor)
        )

    async def _fork_body(
        self,
        snap: SnapshotInfo,
        impl: Backend,
        records: builtins.list[SandboxInfo],
        spec: SandboxSpec,
        actor: Actor,
    ) -> builtins.list[SandboxInfo]:
        try:
            refs = await impl.fork(_snapshot_ref(snap), [r.id for r in records], spec)
        except SandboxError as e:
            for r in records:
                await self._fail(r, "backend_error", f"fork failed: {e}")
            raise
        out = []
        for r, ref in zip(records, refs, strict=True):
            r = await self._cas(r, status=S.STARTING, backend_ref=ref)
            command = spec.resume_command()
            if command is not None:
                await self._launch_main(r, actor, await self._channel(r), command)
            out.append(
                await self._cas(
                    r, status=S.RUNNING, transition_owner=None, transition_deadline=None
                )
            )
        return out

    async def reset(
        self, sandbox_id: str, snapshot_id: str | None = None, *, actor: Actor = LOCAL_ACTOR
    ) -> SandboxInfo:
        """Return the sandbox to a snapshot (default: its baseline, as created) and verify it.

        If a verification source disagrees, the sandbox is marked ``failed`` (cause
        ``verification``, the report in ``metadata["verification"]``) and ``VerificationFailed``
        is raised naming the sources.
        """
        sb = await self.get(sandbox_id, actor=actor)
        impl = self._backend_of(sb)
        if not impl.capabilities().reset:
            msg = f"backend {sb.backend!r} cannot reset"
            raise NotSupported(msg)
        async with self._gated(actor, "reset", sb, snapshot_id=snapshot_id) as outcome:
            snap = None
            if snapshot_id is not None:
                snap = await self.store.get_snapshot(
                    snapshot_id, tenant=None if actor.admin else actor.tenant
                )
                if snap.backend != sb.backend:
                    msg = f"snapshot {snap.id} is from backend {snap.backend}, sandbox is on {sb.backend}"
                    raise InvalidRequest(msg)
            sb = await self._settled(sb)
            return await self._drive([sb.id], self._reset_body(sb, impl, snap, actor, outcome))

    async def _reset_body(
        self,
        sb: SandboxInfo,
        impl: Backend,
        snap: SnapshotInfo | None,
        actor: Actor,
        outcome: _Outcome,
    ) -> SandboxInfo:
        sb = await self._begin(sb, {S.RUNNING, S.STOPPED, S.FAILED}, S.RESUMING)
        await self._drop_channel(sb.id)
        assert sb.backend_ref is not None
        try:
            report = await impl.reset(
                sb.backend_ref, None if snap is None else _snapshot_ref(snap), sb.spec
            )
        except VerificationFailed as e:
            await self._fail(sb, "verification", e.message)
            current = await self.store.get(sb.id)
            await self._cas(current, metadata={**current.metadata, "verification": e.details})
            raise
        except SandboxError as e:
            await self._fail(sb, "backend_error", f"reset failed: {e}")
            raise
        outcome.detail = {"verification": report}
        command = sb.spec.resume_command()
        if command is not None:
            await self._launch_main(sb, actor, await self._channel(sb), command)
        return await self._cas(
            sb,
            status=S.RUNNING,
            transition_owner=None,
            transition_deadline=None,
            error=None,
            metadata={**sb.metadata, "verification": report},
        )


def _snapshot_ref(snap: SnapshotInfo) -> SnapshotRef:
    return SnapshotRef(ref=snap.ref, size_bytes=snap.size_bytes, metadata=dict(snap.metadata))
