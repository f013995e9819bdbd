"""Where the gate reads an operation: inline when it is small, on a worker thread when it is large.

Normalizing and deciding a one-line command takes tens of microseconds, less than a hop to a
thread and back, so small operations stay on the event loop. A large one (a command string
near :data:`~sandlot.policy.limits.MAX_ARG_BYTES`) takes up to a few hundred milliseconds of
CPU: on the event loop that would stall every tenant's requests, even ``/healthz`` (issue 23).
Large ones go to a thread of their own pool, one at a time per tenant: a tenant sending many
at once queues behind itself, leaves other tenants a thread, and does not fill anyio's shared
worker pool (which the store and the receipts need).

This module imports :mod:`sandlot.models` and :mod:`sandlot.policy`; it must not import the
store, backends or front ends.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Mapping
from typing import Final, Protocol, TypeVar, final, runtime_checkable

import anyio
import anyio.to_thread

from sandlot.models import CommandSpec
from sandlot.policy import Decision, Explanation, PolicyRequest

__all__ = ["INLINE_BYTES", "Offload", "SyncEngine", "favour_the_event_loop", "weight"]

T = TypeVar("T")

INLINE_BYTES: Final = 256
"""Text (command, argv, path) up to which an operation is read on the event loop. Its worst
shape, 128 one-letter commands (``a;a;…``), normalizes in ~1.3 ms on the shared CI host (a
typical command, ``git status && make test 2>&1 | tee log``, in ~80 us); 1 KiB of that shape
took ~10 ms, too long to hold the loop. Beyond this a ~50 us thread hop costs less than it
saves."""


THREADS: Final = 2
"""Threads reading large operations at once, over all tenants (they share one interpreter
lock, so more would only slow each other)."""
SWITCH_INTERVAL: Final = 0.0005
"""Seconds a thread may hold the interpreter lock while another waits for it, in a server."""


def favour_the_event_loop() -> None:
    """Tune this interpreter for a long-running server whose event loop shares it with threads
    doing CPU work (the gate's large operations, hashing, JSON): call once, after start-up.

    - The switch interval goes from Python's 5 ms to :data:`SWITCH_INTERVAL`: each time the
      event loop wakes from I/O it must take the interpreter lock back, and with a thread busy
      normalizing it waited up to 5 ms at each of the dozens of wake-ups one request makes
      (tenant A's exec p99 went from ~13 ms to ~600 ms under tenant B's largest commands).
    - Everything built at start-up is frozen out of the collector: a full collection holds
      the lock for as long as it scans, and the thousands of objects a large command makes
      trigger them; frozen, a collection scans only what was made since.
    """
    sys.setswitchinterval(SWITCH_INTERVAL)
    gc.collect()
    gc.freeze()


@runtime_checkable
class SyncEngine(Protocol):
    """An engine that can also decide synchronously (Cedar, builtin): its whole decision can
    move to the thread. Others (OPA answers over HTTP) decide on the event loop."""

    def evaluate(self, request: PolicyRequest) -> Decision:
        """Decide, synchronously."""
        ...

    def explain_now(self, request: PolicyRequest) -> Explanation:
        """Explain, synchronously."""
        ...


def weight(args: Mapping[str, object]) -> int:
    """How much text the normalizer would read in an operation's arguments (an upper estimate,
    cheap: it reads lengths, never the text)."""
    total = 0
    for value in args.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, CommandSpec):
            total += len(value.cmd) + sum(len(a) + 1 for a in value.args) + len(value.env) * 8
        elif isinstance(value, (list, tuple)):
            total += sum(len(a) + 1 if isinstance(a, str) else 8 for a in value)
        elif isinstance(value, Mapping):
            total += len(value) * 8
    return total


@final
class Offload:
    """Runs the gate's CPU work for large operations on threads: one at a time per tenant, and
    at most :data:`THREADS` at once, so one tenant's flood of large commands queues behind
    itself and leaves another tenant a thread."""

    def __init__(self, inline_bytes: int = INLINE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        # Made on first use: an anyio limiter belongs to the event loop that first uses it.
        self._threads: anyio.CapacityLimiter | None = None
        # One per tenant that ever sent a large operation: as many as there are API keys.
        self._lanes: dict[str, anyio.Lock] = {}

    def inline(self, args: Mapping[str, object]) -> bool:
        """True when reading ``args`` is cheaper on the event loop than a thread hop."""
        return weight(args) <= self.inline_bytes

    async def run(self, fn: Callable[[], T], tenant: str = "") -> T:
        """``fn()`` on a worker thread, after the tenant's large operations before it."""
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(THREADS)
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = anyio.Lock()
        async with lane:
            return await anyio.to_thread.run_sync(fn, limiter=self._threads)
