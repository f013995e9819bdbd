"""load_engine, the request model, and the public surface of sandlot.policy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import rfc8785

import sandlot.policy
from sandlot.errors import InvalidRequest, NotSupported
from sandlot.models import Actor, SandboxInfo, SandboxSpec, SandboxStatus
from sandlot.policy import (
    Outcome,
    PolicyConfig,
    PolicyEngine,
    PolicyRequest,
    Principal,
    ReasonCode,
    Resource,
    load_engine,
)
from sandlot.policy.builtin import BuiltinEngine
from sandlot.policy.cedar import CedarEngine

from .conftest import AGENT, SANDBOX, decide, exec_request


def test_public_surface_is_sorted_and_importable() -> None:
    assert sandlot.policy.__all__ == sorted(sandlot.policy.__all__)
    for name in sandlot.policy.__all__:
        assert getattr(sandlot.policy, name) is not None


def test_engines_satisfy_the_protocol() -> None:
    for engine in (load_engine(), load_engine({"engine": "builtin"})):
        assert isinstance(engine, PolicyEngine)


def test_cedar_policy_files_are_concatenated(tmp_path: Path) -> None:
    extra = tmp_path / "extra.cedar"
    extra.write_text(
        '@id("no-ls") forbid (principal, action in Action::"run", resource) when { context.program == "ls" };'
    )
    engine = load_engine(PolicyConfig(policy_paths=("default", str(extra))))
    assert isinstance(engine, CedarEngine)
    d = decide(engine, exec_request("ls"))
    assert (d.outcome, d.matched) == (Outcome.DENY, ("no-ls",))
    assert decide(engine, exec_request("rm -rf /")).outcome is Outcome.DENY


def test_builtin_rules_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text('{"default": "allow", "rule": []}')
    engine = load_engine({"engine": "builtin", "policy_paths": [str(rules)], "on_error": "allow"})
    assert isinstance(engine, BuiltinEngine)
    assert decide(engine, exec_request("rm -rf /")).outcome is Outcome.ALLOW


@pytest.mark.parametrize(
    "config",
    [
        {"engine": "prolog"},
        {"engine": "cedar", "policy_paths": ["/nonexistent.cedar"]},
        {"engine": "cedar", "schema_path": "/nonexistent.cedarschema"},
        {"engine": "builtin", "policy_paths": ["a", "b"]},
        {"engine": "cedar", "on_error": "maybe"},
        {"engine": "opa", "url": "http://x", "timeout": 0},
        {"colour": "blue"},
    ],
)
def test_bad_configuration_is_an_invalid_request(config: dict) -> None:
    with pytest.raises(InvalidRequest):
        load_engine(config)


def test_cedar_without_cedarpy_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cedarpy", None)
    monkeypatch.delitem(sys.modules, "sandlot.policy.cedar", raising=False)
    with pytest.raises(NotSupported, match="cedarpy"):
        load_engine()
    # The builtin engine needs nothing and still protects the default cases.
    assert (
        decide(load_engine({"engine": "builtin"}), exec_request("rm -rf /")).reason_code
        is ReasonCode.POLICY_VIOLATION
    )


def test_fail_open_is_configurable_and_visible() -> None:
    engine = load_engine({"on_error": "allow"})
    broken = PolicyRequest(principal=AGENT, action="fs.write", resource=SANDBOX, context={})
    d = decide(engine, broken)
    assert (d.outcome, d.reason_code) == (Outcome.ALLOW, ReasonCode.POLICY_ERROR_FAIL_OPEN)
    assert decide(load_engine(), broken).outcome is Outcome.DENY


def test_canonical_request_is_stable_json() -> None:
    req = exec_request("rm -rf /tmp/x")
    body = req.canonical()
    assert list(body) == sorted(body)
    assert rfc8785.dumps(body) == rfc8785.dumps(exec_request("rm -rf /tmp/x").canonical())
    assert rfc8785.dumps(body) != rfc8785.dumps(
        exec_request("rm -fr /tmp/x").canonical()
    )  # raw differs
    assert body["principal"] == {"id": "agent-1", "kind": "agent", "roles": [], "tenant": "acme"}


def test_request_rejects_unknown_actions() -> None:
    with pytest.raises(ValueError, match="unknown action"):
        PolicyRequest(principal=AGENT, action="nope", resource=SANDBOX, context={})


def test_principal_and_resource_from_manager_records() -> None:
    p = Principal.of(Actor(tenant="acme", principal="alice", admin=True), kind="user")
    assert (p.id, p.tenant, p.kind, p.roles) == ("alice", "acme", "user", ("admin",))
    info = SandboxInfo(
        id="sb-1",
        backend="local",
        status=SandboxStatus.RUNNING,
        spec=SandboxSpec(labels={"env": "dev"}, owner="alice", workdir="/srv"),
        tenant="acme",
    )
    r = Resource.of(info)
    assert (r.sandbox_id, r.backend, r.owner, r.workdir, dict(r.labels), r.tenant) == (
        "sb-1",
        "local",
        "alice",
        "/srv",
        {"env": "dev"},
        "acme",
    )
