"""A small pure-Python rule engine for installs without cedarpy (and a reference for tests).

Rules come from a TOML or JSON file (``builtin_default.toml`` mirrors ``default.cedar``)::

    default = "deny"                 # when no rule matches: "deny" or "allow"

    [[rule]]
    id = "deny-recursive-remove-system-dirs"
    effect = "forbid"                # "permit", "forbid" or "hold"
    actions = ["run"]                # action names, groups or patterns ("fs.*"); default all
    reason = "recursive removal of / or of a system directory"
    when = { program = "rm", flags_all = ["recursive"], paths_any = ["/", "/usr"] }
    unless = { ... }                 # optional: the rule does not apply when this matches

A condition key names an attribute of the unit's context (see ``docs/policies/README.md``),
or of ``principal.`` (``id``, ``tenant``, ``kind``, ``roles``) or ``resource.`` (``sandbox_id``,
``tenant``, ``backend``, ``owner``, ``workdir``, ``labels.<key>``), with an optional operator
suffix: for list attributes ``_any`` (shares an element), ``_all`` (has every one), ``_none``
(shares none) and ``_empty`` (true/false); for strings a value or list of ``fnmatch`` patterns
(``_not`` negates); booleans and integers compare equal. In values, ``{resource.workdir}`` and
the like are replaced by the request's value. All conditions of a rule must hold.

Semantics match the Cedar engine: a matching forbid denies; otherwise a matching hold rule
asks for approval; otherwise a matching permit allows; otherwise ``default``. Command actions
are decided per command, and any failure is a DENY (or a visible fail-open ALLOW).

This module imports the policy package and :mod:`sandlot.errors`; nothing else from sandlot.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.resources
import json
import re
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

from pydantic import JsonValue

from sandlot.errors import InvalidRequest
from sandlot.policy.engine import (
    Decision,
    Explanation,
    OnError,
    Outcome,
    PolicyTrace,
    ReasonCode,
    UnitTrace,
    UnitVerdict,
    combine_units,
    decision_units,
    error_decision,
)
from sandlot.policy.request import ACTION_GROUPS, ACTIONS, PolicyRequest
from sandlot.policy.schema import CONTEXT_TYPES

__all__ = ["DEFAULT_RULES", "BuiltinEngine"]

DEFAULT_RULES: Final = (
    importlib.resources.files("sandlot.policy").joinpath("builtin_default.toml").read_text("utf-8")
)
"""The builtin twin of ``default.cedar``."""

_LIST_OPS: Final = ("any", "all", "none", "empty")
# A TOML array-of-tables header for one rule (what a rule's line number points at).
_RULE_HEADER: Final = re.compile(r"\s*\[\[\s*rule\s*\]\]")
_PRINCIPAL_ATTRS: Final = frozenset({"id", "tenant", "kind", "roles"})
_RESOURCE_ATTRS: Final = frozenset({"sandbox_id", "tenant", "backend", "owner", "workdir"})

_View = Mapping[str, JsonValue]
_Check = Callable[[_View, Mapping[str, str]], bool]


class _RuleError(Exception):
    """A rule could not be evaluated against a request (a missing or mistyped attribute)."""


def _substitute(value: str, subs: Mapping[str, str]) -> str:
    if "{" not in value:
        return value
    for k, v in subs.items():
        value = value.replace("{" + k + "}", v)
    return value


def _strings(value: object, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    msg = f"condition {key!r} needs a string or a list of strings"
    raise InvalidRequest(msg)


def _condition(key: str, expected: object) -> tuple[str, _Check]:
    """Compile one ``key = value`` condition; returns the attribute it reads and its check."""
    attr, _, op = key.rpartition("_")
    if op not in (*_LIST_OPS, "not") or not attr:
        attr, op = key, ""

    def lookup(view: _View) -> JsonValue:
        try:
            return view[attr]
        except KeyError:
            msg = f"the request has no attribute {attr!r}"
            raise _RuleError(msg) from None

    if op in ("any", "all", "none"):
        wanted = _strings(expected, key)

        def check_set(view: _View, subs: Mapping[str, str]) -> bool:
            have = lookup(view)
            if not isinstance(have, list):
                msg = f"{attr!r} is not a list"
                raise _RuleError(msg)
            values = {_substitute(w, subs) for w in wanted}
            hits = values.intersection(str(h) for h in have)
            if op == "any":
                return bool(hits)
            if op == "all":
                return hits == values
            return not hits

        return attr, check_set
    if op == "empty":
        if not isinstance(expected, bool):
            msg = f"condition {key!r} needs true or false"
            raise InvalidRequest(msg)

        def check_empty(view: _View, subs: Mapping[str, str]) -> bool:
            have = lookup(view)
            if not isinstance(have, list):
                msg = f"{attr!r} is not a list"
                raise _RuleError(msg)
            return (not have) is expected

        return attr, check_empty
    if isinstance(expected, bool | int) and not isinstance(expected, str):
        if op:
            msg = f"condition {key!r}: _{op} applies to strings and lists"
            raise InvalidRequest(msg)

        def check_eq(view: _View, subs: Mapping[str, str]) -> bool:
            have = lookup(view)
            if type(have) is not type(expected):
                msg = f"{attr!r} is not a {type(expected).__name__}"
                raise _RuleError(msg)
            return have == expected

        return attr, check_eq
    patterns = _strings(expected, key)
    negate = op == "not"

    def check_str(view: _View, subs: Mapping[str, str]) -> bool:
        have = lookup(view)
        if not isinstance(have, str):
            msg = f"{attr!r} is not a string"
            raise _RuleError(msg)
        hit = any(fnmatch.fnmatchcase(have, _substitute(p, subs)) for p in patterns)
        return hit is not negate

    return attr, check_str


@final
@dataclass(frozen=True, slots=True)
class _Rule:
    id: str
    effect: str
    actions: frozenset[str]
    reason: str
    when: tuple[_Check, ...]
    unless: tuple[_Check, ...]

    def matches(self, view: _View, subs: Mapping[str, str]) -> bool:
        return all(c(view, subs) for c in self.when) and not (
            self.unless and all(c(view, subs) for c in self.unless)
        )


def _actions(patterns: Sequence[str], rule_id: str) -> frozenset[str]:
    out: set[str] = set()
    for pattern in patterns:
        if pattern in ACTION_GROUPS:
            out |= {a.name for a in ACTIONS.values() if pattern in a.groups}
            continue
        hits = fnmatch.filter(ACTIONS, pattern)
        if not hits:
            msg = f"rule {rule_id!r}: {pattern!r} names no action or group"
            raise InvalidRequest(msg)
        out |= set(hits)
    return frozenset(out)


def _compile(raw: object, index: int) -> _Rule:
    if not isinstance(raw, dict):
        msg = f"rule {index} is not a table"
        raise InvalidRequest(msg)
    unknown = set(raw) - {"id", "effect", "actions", "reason", "when", "unless"}
    if unknown:
        msg = f"rule {index} has unknown keys: {', '.join(sorted(unknown))}"
        raise InvalidRequest(msg)
    rule_id = str(raw.get("id") or f"rule{index}")
    effect = raw.get("effect")
    if effect not in ("permit", "forbid", "hold"):
        msg = f"rule {rule_id!r}: effect must be permit, forbid or hold"
        raise InvalidRequest(msg)
    actions = _actions(_strings(raw.get("actions", ["*"]), "actions"), rule_id)
    compiled: dict[str, tuple[_Check, ...]] = {}
    for part in ("when", "unless"):
        table = raw.get(part, {})
        if not isinstance(table, dict):
            msg = f"rule {rule_id!r}: {part} must be a table"
            raise InvalidRequest(msg)
        checks: list[_Check] = []
        for key, value in table.items():
            attr, check = _condition(str(key), value)
            _check_attr(rule_id, attr, actions)
            checks.append(check)
        compiled[part] = tuple(checks)
    return _Rule(
        rule_id,
        str(effect),
        actions,
        str(raw.get("reason", "")),
        compiled["when"],
        compiled["unless"],
    )


def _check_attr(rule_id: str, attr: str, actions: frozenset[str]) -> None:
    """Reject at load a condition on an attribute some of the rule's actions do not have."""
    if attr.startswith("principal."):
        if attr.removeprefix("principal.") not in _PRINCIPAL_ATTRS:
            msg = f"rule {rule_id!r}: principals have no attribute {attr!r}"
            raise InvalidRequest(msg)
        return
    if attr.startswith("resource."):
        name = attr.removeprefix("resource.")
        if name not in _RESOURCE_ATTRS and not name.startswith("labels."):
            msg = f"rule {rule_id!r}: sandboxes have no attribute {attr!r}"
            raise InvalidRequest(msg)
        return
    for action in actions:
        kind = ACTIONS[action].kind
        names = {n for n, _, _ in CONTEXT_TYPES[kind]}
        if attr not in names:
            msg = (
                f"rule {rule_id!r}: action {action!r} has no context attribute {attr!r}; "
                "narrow the rule's actions"
            )
            raise InvalidRequest(msg)


