"""Helpers for the policy tests: a principal, a sandbox, and a one-call decide."""

from __future__ import annotations

from pathlib import Path

import anyio

from sandlot.policy import (
    Decision,
    PolicyEngine,
    PolicyRequest,
    Principal,
    Resource,
    normalize_operation,
)

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "policies"

AGENT = Principal(id="agent-1", tenant="acme")
SANDBOX = Resource(
    sandbox_id="sb-000000000001", tenant="acme", backend="local", workdir="/workspace"
)


def request(
    action: str, principal: Principal = AGENT, resource: Resource = SANDBOX, **args: object
) -> PolicyRequest:
    return normalize_operation(action, principal=principal, resource=resource, args=args)


def exec_request(command: str | list[str], **kw: object) -> PolicyRequest:
    return request("exec", command=command, **kw)


def decide(engine: PolicyEngine, req: PolicyRequest) -> Decision:
    return anyio.run(engine.decide, req)
