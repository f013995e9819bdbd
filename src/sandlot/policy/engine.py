"""The policy-engine seam: the :class:`PolicyEngine` protocol and what it returns.

An engine takes a normalized :class:`~sandlot.policy.request.PolicyRequest` and returns a
:class:`Decision` (ALLOW, DENY or HOLD, a stable reason code, the policies that decided it,
the engine's name and policy hash, and how long it took), or an :class:`Explanation` (the
same decision plus which policies were considered and which matched, for ``explain``).

Engines fail closed: an engine that cannot decide returns DENY with an error reason code,
unless the operator set ``on_error = "allow"``; then it returns ALLOW with
``POLICY_ERROR_FAIL_OPEN`` so the receipt shows the choice.

Command actions (``exec``, ``process.start``, ``pty.open``) are decided per simple command:
:func:`decision_units` splits the request into one unit per distinct command it runs, each
with the request-wide attributes (``shell_undecidable``, ``raw``...) merged in. The request is
allowed only when every unit is.

The verdict types (:class:`Decision`, :class:`Explanation`, …) are wire data that clients read
too: they live in :mod:`sandlot.models` and are re-exported here. This module imports only
:mod:`sandlot.models` and :mod:`sandlot.policy.request`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol, final, runtime_checkable

from pydantic import JsonValue

from sandlot.models import (
    Decision,
    Explanation,
    Outcome,
    PolicyTrace,
    ReasonCode,
    UnitTrace,
)
from sandlot.policy.request import ContextKind, PolicyRequest

__all__ = [
    "HELP",
    "Decision",
    "Explanation",
    "OnError",
    "Outcome",
    "PolicyEngine",
    "PolicyTrace",
    "ReasonCode",
    "UnitTrace",
    "UnitVerdict",
    "combine_units",
    "decision_units",
    "error_decision",
]

OnError = Literal["deny", "allow"]
"""What an engine does when it cannot decide: deny (the default) or allow, visibly."""


ERROR_CODES: Final = frozenset(
    {ReasonCode.POLICY_ERROR, ReasonCode.SCHEMA_VIOLATION, ReasonCode.REMOTE_UNAVAILABLE}
)
"""Reason codes that mean "could not decide"; ``on_error`` applies to these."""


@runtime_checkable
class PolicyEngine(Protocol):
    """Decides on normalized requests. Implementations: cedar, builtin, opa."""

    @property
    def name(self) -> str:
        """The engine's name, recorded in receipts."""
        ...

    @property
    def policy_hash(self) -> str:
        """``sha256:<hex>`` identifying the active policy version."""
        ...

    async def decide(self, request: PolicyRequest) -> Decision:
        """Decide; never raises for a policy problem (that is a DENY with an error code)."""
        ...

    async def explain(self, request: PolicyRequest) -> Explanation:
        """Decide, and say which policies were considered and matched; executes nothing."""
        ...

    async def aclose(self) -> None:
        """Release connections (remote engines)."""
        ...


_COMMAND_SHARED: Final = ("cwd", "shell", "shell_undecidable", "shell_features", "raw", "programs")
_EMPTY_COMMAND: Final[Mapping[str, JsonValue]] = {
    "program": "",
    "argv0": "",
    "args": [],
    "flags": [],
    "operands": [],
    "paths": [],
    "glob_dirs": [],
    "writes": [],
    "writes_within": [],
    "devices": [],
    "device_writes": [],
    "via": [],
    "env": [],
}


