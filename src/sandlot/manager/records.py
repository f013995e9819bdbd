"""What the rooms read off a sandbox's record, and what reconcile and the sweep report.

The statuses a creation passes through, the mark of a failed creation kept for inspection,
time-to-live arithmetic, and :class:`ReconcileReport` (defined with the wire models, which the
HTTP client reads too, and re-exported here). Pure: imports models only, nothing of the
Manager's rooms.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sandlot.models import ReconcileReport as ReconcileReport  # re-exported for the rooms
from sandlot.models import SandboxInfo, SandboxStatus

S = SandboxStatus
_KEPT = "kept_for_inspection"
"""Metadata marking a failed creation, kept for inspection until its ``expires_at``."""
_CREATING = frozenset(
    {SandboxStatus.PROVISIONING, SandboxStatus.SETTING_UP, SandboxStatus.STARTING}
)


def _past_ttl(sb: SandboxInfo, now: datetime) -> bool:
    """Whether the sandbox's time to live has run out."""
    return sb.expires_at is not None and sb.expires_at <= now


def _resumed_expiry(sb: SandboxInfo, now: datetime) -> datetime | None:
    """A resumed sandbox's TTL: what is left of it, else a whole new one (or none)."""
    if sb.status is not S.FAILED and sb.expires_at is not None and sb.expires_at > now:
        return sb.expires_at
    return now + timedelta(seconds=sb.spec.timeout) if sb.spec.timeout else None


def _ttl_message(sb: SandboxInfo) -> str:
    assert sb.expires_at is not None
    return f"time to live ran out at {sb.expires_at.isoformat()}"
