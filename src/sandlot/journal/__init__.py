"""The durable journal: idempotent intents, one-use authorizations, fencing, exec output runs.

Re-exports only. The package imports SQLAlchemy, :mod:`sandlot.errors`, the store's metadata
and :mod:`sandlot.receipts.canonical`; never the Manager, backends or front ends.
"""

from __future__ import annotations

from sandlot.journal.execlog import ExecChunk, ExecPage, ExecRun, ExecRuns
from sandlot.journal.journal import (
    FINAL_STATES,
    LEASED_STATES,
    Allocation,
    Begun,
    Intent,
    IntentState,
    Journal,
    JournalEvent,
    Lease,
    StaleLease,
    allocation_name,
)
from sandlot.journal.owner import owner_alive, process_owner

__all__ = [
    "FINAL_STATES",
    "LEASED_STATES",
    "Allocation",
    "Begun",
    "ExecChunk",
    "ExecPage",
    "ExecRun",
    "ExecRuns",
    "Intent",
    "IntentState",
    "Journal",
    "JournalEvent",
    "Lease",
    "StaleLease",
    "allocation_name",
    "owner_alive",
    "process_owner",
]
