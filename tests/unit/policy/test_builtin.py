"""The builtin rule engine: the rule language, its semantics, failing closed."""

from __future__ import annotations

import json

import anyio
import pytest

from sandlot.errors import InvalidRequest
from sandlot.policy import Outcome, PolicyRequest, Principal, ReasonCode, Resource
from sandlot.policy.builtin import BuiltinEngine

from .conftest import AGENT, SANDBOX, decide, exec_request, request

RULES = """
default = "deny"

[[rule]]
id = "allow-tools"
effect = "permit"
actions = ["exec", "process.sta*"]
when = { program = ["ls", "python*", "git"] }

[[rule]]
id = "hold-push"
effect = "hold"
actions = ["exec"]
reason = "pushing needs approval"
when = { program = "git", operands_any = ["push"] }

[[rule]]
id = "no-force"
effect = "forbid"
actions = ["run"]
reason = "no forced git"
when = { program = "git", args_any = ["--force", "-f"] }

[[rule]]
id = "dev-sandboxes-only"
effect = "forbid"
actions = ["*"]
unless = { "resource.labels.env" = "dev" }

[[rule]]
id = "workdir-writes"
effect = "permit"
actions = ["files"]
when = { within_any = ["{resource.workdir}"], "principal.roles_any" = ["writer"] }
"""

DEV = SANDBOX.model_copy(update={"labels": {"env": "dev"}})
WRITER = AGENT.model_copy(update={"roles": ("writer",)})


@pytest.fixture
def engine() -> BuiltinEngine:
    return BuiltinEngine.from_text(RULES)


@pytest.mark.parametrize(
    ("action", "args", "principal", "outcome", "code"),
    [
        ("exec", {"command": "ls -la"}, AGENT, Outcome.ALLOW, ReasonCode.OK),
        ("exec", {"command": "python3.11 x.py"}, AGENT, Outcome.ALLOW, ReasonCode.OK),
        ("process.start", {"command": "git status"}, AGENT, Outcome.ALLOW, ReasonCode.OK),
        (
            "exec",
            {"command": "git push origin main"},
            AGENT,
            Outcome.HOLD,
            ReasonCode.HOLD_REQUIRED,
        ),
        ("exec", {"command": "git push -f"}, AGENT, Outcome.DENY, ReasonCode.POLICY_VIOLATION),
        ("exec", {"command": "ls; curl x"}, AGENT, Outcome.DENY, ReasonCode.NO_MATCHING_PERMIT),
        ("fs.write", {"path": "/workspace/a"}, WRITER, Outcome.ALLOW, ReasonCode.OK),
        ("fs.write", {"path": "/workspace/a"}, AGENT, Outcome.DENY, ReasonCode.NO_MATCHING_PERMIT),
        ("fs.write", {"path": "/etc/a"}, WRITER, Outcome.DENY, ReasonCode.NO_MATCHING_PERMIT),
    ],
)
def test_rules(
    engine: BuiltinEngine,
    action: str,
    args: dict,
    principal: Principal,
    outcome: Outcome,
    code: ReasonCode,
) -> None:
    d = decide(engine, request(action, principal=principal, resource=DEV, **args))
    assert (d.outcome, d.reason_code) == (outcome, code), d


def test_unless_and_resource_labels(engine: BuiltinEngine) -> None:
    d = decide(engine, exec_request("ls"))  # SANDBOX has no env=dev label
    assert (d.outcome, d.matched) == (Outcome.DENY, ("dev-sandboxes-only",))


def test_hold_question_comes_from_the_reason(engine: BuiltinEngine) -> None:
    d = decide(engine, request("exec", resource=DEV, command="git push"))
    assert d.hold_reason == "pushing needs approval"


def test_default_allow() -> None:
    engine = BuiltinEngine.from_text(
        'default = "allow"\n[[rule]]\nid = "x"\neffect = "forbid"\nwhen = { "principal.id" = "evil" }'
    )
    assert decide(engine, exec_request("anything")).outcome is Outcome.ALLOW
    assert (
        decide(engine, request("destroy", principal=Principal(id="evil", tenant="acme"))).outcome
        is Outcome.DENY
    )


