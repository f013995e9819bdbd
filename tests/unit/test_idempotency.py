"""Idempotency keys through the Manager: replays return the first outcome, nothing runs twice."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sandlot import BackendUnavailable, Conflict, ExecResult, PolicyDenied, SandboxStatus
from sandlot.journal import IntentState, Journal
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec


def _dead_owner() -> str:
    proc = subprocess.Popen(["true"])
    proc.wait()
    import socket

    return f"{socket.gethostname()}:{proc.pid}:1"


async def test_create_with_a_key_is_created_once(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    first = await aclient.create(setup="echo once", idempotency_key="k-create")
    again = await aclient.create(setup="echo once", idempotency_key="k-create")
    assert again.id == first.id
    assert len(fake.calls_for(first.id, "create")) == 1
    assert len(fake.calls_for(first.id, "exec")) == 1
    with pytest.raises(Conflict, match="different request"):
        await aclient.create(setup="echo twice", idempotency_key="k-create")
    other = await aclient.create(setup="echo once", idempotency_key="k-other")
    assert other.id != first.id


async def test_exec_with_a_key_runs_once(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    counter = {"n": 0}

    def handler(req: FakeExec) -> ExecResult:
        counter["n"] += 1
        return ExecResult(exit_code=3, stdout=f"run {counter['n']}\n")

    sb = await aclient.create()
    fake.exec_handler = handler
    first = await sb.exec(["deploy"], idempotency_key="k-exec")
    again = await sb.exec(["deploy"], idempotency_key="k-exec")
    assert (first.stdout, again.stdout) == ("run 1\n", "run 1\n")
    assert again.exit_code == 3
    assert counter["n"] == 1
    with pytest.raises(Conflict):
        await sb.exec(["deploy", "--force"], idempotency_key="k-exec")
    from sandlot import ExecFailed

    with pytest.raises(ExecFailed):
        await sb.exec(["deploy"], idempotency_key="k-exec", check=True)
    assert counter["n"] == 1


async def test_write_files_and_destroy_with_keys(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    infos = await sb.write_files({"/workspace/a": "1", "/workspace/b": "2"}, idempotency_key="k-w")
    again = await sb.write_files({"/workspace/a": "1", "/workspace/b": "2"}, idempotency_key="k-w")
    assert [i.path for i in again] == [i.path for i in infos]
    assert len(fake.calls_for(sb.id, "write_file")) == 2
    gone = await sb.destroy(idempotency_key="k-d")
    again_gone = await sb.destroy(idempotency_key="k-d")
    assert gone.status is again_gone.status is SandboxStatus.DESTROYED
    assert len(fake.calls_for(sb.id, "destroy")) == 1


async def test_a_denied_key_stays_denied(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    with pytest.raises(PolicyDenied):
        await sb.exec("rm -rf /", idempotency_key="k-bad")
    with pytest.raises(PolicyDenied):
        await sb.exec("rm -rf /", idempotency_key="k-bad")
    assert fake.calls_for(sb.id, "exec") == []


async def test_exec_whose_worker_died_is_reported_unknown_never_rerun(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    engine = aclient.manager.store.engine  # type: ignore[attr-defined]
    dead = Journal(engine, owner=_dead_owner())
    request = {
        "sandbox_id": sb.id,
        "command": ["deploy"],
        "cwd": "/workspace",
        "env": {},
        "timeout": None,
        "stdin": None,
    }
    begun = dead.begin(
        tenant="default", principal="local", op="exec", request=request, idempotency_key="k-crash"
    )
    lease = dead.authorize(begun.intent.intent_id, decision="ungated:test")
    dead.advance(lease, IntentState.RUNNING)
    with pytest.raises(BackendUnavailable, match="unknown") as info:
        await sb.exec(["deploy"], idempotency_key="k-crash")
    assert info.value.details.get("outcome") == "unknown"
    assert fake.calls_for(sb.id, "exec") == []
    with pytest.raises(BackendUnavailable):
        await sb.exec(["deploy"], idempotency_key="k-crash")


async def test_recover_settles_a_creation_abandoned_by_a_crash(
    home: Path, fake: FakeBackend
) -> None:
    async with AsyncSandlot(home, backends={"fake": fake}) as client:
        engine = client.manager.store.engine  # type: ignore[attr-defined]
        dead = Journal(engine, owner=_dead_owner())
        spec = {"backend": "fake", "spec": (await _spec_json())}
        begun = dead.begin(
            tenant="default",
            principal="local",
            op="sandbox.create",
            request=spec,
            idempotency_key="k-c",
        )
        lease = dead.authorize(begun.intent.intent_id, decision="ungated:test")
        sid = "sb-" + begun.intent.intent_id.split(":")[-1][:12]
        lease = dead.attach_sandbox(lease, sid)
        dead.allocating(lease, backend="fake", name=sid)
        report = await client.manager.recover()
        assert report == {begun.intent.intent_id: "failed"}
        assert client.manager.journal is not None
        assert client.manager.journal.get(begun.intent.intent_id).state is IntentState.FAILED
        with pytest.raises(BackendUnavailable):
            await client.create(idempotency_key="k-c")
        assert fake.calls_for(sid, "create") == [], "never allocated a second time"


async def _spec_json() -> dict[str, object]:
    from sandlot.models import SandboxSpec

    return SandboxSpec().model_dump(mode="json")
