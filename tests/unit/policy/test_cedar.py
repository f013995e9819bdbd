"""The Cedar engine: fail closed, schema validation, HOLD, explain, caching and pruning."""

from __future__ import annotations

import anyio
import cedarpy
import pytest

from sandlot.errors import InvalidRequest
from sandlot.policy import Outcome, PolicyRequest, Principal, ReasonCode, Resource, load_engine
from sandlot.policy.cedar import DEFAULT_POLICY, SCHEMA, CedarEngine
from sandlot.policy.request import ACTIONS, ContextKind

from .conftest import AGENT, SANDBOX, decide, exec_request, request
from .test_default_policy import ALLOWED, DENIED

PERMIT_ALL = "permit (principal, action, resource);"
OVERFLOW = (
    PERMIT_ALL
    + '\n@id("boom")\nforbid (principal, action == Action::"port.expose", resource)'
    + "\nwhen { context.port * 9223372036854775807 > 0 };"
)


def test_an_erroring_forbid_does_not_let_the_request_through() -> None:
    # Plain Cedar skips the erroring forbid and answers Allow: the trap the gate must avoid.
    raw = cedarpy.is_authorized(
        {
            "principal": 'Agent::"a"',
            "action": 'Action::"port.expose"',
            "resource": 'Sandbox::"s"',
            "context": {"port": 8080},
        },
        OVERFLOW,
        [],
    )
    assert raw.decision == cedarpy.Decision.Allow
    assert raw.diagnostics.errors
    d = decide(CedarEngine(OVERFLOW), request("port.expose", port=8080))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.POLICY_ERROR)
    assert d.matched == ("boom",)
    assert "integer overflow" in d.errors[0]


def test_fail_open_allows_and_says_so() -> None:
    d = decide(CedarEngine(OVERFLOW, on_error="allow"), request("port.expose", port=8080))
    assert (d.outcome, d.reason_code) == (Outcome.ALLOW, ReasonCode.POLICY_ERROR_FAIL_OPEN)
    assert "POLICY_ERROR" in d.message
    assert d.errors


def test_a_definite_forbid_wins_over_errors_even_when_failing_open() -> None:
    policy = (
        OVERFLOW
        + '\n@id("no-8080") forbid (principal, action, resource) when { context has port && context.port == 8080 };'
    )
    d = decide(CedarEngine(policy, on_error="allow"), request("port.expose", port=8080))
    assert (d.outcome, d.reason_code, d.matched) == (
        Outcome.DENY,
        ReasonCode.POLICY_VIOLATION,
        ("no-8080",),
    )


def test_a_request_missing_a_context_attribute_is_denied() -> None:
    engine = CedarEngine(DEFAULT_POLICY)
    good = request("fs.write", path="/workspace/x")
    missing = PolicyRequest(
        principal=AGENT, action="fs.write", resource=SANDBOX, context={"path": "/workspace/x"}
    )
    assert decide(engine, good).outcome is Outcome.ALLOW
    d = decide(engine, missing)
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.SCHEMA_VIOLATION)
    no_commands = PolicyRequest(
        principal=AGENT, action="exec", resource=SANDBOX, context={"raw": "ls"}
    )
    assert decide(engine, no_commands).reason_code is ReasonCode.SCHEMA_VIOLATION
    failing_open = CedarEngine(DEFAULT_POLICY, on_error="allow")
    assert decide(failing_open, missing).reason_code is ReasonCode.POLICY_ERROR_FAIL_OPEN


def test_cedar_itself_rejects_a_request_that_does_not_fit_the_schema() -> None:
    # With the full schema nothing is pruned, so Cedar sees and rejects the bad request.
    engine = CedarEngine(PERMIT_ALL, schema=SCHEMA)
    wrong_type = PolicyRequest(
        principal=AGENT,
        action="fs.write",
        resource=SANDBOX,
        context={"path": 5, "within": [], "recursive": False},
    )
    d = decide(engine, wrong_type)
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.SCHEMA_VIOLATION)
    assert "failed to build request" in d.errors[0]
    missing = PolicyRequest(
        principal=AGENT, action="fs.write", resource=SANDBOX, context={"path": "/x", "within": []}
    )
    assert decide(engine, missing).reason_code is ReasonCode.SCHEMA_VIOLATION


def test_an_operator_schema_can_require_more_context() -> None:
    schema = SCHEMA.replace("type PortContext = {", "type PortContext = {\n  ticket: String,")
    engine = CedarEngine(PERMIT_ALL, schema=schema)
    d = decide(engine, request("port.expose", port=80))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.SCHEMA_VIOLATION)


