"""The gated operation: decide, run, receipt; and idempotency keys' intents.

:meth:`Gating._gated` is the one way an operation runs: the gate decides (and signs a decision
receipt) before the body, the body fills in an :class:`~sandlot.manager.intents._Outcome`, and
an execution receipt records what it did, also when it fails. With an idempotency key the ALLOW
is consumed as the intent's one-use authorization and the result (or error) is journalled for
replays (:meth:`Gating._begin_intent`). Also: programs a strict sandbox starts, decided from
outside (``exec.program``), and the approvals of HOLD decisions. Must not import a front end.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

import anyio

from sandlot.errors import (
    Conflict,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotSupported,
    PolicyDenied,
    SandboxError,
)
from sandlot.journal import LEASED_STATES, Intent, IntentState, owner_alive
from sandlot.manager.core import ManagerCore
from sandlot.manager.intents import (
    _encode_error,
    _interrupted,
    _LeaseKeeper,
    _Outcome,
    _Replay,
    _replayed,
)
from sandlot.models import LOCAL_ACTOR, SYSTEM_PRINCIPAL, Actor, JsonValue, SandboxInfo
from sandlot.policy.request import Resource

if TYPE_CHECKING:
    from sandlot.backends.local.execgate import ExecCall as _ExecCall
    from sandlot.gate.gate import Approval, Authorization, Gate
    from sandlot.policy import Explanation


class Gating(ManagerCore):
    """The policy gate in front of every operation, and the intents of keyed calls."""

    async def _decide_program(self, sandbox_id: str, call: _ExecCall) -> bool:
        """A program started inside a strict sandbox, stopped in the kernel: decided and
        receipted as ``exec.program`` (the binary as the caller named it, then its arguments;
        ``argv[0]`` is the caller's to choose, so the program is the path), as the sandbox's
        owner without admin rights (the kernel does not say who typed the command).

        Who that is and what the policy sees of the sandbox (its id, spec, backend, tenant)
        are fixed for its life, so its record is read once, not on every new program.
        """
        subject = self._program_subjects.get(sandbox_id)
        if subject is None:
            try:
                sb = await self.store.get(sandbox_id)
            except NotFound:
                return False
            actor = Actor(tenant=sb.tenant, principal=sb.owner or SYSTEM_PRINCIPAL)
            subject = (actor, Resource.of(sb))
            if len(self._program_subjects) >= 4096:  # a bound, not an eviction policy
                self._program_subjects.clear()
            self._program_subjects[sandbox_id] = subject
        actor, resource = subject
        command = [call.path, *call.argv[1:]]
        try:
            async with self._gated(actor, "exec.program", resource, command=command, cwd=call.cwd):
                return True
        except PolicyDenied:
            return False

    @contextlib.asynccontextmanager
    async def _gated(
        self,
        actor: Actor,
        action: str,
        target: SandboxInfo | Resource,
        *,
        intent: Intent | None = None,
        **args: object,
    ) -> AsyncIterator[_Outcome]:
        """Decide (and record) before the body runs; record what it did after.

        Nothing in the body runs unless the gate allowed it, and every allowed operation gets
        an execution receipt, also when it fails. With an ``intent`` (an idempotency key), the
        ALLOW decision is consumed as the intent's one-use authorization before the body runs,
        and the body's result (or its error) is recorded for replays.
        """
        outcome = _Outcome()
        # While it runs the sandbox is busy: the idle reaper of this process leaves it be.
        busy = target.sandbox_id if isinstance(target, Resource) else target.id
        self._busy[busy] = self._busy.get(busy, 0) + 1
        try:
            async with self._gated_body(actor, action, target, intent, args, outcome) as done:
                yield done
        finally:
            self._busy[busy] -= 1
            if not self._busy[busy]:
                del self._busy[busy]
            if intent is not None:
                self._wakeups.wake(intent.intent_id)

    @contextlib.asynccontextmanager
    async def _gated_body(
        self,
        actor: Actor,
        action: str,
        target: SandboxInfo | Resource,
        intent: Intent | None,
        args: Mapping[str, object],
        outcome: _Outcome,
    ) -> AsyncIterator[_Outcome]:
        auth = None
        if self.gate is not None:
            resource = target if isinstance(target, Resource) else Resource.of(target)
            try:
                auth = await self.gate.authorize(
                    actor,
                    action,
                    resource,
                    args,
                    idempotency_key=intent.idempotency_key if intent else None,
                )
            except PolicyDenied as e:
                if intent is not None:
                    await self._jr(
                        self._journal().deny,
                        intent.intent_id,
                        decision=e.receipt_id or "none",
                        reason=e.reason_code,
                    )
                raise
            except BaseException:
                if intent is not None:
                    # No decision (an error, a cancelled caller): a repeat waiting for this
                    # call's claim may go to the gate itself at once.
                    with anyio.CancelScope(shield=True), contextlib.suppress(SandboxError):
                        await self._jr(self._journal().release_claim, intent.intent_id)
                raise
        keeper = None
        if intent is not None:
            decision = auth.receipt.entry_hash if auth else f"ungated:{intent.intent_id}"
            try:
                outcome.lease = await self._jr(
                    self._journal().authorize, intent.intent_id, decision=decision
                )
            except Conflict:
                # Another call with the same key was authorized first and runs it; this
                # decision authorized nothing, and its receipt says so.
                if auth is not None:
                    await self._complete(auth, outcome, error="superseded by another call")
                msg = (
                    f"another call with idempotency key {intent.idempotency_key!r} is running "
                    "this operation; repeat the call to get its outcome"
                )
                raise Conflict(msg, intent_id=intent.intent_id) from None
            # A long operation keeps its lease, so nobody takes it for dead.
            keeper = _LeaseKeeper(self._journal(), outcome)
        try:
            yield outcome
        except GeneratorExit:
            # A reader stopped consuming a stream (logs, a file, process output): the
            # operation itself went fine, it was only cut short.
            outcome.detail["stopped_early"] = True
            with anyio.CancelScope(shield=True):
                if auth is not None:
                    await self._complete(auth, outcome)
                if outcome.lease is not None:
                    await self._finish_intent(outcome, auth)
            raise
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                if auth is not None:
                    await self._complete(auth, outcome, error=f"{type(e).__name__}: {e}")
                if outcome.lease is not None:
                    recorded: BaseException = e
                    if not isinstance(e, SandboxError):
                        recorded = _interrupted(e, outcome, self.failed_keep)
                    with contextlib.suppress(SandboxError):
                        await self._jr(
                            self._journal().fail, outcome.lease, error=_encode_error(recorded)
                        )
            raise
        finally:
            if keeper is not None:
                keeper.stop()
        if auth is not None:
            await self._complete(auth, outcome)
        if outcome.lease is not None:
            await self._finish_intent(outcome, auth)

    async def _finish_intent(self, outcome: _Outcome, auth: Authorization | None) -> None:
        assert outcome.lease is not None
        journal = self._journal()
        if outcome.final_state == "CLEANED":
            await self._jr(journal.advance, outcome.lease, "CLEANED", result=outcome.result)
        else:
            await self._jr(
                journal.record_result,
                outcome.lease,
                result=outcome.result,
                receipt_seq=auth.receipt.seq if auth else None,
            )

    async def _begin_intent(
        self,
        actor: Actor,
        op: str,
        request: Mapping[str, JsonValue],
        key: str | None,
    ) -> Intent | _Replay | None:
        """Record the intent of an operation with an idempotency key.

        Returns None without a key; the new (or never authorized) intent to run; or, for a
        key seen before with the same request, the recorded result (``_Replay``). Raises what
        an earlier attempt raised, and ``Conflict`` for a key reused with another request. A
        replay that finds the first attempt still running waits for it; one that finds it
        abandoned by a crash settles it (it is never run twice).
        """
        if key is None:
            return None
        if not key or len(key) > 200:
            msg = "an idempotency key is 1 to 200 characters"
            raise InvalidRequest(msg)
        journal = self._journal()
        begun = await self._jr(
            journal.begin,
            tenant=actor.tenant,
            principal=actor.principal,
            op=op,
            request=dict(request),
            idempotency_key=key,
            claim_seconds=self._claim_seconds(),
        )
        intent = begun.intent
        if not begun.replay:
            return intent
        deadline = anyio.current_time() + self.transition_timeout
        while intent.state is IntentState.PREPARED or (
            intent.state in LEASED_STATES and owner_alive(intent.lease_owner or "")
        ):
            if intent.state is IntentState.PREPARED:
                # Its first call is at the gate (it holds the claim) or went away (the claim
                # is free or its holder died): one repeat takes it over, the others wait.
                holder = intent.lease_owner
                dead = holder if holder and not owner_alive(holder) else None
                if await self._jr(
                    journal.claim,
                    intent.intent_id,
                    dead_owner=dead,
                    claim_seconds=self._claim_seconds(),
                ):
                    return intent
            left = deadline - anyio.current_time()
            if left <= 0:
                break
            with self._wakeups.waiting(intent.intent_id) as wake:
                # Woken at once by a call run here; a slow poll sees one run elsewhere.
                intent = await journal.wait(intent.intent_id, timeout=left, wake=wake, max_poll=1)
            if intent.state in LEASED_STATES:
                break  # its lease expired (or the wait timed out): settle it below
        if intent.state is IntentState.PREPARED:
            msg = (
                f"another call with idempotency key {key!r} is still being decided after "
                f"{self.transition_timeout:g}s; repeat the call to get its outcome"
            )
            raise Conflict(msg, intent_id=intent.intent_id)
        if intent.state in LEASED_STATES:
            try:
                await self._recover_intent(intent)
            except InvalidState:
                pass  # it came to rest after we looked: its outcome is recorded
            except Conflict:
                msg = (
                    f"the first call with idempotency key {key!r} is still running after "
                    f"{self.transition_timeout:g}s; repeat the call to get its outcome"
                )
                raise Conflict(msg, intent_id=intent.intent_id) from None
            intent = await self._jr(journal.get, intent.intent_id)
            if intent.state in LEASED_STATES:
                msg = f"the first call with idempotency key {key!r} is still running"
                raise Conflict(msg, intent_id=intent.intent_id)
        return _Replay(_replayed(intent))

    def _claim_seconds(self) -> float:
        """How long a caller at the gate holds its key's intent: through a HOLD's wait for an
        approval, so that a repeat does not ask for a second approval meanwhile (a claim is
        released as soon as the gate answers; only a crash on another host waits it out)."""
        lease = self._journal().lease_seconds
        return lease if self.gate is None else max(lease, self.gate.hold_timeout + lease)

    async def _complete(
        self, auth: Authorization, outcome: _Outcome, error: str | None = None
    ) -> None:
        assert self.gate is not None
        await self.gate.complete(
            auth,
            output=outcome.output,
            output_hash=outcome.output_hash,
            exit_code=outcome.exit_code,
            error=error,
            detail=outcome.detail or None,
        )

    async def explain(
        self,
        action: str,
        sandbox_id: str,
        *,
        actor: Actor = LOCAL_ACTOR,
        **args: object,
    ) -> Explanation:
        """What the policy would decide about an operation and why, without running it."""
        gate = self._require_gate()
        sb = await self.get(sandbox_id, actor=actor)
        return await gate.explain(actor, action, Resource.of(sb), args)

    async def list_approvals(
        self, *, actor: Actor = LOCAL_ACTOR, status: str | None = "pending"
    ) -> builtins.list[Approval]:
        """HOLD decisions (pending by default) of the actor's tenant, newest first."""
        return await self._require_gate().list_approvals(actor, status=status)

    async def approve(self, approval_id: str, *, actor: Actor = LOCAL_ACTOR) -> Approval:
        """Let a held operation run (the answer is a signed receipt)."""
        return await self._require_gate().answer(approval_id, actor, allow=True)

    async def deny(self, approval_id: str, *, actor: Actor = LOCAL_ACTOR) -> Approval:
        """Refuse a held operation (the answer is a signed receipt)."""
        return await self._require_gate().answer(approval_id, actor, allow=False)

    def _require_gate(self) -> Gate:
        if self.gate is None:
            msg = "this manager runs without a policy gate"
            raise NotSupported(msg)
        return self.gate
