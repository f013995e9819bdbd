"""The Cedar policy engine (through ``cedarpy``): sandlot's default.

The policy set, the schema and the per-principal/per-sandbox entity sets are parsed once per
policy version and reused as cedarpy handles (parsing the policy text on every call costs
~1 ms; a decision with handles costs tens of microseconds — ``bench/policy.py`` measures both).

How a Cedar answer becomes a :class:`~sandlot.policy.engine.Decision`:

- ALLOW only when Cedar says ``Allow`` with **no** diagnostics errors, for a request that
  validated against the schema. Cedar skips a policy that errors during evaluation, so an
  erroring ``forbid`` would otherwise let a request through.
- A satisfied ``forbid`` is DENY ``POLICY_VIOLATION``; no satisfied ``permit`` is DENY
  ``NO_MATCHING_PERMIT``. Both are definite and win over evaluation errors elsewhere.
- A request that does not fit the schema is DENY ``SCHEMA_VIOLATION``; an evaluation error is
  DENY ``POLICY_ERROR``. With ``on_error="allow"`` both become ALLOW
  ``POLICY_ERROR_FAIL_OPEN``.
- HOLD: when the request is allowed and any of the permits that allowed it carries a
  ``@hold("question for the approver")`` annotation, the outcome is HOLD ``HOLD_REQUIRED``.
  A ``@hold`` permit therefore means "allowed, but only with approval", and it wins over
  plain permits; forbids still win over everything. ``@hold`` on a ``forbid`` is rejected at
  load time (a forbid cannot be approved away).

Command actions are decided per simple command (:func:`~sandlot.policy.engine.decision_units`)
in one batched call.

Speed: Cedar parses and validates every context attribute it receives (about 7 µs each on our
CI machine), so with sandlot's own schema the engine sends only the attributes the loaded
policies read, under a schema rendered to declare exactly those (Cedar still validates every
request). Each action is evaluated against only the policies whose action scope can match it
(exact, since Cedar checks the scope before the conditions). And because a Cedar evaluation is
a pure function of the policy set, the entities and the request (no clock, no I/O), each
unit's answer is cached, keyed by the principal and sandbox attributes, the action and the
projected context; a new policy version is a new engine with an empty cache.

This module may import cedarpy, the policy package and :mod:`sandlot.errors`; nothing else
from sandlot.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeVar, final

import cedarpy
from pydantic import JsonValue

from sandlot.errors import InvalidRequest
from sandlot.policy.cedar_source import (
    PolicyFile,
    SourceMap,
    policy_label,
    schema_error,
    statement_of,
    validation_error,
)
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
from sandlot.policy.request import ACTIONS, ContextKind, PolicyRequest, Principal, Resource
from sandlot.policy.schema import CONTEXT_TYPES, context_fields, render_schema

__all__ = ["DEFAULT_POLICY", "MAX_RAW_BYTES", "SCHEMA", "CedarEngine", "PolicyFile"]

MAX_RAW_BYTES: Final = 4 << 20
"""Most characters of ``context.raw`` one request sends Cedar in all (one copy per distinct
command), when the policies read it."""

SCHEMA: Final = render_schema()
"""The Cedar schema of sandlot's requests (rendered from :mod:`sandlot.policy.schema`)."""
DEFAULT_POLICY: Final = (
    importlib.resources.files("sandlot.policy").joinpath("default.cedar").read_text("utf-8")
)
"""The shipped default policy (``default.cedar``)."""

_CATCH_ALL: Final = "permit (principal, action, resource);"
_POLICY_IN_ERROR: Final = re.compile(r"policy `([^`]+)`")
_SCHEMA_ERRORS: Final = (
    "failed to build request",
    "failed to parse entities",
    "does not conform to the schema",
)


def _context_attrs(node: object, found: set[str]) -> bool:
    """Collect the ``context.<attr>`` names a policy (as Cedar JSON) reads.

    Returns True when ``context`` is used other than through an attribute (``context == {}``),
    in which case nothing may be left out.
    """
    if isinstance(node, dict):
        for op in (".", "has"):
            inner = node.get(op)
            if isinstance(inner, dict) and inner.get("left") == {"Var": "context"}:
                found.add(str(inner.get("attr")))
                return False
        if node.get("Var") == "context":
            return True
        return any(_context_attrs(v, found) for v in node.values())
    if isinstance(node, list):
        return any(_context_attrs(v, found) for v in node)
    return False