def test_every_action_context_fits_the_full_schema() -> None:
    engine = CedarEngine(PERMIT_ALL, schema=SCHEMA)
    args: dict[str, dict[str, object]] = {
        "exec": {"command": "sudo rm -rf /tmp/x $Y > /dev/sda; echo `ls`"},
        "process.start": {"command": ["sleep", "1"]},
        "pty.open": {},
        "exec.program": {"command": ["/usr/bin/ls", "-l"]},
        "process.signal": {"process_id": "p", "signal": 9},
        "fs.chmod": {"path": "/x", "mode": 0o644},
        "port.expose": {"port": 80},
        "network.update": {"network": {"allow_domains": ["x.org"], "deny_cidrs": ["10.0.0.0/8"]}},
    }
    for action, info in ACTIONS.items():
        a = args.get(action, {"path": "/workspace/f"} if info.kind is ContextKind.PATH else {})
        d = decide(engine, request(action, **a))
        assert (d.outcome, d.reason_code) == (Outcome.ALLOW, ReasonCode.OK), (action, d)


def test_nothing_permits_means_no_matching_permit() -> None:
    engine = CedarEngine('permit (principal, action == Action::"fs.read", resource);')
    d = decide(engine, exec_request("ls"))
    assert (d.outcome, d.reason_code, d.matched) == (
        Outcome.DENY,
        ReasonCode.NO_MATCHING_PERMIT,
        (),
    )


def test_every_command_of_a_request_must_be_permitted() -> None:
    engine = CedarEngine(
        'permit (principal, action == Action::"exec", resource) when { context.program == "ls" };'
    )
    assert decide(engine, exec_request("ls -la")).outcome is Outcome.ALLOW
    d = decide(engine, exec_request("ls; cat /etc/passwd"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.NO_MATCHING_PERMIT)
    assert "command 2: cat" in d.message


def test_hold_permits_win_over_plain_permits_and_lose_to_forbids() -> None:
    policy = DEFAULT_POLICY + (
        '\n@id("hold-pip")\n@hold("installing packages needs approval")\n'
        'permit (principal, action in Action::"run", resource) when { context.program == "pip" };'
    )
    engine = CedarEngine(policy)
    d = decide(engine, exec_request("pip install x"))
    assert (d.outcome, d.reason_code, d.hold_reason) == (
        Outcome.HOLD,
        ReasonCode.HOLD_REQUIRED,
        "installing packages needs approval",
    )
    assert decide(engine, exec_request("pip install x && rm -rf /")).outcome is Outcome.DENY
    assert decide(engine, exec_request("ls")).outcome is Outcome.ALLOW


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("permit (principal, action, resource", "does not parse"),
        (
            'permit (principal, action, resource) when { context.progam == "rm" };',
            "does not validate",
        ),
        (
            '@id("x") permit (principal, action, resource);\n@id("x") permit (principal, action, resource);',
            "share @id",
        ),
        ('@hold("no") forbid (principal, action, resource);', "only meaningful on a permit"),
    ],
)
def test_bad_policies_are_rejected_at_load(policy: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        CedarEngine(policy)


def test_an_unvalidated_typo_fails_closed_at_evaluation() -> None:
    engine = CedarEngine(
        PERMIT_ALL
        + '\n@id("typo") forbid (principal, action == Action::"exec", resource) when { context.progam == "rm" };',
        validate=False,
    )
    d = decide(engine, exec_request("rm -rf /"))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.POLICY_ERROR)


def test_explain_reports_considered_and_matching_policies() -> None:
    engine = CedarEngine(DEFAULT_POLICY)
    explanation = anyio.run(engine.explain, exec_request("ls && rm -rf /"))
    assert explanation.decision.outcome is Outcome.DENY
    ls, rm = explanation.units
    assert (ls.outcome, rm.outcome) == (Outcome.ALLOW, Outcome.DENY)
    assert {p.policy_id for p in rm.policies} == set(engine.policy_ids())  # every policy considered
    by_id = {p.policy_id: p for p in rm.policies}
    assert by_id["deny-recursive-remove-system-dirs"].satisfied
    assert by_id["deny-recursive-remove-system-dirs"].determining
    assert by_id["allow-run"].satisfied
    assert not by_id["allow-run"].determining
    assert not by_id["deny-raw-device-writes"].satisfied
    assert (
        by_id["deny-recursive-remove-system-dirs"]
        .annotations["reason"]
        .startswith("recursive removal")
    )
    assert rm.context["program"] == "rm"
    assert rm.context["paths"] == ["/"]
    text = explanation.render()
    assert "* forbid deny-recursive-remove-system-dirs: matched" in text
    assert explanation.to_dict()["decision"]["outcome"] == "DENY"  # type: ignore[index,call-overload]


