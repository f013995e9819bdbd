"""In-process wake-ups for callers waiting on an intent (repeats of an idempotency key).

:meth:`Journal.wait` polls the database, which is what sees an outcome recorded by another
process; a poll slow enough to cost the database little would make a repeat in the process
that ran the call learn its outcome late. So the process that runs a keyed call wakes its own
waiters the moment the call ends, and the poll can stay slow. This module imports only anyio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import final

import anyio

__all__ = ["Wakeups"]


@final
class Wakeups:
    """One event per intent that someone in this process waits on (all on one event loop)."""

    def __init__(self) -> None:
        self._events: dict[str, anyio.Event] = {}

    @contextlib.contextmanager
    def waiting(self, intent_id: str) -> Iterator[anyio.Event]:
        """The event :meth:`wake` sets for ``intent_id``, for the duration of one wait."""
        event = self._events.setdefault(intent_id, anyio.Event())
        try:
            yield event
        finally:
            # The first waiter back forgets it; any other still waiting holds it, or polls.
            if self._events.get(intent_id) is event:
                del self._events[intent_id]

    def wake(self, intent_id: str) -> None:
        """Wake everyone here waiting on ``intent_id`` (its call ended or left the gate)."""
        event = self._events.pop(intent_id, None)
        if event is not None:
            event.set()