@final
class BuiltinEngine:
    """Decides with rules from a TOML/JSON document; no third-party dependency."""

    def __init__(
        self,
        document: Mapping[str, object],
        *,
        on_error: OnError = "deny",
        source: str = "",
        name: str = "<rules>",
        rule_lines: Sequence[int] = (),
    ) -> None:
        """Compile a rules document.

        Args:
            document: The parsed TOML/JSON (``default`` and ``rule``).
            on_error: ``"deny"`` (fail closed) or ``"allow"`` (fail open, visibly).
            source: The document's text, hashed into :attr:`policy_hash`.
            name: What errors and denial messages call the document (its path).
            rule_lines: The line each rule starts on, in order (when known).

        Raises:
            InvalidRequest: a malformed rule, or a condition on an attribute its actions lack;
                the message starts with ``path:line:`` of the rule.
        """
        default = document.get("default", "deny")
        if default not in ("deny", "allow"):
            msg = f'{name}: builtin rules: default must be "deny" or "allow"'
            raise InvalidRequest(msg)
        unknown = set(document) - {"default", "rule", "version"}
        if unknown:
            msg = f"{name}: builtin rules: unknown keys {', '.join(sorted(unknown))}"
            raise InvalidRequest(msg)
        raw_rules = document.get("rule", [])
        if not isinstance(raw_rules, list):
            msg = f"{name}: builtin rules: rule must be an array of tables"
            raise InvalidRequest(msg)

        if len(rule_lines) != len(raw_rules):
            rule_lines = ()  # a header inside a string, or inline tables: no trustworthy lines

        def where(index: int) -> str:
            return f"{name}:{rule_lines[index]}" if index < len(rule_lines) else name

        self._rules: list[_Rule] = []
        origins: dict[str, str] = {}
        for i, raw in enumerate(raw_rules):
            try:
                rule = _compile(raw, i)
            except InvalidRequest as e:
                msg = f"{where(i)}: {e.message}"
                raise InvalidRequest(msg) from None
            if rule.id in origins:
                msg = f"{where(i)}: builtin rules: two rules share the id {rule.id!r} (the first is at {origins[rule.id]})"
                raise InvalidRequest(msg)
            origins[rule.id] = where(i)
            self._rules.append(rule)
        self._where = origins
        self._default_allow = default == "allow"
        self._on_error: OnError = on_error
        text = source or json.dumps(document, sort_keys=True, default=str)
        self._hash = "sha256:" + hashlib.sha256(b"builtin\x00" + text.encode()).hexdigest()
        self._reasons = {r.id: r.reason for r in self._rules if r.reason}
        self._questions = {
            r.id: r.reason or "approval required" for r in self._rules if r.effect == "hold"
        }

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        format: str = "toml",
        on_error: OnError = "deny",
        name: str = "<rules>",
    ) -> BuiltinEngine:
        """Parse rules from TOML (default) or JSON text (``name``: its path, for messages).

        Raises:
            InvalidRequest: the text does not parse or the rules are invalid.
        """
        try:
            document = json.loads(text) if format == "json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as e:
            # Both parsers say the line and column themselves ("... (at line 3, column 7)").
            msg = f"{name}: builtin rules do not parse: {e}"
            raise InvalidRequest(msg) from None
        if not isinstance(document, dict):
            msg = f"{name}: builtin rules must be a table"
            raise InvalidRequest(msg)
        lines = (
            [i for i, line in enumerate(text.splitlines(), 1) if _RULE_HEADER.match(line)]
            if format != "json"
            else []
        )
        return cls(document, on_error=on_error, source=text, name=name, rule_lines=lines)

    @classmethod
    def from_file(cls, path: str | Path, *, on_error: OnError = "deny") -> BuiltinEngine:
        """Load rules from a ``.toml`` or ``.json`` file (``"default"`` is the shipped set).

        Raises:
            InvalidRequest: the file cannot be read or the rules are invalid.
        """
        if str(path) == "default":
            return cls.from_text(DEFAULT_RULES, on_error=on_error, name="builtin_default.toml")
        try:
            text = Path(path).read_text("utf-8")
        except OSError as e:
            msg = f"cannot read rules file {path}: {e.strerror}"
            raise InvalidRequest(msg) from None
        return cls.from_text(
            text,
            format="json" if str(path).endswith(".json") else "toml",
            on_error=on_error,
            name=str(path),
        )

    @property
    def name(self) -> str:
        """``"builtin"``."""
        return "builtin"

    @property
    def policy_hash(self) -> str:
        """``sha256:`` of the rules text."""
        return self._hash

    async def decide(self, request: PolicyRequest) -> Decision:
        """Decide (same semantics as the Cedar engine)."""
        return self.evaluate(request)

    async def explain(self, request: PolicyRequest) -> Explanation:
        """Decide, and report which rules matched each unit."""
        return self.explain_now(request)

    async def aclose(self) -> None:
        """Nothing to release."""

    def evaluate(self, request: PolicyRequest) -> Decision:
        """:meth:`decide`, synchronously."""
        return self._run(request)[0]

    def explain_now(self, request: PolicyRequest) -> Explanation:
        """:meth:`explain`, synchronously."""
        decision, _, traces = self._run(request, trace=True)
        return Explanation(
            decision=decision,
            units=tuple(traces),
            notes=(f"when no rule matches: {'allow' if self._default_allow else 'deny'}",),
        )

    def _subs(self, request: PolicyRequest) -> tuple[dict[str, str], dict[str, JsonValue]]:
        p, r = request.principal, request.resource
        subs = {
            "principal.id": p.id,
            "principal.tenant": p.tenant,
            "resource.sandbox_id": r.sandbox_id,
            "resource.tenant": r.tenant,
            "resource.backend": r.backend,
            "resource.owner": r.owner,
            "resource.workdir": r.workdir,
        }
        extra: dict[str, JsonValue] = {f"{k}": v for k, v in subs.items()}
        extra["principal.kind"] = p.kind
        extra["principal.roles"] = list(p.roles)
        for k, v in r.labels.items():
            extra[f"resource.labels.{k}"] = v
        return subs, extra

    def _run(
        self, request: PolicyRequest, *, trace: bool = False
    ) -> tuple[Decision, list[tuple[str, dict[str, JsonValue]]], list[UnitTrace]]:
        started = time.perf_counter_ns()
        try:
            units = decision_units(request)
        except (KeyError, TypeError) as e:
            msg = f"the {request.action} context does not have the expected shape: {e}"
            failed = error_decision(
                engine="builtin",
                policy_hash=self._hash,
                code=ReasonCode.SCHEMA_VIOLATION,
                message=msg,
                errors=(msg,),
                on_error=self._on_error,
                started_ns=started,
            )
            return failed, [], []
        subs, extra = self._subs(request)
        rules = [r for r in self._rules if request.action in r.actions]
        verdicts: list[UnitVerdict] = []
        traces: list[UnitTrace] = []
        for label, ctx in units:
            view = {**ctx, **extra}
            matched: list[_Rule] = []
            errors: list[str] = []
            errored: list[str] = []
            rule_traces: list[PolicyTrace] = []
            for rule in rules:
                try:
                    hit = rule.matches(view, subs)
                    error = None
                except _RuleError as e:
                    hit, error = False, str(e)
                    errors.append(f"rule {rule.id}: {e}")
                    errored.append(rule.id)
                if hit:
                    matched.append(rule)
                if trace:
                    rule_traces.append(
                        PolicyTrace(
                            policy_id=rule.id,
                            effect=rule.effect,
                            satisfied=hit,
                            annotations={"reason": rule.reason} if rule.reason else {},
                            error=error,
                        )
                    )
            forbids = tuple(r.id for r in matched if r.effect == "forbid")
            grants = tuple(r.id for r in matched if r.effect != "forbid")
            holds = tuple(r.id for r in matched if r.effect == "hold")
            if forbids:
                verdict = UnitVerdict(label, "Deny", forbids, (), tuple(errors), tuple(errored))
            elif grants or self._default_allow:
                verdict = UnitVerdict(label, "Allow", grants, holds, tuple(errors), tuple(errored))
            else:
                verdict = UnitVerdict(label, "Deny", (), (), tuple(errors), tuple(errored))
            verdicts.append(verdict)
            if trace:
                determining = set(verdict.reasons)
                outcome = (
                    Outcome.DENY
                    if verdict.decision == "Deny" or errors
                    else (Outcome.HOLD if holds else Outcome.ALLOW)
                )
                traces.append(
                    UnitTrace(
                        label=label,
                        context=ctx,
                        outcome=outcome,
                        policies=tuple(
                            PolicyTrace(
                                policy_id=t.policy_id,
                                effect=t.effect,
                                satisfied=t.satisfied,
                                determining=t.policy_id in determining,
                                annotations=t.annotations,
                                error=t.error,
                            )
                            for t in rule_traces
                        ),
                        errors=tuple(errors),
                    )
                )
        decision = combine_units(
            request,
            verdicts,
            engine="builtin",
            policy_hash=self._hash,
            on_error=self._on_error,
            started_ns=started,
            reasons=self._reasons,
            questions=self._questions,
            where=self._where,
            permits=tuple(r.id for r in rules if r.effect != "forbid"),
        )
        return decision, units, traces
