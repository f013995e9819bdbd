"""Followers of a background process's output: one reader per process, fanned out.

Every ``follow=true`` stream of a process's output used to open its own reader in the agent, so
ten followers of a process printing as fast as it can (``yes``) made the server decode, encode
and send its output ten times over, and starved every other tenant. Here the followers of one
process (asked by one actor) share one *feed*: a single follow reader whose chunks are encoded
once, as server-sent events, and handed to each follower's own buffer of at most
``buffer_bytes``. A follower that cannot keep up (a slow or stalled client) never slows the
feed: when its buffer is full it is dropped, its stream ends with a ``dropped`` event naming
the offset to resume from, and it can reattach from there (the SDK does so by itself). The
feed stops when its last follower leaves; nothing polls.

A follower that asks for output from before the feed's position first gets it with a one-shot
(non-follow) read, then joins the feed, dropping what the two have in common by sequence number.

This module imports the Manager's interface only; never backends, the store or FastAPI.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, final

import anyio

from sandlot.errors import SandboxError
from sandlot.server.problems import problem_body
from sandlot.server.wire import b64encode

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine

    from sandlot.manager import Manager
    from sandlot.models import Actor, OutputChunk

__all__ = ["ProcessFollowers"]

_log = logging.getLogger(__name__)

_FROM_NOW = 1 << 50
"""An offset past any process's output: the agent starts such a reader at the current end."""


def _event(event: str, data: object, *, id: str | None = None) -> bytes:
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _output_event(chunk: OutputChunk) -> bytes:
    # Built by hand: base64 and the stream's name need no JSON escaping, and json.dumps of a
    # MiB of base64 costs the event loop milliseconds.
    data = f'{{"stream": "{chunk.stream}", "data": "{b64encode(chunk.data)}"}}'
    return f"id: {chunk.seq}\nevent: output\ndata: {data}\n\n".encode()


@dataclass(eq=False)
class _Follower:
    """One client's stream: what the feed gave it that it has not sent yet."""

    queue: deque[tuple[int, bytes]] = field(default_factory=deque)
    size: int = 0
    dropped: bool = False
    wake: anyio.Event = field(default_factory=anyio.Event)

    def notify(self) -> None:
        self.wake.set()
        self.wake = anyio.Event()


@final
class _Rate:
    """A token bucket: ``take(n)`` returns once ``n`` more bytes fit in ``rate`` per second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0  # when the bytes taken so far will have been paid for

    async def take(self, n: int) -> None:
        now = anyio.current_time()
        # At most a second of burst: a quiet tenant does not bank an unbounded allowance.
        self._free_at = max(self._free_at, now - 1.0) + n / self.rate
        if self._free_at > now:
            await anyio.sleep(self._free_at - now)


@dataclass(eq=False)
class _Feed:
    """The one reader of a process's output for its followers."""

    key: tuple[str, ...]
    next_seq: int
    """One past the last chunk the feed handed out (where a joining follower meets it)."""
    followers: set[_Follower] = field(default_factory=set)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    room: anyio.Event = field(default_factory=anyio.Event)
    """Set when a follower has made room in its buffer (the feed waits for one that has)."""
    done: bool = False
    final: bytes | None = None
    """How the feed ended for its followers: ``None`` (the process exited) or an error event."""


