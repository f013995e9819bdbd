"""The policy gate: every operation is decided, and the decision is on record, before it runs.

    normalize(request) -> decide -> decision receipt -> (only on ALLOW) execute -> execution receipt

The Manager calls :meth:`Gate.authorize` first and :meth:`Gate.complete` after. ``authorize``
returns only when an ALLOW is durably recorded; if the decision receipt cannot be written it
raises, so nothing executes. A DENY raises ``PolicyDenied`` carrying the reason code and the
receipt id. A HOLD writes a pending approval and waits (bounded) for ``approve``/``deny`` from
any process; the answer is itself a receipt, and the receipts table's uniqueness on what a
receipt consumes makes sure a HOLD is answered once and an ALLOW executed once.

This module composes :mod:`sandlot.policy` and :mod:`sandlot.receipts`; it must not import
backends or front ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, final

import anyio
import anyio.to_thread
from sqlalchemy import Connection, Engine, and_, insert, select, update

from sandlot.errors import Conflict, InvalidRequest, NotFound, PolicyDenied, SandboxError
from sandlot.gate.offload import Offload, SyncEngine
from sandlot.gate.schema import approvals
from sandlot.models import SYSTEM_PRINCIPAL, Actor, Approval, JsonValue, new_id
from sandlot.policy import (
    Decision,
    Explanation,
    Outcome,
    PolicyEngine,
    PolicyRequest,
    Principal,
    Resource,
    normalize_operation,
)
from sandlot.receipts import Decision as ReceiptDecision
from sandlot.receipts import PolicyRef, Receipt, ReceiptLog, canonical_json, sha256_ref
from sandlot.receipts.receipt import Entry, approval_entry, decision_entry, execution_entry
from sandlot.receipts.schema import receipts as receipts_table

__all__ = ["SYSTEM", "Approval", "Authorization", "Gate", "hold_listener"]

T = TypeVar("T")

SYSTEM = Actor(tenant="default", principal=SYSTEM_PRINCIPAL, admin=True)
"""The actor of the Manager's own housekeeping that belongs to no tenant (reaping orphans)."""


@dataclass(frozen=True)
class Authorization:
    """Proof that an operation may run: the ALLOW receipt it will consume."""

    receipt: Receipt
    """The ALLOW decision (or the ALLOW answer to a HOLD)."""
    request: PolicyRequest
    """What was decided."""
    decision: Decision
    """The engine's verdict."""


hold_listener: contextvars.ContextVar[Callable[[Approval], object] | None] = contextvars.ContextVar(
    "sandlot_hold_listener", default=None
)
"""Called, in the context of the operation that is held, with its pending approval: how a
server tells the one client whose request waits (the gate's ``on_hold`` hears every hold)."""

_log = logging.getLogger("sandlot")

_LINGER = 0.02
"""Seconds the receipt writer waits for more receipts before committing a batch."""


class _ReceiptWriter:
    """Appends execution receipts on a daemon thread, as many per transaction as are waiting.

    Decision receipts are never written here: they must be durable before anything runs, so
    the gate writes them itself and waits.
    """

    def __init__(self, log: ReceiptLog) -> None:
        self._log = log
        self._queue: queue.Queue[Entry | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, entry: Entry) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sandlot-receipts", daemon=True
                )
                self._thread.start()
        self._queue.put(entry)

    def flush(self) -> None:
        if self._thread is not None:
            self._queue.join()

    def _write(self, entries: list[Entry]) -> None:
        if not entries:
            return
        try:
            self._log.append_many(entries)
        except Exception:
            # One at a time, so only the entry that cannot be written is lost. The operations
            # already ran: a lost execution receipt is reported, never silent (their decision
            # receipts are in the log).
            for entry in entries:
                try:
                    self._log.append(entry)
                except Exception as e:
                    logging.getLogger("sandlot").error(
                        "could not write the execution receipt of %s: %s", entry.decision_ref, e
                    )
        with contextlib.suppress(Exception):
            self._log.maybe_checkpoint()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            # Linger a moment so a burst of operations shares one transaction, and the writer
            # rarely contends with the decision receipts on the caller's path.
            time.sleep(_LINGER)
            batch = [first]
            while len(batch) < 500:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            entries = [e for e in batch if e is not None]
            try:
                self._write(entries)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if None in batch:
                return


