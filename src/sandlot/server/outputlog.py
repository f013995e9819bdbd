"""Exec output kept on the server so a client that lost its stream can resume it.

Every exec the HTTP API runs writes its output here, chunk by chunk, each with a sequence
number (0, 1, 2, …, the SSE event id), and finally its outcome (the result, or the error). A
reader asks for what came *after* the last sequence number it saw, so a reconnect with
``Last-Event-ID`` gets the rest with no loss and no duplicate. Output stays for ``retention``
seconds after the command ends, and at most ``max_bytes`` per command (older chunks are
dropped first; a reader that needs a dropped chunk gets a clear error, never a silent gap).
The same cap holds for the outcome: a result whose collected ``stdout``/``stderr`` are over
``max_bytes`` is kept without them, and a reader that comes for it later than the few seconds
this process holds the whole result gets ``output_expired`` (with the exit code), never a result
with its output silently cut. Past ``retention`` a read is ``output_expired`` (410) until the
sweep (:meth:`ExecOutputLog.run_upkeep`) deletes the command, then ``not_found`` (404).

:class:`ExecOutputLog` is the seam: :class:`MemoryExecOutputLog` serves one server process;
:class:`DatabaseExecOutputLog` keeps output in the database (the journal's ``exec_runs`` and
``exec_chunks``), so a reader resumes on another process or after a restart, and a command
whose server died is reported ``unknown``, never run again. This module must not import the
Manager, backends or a web framework.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast, final

import anyio
import anyio.to_thread

from sandlot.errors import BackendUnavailable, NotFound, OutputExpired, SandboxError
from sandlot.journal.execlog import ExecRuns, NewChunk, Stream
from sandlot.journal.owner import owner_alive as _local_owner_alive
from sandlot.journal.owner import process_owner
from sandlot.server.problems import problem_body

if TYPE_CHECKING:
    from collections.abc import Callable

    from sqlalchemy import Engine

    from sandlot.journal.execlog import ExecPage
    from sandlot.receipts.canonical import JsonValue

__all__ = [
    "DatabaseExecOutputLog",
    "ExecOutcome",
    "ExecOutputLog",
    "ExecOutputPage",
    "MemoryExecOutputLog",
    "OutputExpired",
    "OutputRecord",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputRecord:
    """One chunk of a command's output."""

    seq: int
    stream: Stream
    data: bytes


@dataclass(frozen=True)
class ExecOutcome:
    """How a command ended: a result (JSON of an ``ExecResult``) or an error (problem JSON)."""

    result: dict[str, object] | None = None
    error: dict[str, object] | None = None


@dataclass(frozen=True)
class ExecOutputPage:
    """What a read returns: chunks after the cursor, and the outcome once all were read."""

    chunks: list[OutputRecord]
    outcome: ExecOutcome | None = None


class ExecOutputLog(Protocol):
    """Where exec output waits for readers."""

    async def open(self, exec_id: str, *, tenant: str, sandbox_id: str) -> None:
        """Start the output of a new command."""
        ...

    async def append(self, exec_id: str, stream: Stream, data: bytes) -> int:
        """Add a chunk; its sequence number."""
        ...

    async def finish(self, exec_id: str, outcome: ExecOutcome) -> None:
        """Record how the command ended (readers get it after the last chunk)."""
        ...

    async def read(self, exec_id: str, *, tenant: str, after: int, wait: float) -> ExecOutputPage:
        """Chunks with ``seq > after``; waits up to ``wait`` seconds when there are none yet.

        Raises ``NotFound`` for an unknown, expired or other tenant's command, and
        :class:`OutputExpired` when chunks after ``after`` were already dropped.
        """
        ...

    async def run_upkeep(self) -> None:
        """Delete expired output now and then, until cancelled (the server runs it)."""
        ...


@dataclass
class _Entry:
    tenant: str
    sandbox_id: str
    chunks: deque[OutputRecord] = field(default_factory=deque)
    next_seq: int = 0
    size: int = 0
    outcome: ExecOutcome | None = None
    finished_at: float | None = None
    changed: anyio.Event = field(default_factory=anyio.Event)