@final
class ProcessFollowers:
    """The feeds of one server, by actor, sandbox and process.

    Args:
        manager: Where output is read (each feed and each catch-up is one Manager call, so the
            policy gate and receipts see them as the actor's).
        spawn: Starts a feed's task in the server's task group.
        buffer_bytes: Encoded output a follower may have waiting before it is dropped.
        rate: Bytes per second sent to all of one tenant's followers together (``None``: no
            limit): what one tenant's followers cost the server is bounded, however many
            followers and processes that print without end it has.
        keepalive: Seconds of silence after which a follower's stream gets an SSE comment.
    """

    def __init__(
        self,
        manager: Manager,
        spawn: Callable[[Callable[[], Coroutine[object, object, None]]], None],
        *,
        buffer_bytes: int = 1 << 20,
        rate: float | None = 8 << 20,
        keepalive: float = 15.0,
    ) -> None:
        self.manager = manager
        self.spawn = spawn
        self.buffer_bytes = buffer_bytes
        self.rate = rate
        self.keepalive = keepalive
        self._feeds: dict[tuple[str, ...], _Feed] = {}
        self._rates: dict[str, _Rate] = {}

    async def _pace(self, tenant: str, n: int) -> None:
        if self.rate is None:
            return
        bucket = self._rates.get(tenant)
        if bucket is None:
            bucket = self._rates[tenant] = _Rate(self.rate)
        await bucket.take(n)

    def feeds(self) -> int:
        """How many process outputs are being read for followers now."""
        return len(self._feeds)

    async def events(
        self, sandbox_id: str, process_id: str, actor: Actor, offset: int
    ) -> AsyncIterator[bytes]:
        """The output of a process from chunk ``offset`` on, as SSE, until it exits.

        Ends with ``end`` (``{"next_offset": n}``), ``error`` (a problem document) or
        ``dropped`` (``{"next_offset": n, …}``: this client fell too far behind; resume there).
        """
        key = (actor.tenant, actor.principal, str(actor.admin), sandbox_id, process_id)
        me = _Follower()
        feed = self._feeds.get(key)
        fresh = feed is None or feed.done
        if feed is None or feed.done:
            feed = _Feed(key, next_seq=offset)
            start = offset
            self.spawn(lambda: self._run(feed, sandbox_id, process_id, actor, start))
            # Registered only once spawned: a feed that never ran would keep followers waiting.
            self._feeds[key] = feed
        feed.followers.add(me)
        feed.room.set()  # a feed that waited for its followers to make room has a new one
        cursor = offset
        try:
            if not fresh:
                # What the feed passed before this follower joined: one bounded read.
                async for chunk in self.manager.process_output(
                    sandbox_id, process_id, actor=actor, offset=offset, follow=False
                ):
                    # Up to where the feed is, no further: a process that prints faster than
                    # this client reads would keep a one-shot read going for ever.
                    if me.dropped or chunk.seq >= feed.next_seq:
                        break
                    if me.queue and chunk.seq >= me.queue[0][0]:
                        break
                    cursor = chunk.seq + 1
                    ev = _output_event(chunk)
                    yield ev
                    await self._pace(actor.tenant, len(ev))
            while True:
                if me.queue:
                    batch: list[bytes] = []
                    while me.queue:
                        seq, ev = me.queue.popleft()
                        if seq >= cursor:
                            batch.append(ev)
                            cursor = seq + 1
                    me.size = 0
                    feed.room.set()
                    if batch:
                        # One write for what piled up: a fast producer costs per batch, not
                        # per chunk.
                        yield b"".join(batch)
                    continue
                if me.dropped:
                    yield _event("dropped", self._dropped(cursor), id=None)
                    return
                if feed.done:
                    if feed.final is not None:
                        yield feed.final
                    else:
                        yield _event("end", {"next_offset": cursor})
                    return
                wake = me.wake
                with anyio.move_on_after(self.keepalive) as waited:
                    await wake.wait()
                if waited.cancelled_caught:
                    yield b": keep-alive\n\n"
        except SandboxError as e:
            yield _event("error", problem_body(e))
        finally:
            self._leave(feed, me)

    def _dropped(self, cursor: int) -> dict[str, object]:
        return {
            "next_offset": cursor,
            "buffer_bytes": self.buffer_bytes,
            "detail": (
                f"this stream fell more than {self.buffer_bytes} bytes behind the process's "
                f"output and was ended so as not to hold the server back; reconnect with "
                f"offset={cursor} (or Last-Event-ID: {cursor - 1}) to go on"
            ),
        }

    def _leave(self, feed: _Feed, me: _Follower) -> None:
        feed.followers.discard(me)
        feed.room.set()
        if not feed.followers:
            feed.scope.cancel()
            if self._feeds.get(feed.key) is feed:
                del self._feeds[feed.key]

    async def _run(
        self, feed: _Feed, sandbox_id: str, process_id: str, actor: Actor, offset: int
    ) -> None:
        limit = self.buffer_bytes
        try:
            with feed.scope:
                async for chunk in self.manager.process_output(
                    sandbox_id, process_id, actor=actor, offset=offset, follow=True
                ):
                    ev = _output_event(chunk)
                    feed.next_seq = chunk.seq + 1
                    sent = 0
                    for f in list(feed.followers):
                        if f.size + len(ev) > limit and f.queue:
                            # Too far behind: dropped, and no longer a reason to read on.
                            f.dropped = True
                            f.queue.clear()
                            f.size = 0
                            feed.followers.discard(f)
                        else:
                            f.queue.append((chunk.seq, ev))
                            f.size += len(ev)
                            sent += len(ev)
                        f.notify()
                    # Read on only as fast as the fastest follower takes it, and within the
                    # tenant's rate of bytes sent (to all its followers): a process that
                    # prints without end costs what its readers read, not what it prints,
                    # and however many followers there are, no more than the rate.
                    await self._pace(actor.tenant, sent)
                    while feed.followers and all(f.size >= limit // 2 for f in feed.followers):
                        feed.room = anyio.Event()
                        await feed.room.wait()
                    if not feed.followers:
                        return
        except SandboxError as e:
            feed.final = _event("error", problem_body(e))
        except Exception as e:  # a bug below us must still end the streams, with its cause
            _log.exception("following process %s in %s failed", process_id, sandbox_id)
            err = SandboxError(f"internal error: {type(e).__name__}: {e}")
            feed.final = _event("error", problem_body(err))
        finally:
            feed.done = True
            if self._feeds.get(feed.key) is feed:
                del self._feeds[feed.key]
            for f in feed.followers:
                f.notify()
