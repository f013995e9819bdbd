"""The Manager: the one place that composes store, backends, channels and the policy gate.

It owns the lifecycle state machine (DESIGN.md)::

    create ─► provisioning ─► setting_up ─► starting ─► running ◄──► stopping ─► stopped
                                                            ▲                       │
                                                            └──────── resuming ◄────┘
    any ─► destroying ─► destroyed                  failures ─► failed

Every status change is a compare-and-set on the record's ``version``, so several processes
(or hosts, on PostgreSQL) can drive the same sandboxes: when many requests find a sandbox
stopped, exactly one wins the ``stopped -> resuming`` update and resumes it; the others wait
for the transition (bounded by ``transition_timeout``) and then proceed. A transition whose
driver died is *abandoned*: its owner process is gone (same host) or its deadline passed, and
``reconcile`` (or the next waiter) settles it.

Front ends (SDK, CLI, HTTP, MCP) call the Manager and nothing below it. The Manager never
imports a concrete backend; it gets them by name from the caller. Nothing in this package
imports a front end (``sdk``, ``sync``, ``client``, ``server``, ``mcp``, ``cli``).

The rooms
---------

:class:`Manager` is one class, the one front door, composed of rooms: each room is a mixin over
:class:`~sandlot.manager.core.ManagerCore`, which holds the shared state and plumbing and
declares (as abstract methods) what the rooms provide one another::

    core.py          ManagerCore: construction, shared state, records and the hot-path cache,
                     compare-and-set transitions (_cas, _begin, _fail, _drive, _settled),
                     _ready (auto-resume), backends by name, channels
    gating.py        Gating: the gated operation (_gated: decide, run, receipt), idempotency
                     keys' intents and replays, exec.program decisions, approvals, explain
    recovery.py      Recovery: recover (intents of dead workers), reconcile, _settle, reaping
    lifecycle.py     Lifecycle: create (clone, setup, main process), stop, resume, destroy,
                     keep_alive
    snapshots.py     Snapshots: snapshot, list/delete, restore, fork, reset
    session.py       Session: exec, logs, background processes, terminals (PTY)
    files.py         Files: read/stream, write, list, remove (symlinks resolved and decided)
    network.py       Network: egress policy, log and receipts; published ports
    housekeeping.py  Housekeeping: the sweep (TTL, idle, failed creations past inspection)

and leaf modules the rooms share, which import no room: ``tuning.py`` (the tunable numbers,
read as ``tuning.NAME`` at run time so setting one there takes effect), ``records.py`` (status
sets, TTL arithmetic, :class:`ReconcileReport`), ``commands.py`` (:func:`command_argv`, output
hashing and tails), ``intents.py`` (an operation's outcome, lease heartbeat, replay encoding).
Names with a leading underscore are the package's own; what ``__all__`` lists is its API.
"""

from __future__ import annotations

from typing import final

from sandlot.manager.commands import command_argv
from sandlot.manager.files import FileBody, Files
from sandlot.manager.gating import Gating
from sandlot.manager.housekeeping import Housekeeping
from sandlot.manager.lifecycle import Lifecycle
from sandlot.manager.network import Network
from sandlot.manager.records import ReconcileReport
from sandlot.manager.recovery import Recovery
from sandlot.manager.session import Session
from sandlot.manager.snapshots import Snapshots

__all__ = ["FileBody", "Manager", "ReconcileReport", "command_argv"]


@final
class Manager(Lifecycle, Session, Files, Snapshots, Network, Housekeeping, Recovery, Gating):
    """Drives sandboxes through their lifecycle on a store and a set of backends.

    Args:
        store: Where records live.
        backends: Backends by name; new sandboxes go to ``default_backend`` unless asked.
        default_backend: The name of the backend for new sandboxes.
        transition_timeout: How long a request waits for another's transition (seconds).
        create_timeout: After this, a creation in flight counts as abandoned (seconds).
        gate: The policy gate every operation passes first (None: no policy, no receipts —
            for unit tests of the lifecycle only; the SDK always has one).
        journal: The durable intent journal that makes operations with an idempotency key
            replayable and crash-safe (None: idempotency keys are refused).
        failed_keep: Seconds a failed creation is kept for inspection before the sweep
            (:meth:`stop_expired`) destroys it.
        sweep_every: With no server around to sweep (the embedded SDK and CLI), ``create``
            and ``list`` first sweep this host's sandboxes when the last sweep of this Manager
            is older than this many seconds (None: never; a server sweeps on its own
            schedule).
        option_defaults: Backend options a new sandbox gets on its backend when its spec does
            not set them (``{"local": {"isolation": "gvisor"}}``, from ``sandlot.toml``); they
            are written into its spec, so its record says what it runs on.
    """
