"""The durable journal: idempotent intents, one-use authorizations, fencing, exec output runs.

Rooms: ``journal.py`` (the :class:`Journal` and its fenced transitions: the state machine),
``reader.py`` (its connection plumbing and the queries that change nothing), ``records.py``
(intent states and the rows returned), ``statements.py`` (the SQL, built once per dialect),
``execlog.py`` (kept output of keyed execs), ``owner.py`` (who a process is, and whether it
lives), ``wakeups.py`` (in-process wake-ups of waiting repeats), ``schema.py`` (tables).

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