def _scope_actions(constraint: object) -> frozenset[str] | None:
    """The actions a policy's action scope can match (None: any, or not understood)."""
    if not isinstance(constraint, dict) or constraint.get("op") == "All":
        return None
    entities = constraint.get("entities") or (
        [constraint["entity"]] if "entity" in constraint else []
    )
    out: set[str] = set()
    for entity in entities:
        if not isinstance(entity, dict) or entity.get("type") != "Action":
            return None
        name = str(entity.get("id"))
        if constraint.get("op") == "in":
            out |= {a.name for a in ACTIONS.values() if name in a.groups}
        out.add(name)
    return frozenset(out) if constraint.get("op") in ("==", "in") else None


@final
@dataclass(frozen=True, slots=True)
class _PolicyMeta:
    display: str
    effect: str
    annotations: dict[str, str]
    est: JsonValue


@final
@dataclass(frozen=True, slots=True)
class _UnitResult:
    """What Cedar said about one unit, already in the terms a decision needs (cacheable)."""

    decision: Literal["Allow", "Deny", "NoDecision"]
    reasons: tuple[str, ...]  # display ids of the determining policies, in file order
    holds: tuple[str, ...]  # those of ``reasons`` that carry @hold (on Allow only)
    errors: tuple[str, ...]
    errored: tuple[str, ...]  # display ids of the policies that raised errors
    schema_problem: bool


_EntityKey = tuple[object, ...]


_K = TypeVar("_K")
_V = TypeVar("_V")


def _evict_oldest(cache: dict[_K, _V]) -> None:
    """Drop the oldest entry (dicts keep insertion order); tolerate a concurrent evictor."""
    with contextlib.suppress(KeyError, RuntimeError, StopIteration):
        del cache[next(iter(cache))]