@final
class MemoryExecOutputLog:
    """An :class:`ExecOutputLog` in this process's memory.

    Args:
        retention: Seconds a finished command's output stays readable.
        max_bytes: Output kept per command; beyond it the oldest chunks are dropped.
        max_entries: Commands remembered at most (the oldest finished ones go first).
    """

    def __init__(
        self, *, retention: float = 300.0, max_bytes: int = 16 << 20, max_entries: int = 10_000
    ) -> None:
        self.retention = retention
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: dict[str, _Entry] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        dead = [
            k
            for k, e in self._entries.items()
            if e.finished_at is not None and e.finished_at + self.retention <= now
        ]
        for k in dead:
            del self._entries[k]
        if len(self._entries) > self.max_entries:
            finished = sorted(
                (e.finished_at, k) for k, e in self._entries.items() if e.finished_at is not None
            )
            for _, k in finished[: len(self._entries) - self.max_entries]:
                del self._entries[k]

    def _get(self, exec_id: str, tenant: str | None = None) -> _Entry:
        entry = self._entries.get(exec_id)
        if entry is None or (tenant is not None and entry.tenant != tenant):
            msg = f"no exec {exec_id!r} (unknown, or its output is no longer kept)"
            raise NotFound(msg, exec_id=exec_id)
        return entry

    def _wake(self, entry: _Entry) -> None:
        entry.changed.set()
        entry.changed = anyio.Event()

    async def run_upkeep(self) -> None:
        """Forget expired commands now and then, until cancelled."""
        while True:
            await anyio.sleep(_upkeep_interval(self.retention))
            self._expire()

    async def open(self, exec_id: str, *, tenant: str, sandbox_id: str) -> None:
        """Start the output of a new command."""
        self._expire()
        self._entries[exec_id] = _Entry(tenant=tenant, sandbox_id=sandbox_id)

    async def append(self, exec_id: str, stream: Stream, data: bytes) -> int:
        """Add a chunk; its sequence number."""
        entry = self._get(exec_id)
        seq = entry.next_seq
        entry.next_seq += 1
        entry.chunks.append(OutputRecord(seq, stream, data))
        entry.size += len(data)
        while entry.size > self.max_bytes and len(entry.chunks) > 1:
            entry.size -= len(entry.chunks.popleft().data)
        self._wake(entry)
        return seq

    async def finish(self, exec_id: str, outcome: ExecOutcome) -> None:
        """Record how the command ended."""
        entry = self._get(exec_id)
        entry.outcome = outcome
        entry.finished_at = time.monotonic()
        self._wake(entry)

    async def read(self, exec_id: str, *, tenant: str, after: int, wait: float) -> ExecOutputPage:
        """Chunks with ``seq > after``, waiting up to ``wait`` seconds for the first."""
        self._expire()
        entry = self._get(exec_id, tenant)
        with anyio.move_on_after(wait):
            while not self._ready(entry, after):
                await entry.changed.wait()
        first = entry.chunks[0].seq if entry.chunks else entry.next_seq
        if after + 1 < first:
            msg = (
                f"output of exec {exec_id} before chunk {first} was dropped "
                f"(the server keeps {self.max_bytes} bytes per command); asked from {after + 1}"
            )
            raise OutputExpired(msg, exec_id=exec_id, first_seq=first)
        chunks = [c for c in entry.chunks if c.seq > after]
        last = chunks[-1].seq if chunks else after
        done = entry.outcome if last + 1 >= entry.next_seq else None
        return ExecOutputPage(chunks=chunks, outcome=done)

    @staticmethod
    def _ready(entry: _Entry, after: int) -> bool:
        return entry.outcome is not None or entry.next_seq > after + 1


@dataclass
class _Live:
    """A command this process is streaming: its counters and its wake-up for local readers."""

    tenant: str
    next_seq: int = 0
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0, "notice": 0})
    changed: anyio.Event = field(default_factory=anyio.Event)


