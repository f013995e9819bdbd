"""Exec runs and their output chunks in the database: what a reader on any process resumes from.

A run is one command: a row in ``exec_runs`` (who streams it, its state, its outcome) and its
output as numbered chunks in ``exec_chunks`` (``PRIMARY KEY (exec_id, seq)``, each with its
byte offset in its stream). Chunks arrive here in batches (the caller buffers: one transaction
per batch, never one per chunk), and the run's outcome is written in the same transaction as its
last chunks, so a reader that sees the outcome has every chunk before it.

Retention is bounded twice: per run, only the newest ``max_bytes`` of output are kept (older
chunks are deleted and ``first_seq`` moves on, so a reader asking for them gets
``OutputExpired``, never a silent gap); and :meth:`ExecRuns.sweep` deletes runs that ended
before a cutoff.

A run left ``running`` by a process that died is never run again: :meth:`ExecRuns.mark_unknown_abandoned`
marks it ``unknown`` with the chunks that reached the database. This module imports SQLAlchemy,
:mod:`sandlot.errors` and the journal's schema; never the Manager, backends or front ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, final

from sqlalchemy import Engine, delete, func, insert, select, update
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from sandlot.errors import (
    BackendUnavailable,
    Conflict,
    InvalidRequest,
    InvalidState,
    NotFound,
    OutputExpired,
)
from sandlot.journal.owner import owner_alive as _local_owner_alive
from sandlot.journal.schema import exec_chunks, exec_runs

if TYPE_CHECKING:
    from sqlalchemy import Connection, RowMapping

    from sandlot.receipts.canonical import JsonValue

__all__ = ["ExecChunk", "ExecPage", "ExecRun", "ExecRunState", "ExecRuns", "NewChunk", "Stream"]

ExecRunState = Literal["running", "finished", "unknown"]
Stream = Literal["stdout", "stderr", "notice"]
"""A chunk's stream: the command's output, or a ``notice`` of the server's own about the run
(JSON: it is held for approval, …), which readers get in order with the output."""


@dataclass(frozen=True)
class NewChunk:
    """A chunk to write: its run, its number, its stream, its byte offset in that stream."""

    exec_id: str
    seq: int
    stream: Stream
    offset: int
    data: bytes


@dataclass(frozen=True)
class ExecChunk:
    """A stored chunk of output."""

    seq: int
    stream: Stream
    offset: int
    data: bytes


@dataclass(frozen=True)
class ExecRun:
    """A command's run as stored."""

    exec_id: str
    tenant: str
    sandbox_id: str
    intent_id: str | None
    owner: str
    state: ExecRunState
    exit_code: int | None
    result: dict[str, JsonValue] | None
    error: dict[str, JsonValue] | None
    first_seq: int
    """The oldest chunk still kept (older ones were dropped by the byte limit)."""
    chunk_count: int | None
    """How many chunks the run produced; known once it ended."""
    kept_bytes: int
    started_at: float
    finished_at: float | None


@dataclass(frozen=True)
class ExecPage:
    """What one read returns: the run and the contiguous chunks after the cursor."""

    run: ExecRun
    chunks: list[ExecChunk]
    after: int
    """The cursor the read started after."""

    @property
    def done(self) -> bool:
        """Whether the run ended and, with this page, the reader has seen its last chunk."""
        last = self.chunks[-1].seq if self.chunks else self.after
        count = self.run.chunk_count
        return self.run.state != "running" and count is not None and last + 1 >= count


def _run(row: RowMapping) -> ExecRun:
    return ExecRun(
        exec_id=row["exec_id"],
        tenant=row["tenant"],
        sandbox_id=row["sandbox_id"],
        intent_id=row["intent_id"],
        owner=row["owner"],
        state=row["state"],
        exit_code=row["exit_code"],
        result=row["result"],
        error=row["error"],
        first_seq=int(row["first_seq"]),
        chunk_count=None if row["chunk_count"] is None else int(row["chunk_count"]),
        kept_bytes=int(row["kept_bytes"]),
        started_at=row["started_at"],
        finished_at=row["finished_at"],
    )


