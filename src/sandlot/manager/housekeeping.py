"""The sweep: stop sandboxes past their time to live or idle timeout, stop failed ones still
running past theirs, and destroy failed creations whose time for inspection ran out.

A server runs :meth:`Housekeeping.stop_expired` on its own schedule; with no server (the
embedded SDK and CLI), ``create`` and ``list`` sweep inline when the last sweep is old
(:meth:`Housekeeping._sweep_if_due`). Must not import a front end.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

import anyio

from sandlot.errors import Conflict, InvalidState, SandboxError
from sandlot.manager import tuning
from sandlot.manager.core import ManagerCore
from sandlot.manager.records import _KEPT, ReconcileReport, _past_ttl, _ttl_message
from sandlot.models import DeathCertificate, SandboxInfo, SandboxStatus, system_actor, utcnow
from sandlot.store.base import SandboxQuery

S = SandboxStatus
_log = logging.getLogger("sandlot")


class Housekeeping(ManagerCore):
    """The sweep: expired and idle sandboxes stopped, failed creations discarded."""

    async def stop_expired(self, *, now: datetime | None = None) -> ReconcileReport:
        """The sweep: stop running sandboxes whose TTL ran out (cause ``ttl``) or that sat
        idle longer than ``idle_timeout`` (cause ``idle``), and destroy failed creations whose
        time for inspection ran out. The system does this as itself, in each sandbox's tenant
        (receipts name the ``system`` principal). What could not be done is in ``errors``
        (and logged), never silently skipped."""
        report = ReconcileReport()
        await self._sweep(now or utcnow(), report)
        return report

    async def _sweep_if_due(self) -> None:
        """The embedded stand-in for a server's sweep: no daemon runs, so whoever uses sandlot
        on this host stops what has expired (errors are logged, never raised into the
        caller's unrelated operation)."""
        now = time.monotonic()
        if self.sweep_every is None or (
            self._swept_at is not None and now - self._swept_at < self.sweep_every
        ):
            return
        self._swept_at = now
        # Shielded: a caller cancelled (Ctrl-C on `sandlot list`) must not leave another
        # sandbox half stopped; bounded, so a stuck backend does not hold up the caller long.
        with anyio.CancelScope(shield=True), anyio.move_on_after(tuning.SWEEP_BOUND):
            try:
                await self.stop_expired()  # what it could not do, it logs
            except SandboxError as e:
                _log.error("sweeping expired sandboxes failed: %s", e)

    async def _sweep(self, now: datetime, report: ReconcileReport) -> None:
        due = [
            sb
            for sb in await self.store.list(SandboxQuery(statuses=frozenset({S.RUNNING, S.FAILED})))
            if self._mine(sb)
        ]
        for sb in due:
            if sb.status is S.FAILED:
                if not _past_ttl(sb, now):
                    continue
                report.checked += 1
                if sb.metadata.get(_KEPT):
                    await self._discard(sb, report)
                else:
                    await self._stop_failed(sb, report)
                continue
            if self._due(sb, now) is None:
                continue
            report.checked += 1
            try:
                cause = await self._stop_system(sb, now)
            except (Conflict, InvalidState):
                continue  # changed meanwhile (kept alive, busy, stopped): the next sweep sees it
            except SandboxError as e:
                # One sandbox that cannot be stopped must not keep the others running.
                _log.error("could not stop sandbox %s past its TTL or idle time: %s", sb.id, e)
                report.errors[sb.id] = f"could not stop it past its TTL or idle time: {e}"
                continue
            if cause is not None:
                report.expired.append(sb.id)

    def _due(self, sb: SandboxInfo, now: datetime, *, busy: int = 0) -> tuple[str, str] | None:
        """Why a running sandbox is due to stop (its cause and message), if it is; ``busy``
        operations of its own in flight are the caller's (the stop itself)."""
        if _past_ttl(sb, now):
            return "ttl", _ttl_message(sb)
        if (
            sb.spec.idle_timeout is not None
            and sb.last_active_at + timedelta(seconds=sb.spec.idle_timeout) <= now
            and self._busy.get(sb.id, 0) <= busy
        ):
            return "idle", f"idle for more than {sb.spec.idle_timeout:g}s"
        return None

    async def _stop_system(self, sb: SandboxInfo, now: datetime) -> str | None:
        """Stop a sandbox as sandlot's own duty (TTL, idle), decided and receipted as such; the
        cause, or None when the record read again shows it is no longer due (another process
        kept it alive or used it since the sweep listed it)."""
        sb = await self.store.get(sb.id)
        due = self._due(sb, now) if sb.status is S.RUNNING else None
        if due is None:
            return None
        cause, message = due
        async with self._gated(system_actor(sb.tenant), "stop", sb, reason=cause):
            await self._stop(
                sb, cause, message, still_due=lambda r: self._due(r, now, busy=1) is not None
            )
        return cause

    async def _stop_failed(self, sb: SandboxInfo, report: ReconcileReport) -> None:
        """Stop the runtime of a failed sandbox past its TTL if it still runs (a stop that
        failed once leaves the record failed; its processes must not run on for good)."""
        if sb.backend_ref is None:
            return
        try:
            impl = self._backend_of(sb)
            if (await impl.inspect(sb.backend_ref)).state != "running":
                return
            async with self._gated(system_actor(sb.tenant), "stop", sb, reason="ttl"):
                await impl.stop(sb.backend_ref)
                await self._drop_channel(sb.id)
                await self._cas(
                    sb,
                    status=S.STOPPED,
                    death=DeathCertificate(
                        cause="ttl", message=f"{_ttl_message(sb)} (it had failed: {sb.error})"
                    ),
                )
        except Conflict:
            return
        except SandboxError as e:
            _log.error("could not stop failed sandbox %s past its TTL: %s", sb.id, e)
            report.errors[sb.id] = f"could not stop it past its TTL (it had failed): {e}"
            return
        report.expired.append(sb.id)

    async def _discard(self, sb: SandboxInfo, report: ReconcileReport) -> None:
        """Destroy a failed creation whose time for inspection ran out (the record stays)."""
        first = f"{sb.death.cause}: {sb.death.message}" if sb.death else (sb.error or "failed")
        message = f"failed ({first}); destroyed when its time for inspection ran out"
        try:
            await self._destroy_system(sb, "discarded", message)
        except (Conflict, InvalidState):
            return
        except SandboxError as e:
            _log.error("could not destroy failed sandbox %s: %s", sb.id, e)
            report.errors[sb.id] = f"could not destroy it after its failure: {e}"
            return
        report.discarded.append(sb.id)