def _held(request: PolicyRequest, decision: Decision) -> str:
    """``exec held for approval by hold-git-push``: what a HOLD's denial message starts with."""
    by = f" by {', '.join(decision.matched)}" if decision.matched else ""
    return f"{request.action} held for approval{by}"


def _summary(request: PolicyRequest) -> str:
    ctx = request.context
    for key in ("raw", "path", "port", "snapshot_id"):
        value = ctx.get(key)
        if value not in (None, ""):
            return f"{request.action} {value}"
    return request.action


@final
class Gate:
    """Decides, records and (for HOLD) waits, for every operation the Manager runs.

    Args:
        engine: The policy engine.
        log: The receipt log (its database also holds the approvals).
        db: The SQLAlchemy engine of that database.
        hold_timeout: Seconds a HOLD waits for an answer before it becomes a DENY.
        on_deny: Called with each ``PolicyDenied`` before it is raised.
        on_hold: Called with each new pending :class:`Approval` as its wait begins (as is
            the :data:`hold_listener` of the operation's context).
    """

    def __init__(
        self,
        engine: PolicyEngine,
        log: ReceiptLog,
        db: Engine,
        *,
        hold_timeout: float = 300.0,
        on_deny: Callable[[PolicyDenied], object] | None = None,
        on_hold: Callable[[Approval], object] | None = None,
    ) -> None:
        self.engine = engine
        self.log = log
        self.db = db
        self.hold_timeout = hold_timeout
        self.on_deny = on_deny
        self.on_hold = on_hold
        self._writer = _ReceiptWriter(log)
        self._offload = Offload()

    def request(
        self, actor: Actor, action: str, resource: Resource, args: Mapping[str, object]
    ) -> PolicyRequest:
        """The normalized request for an operation."""
        return normalize_operation(
            action, principal=Principal.of(actor), resource=resource, args=args
        )

    async def explain(
        self, actor: Actor, action: str, resource: Resource, args: Mapping[str, object]
    ) -> Explanation:
        """What the policy would decide and why, without recording or running anything."""
        if self._offload.inline(args):
            return await self.engine.explain(self.request(actor, action, resource, args))
        engine = self.engine
        if isinstance(engine, SyncEngine):
            return await self._offload.run(
                lambda: engine.explain_now(self.request(actor, action, resource, args)),
                actor.tenant,
            )
        request = await self._offload.run(
            lambda: self.request(actor, action, resource, args), actor.tenant
        )
        return await engine.explain(request)

    async def _decide(
        self, actor: Actor, action: str, resource: Resource, args: Mapping[str, object]
    ) -> tuple[PolicyRequest, Decision, str]:
        """The request, the engine's decision and the request's hash; for a large operation
        the CPU work of all three runs off the event loop (see :mod:`sandlot.gate.offload`)."""
        if self._offload.inline(args):
            request = self.request(actor, action, resource, args)
            decision = await self.engine.decide(request)
            return request, decision, sha256_ref(canonical_json(request.canonical()))
        engine = self.engine
        if isinstance(engine, SyncEngine):

            def work() -> tuple[PolicyRequest, Decision, str]:
                request = self.request(actor, action, resource, args)
                decision = engine.evaluate(request)
                return request, decision, sha256_ref(canonical_json(request.canonical()))

            return await self._offload.run(work, actor.tenant)
        request = await self._offload.run(
            lambda: self.request(actor, action, resource, args), actor.tenant
        )
        decision = await engine.decide(request)
        digest = await self._offload.run(
            lambda: sha256_ref(canonical_json(request.canonical())), actor.tenant
        )
        return request, decision, digest

    async def authorize(
        self,
        actor: Actor,
        action: str,
        resource: Resource,
        args: Mapping[str, object],
        *,
        idempotency_key: str | None = None,
    ) -> Authorization:
        """Decide and record; return only for an ALLOW (after an approval, for a HOLD).

        Raises:
            PolicyDenied: DENY, a denied HOLD or a HOLD that timed out.
            SandboxError: The decision could not be recorded (nothing may run).
        """
        request, decision, request_hash = await self._decide(actor, action, resource, args)
        entry = decision_entry(
            op=action,
            request_hash=request_hash,
            decision=ReceiptDecision(decision.outcome.value),
            reason_code=decision.reason_code.value,
            policy=self._policy_ref(decision),
            tenant=actor.tenant,
            principal=actor.principal,
            sandbox_id=resource.sandbox_id,
            idempotency_key=idempotency_key,
            detail={"summary": _summary(request)[:500]},
        )
        receipt = await anyio.to_thread.run_sync(self.log.append, entry)
        if decision.outcome is Outcome.ALLOW:
            return Authorization(receipt, request, decision)
        if decision.outcome is Outcome.HOLD:
            answer = await self._wait_for_answer(actor, request, decision, receipt)
            return Authorization(answer, request, decision)
        self._deny(decision.denial(receipt.entry_hash))
        raise AssertionError  # pragma: no cover - _deny raises

    async def complete(
        self,
        auth: Authorization,
        *,
        output: bytes | None = None,
        output_hash: str | None = None,
        exit_code: int | None = None,
        error: str | None = None,
        detail: Mapping[str, JsonValue] | None = None,
    ) -> None:
        """Record what the authorized operation did (its output's hash, its exit code).

        ``output_hash`` (``sha256:…``) stands for output that streamed past without being
        kept; otherwise the hash is taken of ``output``.

        The execution receipt is written by a background writer, in batches, so the caller
        does not wait for a second commit; :meth:`flush` waits until everything submitted is
        durable (the SDK flushes when it closes).
        """
        extra: dict[str, JsonValue] = dict(detail or {})
        if error is not None:
            extra["error"] = error[:1000]
        entry = execution_entry(
            auth.receipt,
            output_hash=(
                output_hash if output is None else "sha256:" + hashlib.sha256(output).hexdigest()
            ),
            exit_code=exit_code,
            detail=extra or None,
        )
        self._writer.submit(entry)

    async def flush(self) -> None:
        """Wait until every execution receipt submitted so far is written."""
        await anyio.to_thread.run_sync(self._writer.flush)

    def close(self) -> None:
        """Write what is pending and stop the background writer."""
        self._writer.close()

    async def record_egress(
        self, tenant: str, sandbox_id: str, events: list[dict[str, JsonValue]]
    ) -> None:
        """Record egress decisions the sandbox's proxy took as ``network.egress`` receipts."""
        entries = [
            Entry(
                type="network.egress",
                op="network.egress",
                tenant=tenant,
                principal="system:egress-proxy",
                sandbox_id=sandbox_id,
                decision=ReceiptDecision.ALLOW
                if e.get("decision") == "allow"
                else ReceiptDecision.DENY,
                reason_code=str(e.get("reason", "")) or None,
                detail=e,
            )
            for e in events
        ]
        await anyio.to_thread.run_sync(self.log.append_many, entries)

    def _policy_ref(self, decision: Decision) -> PolicyRef:
        return PolicyRef(
            engine=decision.engine,
            policy_hash=decision.policy_hash,
            matched=tuple(decision.matched),
        )

    def _deny(self, error: PolicyDenied) -> None:
        if self.on_deny is not None:
            self.on_deny(error)
        raise error

    # -- HOLD and approvals -------------------------------------------------------------------

    async def _wait_for_answer(
        self, actor: Actor, request: PolicyRequest, decision: Decision, hold: Receipt
    ) -> Receipt:
        now = time.time()
        approval_id = new_id("appr")
        question = decision.hold_reason or decision.message or "approve this operation?"
        row = {
            "id": approval_id,
            "tenant": actor.tenant,
            "principal": actor.principal,
            "sandbox_id": request.resource.sandbox_id,
            "action": request.action,
            "summary": _summary(request)[:2000],
            "question": question,
            "request": request.canonical(),
            "hold_seq": hold.seq,
            "status": "pending",
            "created_at": now,
            "expires_at": now + self.hold_timeout,
        }
        await self._db(lambda conn: conn.execute(insert(approvals).values(**row)))
        await self._announce(
            Approval(
                id=approval_id,
                tenant=actor.tenant,
                principal=actor.principal,
                sandbox_id=request.resource.sandbox_id,
                action=request.action,
                summary=str(row["summary"]),
                question=question,
                status="pending",
                hold_seq=hold.seq,
                created_at=now,
                expires_at=now + self.hold_timeout,
            )
        )
        delay = 0.02
        try:
            while time.time() < now + self.hold_timeout:
                await anyio.sleep(delay)
                delay = min(delay * 1.5, 0.5)
                answer = await self._answer_receipt(hold)
                if answer is not None:
                    return self._accept(answer, request, decision, approval_id)
        except anyio.get_cancelled_exc_class():
            # The caller went away (cancelled): nobody would run an approval given now, so
            # the request is closed as expired rather than left pending.
            with anyio.CancelScope(shield=True), contextlib.suppress(Conflict, SandboxError):
                await self._expire(approval_id, hold, reason_code="HOLD_ABANDONED")
            raise
        # Nobody answered in time: the gate answers DENY itself. If an approver got there in
        # the same instant, the log refuses our answer (a HOLD is answered once) and theirs holds.
        try:
            timeout = await self._expire(approval_id, hold, reason_code="HOLD_TIMEOUT")
        except Conflict:
            answer = await self._answer_receipt(hold)
            assert answer is not None
            return self._accept(answer, request, decision, approval_id)
        self._deny(
            PolicyDenied(
                f"{_held(request, decision)} got no answer within {self.hold_timeout:g}s "
                f"({question}); to run it, ask again and have it approved in time "
                "(sandlot approvals approve ID)",
                reason_code="HOLD_TIMEOUT",
                receipt_id=timeout.entry_hash,
            )
        )
        raise AssertionError  # pragma: no cover

    async def _announce(self, approval: Approval) -> None:
        """Tell whoever waits on this operation that it is held (at once, not when the wait
        ends), so they can say how to approve it. A listener's failure is logged, not raised:
        the hold stands either way."""
        for listener in (self.on_hold, hold_listener.get()):
            if listener is None:
                continue
            try:
                result = listener(approval)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                _log.exception("a hold listener failed")

    async def _expire(self, approval_id: str, hold: Receipt, *, reason_code: str) -> Receipt:
        """Answer a HOLD with the gate's own DENY and close its approval request."""
        denial = await anyio.to_thread.run_sync(
            self.log.append,
            approval_entry(
                hold,
                decision=ReceiptDecision.DENY,
                principal="system:gate",
                reason_code=reason_code,
            ),
        )
        await self._settle_row(approval_id, "expired", "system:gate", denial.seq)
        return denial

    def _accept(
        self, answer: Receipt, request: PolicyRequest, decision: Decision, approval_id: str
    ) -> Receipt:
        if answer.decision is ReceiptDecision.ALLOW:
            return answer
        self._deny(
            PolicyDenied(
                f"{_held(request, decision)} was refused by {answer.body.get('principal')} "
                f"(approval {approval_id})",
                reason_code=answer.reason_code or "HOLD_DENIED",
                receipt_id=answer.entry_hash,
            )
        )
        raise AssertionError  # pragma: no cover

    async def _answer_receipt(self, hold: Receipt) -> Receipt | None:
        def read(conn: Connection) -> Receipt | None:
            row = conn.execute(
                select(receipts_table.c.seq).where(
                    and_(
                        receipts_table.c.log_id == self.log.log_id,
                        receipts_table.c.consumes == hold.entry_hash,
                    )
                )
            ).first()
            return None if row is None else self.log.get(int(row[0]))

        return await self._db(read, write=False)

    async def answer(self, approval_id: str, actor: Actor, *, allow: bool) -> Approval:
        """Approve or deny a pending HOLD (as ``actor``); the answer is a receipt.

        Raises:
            NotFound: No such approval in the actor's tenant.
            Conflict: It was answered already, or expired.
        """
        current = await self.get_approval(approval_id, actor)
        if current.status != "pending" or current.expires_at <= time.time():
            status = current.status if current.status != "pending" else "expired"
            msg = f"approval {approval_id} is {status} already"
            raise Conflict(msg)
        if current.principal == actor.principal and not actor.admin:
            # The point of a HOLD is a second opinion: the one who asked cannot give it.
            msg = f"{actor.principal} asked for this operation and cannot approve or deny it"
            raise PolicyDenied(msg, reason_code="SELF_APPROVAL")
        hold = await anyio.to_thread.run_sync(self.log.get, current.hold_seq)
        entry = approval_entry(
            hold,
            decision=ReceiptDecision.ALLOW if allow else ReceiptDecision.DENY,
            principal=actor.principal,
            reason_code="APPROVED" if allow else "REJECTED",
        )
        try:
            answer = await anyio.to_thread.run_sync(self.log.append, entry)
        except Conflict:
            msg = f"approval {approval_id} was answered already"
            raise Conflict(msg) from None
        await self._settle_row(
            approval_id, "approved" if allow else "denied", actor.principal, answer.seq
        )
        return await self.get_approval(approval_id, actor)

    async def get_approval(self, approval_id: str, actor: Actor) -> Approval:
        """One approval (``NotFound`` outside the actor's tenant)."""
        rows = await self.list_approvals(actor, status=None, approval_id=approval_id)
        if not rows:
            msg = f"no approval {approval_id!r}"
            raise NotFound(msg, id=approval_id)
        return rows[0]

    async def list_approvals(
        self, actor: Actor, *, status: str | None = "pending", approval_id: str | None = None
    ) -> list[Approval]:
        """Approvals of the actor's tenant (all tenants for admins), newest first."""
        if status not in (None, "pending", "approved", "denied", "expired"):
            msg = f"unknown approval status {status!r}"
            raise InvalidRequest(msg)
        stmt = select(approvals).order_by(approvals.c.created_at.desc())
        if not actor.admin:
            stmt = stmt.where(approvals.c.tenant == actor.tenant)
        if status is not None:
            stmt = stmt.where(approvals.c.status == status)
        if approval_id is not None:
            stmt = stmt.where(approvals.c.id == approval_id)

        def read(conn: Connection) -> list[Approval]:
            return [
                Approval(
                    id=r["id"],
                    tenant=r["tenant"],
                    principal=r["principal"],
                    sandbox_id=r["sandbox_id"],
                    action=r["action"],
                    summary=r["summary"],
                    question=r["question"],
                    status=r["status"],
                    hold_seq=r["hold_seq"],
                    created_at=r["created_at"],
                    expires_at=r["expires_at"],
                    decided_by=r["decided_by"],
                    decided_at=r["decided_at"],
                )
                for r in conn.execute(stmt).mappings()
            ]

        return await self._db(read, write=False)

    async def _settle_row(self, approval_id: str, status: str, by: str, answer_seq: int) -> None:
        await self._db(
            lambda conn: conn.execute(
                update(approvals)
                .where(approvals.c.id == approval_id)
                .values(status=status, decided_by=by, decided_at=time.time(), answer_seq=answer_seq)
            )
        )

    async def _db(self, fn: Callable[[Connection], T], *, write: bool = True) -> T:
        def run() -> T:
            with self.db.begin() if write else self.db.connect() as conn:
                return fn(conn)

        return await anyio.to_thread.run_sync(run)
