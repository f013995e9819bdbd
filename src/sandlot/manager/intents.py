"""What a gated operation carries, and what its idempotency key's intent records.

:class:`_Outcome` is filled in while an operation runs (for its execution receipt and its
intent); :class:`_LeaseKeeper` renews the intent's lease from a thread; :class:`_Replay` is an
earlier call's recorded result; the functions encode an error for the journal and turn a
recorded intent back into its result or its error. Imports the journal and the error tree,
nothing of the Manager's rooms.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass

from sandlot.errors import (
    BackendUnavailable,
    InvalidState,
    PolicyDenied,
    SandboxError,
    error_from_code,
)
from sandlot.journal import Intent, IntentState, Journal, Lease
from sandlot.models import JsonValue


class _Outcome:
    """What an operation reports for its execution receipt and, when it carries an
    idempotency key, for its journal intent (filled in while it runs)."""

    def __init__(self) -> None:
        self.output: bytes | None = None
        self.output_hash: str | None = None
        """``sha256:`` of output hashed as it passed (else taken of ``output``)."""
        self.exit_code: int | None = None
        self.detail: dict[str, JsonValue] = {}
        self.lease: Lease | None = None
        """The journal lease, for operations with an idempotency key."""
        self.result: JsonValue = None
        """The durable result a replay of the same key returns."""
        self.final_state: str = "RESULT_RECORDED"
        self.creating: str | None = None
        """The sandbox a creation is making (so an interruption's record can name it)."""


class _LeaseKeeper:
    """Renews an operation's journal lease from a thread while the operation runs.

    A thread, not a task: the operation's own cancel scopes must not be able to stop the
    heartbeat early, and the renewal is a short blocking database write.
    """

    def __init__(self, journal: Journal, outcome: _Outcome) -> None:
        self._journal = journal
        self._outcome = outcome
        self._interval = journal.lease_seconds / 3
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandlot-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            lease = self._outcome.lease
            if lease is None or lease.expires_at is None:
                continue
            # A transition racing with the renewal makes one of them see a stale state; the
            # next beat uses the new lease.
            with contextlib.suppress(SandboxError):
                self._journal.renew(lease)

    def stop(self) -> None:
        self._stopped.set()


@dataclass(frozen=True)
class _Replay:
    """The recorded result of an earlier call with the same idempotency key."""

    result: JsonValue


def _fresh(begun: Intent | _Replay | None) -> Intent | None:
    """The intent to run (a replay has returned before this is asked)."""
    assert not isinstance(begun, _Replay)
    return begun


def _interrupted(error: BaseException, outcome: _Outcome, keep: float) -> SandboxError:
    """What a replay of an interrupted keyed operation raises (never a bare CancelledError)."""
    assert outcome.lease is not None
    why = f"interrupted ({type(error).__name__})"
    if outcome.lease.state is IntentState.RUNNING:
        # Interrupted while the command ran: whether it finished is unknown, and a replay must
        # say so rather than run it again.
        msg = f"{why} while running; its outcome is unknown and it was not run again"
        return BackendUnavailable(msg, outcome="unknown")
    sandbox_id = outcome.creating
    if sandbox_id is not None:
        msg = (
            f"{why} while creating; sandbox {sandbox_id} is kept, failed, for inspection (for "
            f"{keep / 3600:g} h at most): destroy it or resume it"
        )
        return InvalidState(msg, sandbox_id=sandbox_id, status="failed")
    return BackendUnavailable(f"{why} before it ran; it was not run", outcome="not_run")


def _encode_error(error: BaseException) -> str:
    """An error as the journal records it, so a replay raises the same class."""
    if isinstance(error, SandboxError):
        return json.dumps(error.to_dict(), default=str)
    return json.dumps({"code": "sandbox_error", "message": f"{type(error).__name__}: {error}"})


def _replayed(intent: Intent) -> JsonValue:
    """What a replay of ``intent`` returns, or raises what its first attempt raised."""
    if intent.state in (IntentState.RESULT_RECORDED, IntentState.CLEANED):
        return intent.result
    if intent.state is IntentState.NEEDS_RECONCILE:
        msg = (
            f"the operation of this idempotency key needs an operator ({intent.error}); "
            "see `sandlot doctor`"
        )
        raise InvalidState(msg, intent_id=intent.intent_id)
    try:
        data = json.loads(intent.error or "{}")
    except ValueError:
        data = {"message": intent.error}
    if intent.state is IntentState.DENIED:
        raise PolicyDenied(str(data.get("message") or intent.error or "denied by policy"))
    details = data.get("details") if isinstance(data.get("details"), dict) else {}
    raise error_from_code(
        str(data.get("code", "sandbox_error")), str(data.get("message", "")), details
    )