def test_json_rules() -> None:
    doc = {"default": "deny", "rule": [{"id": "ro", "effect": "permit", "actions": ["read"]}]}
    engine = BuiltinEngine.from_text(json.dumps(doc), format="json")
    assert decide(engine, request("fs.read", path="/x")).outcome is Outcome.ALLOW
    assert decide(engine, request("fs.write", path="/x")).outcome is Outcome.DENY


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[rule]]\neffect = 'allow'", "effect must be"),
        ("[[rule]]\neffect = 'permit'\nactions = ['nope']", "names no action"),
        ("[[rule]]\neffect = 'permit'\nwhen = { program = 'ls' }", "has no context attribute"),
        (
            "[[rule]]\neffect = 'permit'\nactions = ['read']\nwhen = { progam = 'ls' }",
            "has no context attribute",
        ),
        ("[[rule]]\neffect = 'permit'\ncolour = 1", "unknown keys"),
        ("default = 'maybe'", "default must be"),
        ("[[rule]]\nid='a'\neffect='permit'\n[[rule]]\nid='a'\neffect='permit'", "share the id"),
        ("[[rule]\n", "do not parse"),
        (
            "[[rule]]\neffect = 'permit'\nactions = ['run']\nwhen = { flags_empty = 'yes' }",
            "true or false",
        ),
    ],
)
def test_bad_rules_are_rejected_at_load(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        BuiltinEngine.from_text(text)


def test_a_malformed_request_fails_closed(engine: BuiltinEngine) -> None:
    broken = PolicyRequest(
        principal=AGENT,
        action="exec",
        resource=DEV,
        context={
            "cwd": "/",
            "shell": False,
            "shell_undecidable": False,
            "shell_features": [],
            "raw": "x",
            "programs": [],
            "commands": [{"program": 5}],
        },
    )
    d = decide(engine, broken)
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.POLICY_ERROR)
    assert any("is not a string" in e for e in d.errors)
    open_engine = BuiltinEngine.from_text(RULES, on_error="allow")
    assert decide(open_engine, broken).reason_code is ReasonCode.POLICY_ERROR_FAIL_OPEN
    shapeless = PolicyRequest(principal=AGENT, action="exec", resource=DEV, context={})
    assert decide(engine, shapeless).reason_code is ReasonCode.SCHEMA_VIOLATION


def test_explain_lists_every_rule(engine: BuiltinEngine) -> None:
    explanation = anyio.run(engine.explain, request("exec", resource=DEV, command="git push -f"))
    (unit,) = explanation.units
    by_id = {p.policy_id: p for p in unit.policies}
    assert by_id["no-force"].satisfied
    assert by_id["no-force"].determining
    assert by_id["hold-push"].satisfied
    assert not by_id["hold-push"].determining
    assert not by_id["dev-sandboxes-only"].satisfied
    assert "workdir-writes" not in by_id  # not in scope for exec
    assert explanation.decision.outcome is Outcome.DENY


def test_policy_hash_changes_with_the_rules() -> None:
    assert BuiltinEngine.from_text(RULES).policy_hash == BuiltinEngine.from_text(RULES).policy_hash
    assert (
        BuiltinEngine.from_text(RULES).policy_hash
        != BuiltinEngine.from_text(RULES + "\n# x").policy_hash
    )


def test_resource_substitution_uses_the_request(engine: BuiltinEngine) -> None:
    elsewhere = Resource(
        sandbox_id="sb-9", tenant="acme", workdir="/srv/app", labels={"env": "dev"}
    )
    assert (
        decide(
            engine, request("fs.write", principal=WRITER, resource=elsewhere, path="/srv/app/x")
        ).outcome
        is Outcome.ALLOW
    )
    assert (
        decide(
            engine, request("fs.write", principal=WRITER, resource=elsewhere, path="/workspace/x")
        ).outcome
        is Outcome.DENY
    )
