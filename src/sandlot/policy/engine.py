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

This module imports only :mod:`sandlot.errors` and :mod:`sandlot.policy.request`.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, final, runtime_checkable

from pydantic import JsonValue

from sandlot.errors import PolicyDenied
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


class Outcome(enum.StrEnum):
    """What the gate does with the operation."""

    ALLOW = "ALLOW"
    DENY = "DENY"
    HOLD = "HOLD"
    """Wait for a human (or another agent) to approve or deny; a timeout denies."""


class ReasonCode(enum.StrEnum):
    """Why: a closed set of stable strings that receipts, errors and clients rely on."""

    OK = "OK"
    """Allowed by a permit."""
    POLICY_VIOLATION = "POLICY_VIOLATION"
    """A forbid matched."""
    NO_MATCHING_PERMIT = "NO_MATCHING_PERMIT"
    """Nothing permits it (default deny)."""
    HOLD_REQUIRED = "HOLD_REQUIRED"
    """A permit marked ``@hold`` matched: approval needed."""
    POLICY_ERROR = "POLICY_ERROR"
    """The engine failed to evaluate (an erroring policy, an undefined remote result)."""
    POLICY_ERROR_FAIL_OPEN = "POLICY_ERROR_FAIL_OPEN"
    """The engine failed and the operator chose ``on_error = "allow"``."""
    SCHEMA_VIOLATION = "SCHEMA_VIOLATION"
    """The request does not fit the policy schema (a missing or mistyped attribute)."""
    REMOTE_UNAVAILABLE = "REMOTE_UNAVAILABLE"
    """A remote decision point could not be reached or timed out."""


ERROR_CODES: Final = frozenset(
    {ReasonCode.POLICY_ERROR, ReasonCode.SCHEMA_VIOLATION, ReasonCode.REMOTE_UNAVAILABLE}
)
"""Reason codes that mean "could not decide"; ``on_error`` applies to these."""


@final
@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict on one request."""

    outcome: Outcome
    """ALLOW, DENY or HOLD."""
    reason_code: ReasonCode
    """Why (stable)."""
    engine: str
    """The engine that decided (``cedar``, ``builtin``, ``opa``)."""
    policy_hash: str
    """``sha256:<hex>`` of the policy version that decided."""
    matched: tuple[str, ...] = ()
    """The policies that determined the outcome (their ``@id``, else the engine's id)."""
    message: str = ""
    """A sentence for humans."""
    hold_reason: str | None = None
    """For HOLD: what the approver is asked (from ``@hold("...")``)."""
    errors: tuple[str, ...] = ()
    """Evaluation errors, when the reason code is an error (or fail-open)."""
    duration_ns: int = 0
    """Time spent deciding."""

    @property
    def allowed(self) -> bool:
        """True when the operation may run now."""
        return self.outcome is Outcome.ALLOW

    def to_dict(self) -> dict[str, JsonValue]:
        """The decision as JSON data (for receipts, HTTP and MCP)."""
        return {
            "outcome": self.outcome.value,
            "reason_code": self.reason_code.value,
            "engine": self.engine,
            "policy_hash": self.policy_hash,
            "matched": list(self.matched),
            "message": self.message,
            "hold_reason": self.hold_reason,
            "errors": list(self.errors),
            "duration_ns": self.duration_ns,
        }

    def denial(self, receipt_id: str | None = None) -> PolicyDenied:
        """The error a front end raises for this decision (DENY, or a HOLD that timed out)."""
        return PolicyDenied(
            self.message or "denied by policy",
            reason_code=self.reason_code.value,
            receipt_id=receipt_id,
        )


@final
@dataclass(frozen=True, slots=True)
class PolicyTrace:
    """One policy (or rule) and what it did for one unit of a request."""

    policy_id: str
    """Its ``@id`` (or the engine's id)."""
    effect: str
    """``permit`` or ``forbid`` (``hold`` for a builtin hold rule)."""
    satisfied: bool
    """True when its scope and conditions held."""
    determining: bool = False
    """True when it is among the policies that decided the unit."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Its annotations (``@id``, ``@hold``, ``@reason``...)."""
    error: str | None = None
    """The evaluation error it raised, if any."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data."""
        return {
            "policy_id": self.policy_id,
            "effect": self.effect,
            "satisfied": self.satisfied,
            "determining": self.determining,
            "annotations": dict(self.annotations),
            "error": self.error,
        }


@final
@dataclass(frozen=True, slots=True)
class UnitTrace:
    """One evaluated unit (a whole request, or one command of a command action)."""

    label: str
    """``request``, or ``command 2: rm``."""
    context: Mapping[str, JsonValue]
    """The context the engine saw for this unit."""
    outcome: Outcome
    """The unit's own verdict."""
    policies: tuple[PolicyTrace, ...] = ()
    """Every policy considered, with what it did."""
    errors: tuple[str, ...] = ()
    """Errors raised while evaluating the unit."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data."""
        return {
            "label": self.label,
            "context": dict(self.context),
            "outcome": self.outcome.value,
            "policies": [p.to_dict() for p in self.policies],
            "errors": list(self.errors),
        }


@final
@dataclass(frozen=True, slots=True)
class Explanation:
    """A dry run: the decision, and per unit which policies were considered and matched."""

    decision: Decision
    """What :meth:`PolicyEngine.decide` would return."""
    units: tuple[UnitTrace, ...] = ()
    """What each unit saw and which policies matched it."""
    notes: tuple[str, ...] = ()
    """Anything else worth saying (how HOLD was derived, what a remote returned)."""

    def to_dict(self) -> dict[str, JsonValue]:
        """As JSON data (``sandlot policy explain --json``)."""
        return {
            "decision": self.decision.to_dict(),
            "units": [u.to_dict() for u in self.units],
            "notes": list(self.notes),
        }

    def render(self) -> str:
        """A human-readable report."""
        d = self.decision
        lines = [f"{d.outcome.value} ({d.reason_code.value}) by {d.engine} {d.policy_hash[:19]}"]
        if d.message:
            lines.append(f"  {d.message}")
        for unit in self.units:
            lines.append(f"- {unit.label}: {unit.outcome.value}")
            for p in unit.policies:
                mark = "*" if p.determining else ("+" if p.satisfied else " ")
                state = "error" if p.error else ("matched" if p.satisfied else "not matched")
                lines.append(f"    {mark} {p.effect:<6} {p.policy_id}: {state}")
                if p.error:
                    lines.append(f"        {p.error}")
            lines.extend(f"    error: {e}" for e in unit.errors)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


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
