"""A remote decision point speaking Open Policy Agent's Data API.

The engine sends ``POST <url>/v1/data/<path>`` with ``{"input": <request.canonical()>}`` and
reads ``result``, which may be:

- a boolean: ``true`` allows, ``false`` denies (``POLICY_VIOLATION``);
- an object ``{"allow": bool, "hold": bool | "question", "reasons": [str], "reason_code": str}``
  (``deny`` is accepted as a synonym of ``reasons``): ``allow`` false denies, ``allow`` true
  with a truthy ``hold`` holds, otherwise it allows.

It fails closed: a timeout, a refused connection or a 5xx answer is DENY
``REMOTE_UNAVAILABLE``; a 4xx answer, a body that is not JSON, an undefined result (no
``result`` key: the rule does not exist or did not evaluate) or a result of the wrong shape is
DENY ``POLICY_ERROR``. With ``on_error="allow"`` these become ALLOW ``POLICY_ERROR_FAIL_OPEN``.
Rego deny-lists fail open on missing input, so write the policy default-deny
(``default allow := false``).

:attr:`policy_hash` identifies the decision point (``sha256`` of the endpoint), not the policy
text, which lives in OPA; when OPA reports a bundle revision (``?provenance``) it is added to
the decision's message.

This module imports httpx, the policy package and :mod:`sandlot.errors`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import final

import httpx
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
    error_decision,
)
from sandlot.policy.request import PolicyRequest

__all__ = ["OpaEngine"]

_DENY_CODES = frozenset({ReasonCode.POLICY_VIOLATION.value, ReasonCode.NO_MATCHING_PERMIT.value})


@final
class OpaEngine:
    """Asks an OPA server (or anything speaking its Data API) for each decision."""

    def __init__(
        self,
        url: str,
        path: str = "sandlot/decision",
        *,
        timeout: float = 0.5,
        on_error: OnError = "deny",
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Configure the decision point.

        Args:
            url: The server's base URL (``http://127.0.0.1:8181``).
            path: The rule's path under ``/v1/data/`` (``sandlot/decision`` is
                ``data.sandlot.decision``).
            timeout: Seconds for the whole exchange; past it the decision is a DENY.
            on_error: ``"deny"`` (fail closed) or ``"allow"`` (fail open, visibly).
            headers: Extra headers (an ``Authorization`` bearer token for OPA's authn).
            transport: An httpx transport (tests, unix sockets).

        Raises:
            InvalidRequest: the URL is not http(s), the path is empty, or the timeout is not positive.
        """
        if not url.startswith(("http://", "https://")):
            msg = f"the OPA url must be http:// or https://, got {url!r}"
            raise InvalidRequest(msg)
        path = path.strip("/")
        if not path:
            msg = "the OPA decision path must not be empty"
            raise InvalidRequest(msg)
        if timeout <= 0:
            msg = f"the OPA timeout must be positive, got {timeout}"
            raise InvalidRequest(msg)
        self._endpoint = f"{url.rstrip('/')}/v1/data/{path}"
        self._timeout = timeout
        self._on_error: OnError = on_error
        self._headers = dict(headers or {})
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._hash = "sha256:" + hashlib.sha256(b"opa\x00" + self._endpoint.encode()).hexdigest()

    @property
    def name(self) -> str:
        """``"opa"``."""
        return "opa"

    @property
    def policy_hash(self) -> str:
        """``sha256:`` of the decision endpoint (the policy itself lives in OPA)."""
        return self._hash

    @property
    def endpoint(self) -> str:
        """The URL decisions are posted to."""
        return self._endpoint

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                headers=self._headers,
                transport=self._transport,
            )
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _fail(self, code: ReasonCode, message: str, started: int) -> Decision:
        return error_decision(
            engine="opa",
            policy_hash=self._hash,
            code=code,
            message=message,
            errors=(message,),
            on_error=self._on_error,
            started_ns=started,
        )

    async def _query(
        self, request: PolicyRequest, params: Mapping[str, str]
    ) -> tuple[Decision, JsonValue]:
        started = time.perf_counter_ns()
        try:
            response = await self._http().post(
                self._endpoint, json={"input": request.canonical()}, params=dict(params)
            )
        except httpx.TimeoutException:
            return self._fail(
                ReasonCode.REMOTE_UNAVAILABLE,
                f"OPA at {self._endpoint} timed out after {self._timeout}s",
                started,
            ), None
        except httpx.HTTPError as e:
            return self._fail(
                ReasonCode.REMOTE_UNAVAILABLE,
                f"OPA at {self._endpoint} unreachable: {type(e).__name__}: {e}",
                started,
            ), None
        if response.status_code >= 500:
            return self._fail(
                ReasonCode.REMOTE_UNAVAILABLE,
                f"OPA answered {response.status_code}: {response.text[:200]}",
                started,
            ), None
        if response.status_code != 200:
            return self._fail(
                ReasonCode.POLICY_ERROR,
                f"OPA answered {response.status_code}: {response.text[:200]}",
                started,
            ), None
        try:
            body = response.json()
        except (ValueError, UnicodeDecodeError):
            return self._fail(ReasonCode.POLICY_ERROR, "OPA's answer is not JSON", started), None
        if not isinstance(body, dict) or "result" not in body:
            # OPA omits "result" when the rule is undefined for this input: never an allow.
            return self._fail(
                ReasonCode.POLICY_ERROR, f"OPA result undefined at {self._endpoint}", started
            ), body
        return self._interpret(request, body, started), body

    def _interpret(
        self, request: PolicyRequest, body: dict[str, JsonValue], started: int
    ) -> Decision:
        result = body["result"]
        revision = ""
        provenance = body.get("provenance")
        if isinstance(provenance, dict):
            bundles = provenance.get("bundles")
            if isinstance(bundles, dict):
                revs = [
                    str(b.get("revision"))
                    for b in bundles.values()
                    if isinstance(b, dict) and b.get("revision")
                ]
                revision = f" (bundle revision {', '.join(revs)})" if revs else ""

        def made(
            outcome: Outcome,
            code: ReasonCode,
            matched: tuple[str, ...],
            message: str,
            hold: str | None = None,
        ) -> Decision:
            return Decision(
                outcome=outcome,
                reason_code=code,
                engine="opa",
                policy_hash=self._hash,
                matched=matched,
                message=message + revision,
                hold_reason=hold,
                duration_ns=time.perf_counter_ns() - started,
            )

        if isinstance(result, bool):
            if result:
                return made(Outcome.ALLOW, ReasonCode.OK, (), f"{request.action} allowed by OPA")
            return made(
                Outcome.DENY, ReasonCode.POLICY_VIOLATION, (), f"{request.action} denied by OPA"
            )
        if not isinstance(result, dict):
            return self._fail(
                ReasonCode.POLICY_ERROR,
                f"OPA result has the wrong shape: {json.dumps(result)[:200]}",
                started,
            )
        allow = result.get("allow")
        if not isinstance(allow, bool):
            return self._fail(
                ReasonCode.POLICY_ERROR, "OPA result.allow is missing or not a boolean", started
            )
        raw_reasons = result.get("reasons", result.get("deny", []))
        if not isinstance(raw_reasons, list) or not all(isinstance(r, str) for r in raw_reasons):
            return self._fail(
                ReasonCode.POLICY_ERROR, "OPA result.reasons is not a list of strings", started
            )
        reasons = tuple(str(r) for r in raw_reasons)
        if not allow:
            code = result.get("reason_code")
            if isinstance(code, str) and code in _DENY_CODES:
                reason_code = ReasonCode(code)
            else:
                reason_code = (
                    ReasonCode.POLICY_VIOLATION if reasons else ReasonCode.NO_MATCHING_PERMIT
                )
            detail = f": {', '.join(reasons)}" if reasons else ""
            return made(
                Outcome.DENY, reason_code, reasons, f"{request.action} denied by OPA{detail}"
            )
        hold = result.get("hold", False)
        if hold:
            question = hold if isinstance(hold, str) else "approval required"
            return made(
                Outcome.HOLD,
                ReasonCode.HOLD_REQUIRED,
                reasons,
                f"{request.action} needs approval: {question}",
                question,
            )
        return made(Outcome.ALLOW, ReasonCode.OK, reasons, f"{request.action} allowed by OPA")

    async def decide(self, request: PolicyRequest) -> Decision:
        """Ask OPA; any failure is a DENY (or a visible fail-open ALLOW)."""
        return (await self._query(request, {}))[0]

    async def explain(self, request: PolicyRequest) -> Explanation:
        """Ask OPA with ``explain=notes`` and ``provenance``; report the result it returned."""
        decision, body = await self._query(request, {"explain": "notes", "provenance": "true"})
        notes = [f"decision point: POST {self._endpoint}"]
        if isinstance(body, dict):
            notes.append(f"result: {json.dumps(body.get('result'), sort_keys=True)[:500]}")
            explanation = body.get("explanation")
            if isinstance(explanation, list):
                notes.append(f"OPA returned {len(explanation)} explanation events")
        traces = tuple(
            PolicyTrace(
                policy_id=r,
                effect="forbid" if decision.outcome is Outcome.DENY else "permit",
                satisfied=True,
                determining=True,
            )
            for r in decision.matched
        )
        unit = UnitTrace(
            label="request",
            context=request.canonical(),
            outcome=decision.outcome,
            policies=traces,
            errors=decision.errors,
        )
        return Explanation(decision=decision, units=(unit,), notes=tuple(notes))
