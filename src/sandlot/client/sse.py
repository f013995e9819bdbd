"""A server-sent events reader over an httpx response (the subset sandlot's server sends).

Parses ``event:``, ``data:`` and ``id:`` fields into :class:`Event` objects, skipping
comments (keep-alives) and events without data. This module imports httpx and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

__all__ = ["Event", "events"]


@dataclass(frozen=True)
class Event:
    """One event."""

    event: str
    """The event type (``message`` when the server named none)."""
    data: str
    """The data lines joined with newlines."""
    id: str | None
    """The event id, when the event carried one."""

    def json(self) -> dict[str, object]:
        """The data as a JSON object (``ValueError`` when it is not one)."""
        value = json.loads(self.data)
        if not isinstance(value, dict):
            msg = f"event {self.event!r} carries {type(value).__name__}, not an object"
            raise ValueError(msg)
        return value


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """The events of a ``text/event-stream`` response, as they arrive."""
    name = ""
    data: list[str] = []
    event_id: str | None = None
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield Event(name or "message", "\n".join(data), event_id)
            name, data, event_id = "", [], None
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
