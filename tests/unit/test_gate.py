"""The policy gate in front of every Manager operation, and the receipts it leaves."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import anyio
import pytest
from sqlalchemy import text

from sandlot import PolicyDenied, SandboxError
from sandlot.manager import Manager
from sandlot.models import Actor
from sandlot.receipts import Receipt, verify_log
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend

PERMIT_ALL = "permit (principal, action, resource);\n"
DENY_ALL = 'permit (principal, action == Action::"sandbox.create", resource);\n'


def _policy(tmp_path: Path, name: str, text_: str) -> Path:
    path = tmp_path / name
    path.write_text(text_)
    return path


async def test_default_policy_denies_rm_rf_root_before_the_backend(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    denials: list[PolicyDenied] = []
    aclient.manager.gate.on_deny = denials.append  # type: ignore[union-attr]
    for spelling in (
        ["rm", "-rf", "/"],
        "rm -fr /*",
        ["/bin/rm", "--recursive", "--force", "/"],
        "sh -c 'rm -rf /'",
    ):
        with pytest.raises(PolicyDenied) as info:
            await sb.exec(spelling)
        assert info.value.reason_code
        assert (info.value.receipt_id or "").startswith("sha256:")
    assert fake.calls_for(sb.id, "exec") == []
    assert len(denials) == 4
    # Ordinary work goes through.
    assert (await sb.exec(["echo", "fine"])).stdout == "fine\n"


async def test_allowed_exec_leaves_decision_and_execution_receipts(aclient: AsyncSandlot) -> None:
    sb = await aclient.create()
    result = await sb.exec(["echo", "hello"])
    await aclient.manager.flush_receipts()
    log = aclient.receipts
    recent = log.tail(10)
    decision = next(r for r in reversed(recent) if r.type == "decision" and r.body["op"] == "exec")
    execution = next(r for r in recent if r.body.get("decision_ref") == decision.entry_hash)
    assert decision.seq < execution.seq
    assert decision.body["decision"] == "ALLOW"
    assert decision.body["op"] == "exec"
    assert decision.body["sandbox_id"] == sb.id
    assert execution.type == "execution"
    assert execution.body["decision_ref"] == decision.entry_hash
    assert execution.body["exit_code"] == 0
    import hashlib

    streams = {
        name: hashlib.sha256(text.encode()).hexdigest()
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr))
    }
    both = f"stdout:{streams['stdout']}\nstderr:{streams['stderr']}\n"
    assert execution.body["output_hash"] == "sha256:" + hashlib.sha256(both.encode()).hexdigest()
    detail = execution.body["detail"]
    assert detail["stdout"] == {"sha256": "sha256:" + streams["stdout"], "bytes": 6}
    lines = list(log.lines())
    assert verify_log(lines, log.export_trust_root()).ok


async def test_denied_operation_receipt_says_deny(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    policy = _policy(tmp_path, "p.cedar", DENY_ALL)
    async with AsyncSandlot(home, backends={"fake": fake}, policy=policy) as client:
        sb = await client.create()
        with pytest.raises(PolicyDenied) as info:
            await sb.exec(["echo", "hi"])
        last = client.receipts.tail(1)[0]
        assert last.entry_hash == info.value.receipt_id
        assert last.body["decision"] == "DENY"
        assert last.type == "decision"


# Arguments for every public Manager operation; a new one must be added here (the test below
# fails otherwise), so no operation can skip the gate unnoticed.
def _calls(sid: str, snap: str) -> dict[str, tuple[tuple[object, ...], dict[str, object]]]:
    return {
        "exec": ((sid, ["echo", "x"]), {}),
        "read_file": ((sid, "/workspace/f"), {}),
        "write_files": ((sid, {"/workspace/f": b"x"}), {}),
        "list_files": ((sid, "/workspace"), {}),
        "remove_file": ((sid, "/workspace/f"), {}),
        "stop": ((sid,), {}),
        "resume": ((sid,), {}),
        "destroy": ((sid,), {}),
        "keep_alive": ((sid, 60), {}),
        "snapshot": ((sid,), {}),
        "delete_snapshot": ((snap,), {}),
        "restore": ((sid, snap), {}),
        "fork": ((sid, 2), {}),
        "expose_port": ((sid, 8080), {}),
        "reset": ((sid,), {}),
        "update_network": ((sid, "deny-all"), {}),
        "start_process": ((sid, ["sleep", "100"]), {}),
        "list_processes": ((sid,), {}),
        "signal_process": ((sid, "p1"), {}),
        "wait_process": ((sid, "p1"), {"timeout": 1}),
        "write_stdin": ((sid, "p1", b"x"), {}),
        "open_pty": ((sid,), {}),
    }


# Operations on records and logs that neither reach nor change a sandbox.
READ_ONLY = {
    "get",
    "list",
    "list_ports",
    "list_snapshots",
    "list_approvals",
    "explain",
    "network_log",
    "suggest_network",
    "flush_receipts",
    "aclose",
}
STREAMS = {"stream_file": "/workspace/f", "logs": None, "process_output": "p1"}
HOUSEKEEPING = {
    "reconcile",
    "recover",
    "record_egress",
    "stop_expired",
    "approve",
    "deny",
    "create",
}


async def test_every_manager_operation_passes_the_gate(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    async with AsyncSandlot(
        home, backends={"fake": fake}, policy=_policy(tmp_path, "a.cedar", PERMIT_ALL)
    ) as permissive:
        sb = await permissive.create()
        await sb.write_file("/workspace/f", "x")
        snap = await sb.snapshot()
    deny_path = _policy(tmp_path, "d.cedar", DENY_ALL)
    async with AsyncSandlot(home, backends={"fake": fake}, policy=deny_path) as client:
        manager = client.manager
        calls = _calls(sb.id, snap.id)
        public = {
            name
            for name, fn in inspect.getmembers(Manager, inspect.isfunction)
            if not name.startswith("_")
            and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))
        }
        assert public == set(calls) | READ_ONLY | set(STREAMS) | HOUSEKEEPING
        fake.calls.clear()
        for name, (args, kwargs) in calls.items():
            with pytest.raises(PolicyDenied):
                await getattr(manager, name)(*args, **kwargs)
            assert fake.calls == [], f"{name} reached the backend: {fake.calls}"
        for name, path in STREAMS.items():
            args = (sb.id, path) if path else (sb.id,)
            with pytest.raises(PolicyDenied):
                async for _ in getattr(manager, name)(*args):
                    pass
            assert fake.calls == [], f"{name} reached the backend"
        # create is gated too: a policy without the create permit refuses it before the backend.
    nothing = _policy(
        tmp_path,
        "n.cedar",
        "forbid (principal, action, resource);\npermit (principal, action, resource);\n",
    )
    async with AsyncSandlot(home, backends={"fake": fake}, policy=nothing) as client:
        with pytest.raises(PolicyDenied):
            await client.create()
        assert fake.calls == []


async def test_setup_and_start_commands_are_gated_one_by_one(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    policy = _policy(
        tmp_path,
        "p.cedar",
        PERMIT_ALL + 'forbid (principal, action == Action::"process.start", resource);\n',
    )
    async with AsyncSandlot(home, backends={"fake": fake}, policy=policy) as client:
        with pytest.raises(PolicyDenied):
            await client.create(setup="echo ok", start="serve")
        (sb,) = await client.list(include_destroyed=True)
        assert [c.args["argv"] for c in fake.calls_for(sb.id, "exec")] == [["sh", "-c", "echo ok"]]
        assert fake.calls_for(sb.id, "start_process") == []


HUMAN = Actor(principal="operator:alice")

HOLD_EXEC = (
    'permit (principal, action, resource) unless { action == Action::"exec" };\n'
    '@hold("may this agent run it?")\npermit (principal, action == Action::"exec", resource);\n'
)


async def test_hold_waits_for_approval_from_another_client(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    policy = _policy(tmp_path, "h.cedar", HOLD_EXEC)
    async with (
        AsyncSandlot(home, backends={"fake": fake}, policy=policy) as agent,
        AsyncSandlot(home, backends={"fake": fake}, policy=policy, actor=HUMAN) as human,
    ):
        sb = await agent.create()
        results: list[str] = []

        async def run() -> None:
            results.append((await sb.exec(["echo", "approved"])).stdout)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            pending = []
            with anyio.fail_after(10):
                while not pending:
                    await anyio.sleep(0.02)
                    pending = await human.list_approvals()
            assert fake.calls_for(sb.id, "exec") == []
            (approval,) = pending
            assert approval.question == "may this agent run it?"
            assert "echo approved" in approval.summary
            answered = await human.approve(approval.id)
            assert answered.status == "approved"
        assert results == ["approved\n"]
        await agent.manager.flush_receipts()
        recent = agent.receipts.tail(10)
        hold = next(r for r in recent if r.body.get("decision") == "HOLD")
        answer = next(r for r in recent if r.type == "approval")
        execution = next(r for r in recent if r.body.get("decision_ref") == answer.entry_hash)
        assert hold.seq < answer.seq < execution.seq
        assert (hold.type, hold.body["decision"]) == ("decision", "HOLD")
        assert (answer.type, answer.body["decision"]) == ("approval", "ALLOW")
        assert answer.body["decision_ref"] == hold.entry_hash
        assert execution.type == "execution"
        assert execution.body["decision_ref"] == answer.entry_hash
        with pytest.raises(SandboxError):
            await human.approve(approval.id)


async def test_hold_denied_and_hold_timeout(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    policy = _policy(tmp_path, "h.cedar", HOLD_EXEC)
    async with AsyncSandlot(
        home, backends={"fake": fake}, policy=policy, hold_timeout=0.5
    ) as client:
        sb = await client.create()
        with pytest.raises(PolicyDenied) as info:
            await sb.exec(["echo", "late"])
        assert info.value.reason_code == "HOLD_TIMEOUT"
        (expired,) = await client.list_approvals(status="expired")
        assert expired.decided_by == "system:gate"
    async with (
        AsyncSandlot(home, backends={"fake": fake}, policy=policy, hold_timeout=10) as client,
        AsyncSandlot(home, backends={"fake": fake}, policy=policy, actor=HUMAN) as human,
    ):
        sb = await client.get(sb.id)

        async def refuse() -> None:
            with anyio.fail_after(10):
                while not (pending := await human.list_approvals()):
                    await anyio.sleep(0.02)
            await human.deny(pending[0].id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(refuse)
            with pytest.raises(PolicyDenied) as info:
                await sb.exec(["echo", "no"])
        assert info.value.reason_code == "REJECTED"
    assert fake.calls_for(sb.id, "exec") == []


async def test_nothing_runs_when_the_decision_cannot_be_recorded(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    with aclient.manager.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("DROP TABLE receipts"))
    aclient.receipts._tail = None
    with pytest.raises(SandboxError):
        await sb.exec(["echo", "x"])
    assert fake.calls_for(sb.id, "exec") == []


async def test_on_receipt_and_explain(home: Path, fake: FakeBackend) -> None:
    seen: list[Receipt] = []
    async with AsyncSandlot(home, backends={"fake": fake}, on_receipt=seen.append) as client:
        sb = await client.create()
        await sb.exec("true")
        await client.manager.flush_receipts()
        ops = [(r.type, r.body.get("op")) for r in seen]
        assert ("decision", "exec") in ops
        assert ("execution", "exec") in ops
        count = len(seen)
        explanation = await sb.explain("exec", command="rm -rf /")
        assert json.dumps(explanation.to_dict())
        assert "DENY" in explanation.render()
        await client.manager.flush_receipts()
        assert len(seen) == count, "explain records nothing"


async def test_an_agent_cannot_approve_its_own_hold(home: Path, tmp_path: Path) -> None:
    fake = FakeBackend()
    policy = _policy(tmp_path, "h.cedar", HOLD_EXEC)
    async with AsyncSandlot(home, backends={"fake": fake}, policy=policy, hold_timeout=10) as agent:
        sb = await agent.create()

        async def self_approve() -> None:
            with anyio.fail_after(10):
                while not (pending := await agent.list_approvals()):
                    await anyio.sleep(0.02)
            with pytest.raises(PolicyDenied) as info:
                await agent.approve(pending[0].id)
            assert info.value.reason_code == "SELF_APPROVAL"
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(self_approve)
            await sb.exec(["echo", "pwned"])
        # The cancelled request was closed, and can no longer be approved by anyone.
        (closed,) = await agent.list_approvals(status="expired")
        assert closed.decided_by == "system:gate"
    assert fake.calls_for(sb.id, "exec") == []