def test_explain_reports_errors_per_policy() -> None:
    explanation = CedarEngine(OVERFLOW).explain_now(request("port.expose", port=8080))
    (unit,) = explanation.units
    boom = next(p for p in unit.policies if p.policy_id == "boom")
    assert boom.error
    assert "overflow" in boom.error
    assert not boom.satisfied


def test_the_cache_never_changes_an_answer() -> None:
    cached = CedarEngine(DEFAULT_POLICY)
    uncached = CedarEngine(DEFAULT_POLICY, decision_cache_size=0)
    stranger = Principal(id="agent-1", tenant="other")
    for _ in range(2):
        for command in DENIED + ALLOWED:
            for principal in (AGENT, stranger):
                req = request("exec", principal=principal, command=command)
                a, b = cached.evaluate(req), uncached.evaluate(req)
                assert (a.outcome, a.reason_code, a.matched) == (
                    b.outcome,
                    b.reason_code,
                    b.matched,
                )


def test_only_the_attributes_the_policies_read_are_sent() -> None:
    engine = CedarEngine(DEFAULT_POLICY)
    assert engine.context_attributes(ContextKind.COMMAND) == [
        "program",
        "flags",
        "paths",
        "glob_dirs",
        "device_writes",
    ]
    assert engine.context_attributes(ContextKind.PATH) == ["path", "recursive", "device"]
    whole = CedarEngine(
        PERMIT_ALL
        + '\nforbid (principal, action == Action::"stop", resource) when { context == {} };'
    )
    assert whole.context_attributes(ContextKind.COMMAND) is None


def test_labels_are_tags_and_tenants_are_parents() -> None:
    policy = (
        '@id("dev-only") permit (principal in Tenant::"acme", action == Action::"destroy", resource)\n'
        'when { resource.hasTag("env") && resource.getTag("env") == "dev" };'
    )
    engine = CedarEngine(policy)
    dev = Resource(sandbox_id="sb-1", tenant="acme", labels={"env": "dev"})
    prod = Resource(sandbox_id="sb-2", tenant="acme", labels={"env": "prod"})
    assert decide(engine, request("destroy", resource=dev)).outcome is Outcome.ALLOW
    assert decide(engine, request("destroy", resource=prod)).outcome is Outcome.DENY
    assert (
        decide(
            engine, request("destroy", principal=Principal(id="x", tenant="b"), resource=dev)
        ).outcome
        is Outcome.DENY
    )


def test_too_many_distinct_commands_is_an_error() -> None:
    engine = CedarEngine(PERMIT_ALL, max_units=10)
    d = decide(engine, exec_request("; ".join(f"echo {i}" for i in range(11))))
    assert (d.outcome, d.reason_code) == (Outcome.DENY, ReasonCode.POLICY_ERROR)
    # Repeats are decided once, so padding does not count.
    assert decide(engine, exec_request("true; " * 50 + "ls")).outcome is Outcome.ALLOW


def test_policy_hash_identifies_the_policy_version() -> None:
    a, b = CedarEngine(DEFAULT_POLICY), CedarEngine(DEFAULT_POLICY)
    c = CedarEngine(DEFAULT_POLICY + "\n" + PERMIT_ALL)
    assert a.policy_hash == b.policy_hash != c.policy_hash
    assert a.policy_hash.startswith("sha256:")
    assert len(a.policy_hash) == 71
    d = decide(a, exec_request("ls"))
    assert (d.engine, d.policy_hash) == ("cedar", a.policy_hash)


def test_load_engine_default_is_cedar_with_the_shipped_policy() -> None:
    engine = load_engine()
    assert engine.name == "cedar"
    assert engine.policy_hash == CedarEngine(DEFAULT_POLICY).policy_hash


def test_per_action_policy_slices_give_the_same_answers() -> None:
    sliced = CedarEngine(DEFAULT_POLICY, decision_cache_size=0)
    whole = CedarEngine(DEFAULT_POLICY, decision_cache_size=0)
    whole._slices = {}  # every request against the whole set
    assert len(str(sliced._slices["fs.write"]).split(";")) < len(str(sliced._policies).split(";"))
    requests = [exec_request(c) for c in DENIED + ALLOWED]
    requests += [request(a, path="/workspace/x") for a in ("fs.write", "fs.read", "fs.remove")]
    requests += [request(a) for a in ("stop", "destroy", "snapshot", "sandbox.create")]
    requests += [request("destroy", principal=Principal(id="x", tenant="other"))]
    for req in requests:
        a, b = sliced.evaluate(req), whole.evaluate(req)
        assert (a.outcome, a.reason_code, a.matched) == (b.outcome, b.reason_code, b.matched)