@dataclass
class _Kept:
    """What this process wrote for one open run: (seq, size) of the chunks still kept."""

    chunks: deque[tuple[int, int]] = field(default_factory=deque)
    size: int = 0


@final
class ExecRuns:
    """Exec runs on one database, written by this process (``owner``), readable by any.

    Thread-safe. Give it an engine from :func:`sandlot.store.sql.open_engine` (schema current).

    Args:
        engine: The database.
        owner: This process (:func:`sandlot.journal.owner.process_owner`): runs it opens are
            marked with it, so that they can be found when it dies.
        max_bytes: Output kept per run; beyond it the oldest chunks are deleted (the newest
            chunk is always kept, whatever its size).
    """

    def __init__(self, engine: Engine, *, owner: str, max_bytes: int = 16 << 20) -> None:
        self.engine = engine
        self.owner = owner
        self.max_bytes = max_bytes
        self._writer = engine.execution_options(sandlot_write=True)
        # A read sees the run row and its chunks at one instant, so a trim between the two
        # cannot look like a gap. SQLite read transactions are snapshots already.
        self._reader = (
            engine.execution_options(isolation_level="REPEATABLE READ")
            if engine.dialect.name == "postgresql"
            else engine
        )
        self._lock = threading.Lock()
        # Writes of this process go one at a time: each batch is planned against the trims of
        # the one before, and commits in seq order, so readers never see a later chunk first.
        self._serial = threading.Lock()
        self._kept: dict[str, _Kept] = {}

    @contextlib.contextmanager
    def _db(self, *, write: bool) -> Iterator[Connection]:
        try:
            if write:
                with self._writer.begin() as conn:
                    yield conn
            else:
                with self._reader.connect() as conn, conn.begin():
                    yield conn
        except OperationalError as e:
            msg = f"exec output database error: {e.orig}"
            raise BackendUnavailable(msg) from e
        except DataError as e:
            msg = f"the exec output database refused a value: {e.orig}"
            raise InvalidRequest(msg) from e

    # -- writing --------------------------------------------------------------------------------

    def open(
        self, exec_id: str, *, tenant: str, sandbox_id: str, intent_id: str | None = None
    ) -> None:
        """Record the start of a run (state ``running``, owned by this process).

        Raises:
            Conflict: ``exec_id`` exists already.
        """
        try:
            with self._db(write=True) as conn:
                conn.execute(
                    insert(exec_runs).values(
                        exec_id=exec_id,
                        tenant=tenant,
                        sandbox_id=sandbox_id,
                        intent_id=intent_id,
                        owner=self.owner,
                        state="running",
                        first_seq=0,
                        kept_bytes=0,
                        started_at=time.time(),
                    )
                )
        except IntegrityError as e:
            msg = f"exec {exec_id} exists already"
            raise Conflict(msg, exec_id=exec_id) from e
        with self._lock:
            self._kept[exec_id] = _Kept()

    def _plan(self, chunks: Sequence[NewChunk]) -> dict[str, tuple[int, int, int]]:
        """Per run in ``chunks``: (kept chunks to drop from the front, new first seq, new size).

        Computed without changing ``_kept``, which changes only once the batch committed (so a
        failed batch can be retried as it was).
        """
        added: dict[str, list[NewChunk]] = {}
        for c in chunks:
            added.setdefault(c.exec_id, []).append(c)
        plan: dict[str, tuple[int, int, int]] = {}
        for exec_id, new in added.items():
            kept = self._kept.get(exec_id)
            if kept is None:
                msg = f"exec {exec_id} was not opened by this process, or has ended"
                raise InvalidState(msg, exec_id=exec_id)
            size = kept.size + sum(len(c.data) for c in new)
            count = len(kept.chunks) + len(new)
            drop = 0
            while size > self.max_bytes and count - drop > 1:
                if drop < len(kept.chunks):
                    size -= kept.chunks[drop][1]
                else:
                    size -= len(new[drop - len(kept.chunks)].data)
                drop += 1
            if drop < len(kept.chunks):
                first = kept.chunks[drop][0] if kept.chunks else new[0].seq
            else:
                first = new[drop - len(kept.chunks)].seq
            plan[exec_id] = (drop, first, size)
        return plan

    def _write_chunks(self, conn: Connection, chunks: Sequence[NewChunk]) -> Callable[[], None]:
        """Write ``chunks`` (and the trims they cause); returns what to apply after commit."""
        if not chunks:
            return lambda: None
        with self._lock:
            plan = self._plan(chunks)
        conn.execute(
            insert(exec_chunks),
            [
                {
                    "exec_id": c.exec_id,
                    "seq": c.seq,
                    "stream": c.stream,
                    "stream_offset": c.offset,
                    "data": c.data,
                }
                for c in chunks
            ],
        )
        for exec_id, (drop, first, size) in plan.items():
            if drop:
                conn.execute(
                    delete(exec_chunks).where(
                        exec_chunks.c.exec_id == exec_id, exec_chunks.c.seq < first
                    )
                )
                conn.execute(
                    update(exec_runs)
                    .where(exec_runs.c.exec_id == exec_id)
                    .values(first_seq=first, kept_bytes=size)
                )

        def apply() -> None:
            with self._lock:
                for c in chunks:
                    kept = self._kept.get(c.exec_id)
                    if kept is not None:
                        kept.chunks.append((c.seq, len(c.data)))
                for exec_id, (drop, _, size) in plan.items():
                    kept = self._kept.get(exec_id)
                    if kept is None:
                        continue
                    for _ in range(drop):
                        kept.chunks.popleft()
                    kept.size = size

        return apply

    def write(self, chunks: Sequence[NewChunk]) -> None:
        """Write a batch of chunks (of any runs this process opened) in one transaction.

        Chunks of one run must come in ``seq`` order, after every chunk of it written before.

        Raises:
            InvalidState: A chunk belongs to a run this process did not open, or that ended.
            BackendUnavailable: The database failed; nothing was written (retry the batch).
        """
        with self._serial:
            with self._db(write=True) as conn:
                apply = self._write_chunks(conn, chunks)
            apply()

    def finish(
        self,
        exec_id: str,
        *,
        chunk_count: int,
        result: Mapping[str, JsonValue] | None = None,
        error: Mapping[str, JsonValue] | None = None,
        chunks: Sequence[NewChunk] = (),
    ) -> None:
        """End a run: its last chunks (``chunks``, of any runs) and its outcome, in one transaction.

        Args:
            exec_id: The run.
            chunk_count: How many chunks it produced in all (its next seq).
            result: How it ended (an ``ExecResult`` as JSON), or
            error: the error it ended with (a problem document).
            chunks: Chunks not yet written (this run's last ones, and any others pending).
        """
        exit_code = result.get("exit_code") if result is not None else None
        with self._serial:
            with self._db(write=True) as conn:
                apply = self._write_chunks(conn, chunks)
                conn.execute(
                    update(exec_runs)
                    .where(exec_runs.c.exec_id == exec_id, exec_runs.c.state == "running")
                    .values(
                        state="finished",
                        exit_code=exit_code if isinstance(exit_code, int) else None,
                        result=None if result is None else dict(result),
                        error=None if error is None else dict(error),
                        chunk_count=chunk_count,
                        kept_bytes=select(
                            func.coalesce(func.sum(func.length(exec_chunks.c.data)), 0)
                        )
                        .where(exec_chunks.c.exec_id == exec_id)
                        .scalar_subquery(),
                        finished_at=time.time(),
                    )
                )
            apply()
        with self._lock:
            self._kept.pop(exec_id, None)

    # -- reading --------------------------------------------------------------------------------

    def get(self, exec_id: str, *, tenant: str | None = None) -> ExecRun:
        """The run's row.

        Raises:
            NotFound: No such run (or it belongs to another tenant, or it was swept).
        """
        with self._db(write=False) as conn:
            return self._get(conn, exec_id, tenant)

    @staticmethod
    def _get(conn: Connection, exec_id: str, tenant: str | None) -> ExecRun:
        cond = exec_runs.c.exec_id == exec_id
        if tenant is not None:
            cond = cond & (exec_runs.c.tenant == tenant)
        row = conn.execute(select(exec_runs).where(cond)).mappings().first()
        if row is None:
            msg = f"no exec {exec_id!r} (unknown, or its output is no longer kept)"
            raise NotFound(msg, exec_id=exec_id)
        return _run(row)

    def read(self, exec_id: str, *, tenant: str, after: int, limit: int = 256) -> ExecPage:
        """The run and its chunks with ``seq > after`` (contiguous, at most ``limit``).

        Raises:
            NotFound: No such run for ``tenant``.
            OutputExpired: Chunks after ``after`` were dropped by the byte limit.
        """
        with self._db(write=False) as conn:
            run = self._get(conn, exec_id, tenant)
            if after + 1 < run.first_seq:
                msg = (
                    f"output of exec {exec_id} before chunk {run.first_seq} was dropped "
                    f"(the server keeps {self.max_bytes} bytes per command); asked from "
                    f"{after + 1}"
                )
                raise OutputExpired(msg, exec_id=exec_id, first_seq=run.first_seq)
            rows = conn.execute(
                select(
                    exec_chunks.c.seq,
                    exec_chunks.c.stream,
                    exec_chunks.c.stream_offset,
                    exec_chunks.c.data,
                )
                .where(exec_chunks.c.exec_id == exec_id, exec_chunks.c.seq > after)
                .order_by(exec_chunks.c.seq)
                .limit(limit)
            ).all()
        chunks: list[ExecChunk] = []
        for r in rows:
            # Never hand out a chunk past a hole: the caller's cursor would skip the hole.
            if r.seq != after + 1 + len(chunks):
                break
            chunks.append(ExecChunk(int(r.seq), r.stream, int(r.stream_offset), bytes(r.data)))
        return ExecPage(run=run, chunks=chunks, after=after)

    # -- upkeep ---------------------------------------------------------------------------------

    def sweep(self, *, finished_before: float) -> int:
        """Delete runs that ended before ``finished_before`` (epoch seconds) and their output.

        Returns:
            How many runs were deleted.
        """
        old = select(exec_runs.c.exec_id).where(exec_runs.c.finished_at < finished_before)
        with self._db(write=True) as conn:
            conn.execute(delete(exec_chunks).where(exec_chunks.c.exec_id.in_(old)))
            return conn.execute(delete(exec_runs).where(exec_runs.c.exec_id.in_(old))).rowcount

    def mark_unknown_abandoned(
        self,
        error: Mapping[str, JsonValue],
        *,
        owner_alive: Callable[[str], bool] = _local_owner_alive,
    ) -> list[str]:
        """Mark runs whose streaming process died ``unknown`` (never run again).

        Their output stays readable up to the last chunk that reached the database; readers
        then get ``error`` as the outcome.

        Args:
            error: The outcome readers get (a problem document saying the outcome is unknown).
            owner_alive: Whether an owner process still runs (default: provable only for
                processes on this host; see :func:`sandlot.journal.owner.owner_alive`).

        Returns:
            The exec ids marked.
        """
        with self._db(write=False) as conn:
            owners = [
                r[0]
                for r in conn.execute(
                    select(exec_runs.c.owner).where(exec_runs.c.state == "running").distinct()
                )
            ]
        dead = [o for o in owners if o != self.owner and not owner_alive(o)]
        if not dead:
            return []
        last = (
            select(func.coalesce(func.max(exec_chunks.c.seq) + 1, exec_runs.c.first_seq))
            .where(exec_chunks.c.exec_id == exec_runs.c.exec_id)
            .scalar_subquery()
        )
        with self._db(write=True) as conn:
            cond = (exec_runs.c.state == "running") & exec_runs.c.owner.in_(dead)
            ids = [r[0] for r in conn.execute(select(exec_runs.c.exec_id).where(cond))]
            conn.execute(
                update(exec_runs)
                .where(cond)
                .values(
                    state="unknown",
                    error=dict(error),
                    chunk_count=last,
                    finished_at=time.time(),
                )
            )
        return ids
