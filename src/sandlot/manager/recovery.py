"""Crash recovery: settle what a dead process left behind, and make records agree with backends.

:meth:`Recovery.recover` (at start-up) settles journal intents whose worker died, never running
anything twice; :meth:`Recovery.reconcile` checks records against what backends report, settles
transitions whose driver died (:meth:`Recovery._settle`), reaps backend sandboxes that carry our
mark but have no record, and sweeps. Must not import a front end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from sandlot.backends.base import Backend
from sandlot.errors import BackendUnavailable, Conflict, InvalidState, NotFound, SandboxError
from sandlot.gate.gate import SYSTEM
from sandlot.journal import LEASED_STATES, Intent, IntentState, Lease, owner_alive
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import _encode_error
from sandlot.manager.records import ReconcileReport
from sandlot.models import DeathCertificate, SandboxInfo, SandboxStatus, utcnow
from sandlot.policy.request import Resource
from sandlot.store.base import SandboxQuery

S = SandboxStatus
_log = logging.getLogger("sandlot")


class Recovery(ManagerCore):
    """Crash recovery: intents whose worker died, records that disagree with backends, orphans."""

    async def recover(self) -> dict[str, str]:
        """Settle intents whose worker died (a crash, a ``kill -9``): run at start-up.

        Nothing is run twice: an exec or a write that may have started is reported with an
        unknown outcome, a creation is settled like any abandoned one (its record failed, its
        backend sandbox kept), a destroy is finished (destroying is idempotent). A backend
        that cannot answer leaves the intent ``NEEDS_RECONCILE`` (``sandlot doctor`` lists
        them). Returns intent id -> what happened.
        """
        if self.journal is None:
            return {}
        done: dict[str, str] = {}
        intents = await self._jr(self.journal.list, states=sorted(s.value for s in LEASED_STATES))
        now = utcnow()
        for intent in intents:
            expired = intent.lease_expires_at is None or intent.lease_expires_at <= now
            if not expired and (intent.lease_owner is None or owner_alive(intent.lease_owner)):
                continue
            try:
                done[intent.intent_id] = await self._recover_intent(intent)
            except Conflict:
                continue  # another process took it over, or its worker is still alive
            except SandboxError as e:
                # One intent that cannot be settled must not stop the others (or start-up).
                _log.warning("could not recover intent %s: %s", intent.intent_id, e)
                done[intent.intent_id] = f"error: {e}"
        return done

    async def _recover_intent(self, intent: Intent) -> str:
        journal = self._journal()
        dead = (
            intent.lease_owner
            if intent.lease_owner and not owner_alive(intent.lease_owner)
            else None
        )
        lease = await self._jr(
            journal.take_over, intent.intent_id, dead_owner=dead, leased_only=True
        )
        if intent.op == "destroy":
            # A crash before the sandbox was attached to the intent leaves it in the request.
            target = intent.sandbox_id or intent.request.get("sandbox_id")
            if isinstance(target, str):
                return await self._recover_destroy(lease, target)
        if intent.op == "sandbox.create" and intent.sandbox_id is not None:
            try:
                sb = await self.store.get(intent.sandbox_id)
            except NotFound:
                pass  # the record is written before the backend is asked: nothing was made
            else:
                return await self._recover_create(lease, sb)
        unknown = intent.state is IntentState.RUNNING
        what = (
            "its outcome is unknown (the process running it died); it was not run again"
            if unknown
            else "it was interrupted before it ran; it was not run"
        )
        error = BackendUnavailable(
            f"{intent.op} {what}", outcome="unknown" if unknown else "not_run"
        )
        await self._jr(journal.fail, lease, error=_encode_error(error))
        return "failed"

    async def _recover_destroy(self, lease: Lease, sandbox_id: str) -> str:
        """Finish a destroy whose worker died (destroying is idempotent), so a replay of its
        key answers the destroyed record."""
        journal = self._journal()
        try:
            sb = await self.store.get(sandbox_id)
            sb = await self._destroy(sb, "destroyed", "destroy finished after a crash")
        except BackendUnavailable as e:
            await self._jr(journal.needs_reconcile, lease.intent_id, why=str(e))
            return "needs_reconcile"
        if lease.state is not IntentState.CLEANING:
            lease = await self._jr(journal.advance, lease, "CLEANING", sandbox_id=sb.id)
        await self._jr(journal.advance, lease, "CLEANED", result=sb.model_dump(mode="json"))
        return "finished"

    async def _recover_create(self, lease: Lease, sb: SandboxInfo) -> str:
        """Settle a creation whose worker died, so a replay of its key answers its sandbox.

        A sandbox that reached ``running`` is the result (only the journal's last write was
        lost); one still in creation is failed like any abandoned creation (its backend
        sandbox kept), and the replay raises ``InvalidState`` naming it. Either way a backend
        sandbox found for the record is recorded as the intent's allocation (adopted, never
        made again), so destroying it later releases the allocation.
        """
        journal = self._journal()
        if sb.status.transitional and not self._abandoned(sb):
            msg = f"sandbox {sb.id} is still being driven by {sb.transition_owner}"
            raise Conflict(msg, id=sb.id)
        if sb.status.transitional:
            try:
                sb = await self._settle(sb)
            except BackendUnavailable as e:
                await self._jr(journal.needs_reconcile, lease.intent_id, why=str(e))
                return "needs_reconcile"
        if lease.state is IntentState.ALLOCATING and sb.backend_ref is not None:
            lease = await self._jr(journal.allocated, lease, provider_ref=sb.backend_ref)
        if sb.status is S.RUNNING:
            await self._jr(
                journal.record_result, lease, result={"sandbox_id": sb.id}, receipt_seq=None
            )
            return "adopted"
        cause = f": {sb.death.cause} ({sb.death.message})" if sb.death else ""
        error = InvalidState(
            f"the creation of sandbox {sb.id} was interrupted by a crash; it is {sb.status}{cause}",
            id=sb.id,
            sandbox_id=sb.id,
            status=sb.status.value,
        )
        await self._jr(journal.fail, lease, error=_encode_error(error))
        return "failed"

    async def reconcile(self, ids: Sequence[str] | None = None) -> ReconcileReport:
        """Make records agree with what backends report and settle abandoned transitions;
        when ``ids`` is None also reap backend sandboxes that carry our mark but have no
        record, and sweep (:meth:`stop_expired`)."""
        report = ReconcileReport()
        if ids is None:
            # Another host's sandboxes are its own Manager's to check.
            records = [sb for sb in await self.store.list(SandboxQuery()) if self._mine(sb)]
        else:
            records = [await self.store.get(i) for i in ids]
        for sb in records:
            report.checked += 1
            try:
                self._require_here(sb)
                change = await self._reconcile_one(sb)
            except SandboxError as e:
                report.errors[sb.id] = str(e)
                continue
            if change:
                report.updated[sb.id] = change
        if ids is None:
            for name in self.backends:
                await self._reap(name, self._backend(name), report)
            checked = report.checked
            await self._sweep(utcnow(), report)
            report.checked = checked
        return report

    async def _reconcile_one(self, sb: SandboxInfo) -> str | None:
        before = sb.status
        if before.transitional:
            if not self._abandoned(sb):
                return None
            settled = await self._settle(sb)
            return f"{before} (abandoned) -> {settled.status}"
        if before not in (S.RUNNING, S.STOPPED) or sb.backend_ref is None:
            return None
        state = await self._backend_of(sb).inspect(sb.backend_ref)
        if state.state == "missing":
            await self._fail(sb, "vanished", "the backend no longer has this sandbox")
            return f"{before} -> failed (vanished)"
        if before is S.RUNNING and state.state == "stopped":
            # An init that exited without being asked to is a crash (an OOM kill says oom).
            cause = state.reason or "exited"
            message = state.detail or f"stopped behind our back ({cause})"
            if cause == "exited":
                cause = "crashed"
                message = (
                    state.detail or "its init ended with no stop asked for (killed or crashed)"
                )
            await self._drop_channel(sb.id)
            await self._cas(
                sb, status=S.STOPPED, death=DeathCertificate(cause=cause, message=message)
            )
            return f"running -> stopped ({cause})"
        return None

    async def _reap(self, name: str, impl: Backend, report: ReconcileReport) -> None:
        try:
            owned = await impl.list_owned()
        except SandboxError as e:
            report.errors[name] = f"cannot list backend sandboxes: {e}"
            return
        for sandbox_id, ref in owned.items():
            try:
                record = await self.store.get(sandbox_id)
            except NotFound:
                record = None
            # No record, or one closed while this runtime lived on (a host given up for lost
            # that came back): nobody will ever reach it again.
            if record is None or record.status is S.DESTROYED:
                orphan = Resource(sandbox_id=sandbox_id, backend=name)
                try:
                    async with self._gated(SYSTEM, "destroy", orphan, reason="orphan"):
                        await impl.destroy(ref)
                except SandboxError as e:
                    report.errors[sandbox_id] = f"could not reap orphan: {e}"
                    continue
                report.reaped.append(sandbox_id)

    async def _settle(self, sb: SandboxInfo) -> SandboxInfo:
        """Finish or fail a transition whose driver died."""
        impl = self._backend_of(sb)
        owner = f"abandoned by {sb.transition_owner}"
        if sb.status is S.DESTROYING:
            return await self._destroy(sb, "destroyed", f"destroy finished by reconcile ({owner})")
        if sb.status in (S.STOPPING, S.RESUMING):
            sb = await self._cas(sb, transition_owner=self.instance)
            with contextlib.suppress(SandboxError):
                if sb.backend_ref is not None:
                    await impl.stop(sb.backend_ref)
            await self._drop_channel(sb.id)
            return await self._cas(
                sb,
                status=S.STOPPED,
                transition_owner=None,
                transition_deadline=None,
                death=DeathCertificate(cause="abandoned", message=f"{sb.status} {owner}"),
            )
        # provisioning / setting_up / starting: the backend's sandbox (if any) is kept for
        # inspection, as for any failed creation.
        if sb.backend_ref is None:
            with contextlib.suppress(SandboxError):
                ref = (await impl.list_owned()).get(sb.id)
                if ref is not None:
                    sb = await self._cas(sb, backend_ref=ref)
        return await self._fail(sb, "abandoned", f"{sb.status} {owner}")