@final
class CedarEngine:
    """Decides with Cedar. Build one per policy version; it is safe to share between tasks."""

    def __init__(
        self,
        policies: str | Sequence[PolicyFile],
        *,
        schema: str | None = None,
        schema_name: str = "<schema>",
        on_error: OnError = "deny",
        validate: bool = True,
        max_units: int = 1000,
        entity_cache_size: int = 1024,
        decision_cache_size: int = 4096,
    ) -> None:
        """Parse and check a policy set.

        Args:
            policies: Cedar policy text, or policy files (joined in order with newlines).
                Errors name the file, line and column (``<policies>`` for plain text).
            schema: Cedar schema text; default is sandlot's (:data:`SCHEMA`). A custom schema
                must describe the same requests (it may add constraints); with one, every
                context attribute is sent.
            schema_name: What errors in ``schema`` call it (its path).
            on_error: ``"deny"`` (fail closed) or ``"allow"`` (fail open, visibly).
            validate: Check the policies against the schema at load (catches a misspelled
                attribute before it turns into evaluation errors).
            max_units: Most distinct commands one request may run; more is ``POLICY_ERROR``.
            entity_cache_size: How many principal/sandbox entity sets to keep parsed.
            decision_cache_size: How many unit answers to remember (0 turns the cache off).

        Raises:
            InvalidRequest: the policies or the schema do not parse, the policies do not
                validate, two policies share an ``@id``, or a ``forbid`` carries ``@hold``;
                one line, ``path:line:column: what is wrong``, naming a policy by its ``@id``.
        """
        files = [PolicyFile("<policies>", policies)] if isinstance(policies, str) else policies
        source = SourceMap(files)
        policies = source.text
        schema_text = SCHEMA if schema is None else schema
        try:
            full_schema = cedarpy.Schema.from_str(schema_text)
        except ValueError as e:
            raise schema_error(schema_name, schema_text, str(e)) from None
        try:
            self._policies = cedarpy.PolicySet.from_str(policies)
            est = json.loads(cedarpy.policies_to_json_str(policies))
        except ValueError as e:
            source.check_parses()
            msg = f"the Cedar policies do not parse: {e}"
            raise InvalidRequest(msg) from None
        annotated = {
            str(pid): str(p["annotations"]["id"])
            for pid, p in {**est.get("templates", {}), **est.get("staticPolicies", {})}.items()
            if "id" in (p.get("annotations") or {})
        }
        if validate:
            result = cedarpy.validate_policies(policies, full_schema)
            if not result.validation_passed:
                errors = [(err.policy_id, err.error) for err in result.errors]
                raise validation_error(source, errors, annotated)
        read: set[str] = set()
        whole_context = _context_attrs(est, read)
        self._keep: dict[ContextKind, list[str]] | None = None
        self._schema = full_schema
        if schema is None and not whole_context:
            self._keep = {kind: context_fields(kind, read) for kind in CONTEXT_TYPES}
            self._schema = cedarpy.Schema.from_str(render_schema(read, comments=False))
        self._meta: dict[str, _PolicyMeta] = {}
        self._where: dict[str, str] = {}
        seen: dict[str, str] = {}
        for pid, policy in est.get("staticPolicies", {}).items():
            annotations = {str(k): str(v) for k, v in (policy.get("annotations") or {}).items()}
            display = annotations.get("id") or pid
            stmt = statement_of(source, pid)
            here = source.where(stmt.start) if stmt is not None else display
            if display in seen:
                msg = f'{here}: two Cedar policies share @id("{display}") (the first is at {seen[display]})'
                raise InvalidRequest(msg)
            seen[display] = here
            if stmt is not None:
                self._where[display] = source.where(stmt.start, column=False)
            effect = str(policy.get("effect", ""))
            if "hold" in annotations and effect != "permit":
                label = policy_label(source, pid, annotated)
                msg = f"{here}: @hold is only meaningful on a permit ({label} is a {effect})"
                raise InvalidRequest(msg)
            self._meta[pid] = _PolicyMeta(display, effect, annotations, policy)
        # One policy set per action, holding only the policies whose action scope can match
        # it. Cedar checks the scope before the conditions, so a policy outside it can neither
        # be satisfied nor raise an error: the answers are exactly those of the whole set, and
        # Cedar evaluates fewer policies per request.
        self._slices: dict[str, cedarpy.PolicySet] = {}
        self._permits: dict[str, tuple[str, ...]] = {}
        templates = est.get("templates") or {}
        for action in ACTIONS:
            subset = {
                pid: m.est
                for pid, m in self._meta.items()
                if (
                    scope := _scope_actions(
                        m.est.get("action") if isinstance(m.est, dict) else None
                    )
                )
                is None
                or action in scope
            }
            if templates:
                self._slices[action] = self._policies  # linked templates: keep the whole set
            else:
                doc = {"staticPolicies": subset, "templates": {}, "templateLinks": []}
                self._slices[action] = cedarpy.PolicySet.from_json_str(json.dumps(doc))
            self._permits[action] = tuple(
                self._meta[pid].display for pid in subset if self._meta[pid].effect == "permit"
            )
        self._order = {pid: i for i, pid in enumerate(self._meta)}
        self._unit_memo: dict[tuple[str, tuple[str, ...]], _UnitResult] = {}
        self._hold = frozenset(pid for pid, m in self._meta.items() if "hold" in m.annotations)
        self._reasons = {
            m.display: m.annotations["reason"]
            for m in self._meta.values()
            if "reason" in m.annotations
        }
        self._questions = {
            m.display: m.annotations["hold"] for m in self._meta.values() if "hold" in m.annotations
        }
        self._on_error: OnError = on_error
        self._max_units = max_units
        self._entity_cache: dict[_EntityKey, cedarpy.Entities] = {}
        self._entity_cache_size = entity_cache_size
        self._decision_cache: dict[tuple[_EntityKey, str, str], _UnitResult] = {}
        self._decision_cache_size = decision_cache_size
        self._singles: dict[str, cedarpy.PolicySet] = {}
        digest = hashlib.sha256(b"cedar\x00" + policies.encode() + b"\x00" + schema_text.encode())
        self._hash = f"sha256:{digest.hexdigest()}"

    @classmethod
    def from_files(
        cls,
        paths: Sequence[str | Path],
        *,
        schema_path: str | Path | None = None,
        on_error: OnError = "deny",
        validate: bool = True,
    ) -> CedarEngine:
        """Load policy files, concatenated in order; the name ``"default"`` is the shipped policy.

        Raises:
            InvalidRequest: a file cannot be read, or the policies are invalid (naming the
                file, line and column).
        """
        files: list[PolicyFile] = []
        for p in paths:
            if str(p) == "default":
                files.append(PolicyFile("default.cedar", DEFAULT_POLICY))
                continue
            try:
                files.append(PolicyFile(str(p), Path(p).read_text("utf-8")))
            except OSError as e:
                msg = f"cannot read policy file {p}: {e.strerror}"
                raise InvalidRequest(msg) from None
        schema: str | None = None
        if schema_path is not None:
            try:
                schema = Path(schema_path).read_text("utf-8")
            except OSError as e:
                msg = f"cannot read schema file {schema_path}: {e.strerror}"
                raise InvalidRequest(msg) from None
        return cls(
            files,
            schema=schema,
            schema_name=str(schema_path),
            on_error=on_error,
            validate=validate,
        )

    @property
    def name(self) -> str:
        """``"cedar"``."""
        return "cedar"

    @property
    def policy_hash(self) -> str:
        """``sha256:`` of the policy text and the schema."""
        return self._hash

    @property
    def on_error(self) -> OnError:
        """What happens when a decision cannot be made."""
        return self._on_error

    def policy_ids(self) -> list[str]:
        """The ids of the loaded policies (``@id`` when present), in file order."""
        return [m.display for m in self._meta.values()]

    def context_attributes(self, kind: ContextKind) -> list[str] | None:
        """The context attributes sent to Cedar for a context kind (None: all of them)."""
        return None if self._keep is None else list(self._keep[kind])

    async def decide(self, request: PolicyRequest) -> Decision:
        """Decide (see the module docstring for how Cedar's answer maps to a decision)."""
        return self.evaluate(request)

    async def explain(self, request: PolicyRequest) -> Explanation:
        """Decide, and evaluate every policy on its own to say which matched each unit."""
        return self.explain_now(request)

    async def aclose(self) -> None:
        """Nothing to release."""

    # -- synchronous core (also used by bench/ and the CLI) ------------------------------------

    def evaluate(self, request: PolicyRequest) -> Decision:
        """:meth:`decide`, synchronously."""
        return self._run(request)[0]

    def _entity_key(self, p: Principal, r: Resource) -> _EntityKey:
        labels = tuple(sorted(r.labels.items())) if r.labels else ()
        return (
            p.id,
            p.kind,
            p.tenant,
            p.roles,
            r.sandbox_id,
            r.tenant,
            r.backend,
            r.owner,
            r.workdir,
            labels,
        )

    def _entities(self, key: _EntityKey, p: Principal, r: Resource) -> cedarpy.Entities:
        cached = self._entity_cache.get(key)
        if cached is not None:
            return cached
        data = [
            {
                "uid": {"type": "Agent" if p.kind == "agent" else "User", "id": p.id},
                "attrs": {"tenant": p.tenant, "roles": list(p.roles)},
                "parents": [{"type": "Tenant", "id": p.tenant}],
            },
            {
                "uid": {"type": "Sandbox", "id": r.sandbox_id},
                "attrs": {
                    "tenant": r.tenant,
                    "backend": r.backend,
                    "owner": r.owner,
                    "workdir": r.workdir,
                },
                "parents": [{"type": "Tenant", "id": r.tenant}],
                "tags": dict(r.labels),
            },
        ]
        entities = cedarpy.Entities.from_json_str(json.dumps(data), self._schema)
        if len(self._entity_cache) >= self._entity_cache_size:
            _evict_oldest(self._entity_cache)
        self._entity_cache[key] = entities
        return entities

    def _project(
        self, request: PolicyRequest, units: list[tuple[str, dict[str, JsonValue]]]
    ) -> list[dict[str, JsonValue]]:
        """The contexts Cedar gets: only the attributes the policies read (see the module doc)."""
        if self._keep is None:
            return [ctx for _, ctx in units]
        keep = self._keep[request.info.kind]
        return [{k: ctx[k] for k in keep} for _, ctx in units]

    def _fail(
        self, code: ReasonCode, message: str, errors: Sequence[str], started: int
    ) -> Decision:
        return error_decision(
            engine="cedar",
            policy_hash=self._hash,
            code=code,
            message=message,
            errors=tuple(errors),
            on_error=self._on_error,
            started_ns=started,
        )

    def _names(self, pids: Sequence[str]) -> tuple[str, ...]:
        # Cedar reports reasons in no fixed order; receipts need one, so use the file's.
        ordered = sorted(set(pids), key=lambda p: self._order.get(p, len(self._order)))
        return tuple(self._meta[p].display if p in self._meta else p for p in ordered)

    def _requests(
        self, request: PolicyRequest, contexts: list[dict[str, JsonValue]]
    ) -> list[dict[str, object]]:
        p = request.principal
        principal = {"type": "Agent" if p.kind == "agent" else "User", "id": p.id}
        action = {"type": "Action", "id": request.action}
        resource = {"type": "Sandbox", "id": request.resource.sandbox_id}
        return [
            {"principal": principal, "action": action, "resource": resource, "context": c}
            for c in contexts
        ]

    def _run(
        self, request: PolicyRequest
    ) -> tuple[
        Decision, list[tuple[str, dict[str, JsonValue]]], list[_UnitResult], cedarpy.Entities | None
    ]:
        started = time.perf_counter_ns()
        try:
            units = decision_units(request)
        except (KeyError, TypeError) as e:
            msg = f"the {request.action} context does not have the expected shape: {e}"
            return self._fail(ReasonCode.SCHEMA_VIOLATION, msg, [msg], started), [], [], None
        if len(units) > self._max_units:
            msg = f"the request runs {len(units)} distinct commands; the limit is {self._max_units}"
            return self._fail(ReasonCode.POLICY_ERROR, msg, [msg], started), units, [], None
        try:
            contexts = self._project(request, units)
        except KeyError as e:
            msg = f"the {request.action} context lacks the attribute {e}"
            return self._fail(ReasonCode.SCHEMA_VIOLATION, msg, [msg], started), units, [], None
        raw = request.context.get("raw")
        if isinstance(raw, str) and len(contexts) > 1 and "raw" in contexts[0]:
            # Every unit carries the whole string when a policy reads context.raw, and Cedar
            # parses each copy: the cost grows with commands x length, inside one call that
            # holds the interpreter lock. Past the budget the request is not decided.
            size = len(raw) * len(contexts)
            if size > MAX_RAW_BYTES:
                msg = (
                    f"the policies read context.raw, and this request gives Cedar {len(contexts)} "
                    f"commands x {len(raw)} characters of it; the limit is {MAX_RAW_BYTES} "
                    "(MAX_RAW_BYTES): run a script file instead"
                )
                return self._fail(ReasonCode.POLICY_ERROR, msg, [msg], started), units, [], None
        key = self._entity_key(request.principal, request.resource)
        try:
            entities = self._entities(key, request.principal, request.resource)
        except ValueError as e:
            msg = f"the principal or sandbox does not fit the schema: {e}"
            return self._fail(ReasonCode.SCHEMA_VIOLATION, msg, [msg], started), units, [], None
        results: list[_UnitResult | None] = [None] * len(contexts)
        cache_keys: list[tuple[_EntityKey, str, str]] = []
        if self._decision_cache_size:
            for i, ctx in enumerate(contexts):
                ck = (key, request.action, json.dumps(ctx, separators=(",", ":")))
                cache_keys.append(ck)
                results[i] = self._decision_cache.get(ck)
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            try:
                fresh = cedarpy.is_authorized_batch(
                    self._requests(request, [contexts[i] for i in todo]),
                    self._slices.get(request.action, self._policies),
                    entities,
                    self._schema,
                )
            except Exception as e:  # any failure inside the engine must fail closed, never leak
                msg = f"Cedar failed: {type(e).__name__}: {e}"
                return self._fail(ReasonCode.POLICY_ERROR, msg, [msg], started), units, [], entities
            for i, result in zip(todo, fresh, strict=True):
                unit = self._unit_result(result)
                results[i] = unit
                if self._decision_cache_size:
                    if len(self._decision_cache) >= self._decision_cache_size:
                        _evict_oldest(self._decision_cache)
                    self._decision_cache[cache_keys[i]] = unit
        done = [r for r in results if r is not None]
        return self._combine(request, units, done, started), units, done, entities

    def _unit_result(self, result: cedarpy.AuthzResult) -> _UnitResult:
        diagnostics = result.diagnostics
        errors = tuple(diagnostics.errors)
        if not errors:
            # Error-free results are fully described by the decision and the reasons.
            memo_key = (result.decision.value, tuple(diagnostics.reasons))
            memo = self._unit_memo.get(memo_key)
            if memo is None:
                memo = self._unit_result_uncached(result, errors)
                if len(self._unit_memo) < 4096:
                    self._unit_memo[memo_key] = memo
            return memo
        return self._unit_result_uncached(result, errors)

    def _named(self, errors: Sequence[str]) -> tuple[str, ...]:
        """Errors with Cedar's positional policy ids replaced by the policies' ``@id``."""

        def name(m: re.Match[str]) -> str:
            meta = self._meta.get(m.group(1))
            return f"policy `{meta.display}`" if meta is not None else m.group(0)

        return tuple(_POLICY_IN_ERROR.sub(name, e) for e in errors)

    def _unit_result_uncached(
        self, result: cedarpy.AuthzResult, errors: tuple[str, ...]
    ) -> _UnitResult:
        diagnostics = result.diagnostics
        decision: Literal["Allow", "Deny", "NoDecision"] = (
            "Allow"
            if result.allowed
            else "Deny"
            if result.decision == cedarpy.Decision.Deny
            else "NoDecision"
        )
        reasons = self._names(diagnostics.reasons)
        holds = (
            self._names([r for r in diagnostics.reasons if r in self._hold])
            if decision == "Allow"
            else ()
        )
        return _UnitResult(
            decision=decision,
            reasons=reasons,
            holds=holds,
            errors=self._named(errors),
            errored=self._names(
                [m.group(1) for e in errors for m in [_POLICY_IN_ERROR.search(e)] if m]
            ),
            schema_problem=any(s in e for e in errors for s in _SCHEMA_ERRORS),
        )

    def _combine(
        self,
        request: PolicyRequest,
        units: list[tuple[str, dict[str, JsonValue]]],
        results: list[_UnitResult],
        started: int,
    ) -> Decision:
        verdicts = [
            UnitVerdict(
                label, r.decision, r.reasons, r.holds, r.errors, r.errored, r.schema_problem
            )
            for (label, _), r in zip(units, results, strict=True)
        ]
        return combine_units(
            request,
            verdicts,
            engine="cedar",
            policy_hash=self._hash,
            on_error=self._on_error,
            started_ns=started,
            reasons=self._reasons,
            questions=self._questions,
            where=self._where,
            permits=self._permits.get(request.action, ()),
        )

    def _single(self, pid: str) -> cedarpy.PolicySet:
        single = self._singles.get(pid)
        if single is None:
            meta = self._meta[pid]
            doc = {"staticPolicies": {pid: meta.est}, "templates": {}, "templateLinks": []}
            single = cedarpy.PolicySet.from_json_str(json.dumps(doc))
            if meta.effect == "forbid":
                # A forbid alone can only deny; pair it with a permit-all to see whether it fires.
                single = single.with_added_str(_CATCH_ALL)
            self._singles[pid] = single
        return single

    def explain_now(self, request: PolicyRequest) -> Explanation:
        """:meth:`explain`, synchronously."""
        decision, units, results, entities = self._run(request)
        notes = (
            "each policy was also evaluated on its own to show whether its scope and conditions hold",
            "HOLD: a request allowed by a permit annotated @hold needs approval; forbids win over holds",
        )
        if not results or entities is None:
            bare = tuple(
                UnitTrace(label=label, context=ctx, outcome=Outcome.DENY) for label, ctx in units
            )
            return Explanation(decision=decision, units=bare, notes=notes)
        batch = self._requests(request, self._project(request, units))
        per_policy = {
            pid: cedarpy.is_authorized_batch(batch, self._single(pid), entities, self._schema)
            for pid in self._meta
        }
        traces: list[UnitTrace] = []
        for i, ((label, ctx), result) in enumerate(zip(units, results, strict=True)):
            determining = set(result.reasons)
            policies: list[PolicyTrace] = []
            for pid, meta in self._meta.items():
                alone = per_policy[pid][i]
                error = "; ".join(self._named(alone.diagnostics.errors)) or None
                fired = cedarpy.Decision.Allow if meta.effect == "permit" else cedarpy.Decision.Deny
                policies.append(
                    PolicyTrace(
                        policy_id=meta.display,
                        effect=meta.effect,
                        satisfied=error is None and alone.decision == fired,
                        determining=meta.display in determining,
                        annotations=dict(meta.annotations),
                        error=error,
                    )
                )
            if result.errors or result.decision == "Deny" or result.decision == "NoDecision":
                outcome = Outcome.DENY
            else:
                outcome = Outcome.HOLD if result.holds else Outcome.ALLOW
            traces.append(
                UnitTrace(
                    label=label,
                    context=ctx,
                    outcome=outcome,
                    policies=tuple(policies),
                    errors=result.errors,
                )
            )
        return Explanation(decision=decision, units=tuple(traces), notes=notes)