@final
class DatabaseExecOutputLog:
    """An :class:`ExecOutputLog` in the database: readable from any process, after restarts.

    Appends cost no database round trip: chunks are buffered and written by a background
    thread in one transaction per batch, every ``flush_interval`` seconds or as soon as
    ``flush_bytes`` are waiting, and always (with the outcome, in one transaction) when a
    command finishes. Readers in this process get buffered chunks straight from memory and are
    woken by each append; readers elsewhere poll the database every ``poll_interval``. A crash
    loses at most the last unflushed batch, at the tail of the output, which is where a run the
    crash interrupted ends anyway (:meth:`mark_unknown_abandoned` marks it ``unknown``).

    Args:
        engine: An engine from :func:`sandlot.store.sql.open_engine`, schema current.
        owner: This process's identity (default :func:`sandlot.journal.owner.process_owner`).
        retention: Seconds a finished command's output stays readable.
        max_bytes: Output kept per command; beyond it the oldest chunks are dropped.
        flush_interval: Longest time a chunk waits in memory before it is written.
        flush_bytes: Buffered bytes that trigger a write at once.
        poll_interval: How often a reader of another process's command checks for more.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        owner: str | None = None,
        retention: float = 300.0,
        max_bytes: int = 16 << 20,
        flush_interval: float = 0.05,
        flush_bytes: int = 256 << 10,
        poll_interval: float = 0.05,
    ) -> None:
        self.runs = ExecRuns(engine, owner=owner or process_owner(), max_bytes=max_bytes)
        self.retention = retention
        self.max_bytes = max_bytes
        self.flush_interval = flush_interval
        self.flush_bytes = flush_bytes
        self.poll_interval = poll_interval
        self._live: dict[str, _Live] = {}
        # _cond's lock guards _pending and _inflight; the flusher thread waits on it.
        self._cond = threading.Condition()
        self._pending: list[NewChunk] = []
        self._pending_bytes = 0
        self._oldest = 0.0
        # Taken from _pending, not yet committed: still served to local readers from memory.
        self._inflight: list[NewChunk] = []
        self._flush_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Whole outcomes of commands whose collected output was too big to store, for the
        # readers in this process that come for them within _HOLD seconds (the client that
        # started the command, in the normal course): by exec id, (until, outcome, size).
        self._recent: dict[str, tuple[float, ExecOutcome, int]] = {}

    # -- writing --------------------------------------------------------------------------------

    async def open(
        self, exec_id: str, *, tenant: str, sandbox_id: str, intent_id: str | None = None
    ) -> None:
        """Start the output of a new command (written at once: readers anywhere can find it)."""
        await anyio.to_thread.run_sync(
            lambda: self.runs.open(
                exec_id, tenant=tenant, sandbox_id=sandbox_id, intent_id=intent_id
            )
        )
        self._live[exec_id] = _Live(tenant=tenant)

    async def append(self, exec_id: str, stream: Stream, data: bytes) -> int:
        """Add a chunk; its sequence number. Buffered: no database round trip here."""
        live = self._live.get(exec_id)
        if live is None:
            msg = f"no exec {exec_id!r} streaming in this process"
            raise NotFound(msg, exec_id=exec_id)
        seq = live.next_seq
        live.next_seq += 1
        offset = live.offsets[stream]
        live.offsets[stream] = offset + len(data)
        with self._cond:
            if not self._pending:
                self._oldest = time.monotonic()
            self._pending.append(NewChunk(exec_id, seq, stream, offset, bytes(data)))
            self._pending_bytes += len(data)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._flusher, name="sandlot-output-flush", daemon=True
                )
                self._thread.start()
            if len(self._pending) == 1 or self._pending_bytes >= self.flush_bytes:
                # The flusher sleeps untimed while nothing is pending, and times its wait
                # from the first chunk; a full buffer cuts that wait short.
                self._cond.notify()
        self._wake(live)
        return seq

    async def finish(self, exec_id: str, outcome: ExecOutcome) -> None:
        """Record how the command ended, with every chunk still buffered, in one transaction."""
        live = self._live.get(exec_id)
        if live is None:
            msg = f"no exec {exec_id!r} streaming in this process"
            raise NotFound(msg, exec_id=exec_id)
        result, dropped = _without_big_output(outcome.result, self.max_bytes)
        error, dropped_too = _without_big_output(outcome.error, self.max_bytes)
        if dropped or dropped_too:
            self._hold(exec_id, outcome, dropped + dropped_too)

        def write() -> None:
            with self._flush_lock:
                batch = self._take()
                ok = False
                try:
                    self.runs.finish(
                        exec_id, chunk_count=live.next_seq, result=result, error=error, chunks=batch
                    )
                    ok = True
                finally:
                    self._done(batch, ok=ok)

        await anyio.to_thread.run_sync(write)
        del self._live[exec_id]
        self._wake(live)

    def _take(self) -> list[NewChunk]:
        with self._cond:
            batch, self._pending, self._pending_bytes = self._pending, [], 0
            self._inflight = batch
            return batch

    def _done(self, batch: list[NewChunk], *, ok: bool) -> None:
        """After a write: committed chunks leave memory; a failed batch goes back in front."""
        with self._cond:
            self._inflight = []
            if batch and not ok:
                self._pending[:0] = batch
                self._pending_bytes += sum(len(c.data) for c in batch)
                self._oldest = time.monotonic()

    def _flush_once(self) -> None:
        with self._flush_lock:
            batch = self._take()
            if not batch:
                return
            ok = False
            try:
                self.runs.write(batch)
                ok = True
            except SandboxError:
                # Kept in memory (local readers still see it) and retried on the next tick.
                _log.exception("writing %d output chunks failed; will retry", len(batch))
            finally:
                self._done(batch, ok=ok)

    def _flusher(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._pending:
                        due = self._oldest + self.flush_interval - time.monotonic()
                        if due <= 0 or self._pending_bytes >= self.flush_bytes:
                            break
                        self._cond.wait(due)
                    else:
                        self._cond.wait()
                if self._closed and not self._pending:
                    return
            self._flush_once()
            if self._closed:
                return

    async def flush(self) -> None:
        """Write every buffered chunk now."""
        await anyio.to_thread.run_sync(self._flush_once)

    async def aclose(self) -> None:
        """Write what is buffered and stop the background writer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)
        await self.flush()

    @staticmethod
    def _wake(live: _Live) -> None:
        live.changed.set()
        live.changed = anyio.Event()

    def _hold(self, exec_id: str, outcome: ExecOutcome, size: int) -> None:
        now = time.monotonic()
        self._recent[exec_id] = (now + _HOLD, outcome, size)
        # Oldest first (dicts keep insertion order); the newest is always held.
        budget = 4 * self.max_bytes
        total = sum(size for _, _, size in self._recent.values())
        for key, (until, _, size) in list(self._recent.items()):
            if key == exec_id or (until > now and total <= budget):
                continue
            del self._recent[key]
            total -= size

    def _held(self, exec_id: str) -> ExecOutcome | None:
        held = self._recent.get(exec_id)
        if held is None:
            return None
        if held[0] <= time.monotonic():
            del self._recent[exec_id]
            return None
        return held[1]

    # -- reading --------------------------------------------------------------------------------

    def _memory(self, exec_id: str, after: int) -> list[OutputRecord]:
        with self._cond:
            held = [*self._inflight, *self._pending]
        return [
            OutputRecord(c.seq, c.stream, c.data)
            for c in held
            if c.exec_id == exec_id and c.seq > after
        ]

    async def _read_once(self, exec_id: str, tenant: str, after: int) -> ExecOutputPage:
        live = self._live.get(exec_id)
        # Memory first, then the database: a chunk committed in between is in the database
        # read, and one still buffered is in this snapshot, so together nothing is missed.
        memory = self._memory(exec_id, after) if live is not None else []
        if live is not None and live.tenant == tenant and memory and memory[0].seq == after + 1:
            return ExecOutputPage(chunks=_contiguous(memory, after))
        page: ExecPage = await anyio.to_thread.run_sync(
            lambda: self.runs.read(exec_id, tenant=tenant, after=after)
        )
        merged = {c.seq: OutputRecord(c.seq, c.stream, c.data) for c in page.chunks}
        for m in memory:
            merged.setdefault(m.seq, m)
        chunks = _contiguous(sorted(merged.values(), key=lambda c: c.seq), after)
        last = chunks[-1].seq if chunks else after
        run = page.run
        held = self._held(exec_id)
        if (
            held is None
            and run.finished_at is not None
            and time.time() - run.finished_at >= self.retention
        ):
            msg = (
                f"the output of exec {exec_id} has expired: the server keeps it "
                f"{self.retention:g} s after a command ends"
            )
            raise OutputExpired(msg, exec_id=exec_id, retention=self.retention)
        outcome = None
        ended = run.state != "running" and run.chunk_count is not None
        if ended and last + 1 >= (run.chunk_count or 0):
            if held is not None:
                return ExecOutputPage(chunks=chunks, outcome=held)
            for doc in (run.result, run.error):
                dropped = doc.get(_DROPPED) if doc is not None else None
                if dropped is not None:
                    msg = (
                        f"exec {exec_id} ended, but its collected output ({dropped} bytes) "
                        f"was over the {self.max_bytes} bytes the server keeps per command "
                        "for reconnects, so its outcome is not served again"
                    )
                    exit_code = run.exit_code
                    raise OutputExpired(msg, exec_id=exec_id, exit_code=exit_code)
            outcome = ExecOutcome(
                result=cast("dict[str, object] | None", run.result),
                error=cast("dict[str, object] | None", run.error),
            )
        return ExecOutputPage(chunks=chunks, outcome=outcome)

    async def read(self, exec_id: str, *, tenant: str, after: int, wait: float) -> ExecOutputPage:
        """Chunks with ``seq > after``, waiting up to ``wait`` seconds for the first.

        Raises:
            NotFound: Unknown, swept or another tenant's command.
            OutputExpired: Chunks after ``after`` were already dropped.
        """
        deadline = time.monotonic() + wait
        while True:
            live = self._live.get(exec_id)
            changed = live.changed if live is not None else None
            page = await self._read_once(exec_id, tenant, after)
            remaining = deadline - time.monotonic()
            if page.chunks or page.outcome is not None or remaining <= 0:
                return page
            with anyio.move_on_after(min(remaining, self.poll_interval)):
                if changed is not None:
                    await changed.wait()
                else:
                    await anyio.sleep(remaining)

    # -- upkeep ---------------------------------------------------------------------------------

    async def run_upkeep(self) -> None:
        """Sweep expired commands now and then, until cancelled (the server runs it)."""
        while True:
            await anyio.sleep(_upkeep_interval(self.retention))
            await anyio.to_thread.run_sync(self.sweep)

    def sweep(self) -> int:
        """Delete commands that finished more than ``retention`` seconds ago; how many."""
        try:
            return self.runs.sweep(finished_before=time.time() - self.retention)
        except BackendUnavailable:
            _log.exception("sweeping old exec output failed")
            return 0

    async def mark_unknown_abandoned(
        self, owner_alive: Callable[[str], bool] = _local_owner_alive
    ) -> list[str]:
        """Mark commands whose server process died ``unknown`` (call at server start).

        Their readers get the output that reached the database, then an error saying the
        outcome is unknown; nothing runs them again.

        Returns:
            The exec ids marked.
        """
        err = BackendUnavailable(
            "the server that ran this command stopped while it ran; its outcome is unknown "
            "and it was not run again",
            outcome="unknown",
        )
        error = cast("dict[str, JsonValue]", problem_body(err))
        return await anyio.to_thread.run_sync(
            lambda: self.runs.mark_unknown_abandoned(error, owner_alive=owner_alive)
        )


