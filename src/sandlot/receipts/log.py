"""The receipt log: appends signed, hash-chained receipts to the database, and reads them back.

This module owns the chain: contiguous ``seq`` from 1, ``prev_hash`` = ``entry_hash`` of the
previous receipt, the Lamport clock, key rotation, checkpoints and Merkle proofs. It imports
the receipts' own modules, :mod:`sandlot.errors` and SQLAlchemy; never the Manager, backends
or front ends.

How appenders in several processes never fork the chain: rows are immutable and
``(log_id, seq)`` is the primary key, so no seq is ever written twice. On SQLite an appender
first chains onto the tail it remembers and inserts with no lock (the insert is the
transaction's first statement, so SQLite takes its write lock before reading anything); a
successful insert of ``tail + 1`` proves the remembered tail was the real one, because that row
can never change. If another process got there first, the appender retries once under the
log's write lock (a no-op UPDATE on SQLite, ``pg_advisory_xact_lock`` on PostgreSQL), reading the
tail inside the transaction, and so cannot lose again. On PostgreSQL, where several processes
are the normal case, every append takes the lock.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, TextIO, TypeVar, final

from sqlalchemy import Connection, Engine, Row, Select, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from sandlot.errors import Conflict, InvalidRequest, InvalidState, NotFound, SandboxError
from sandlot.receipts import merkle
from sandlot.receipts.canonical import GENESIS_HASH, JsonValue, sha256_ref
from sandlot.receipts.checkpoint import Checkpoint, check_origin, sign_checkpoint
from sandlot.receipts.dsse import Signature, pae
from sandlot.receipts.receipt import (
    APPROVAL,
    DECISION,
    EXECUTION,
    KEY_ROTATION,
    PAYLOAD_TYPE,
    Decision,
    Entry,
    Receipt,
    draft_entry,
    seal_entry,
    seal_signed,
)
from sandlot.receipts.schema import receipt_checkpoints, receipt_keys, receipts
from sandlot.receipts.signer import Ed25519Signer, Signer, TrustedKey, TrustRoot

__all__ = ["DEFAULT_LOG_ID", "ReceiptLog"]

#: The origin of a log nobody named; also the key name in its checkpoints.
DEFAULT_LOG_ID = "sandlot.local/receipts"

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Batches at least this big are signed on two threads (handing a chunk over costs ~20 µs).
_PARALLEL_SIGNING = 16
_HANDED_OVER = 0.6  # measured best of 0.5-0.9 (this thread also drafts)


def _sign_each(sign: Callable[[bytes], bytes], messages: list[bytes]) -> list[bytes]:
    return [sign(m) for m in messages]


# The receipts columns in the order _row gives them. Appends insert with a plain positional
# statement through exec_driver_sql: with insert(receipts), SQLAlchemy's compiled-statement
# machinery and a dict per row cost ~10 µs a receipt (~80 µs on a one-receipt transaction).
_ROW_COLUMNS = (
    "log_id",
    "seq",
    "lamport",
    "type",
    "entry_hash",
    "leaf_hash",
    "prev_hash",
    "key_id",
    "tenant",
    "principal",
    "sandbox_id",
    "op",
    "request_hash",
    "decision",
    "reason_code",
    "decision_ref",
    "consumes",
    "envelope",
    "created_at",
)
_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


@dataclass(frozen=True)
class _Tail:
    """The last receipt of the log, as far as this process knows."""

    seq: int
    entry_hash: str
    lamport: int
    next_key_id: str | None  # the key that must sign seq + 1 (None: the log is empty)


_EMPTY = _Tail(seq=0, entry_hash=GENESIS_HASH, lamport=0, next_key_id=None)


@final
class ReceiptLog:
    """An append-only, signed, hash-chained log of receipts in a SQL database.

    Thread-safe; several processes may append to the same log at once.

    Example::

        log = ReceiptLog(engine, KeyStore.default().active())
        d = log.append(decision_entry(op="exec", request_hash=h, decision=Decision.ALLOW,
                                      reason_code="OK", sandbox_id=sid))
        ...  # execute only because d is an ALLOW
        log.append(execution_entry(d, output_hash=out, exit_code=0))
        log.maybe_checkpoint()
    """

    def __init__(
        self,
        engine: Engine,
        signer: Signer,
        *,
        log_id: str = DEFAULT_LOG_ID,
        checkpoint_every: int = 1000,
        checkpoint_interval: float = 60.0,
    ) -> None:
        """Open the log ``log_id`` in ``engine``'s database (its tables must exist).

        Args:
            engine: A SQLAlchemy engine (SQLite in WAL mode, or PostgreSQL).
            signer: The key that signs new receipts; it must be the log's current key.
            log_id: The log's origin: a schema-less URL without spaces, e.g.
                ``sandlot.example.com/receipts``.
            checkpoint_every: :meth:`maybe_checkpoint` signs one after this many receipts.
            checkpoint_interval: ... or after this many seconds with new receipts.
        """
        self.log_id = check_origin(log_id)
        self._engine = engine
        self._signer = signer
        self._every = checkpoint_every
        self._interval = checkpoint_interval
        self._lock = threading.Lock()
        self._tail: _Tail | None = None
        self._listeners: list[Callable[[Receipt], None]] = []
        self._checkpointed: tuple[int, float] | None = None  # (size, monotonic time)
        self._conn: Connection | None = None
        self._insert_sql = _insert_sql(engine.dialect.paramstyle)
        self._signing: ThreadPoolExecutor | None = None  # see _seal_entries
        # The PostgreSQL advisory lock key of this log: 64 signed bits of its id's hash.
        digest = hashlib.sha256(log_id.encode()).digest()
        self._lock_key = int.from_bytes(digest[:8], "big", signed=True)

    @property
    def signer(self) -> Signer:
        """The key new receipts are signed with."""
        return self._signer

    # -- appending ---------------------------------------------------------------------------

    def append(self, entry: Entry, *, seen_lamport: int = 0) -> Receipt:
        """Sign and persist one receipt; it is durable when this returns.

        Args:
            entry: What to record.
            seen_lamport: The highest Lamport value received from elsewhere (a peer host, a
                remote decision point); the new receipt's clock moves past it.

        Returns:
            The receipt, with its seq and entry_hash.

        Raises:
            InvalidRequest: The entry references a receipt that cannot authorize it.
            Conflict: The decision it executes already has an execution receipt.
            InvalidState: Another process rotated the key; reopen with the new one.
            SandboxError: The database failed; nothing was recorded.
        """
        return self.append_many([entry], seen_lamport=seen_lamport)[0]

    def append_many(self, entries: Sequence[Entry], *, seen_lamport: int = 0) -> list[Receipt]:
        """Sign and persist several receipts in one transaction (all or none).

        Raises:
            Same as :meth:`append`.
        """
        if not entries:
            return []
        if any(e.type == KEY_ROTATION for e in entries):
            msg = "key_rotation receipts are written by rotate()"
            raise InvalidRequest(msg)
        self._check_references(entries)

        def build(tail: _Tail) -> list[Receipt]:
            return self._seal_entries(tail, entries, seen_lamport)

        return self._commit(build)

    def rotate(self, new_signer: Signer) -> Receipt:
        """Switch to a new key with a ``key_rotation`` receipt.

        The receipt carries the new public key, is signed by the current key and
        countersigned by the new one (proof that the new key's holder asked for it). From the
        next seq on only the new key is accepted. Keep the new key where the next process
        will look for it (``KeyStore.activate``).

        Raises:
            InvalidRequest: ``new_signer`` is the current key.
            InvalidState: Another process rotated the key first.
            SandboxError: The database failed; nothing changed.
        """
        if new_signer.key_id == self._signer.key_id:
            msg = "the new key is the current key"
            raise InvalidRequest(msg)
        new_key: dict[str, JsonValue] = {
            "key_id": new_signer.key_id,
            "alg": "ed25519",
            "public_key": base64.b64encode(new_signer.public_key).decode(),
        }
        entry = Entry(type=KEY_ROTATION, detail={"new_key": new_key})

        def build(tail: _Tail) -> list[Receipt]:
            return [
                seal_entry(
                    entry,
                    log_id=self.log_id,
                    seq=tail.seq + 1,
                    lamport=tail.lamport + 1,
                    ts=_timestamp(),
                    prev_hash=tail.entry_hash,
                    signers=[self._signer, new_signer],
                )
            ]

        (receipt,) = self._commit(build, new_signer=new_signer)
        return receipt

    def on_receipt(self, callback: Callable[[Receipt], None]) -> Callable[[], None]:
        """Call ``callback(receipt)`` after each receipt this process commits.

        Callbacks run in the appending thread, after the commit; an exception in one is
        logged and does not undo the receipt.

        Returns:
            A function that removes the callback.
        """
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    def _commit(
        self, build: Callable[[_Tail], list[Receipt]], *, new_signer: Signer | None = None
    ) -> list[Receipt]:
        with self._lock:
            built = None
            if self._engine.dialect.name == "sqlite":
                # One process is the common case on SQLite: chain onto the tail we remember
                # and skip the lock; only if another process got there first, take it.
                built = self._try_append(build, new_signer, locked=False)
            while built is None:  # a locked attempt cannot lose, so this runs once
                built = self._try_append(build, new_signer, locked=True)
        self._notify(built)
        return built

    def _try_append(
        self, build: Callable[[_Tail], list[Receipt]], new_signer: Signer | None, *, locked: bool
    ) -> list[Receipt] | None:
        """Build, sign and insert on top of the tail; None if another process appended first.

        Unlocked, the tail is the remembered one and the insert is the transaction's first
        statement. Locked, the transaction first takes the log's write lock and reads the tail
        under it, so nobody can append in between and it cannot lose.
        """
        tail = None if locked else (self._tail or self._load_tail())
        built: list[Receipt] = []
        try:
            with self._writer() as conn:
                if tail is None:
                    self._lock_log(conn)
                    tail = self._read_tail(conn)
                self._check_key(tail)
                built = build(tail)
                self._insert(conn, built)
                self._record_keys(conn, tail, built, new_signer)
        except IntegrityError as e:
            self._tail = None
            if not locked and tail is not None and self._load_tail().seq != tail.seq:
                return None
            self._raise_conflict(built, e)
        except SQLAlchemyError as e:
            self._tail = None
            self._drop_writer()
            msg = f"receipt log {self.log_id}: cannot persist receipts: {e}"
            raise SandboxError(msg) from e
        if new_signer is not None:
            self._signer = new_signer
        self._tail = self._tail_after(built[-1])
        return built

    def _lock_log(self, conn: Connection) -> None:
        """Take the lock every locked appender of this log waits for, until commit."""
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": self._lock_key})
        else:
            # Any write statement takes SQLite's one write lock; this one changes nothing.
            keys = receipt_keys.c
            conn.execute(
                update(receipt_keys)
                .where(keys.log_id == self.log_id, keys.key_id == "")
                .values(created_at=keys.created_at)
            )

    @contextlib.contextmanager
    def _writer(self) -> Iterator[Connection]:
        """A write transaction. On SQLite the connection is held between appends (under the
        lock): a pool checkout costs ~45 µs per append, and there is no server to drop it.
        Elsewhere each append checks one out, so the pool's liveness checks apply."""
        if self._engine.dialect.name != "sqlite":
            with self._engine.begin() as conn:
                yield conn
            return
        if self._conn is None:
            self._conn = self._engine.connect()
        with self._conn.begin():
            yield self._conn

    def _drop_writer(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                conn.close()

    def close(self) -> None:
        """Release the database connection this log appends through (it reopens on demand)."""
        with self._lock:
            self._drop_writer()
            signing, self._signing = self._signing, None
        if signing is not None:
            signing.shutdown()

    def _check_key(self, tail: _Tail) -> None:
        if tail.next_key_id not in (None, self._signer.key_id):
            msg = (
                f"receipt log {self.log_id} is now signed by {tail.next_key_id}, not "
                f"{self._signer.key_id}; reopen it with that key"
            )
            raise InvalidState(msg)

    def _seal_entries(
        self, tail: _Tail, entries: Sequence[Entry], seen_lamport: int
    ) -> list[Receipt]:
        # The chain runs through the payloads' hashes, not the signatures: a batch is drafted
        # in order while a second thread signs what is drafted so far (libsodium releases the
        # GIL; signing is a third of an append). Only our Ed25519 key: a KMS client may not
        # take calls from two threads.
        sign = self._signer.sign
        helper = None
        if len(entries) >= _PARALLEL_SIGNING and isinstance(self._signer, Ed25519Signer):
            if self._signing is None:
                self._signing = ThreadPoolExecutor(1, thread_name_prefix="receipt-signing")
            helper = self._signing
        # The helper takes the first chunks as they are drafted, about 60% of the batch: this
        # thread also drafts, so it signs less.
        chunk = max(8, len(entries) // 8)
        handed_over = int(len(entries) * _HANDED_OVER)
        pending: list[Future[list[bytes]]] = []
        drafts: list[tuple[dict[str, JsonValue], bytes, str]] = []
        messages: list[bytes] = []
        prev, lamport = tail.entry_hash, max(tail.lamport, seen_lamport)
        key_id = self._signer.key_id
        for offset, entry in enumerate(entries, start=1):
            body, payload = draft_entry(
                entry,
                log_id=self.log_id,
                seq=tail.seq + offset,
                lamport=lamport + offset,
                ts=_timestamp(),
                prev_hash=prev,
                key_id=key_id,
            )
            prev = sha256_ref(payload)
            drafts.append((body, payload, prev))
            messages.append(pae(PAYLOAD_TYPE, payload))
            if helper is not None and offset % chunk == 0 and offset <= handed_over:
                part = messages[offset - chunk : offset]
                pending.append(helper.submit(_sign_each, sign, part))
        mine = [sign(m) for m in messages[len(pending) * chunk :]]
        sigs = [sig for future in pending for sig in future.result()] + mine
        return [
            seal_signed(body, payload, entry_hash, (Signature(key_id, sig),))
            for (body, payload, entry_hash), sig in zip(drafts, sigs, strict=True)
        ]

    def _insert(self, conn: Connection, built: list[Receipt]) -> None:
        rows = [self._row(r) for r in built]
        if self._insert_sql is None:
            named = [dict(zip(_ROW_COLUMNS, row, strict=True)) for row in rows]
            conn.execute(insert(receipts), named)
        else:
            conn.exec_driver_sql(self._insert_sql, rows)

    def _row(self, r: Receipt) -> tuple[object, ...]:
        """The values of ``r``'s row, in the order of ``_ROW_COLUMNS``."""
        b = r.body
        get = b.get
        decision_ref = get("decision_ref")
        return (
            self.log_id,
            r.seq,
            r.lamport,
            r.type,
            r.entry_hash,
            r.leaf_hash.hex(),
            b["prev_hash"],
            b["key_id"],
            get("tenant"),
            get("principal"),
            get("sandbox_id"),
            get("op"),
            get("request_hash"),
            get("decision"),
            get("reason_code"),
            decision_ref,
            decision_ref if r.type in (EXECUTION, APPROVAL) else None,
            r.line,
            time.time(),
        )

    def _record_keys(
        self, conn: Connection, tail: _Tail, built: list[Receipt], new_signer: Signer | None
    ) -> None:
        """Keep ``receipt_keys`` (what the trust root is exported from) in step with the log."""
        now = time.time()
        if tail.seq == 0:
            conn.execute(insert(receipt_keys), [self._key_row(self._signer, 1, now)])
        if new_signer is not None:
            seq = built[-1].seq
            conn.execute(
                update(receipt_keys)
                .where(receipt_keys.c.log_id == self.log_id)
                .where(receipt_keys.c.key_id == self._signer.key_id)
                .values(valid_to_seq=seq)
            )
            conn.execute(insert(receipt_keys), [self._key_row(new_signer, seq + 1, now)])

    def _key_row(self, signer: Signer, valid_from: int, now: float) -> dict[str, object]:
        return {
            "log_id": self.log_id,
            "key_id": signer.key_id,
            "public_key": base64.b64encode(signer.public_key).decode(),
            "valid_from_seq": valid_from,
            "valid_to_seq": None,
            "created_at": now,
        }

    def _check_references(self, entries: Sequence[Entry]) -> None:
        """Refuse an execution or approval whose reference could not authorize it.

        Referenced rows are immutable, so checking them before the write transaction is safe.
        """
        refs = {e.decision_ref: e for e in entries if e.type in (EXECUTION, APPROVAL)}
        if not refs:
            return
        cols = receipts.c
        query = select(cols.entry_hash, cols.seq, cols.type, cols.decision, cols.request_hash)
        query = query.where(cols.log_id == self.log_id, cols.entry_hash.in_(list(refs)))
        found = {row.entry_hash: row for row in self._read(lambda c: list(c.execute(query)))}
        for ref, entry in refs.items():
            row = found.get(ref)
            wanted = (
                ((DECISION, APPROVAL), Decision.ALLOW)
                if entry.type == EXECUTION
                else ((DECISION,), Decision.HOLD)
            )
            if row is None:
                msg = f"{entry.type} references {ref}, which is not in log {self.log_id}"
                raise InvalidRequest(msg)
            if row.type not in wanted[0] or row.decision != wanted[1]:
                msg = f"{entry.type} references receipt {row.seq}, a {row.type} {row.decision}"
                raise InvalidRequest(msg)
            if row.request_hash != entry.request_hash:
                msg = f"{entry.type} is for another request than receipt {row.seq}"
                raise InvalidRequest(msg)

    def _raise_conflict(self, built: list[Receipt], error: IntegrityError) -> NoReturn:
        consumed = [r.body.get("decision_ref") for r in built if r.type in (EXECUTION, APPROVAL)]
        if consumed:
            msg = f"receipt {consumed[0]} was already used by an execution or approval"
            raise Conflict(msg) from error
        msg = f"receipt log {self.log_id}: unexpected constraint violation: {error.orig}"
        raise SandboxError(msg) from error

    def _notify(self, built: list[Receipt]) -> None:
        for receipt in built:
            for callback in list(self._listeners):
                try:
                    callback(receipt)
                except Exception:
                    _log.exception("on_receipt callback failed for receipt %d", receipt.seq)

    # -- the tail ------------------------------------------------------------------------------

    def _load_tail(self) -> _Tail:
        return self._read(self._read_tail)

    def _read_tail(self, conn: Connection) -> _Tail:
        c = receipts.c
        query = select(c.envelope).where(c.log_id == self.log_id).order_by(c.seq.desc()).limit(1)
        line = conn.execute(query).scalar()
        return _EMPTY if line is None else self._tail_after(Receipt.from_line(line))

    @staticmethod
    def _tail_after(r: Receipt) -> _Tail:
        next_key = r.key_id
        if r.type == KEY_ROTATION:
            detail = r.body.get("detail")
            new_key = detail.get("new_key") if isinstance(detail, dict) else None
            if isinstance(new_key, dict) and isinstance(new_key.get("key_id"), str):
                next_key = str(new_key["key_id"])
        return _Tail(seq=r.seq, entry_hash=r.entry_hash, lamport=r.lamport, next_key_id=next_key)

    def _read(self, fn: Callable[[Connection], _T]) -> _T:
        try:
            with self._engine.connect() as conn:
                return fn(conn)
        except SQLAlchemyError as e:
            msg = f"receipt log {self.log_id}: cannot read: {e}"
            raise SandboxError(msg) from e

    # -- reading -------------------------------------------------------------------------------

    def size(self) -> int:
        """The number of receipts in the log (the seq of the last one)."""
        query = select(func.max(receipts.c.seq)).where(receipts.c.log_id == self.log_id)
        return int(self._read(lambda c: c.execute(query).scalar()) or 0)

    def get(self, seq: int) -> Receipt:
        """The receipt at ``seq``.

        Raises:
            NotFound: There is no such receipt.
        """
        c = receipts.c
        query = select(c.envelope).where(c.log_id == self.log_id, c.seq == seq)
        line = self._read(lambda conn: conn.execute(query).scalar())
        if line is None:
            msg = f"no receipt {seq} in log {self.log_id}"
            raise NotFound(msg)
        return Receipt.from_line(line)

    def tail(self, n: int = 10, *, sandbox_id: str | None = None) -> list[Receipt]:
        """The last ``n`` receipts (optionally of one sandbox), oldest first."""
        c = receipts.c
        query = select(c.envelope).where(c.log_id == self.log_id)
        if sandbox_id is not None:
            query = query.where(c.sandbox_id == sandbox_id)
        query = query.order_by(c.seq.desc()).limit(n)
        lines = self._read(lambda conn: list(conn.execute(query).scalars()))
        return [Receipt.from_line(line) for line in reversed(lines)]

    def iterate(self, from_seq: int = 1, *, page: int = 1000) -> Iterator[Receipt]:
        """Every receipt from ``from_seq`` on, in order (read page by page)."""
        for line in self.lines(from_seq, page=page):
            yield Receipt.from_line(line)

    def lines(self, from_seq: int = 1, *, page: int = 1000) -> Iterator[str]:
        """The JSONL lines (canonical envelopes) from ``from_seq`` on, in order."""
        c = receipts.c
        seq = from_seq
        while True:
            query = (
                select(c.seq, c.envelope)
                .where(c.log_id == self.log_id, c.seq >= seq)
                .order_by(c.seq)
                .limit(page)
            )
            rows = self._read(functools.partial(_fetch_all, query))
            for row in rows:
                yield row.envelope
            if len(rows) < page:
                return
            seq = rows[-1].seq + 1

    def export_jsonl(self, out: TextIO, from_seq: int = 1) -> int:
        """Write the log as JSONL (one envelope per line) to ``out``; returns the count."""
        count = 0
        for line in self.lines(from_seq):
            out.write(line + "\n")
            count += 1
        return count

    def export_trust_root(self) -> TrustRoot:
        """Every key that signed this log, with the seqs each may sign.

        Before the first receipt, the current signer valid from seq 1.
        """
        query = (
            select(receipt_keys)
            .where(receipt_keys.c.log_id == self.log_id)
            .order_by(receipt_keys.c.valid_from_seq)
        )
        rows = self._read(lambda c: list(c.execute(query)))
        keys = tuple(
            TrustedKey(
                key_id=row.key_id,
                public_key=base64.b64decode(row.public_key),
                valid_from_seq=row.valid_from_seq,
                valid_to_seq=row.valid_to_seq,
            )
            for row in rows
        )
        if not keys:
            signer = self._signer
            keys = (TrustedKey(key_id=signer.key_id, public_key=signer.public_key),)
        return TrustRoot(log_id=self.log_id, keys=keys)

    # -- checkpoints and proofs ----------------------------------------------------------------

    def checkpoint(self) -> str:
        """Sign a checkpoint of the log as it is now (C2SP signed note) and store it.

        Returns the latest checkpoint unchanged when nothing was appended since.

        Raises:
            InvalidState: Another process rotated the key; reopen with the new one.
            SandboxError: The database failed.
        """
        size, old_range = self._latest_range()
        leaves = self._leaf_rows(size, None)
        if not leaves and size > 0:
            return self.latest_checkpoint() or ""
        compact = merkle.CompactRange(size, old_range)
        for seq, leaf in leaves:
            if seq != compact.size + 1:
                msg = f"receipt log {self.log_id} has a gap before seq {seq}"
                raise InvalidState(msg)
            compact.append(bytes.fromhex(leaf))
        tail = self._tail_after(self.get(compact.size)) if compact.size else _EMPTY
        self._check_key(tail)
        note = sign_checkpoint(Checkpoint(self.log_id, compact.size, compact.root()), self._signer)
        row = {
            "log_id": self.log_id,
            "tree_size": compact.size,
            "root_hash": compact.root().hex(),
            "compact_range": json.dumps([h.hex() for h in compact.hashes]),
            "note": note,
            "key_id": self._signer.key_id,
            "created_at": time.time(),
        }
        try:
            with self._engine.begin() as conn:
                conn.execute(insert(receipt_checkpoints), [row])
        except IntegrityError:
            note = self.latest_checkpoint() or note  # another process signed this size first
        except SQLAlchemyError as e:
            msg = f"receipt log {self.log_id}: cannot store checkpoint: {e}"
            raise SandboxError(msg) from e
        self._checkpointed = (compact.size, time.monotonic())
        return note

    def maybe_checkpoint(self) -> str | None:
        """Sign a checkpoint if ``checkpoint_every`` receipts or ``checkpoint_interval``
        seconds (with new receipts) have passed since the last one; else None."""
        if self._checkpointed is None:
            self._checkpointed = (self._latest_range()[0], time.monotonic())
        done, at = self._checkpointed
        size = self._tail.seq if self._tail is not None else self.size()
        pending = size - done
        due = pending >= self._every or (pending > 0 and time.monotonic() - at >= self._interval)
        return self.checkpoint() if due else None

    def latest_checkpoint(self) -> str | None:
        """The newest signed checkpoint note, or None before the first."""
        return self._checkpoint_note(None)

    def checkpoint_covering(self, seq: int) -> str | None:
        """The smallest stored checkpoint whose tree includes ``seq``, or None."""
        return self._checkpoint_note(seq)

    def inclusion_proof(self, seq: int, tree_size: int) -> list[bytes]:
        """The RFC 9162 audit path of receipt ``seq`` in the tree of the first ``tree_size``.

        Raises:
            InvalidRequest: ``seq`` is not within the first ``tree_size`` receipts.
        """
        if not 1 <= seq <= tree_size:
            msg = f"receipt {seq} is not in a tree of {tree_size}"
            raise InvalidRequest(msg)
        return merkle.inclusion_proof(self._leaves(tree_size), seq - 1)

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """The RFC 9162 proof that the first ``old_size`` receipts are a prefix of the first
        ``new_size``.

        Raises:
            InvalidRequest: ``old_size`` is larger than ``new_size``.
        """
        if not 0 <= old_size <= new_size:
            msg = f"a tree of {new_size} cannot extend one of {old_size}"
            raise InvalidRequest(msg)
        return merkle.consistency_proof(self._leaves(new_size), old_size)

    def root(self, tree_size: int) -> bytes:
        """The Merkle root of the first ``tree_size`` receipts."""
        return merkle.root(self._leaves(tree_size))

    def _leaves(self, size: int) -> list[bytes]:
        rows = self._leaf_rows(0, size)
        if len(rows) != size:
            msg = f"log {self.log_id} has {len(rows)} receipts, fewer than {size}"
            raise InvalidRequest(msg)
        return [bytes.fromhex(leaf) for _, leaf in rows]

    def _leaf_rows(self, after: int, upto: int | None) -> list[tuple[int, str]]:
        c = receipts.c
        query = select(c.seq, c.leaf_hash).where(c.log_id == self.log_id, c.seq > after)
        if upto is not None:
            query = query.where(c.seq <= upto)
        query = query.order_by(c.seq)
        return self._read(lambda conn: [(r.seq, r.leaf_hash) for r in conn.execute(query)])

    def _latest_range(self) -> tuple[int, list[bytes]]:
        c = receipt_checkpoints.c
        query = (
            select(c.tree_size, c.compact_range)
            .where(c.log_id == self.log_id)
            .order_by(c.tree_size.desc())
            .limit(1)
        )
        row = self._read(lambda conn: conn.execute(query).first())
        if row is None:
            return 0, []
        return row.tree_size, [bytes.fromhex(h) for h in json.loads(row.compact_range)]

    def _checkpoint_note(self, covering: int | None) -> str | None:
        c = receipt_checkpoints.c
        query = select(c.note).where(c.log_id == self.log_id)
        if covering is None:
            query = query.order_by(c.tree_size.desc())
        else:
            query = query.where(c.tree_size >= covering).order_by(c.tree_size)
        note: str | None = self._read(lambda conn: conn.execute(query.limit(1)).scalar())
        return note


def _insert_sql(paramstyle: str) -> str | None:
    """The positional INSERT of one receipts row in the DB-API driver's own placeholders; None
    for a driver with named placeholders (it inserts through SQLAlchemy, more slowly)."""
    mark = _PLACEHOLDERS.get(paramstyle)
    if mark is None:
        return None
    names, marks = ", ".join(_ROW_COLUMNS), ", ".join([mark] * len(_ROW_COLUMNS))
    return f"INSERT INTO {receipts.name} ({names}) VALUES ({marks})"


def _timestamp() -> str:
    """Now, as a receipt's ``ts``: UTC, microseconds, e.g. ``2026-01-01T00:00:00.000000Z``."""
    second, fraction = divmod(time.time_ns() // 1000, 1_000_000)
    return f"{_second_text(second)}.{fraction:06d}Z"


@functools.lru_cache(maxsize=1)
def _second_text(second: int) -> str:
    # Cached: every append within a second shares it, and datetime.isoformat costs ~2 µs.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def _fetch_all(query: Select[tuple[int, str]], conn: Connection) -> list[Row[tuple[int, str]]]:
    return list(conn.execute(query))