def decision_units(request: PolicyRequest) -> list[tuple[str, dict[str, JsonValue]]]:
    """Split a request into the units an engine decides separately.

    Command actions give one unit per distinct command (identical commands are decided once),
    each a flat context: the command's attributes plus ``cwd``, ``shell``,
    ``shell_undecidable``, ``shell_features``, ``raw``, ``programs`` and ``command_count``.
    A command string that runs nothing we could see still gives one unit, with an empty
    ``program``, so request-wide rules (``shell_undecidable``) apply. Other actions give one
    unit whose context is the request's.

    Raises:
        KeyError, TypeError: the context does not have the command shape (engines turn this
            into ``SCHEMA_VIOLATION``).
    """
    ctx = request.context
    if request.info.kind is not ContextKind.COMMAND:
        return [("request", ctx)]
    commands = ctx["commands"]
    if not isinstance(commands, list):
        msg = "context.commands must be a list"
        raise TypeError(msg)
    shared: dict[str, JsonValue] = {k: ctx[k] for k in _COMMAND_SHARED}
    shared["command_count"] = len(commands)
    if not commands:
        return [("command 1: (none)", {**_EMPTY_COMMAND, **shared})]
    units: list[tuple[str, dict[str, JsonValue]]] = []
    seen: set[str] = set()
    for i, command in enumerate(commands, 1):
        if not isinstance(command, dict):
            msg = "context.commands must hold objects"
            raise TypeError(msg)
        if len(commands) > 1:
            key = json.dumps(command, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
        units.append(
            (f"command {i}: {command.get('program') or '(redirection)'}", {**command, **shared})
        )
    return units


def error_decision(
    *,
    engine: str,
    policy_hash: str,
    code: ReasonCode,
    message: str,
    errors: tuple[str, ...],
    on_error: OnError,
    started_ns: int,
    matched: tuple[str, ...] = (),
) -> Decision:
    """The decision for "could not decide": DENY, or a visible fail-open ALLOW."""
    duration = time.perf_counter_ns() - started_ns
    if on_error == "allow":
        return Decision(
            outcome=Outcome.ALLOW,
            reason_code=ReasonCode.POLICY_ERROR_FAIL_OPEN,
            engine=engine,
            policy_hash=policy_hash,
            matched=matched,
            message=f"allowed although the policy failed ({code.value}, on_error=allow): {message}",
            errors=errors,
            duration_ns=duration,
        )
    return Decision(
        outcome=Outcome.DENY,
        reason_code=code,
        engine=engine,
        policy_hash=policy_hash,
        matched=matched,
        message=message,
        errors=errors,
        duration_ns=duration,
    )


@final
@dataclass(frozen=True, slots=True)
class UnitVerdict:
    """What an engine concluded for one unit, before the units are combined."""

    label: str
    """The unit's label (see :func:`decision_units`)."""
    decision: Literal["Allow", "Deny", "NoDecision"]
    """The engine's raw answer."""
    reasons: tuple[str, ...] = ()
    """Policies that determined it: satisfied forbids on Deny, satisfied permits on Allow."""
    holds: tuple[str, ...] = ()
    """Those of ``reasons`` that ask for approval."""
    errors: tuple[str, ...] = ()
    """Evaluation errors."""
    errored: tuple[str, ...] = ()
    """Policies that raised them."""
    schema_problem: bool = False
    """True when the errors say the request did not fit the schema."""


HELP: Final = "docs/policies/README.md"
"""Where a denial message sends its reader for how to write a permit."""


def _subject(request: PolicyRequest, label: str) -> str:
    """What a message says was decided: the path of a file action, else the unit's label."""
    path = request.context.get("path")
    if request.info.kind in (ContextKind.PATH, ContextKind.CHMOD) and isinstance(path, str):
        return path
    return "" if label == "request" else label


def _some(items: list[str], most: int = 3) -> str:
    """``a, b, c and 2 more``."""
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def combine_units(
    request: PolicyRequest,
    verdicts: list[UnitVerdict],
    *,
    engine: str,
    policy_hash: str,
    on_error: OnError,
    started_ns: int,
    reasons: Mapping[str, str],
    questions: Mapping[str, str],
    where: Mapping[str, str] | None = None,
    permits: tuple[str, ...] = (),
) -> Decision:
    """Turn unit verdicts into the request's decision.

    Precedence: a satisfied forbid (DENY ``POLICY_VIOLATION``), then a unit nothing permits
    (DENY ``NO_MATCHING_PERMIT``) — both are definite whatever erroring policies would have
    said — then errors (DENY, or fail-open ALLOW), then holds (HOLD), then ALLOW.

    Every denial message names what decided it and what would allow it: a forbid by its id,
    its ``@reason`` and where it is written (no permit overrides a forbid, so the forbid is
    what must change); "no permit matched" by the permits that could have matched this action,
    with their ``@reason``, since adding or widening a permit is what allows it.

    Args:
        request: The request (for messages).
        verdicts: One per unit.
        engine: Engine name. policy_hash: Its policy hash. on_error: Its error mode.
        started_ns: ``perf_counter_ns()`` when deciding started.
        reasons: Policy id -> human reason (``@reason``; on a permit: what it lets through).
        questions: Policy id -> approval question (``@hold``).
        where: Policy id -> where it is written (``path:line``), for messages.
        permits: The ids of the permits (and hold permits) whose scope includes the action.
    """
    where = where or {}
    forbids: list[str] = []
    forbid_unit = no_permit_unit = ""
    errors: list[str] = []
    errored: list[str] = []
    schema_problem = False
    holds: list[str] = []
    granted: list[str] = []
    for v in verdicts:
        if v.errors or v.decision == "NoDecision":
            errors.extend(f"{v.label}: {e}" for e in v.errors or ("no decision",))
            errored.extend(v.errored)
            schema_problem = schema_problem or v.schema_problem
        if v.decision == "Deny":
            if v.reasons:
                forbids.extend(v.reasons)
                forbid_unit = forbid_unit or v.label
            elif not v.errors:
                no_permit_unit = no_permit_unit or v.label
        elif v.decision == "Allow" and not v.errors:
            granted.extend(v.reasons)
            holds.extend(v.holds)
    duration = time.perf_counter_ns() - started_ns
    action = request.action
    if forbids:
        names = tuple(dict.fromkeys(forbids))
        why = "; ".join(filter(None, (reasons.get(n) for n in names)))
        subject = _subject(request, forbid_unit)
        places = ", ".join(where[n] for n in names if n in where)
        that = "that forbid" if len(names) == 1 else "those forbids"
        return Decision(
            outcome=Outcome.DENY,
            reason_code=ReasonCode.POLICY_VIOLATION,
            matched=names,
            message=f"{action} denied by {', '.join(names)}"
            + (f" ({subject})" if subject else "")
            + (f": {why}" if why else "")
            + f"; no permit overrides a forbid: to allow it, change or remove {that}"
            + (f" at {places}" if places else ""),
            errors=tuple(errors),
            engine=engine,
            policy_hash=policy_hash,
            duration_ns=duration,
        )
    if no_permit_unit:
        subject = _subject(request, no_permit_unit) or "it"
        if permits:
            known = [f"{p} ({reasons[p]})" if p in reasons else p for p in permits]
            which = f"{action} is permitted only by {_some(known)}"
        else:
            which = f"no policy permits {action} at all"
        return Decision(
            outcome=Outcome.DENY,
            reason_code=ReasonCode.NO_MATCHING_PERMIT,
            message=f"{action} denied: no permit matches {subject}; {which}: "
            f"add a permit to allow it (see {HELP})",
            errors=tuple(errors),
            engine=engine,
            policy_hash=policy_hash,
            duration_ns=duration,
        )
    if errors:
        code = ReasonCode.SCHEMA_VIOLATION if schema_problem else ReasonCode.POLICY_ERROR
        failed = tuple(dict.fromkeys(errored))
        if schema_problem:
            what = "the request does not fit the schema"
        elif failed:
            located = [f"{n} at {where[n]}" if n in where else n for n in failed]
            fix = "it" if len(failed) == 1 else "them"
            what = f"{_some(located)} failed to evaluate (fix {fix})"
        else:
            what = "a policy failed to evaluate"
        return error_decision(
            engine=engine,
            policy_hash=policy_hash,
            code=code,
            message=f"{action}: {what}: {errors[0]}",
            errors=tuple(errors),
            on_error=on_error,
            started_ns=started_ns,
            matched=failed,
        )
    if holds:
        names = tuple(dict.fromkeys(holds))
        question = "; ".join(dict.fromkeys(questions.get(n, "approval required") for n in names))
        return Decision(
            outcome=Outcome.HOLD,
            reason_code=ReasonCode.HOLD_REQUIRED,
            matched=names,
            message=f"{action} needs approval ({', '.join(names)}): {question}",
            hold_reason=question,
            engine=engine,
            policy_hash=policy_hash,
            duration_ns=duration,
        )
    return Decision(
        outcome=Outcome.ALLOW,
        reason_code=ReasonCode.OK,
        matched=tuple(dict.fromkeys(granted)),
        message=f"{action} allowed",
        engine=engine,
        policy_hash=policy_hash,
        duration_ns=duration,
    )