_HOLD = 30.0
"""Seconds this process holds a whole outcome whose collected output it did not store."""

_DROPPED = "sandlot_output_dropped"
"""Key in a stored result (or error) whose collected output was left out: how many bytes."""


def _upkeep_interval(retention: float) -> float:
    """Seconds between sweeps: a fraction of the retention, within sane bounds."""
    return min(max(retention / 4, 0.25), 60.0)


def _without_big_output(
    doc: dict[str, object] | None, limit: int
) -> tuple[dict[str, JsonValue] | None, int]:
    """``doc`` (a result, or a problem carrying one) to store: without its collected output
    when that is over ``limit`` bytes; and how many bytes were left out (0: none)."""
    if doc is None:
        return None, 0
    stored = cast("dict[str, JsonValue]", doc)
    nested = stored.get("result")
    holder = nested if isinstance(nested, dict) else stored
    size = sum(len(v.encode()) for k in ("stdout", "stderr") if isinstance(v := holder.get(k), str))
    if size <= limit:
        return stored, 0
    slim = {**holder, "stdout": "", "stderr": ""}
    stored = {**stored, "result": slim} if holder is nested else slim
    return {**stored, _DROPPED: size}, size


def _contiguous(chunks: list[OutputRecord], after: int) -> list[OutputRecord]:
    """The run of ``chunks`` that starts at ``after + 1`` with no hole."""
    out: list[OutputRecord] = []
    for c in chunks:
        if c.seq != after + 1 + len(out):
            break
        out.append(c)
    return out
