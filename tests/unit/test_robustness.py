"""Regressions from review: interrupted transitions, long keyed operations, busy sandboxes,
and a policy that forbids resuming."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from sandlot import PolicyDenied, SandboxStatus
from sandlot.backends.base import SnapshotRef
from sandlot.models import ExecResult, SandboxSpec
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec

S = SandboxStatus


async def test_a_cancelled_auto_resume_does_not_leave_the_sandbox_resuming(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    await sb.stop()
    start = fake.start

    async def slow_start(ref: str, spec: SandboxSpec) -> None:
        await anyio.sleep(5)
        await start(ref, spec)

    fake.start = slow_start  # type: ignore[method-assign]
    with anyio.move_on_after(0.3):
        await sb.exec("echo hi")
    fake.start = start  # type: ignore[method-assign]
    info = await sb.refresh()
    assert info.status is S.FAILED
    assert info.death is not None
    assert info.death.cause == "interrupted"
    assert (await sb.resume()).status is S.RUNNING
    assert (await sb.exec("echo back")).stdout == "back\n"


async def test_a_failing_setup_callback_fails_the_sandbox(aclient: AsyncSandlot) -> None:
    def broken(_: object) -> None:
        msg = "callback bug"
        raise ValueError(msg)

    with pytest.raises(ValueError, match="callback bug"):
        await aclient.create(setup="echo x", on_setup_output=broken)
    (info,) = await aclient.list(include_destroyed=True)
    assert info.status is S.FAILED
    assert info.death is not None
    assert "ValueError" in info.death.message


async def test_a_fork_that_breaks_midway_fails_every_child(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create(start="serve")
    fork = fake.fork

    async def half_fork(snapshot: SnapshotRef, ids: list[str], spec: SandboxSpec) -> list[str]:
        refs = await fork(snapshot, ids, spec)
        fake.fail_next("start_process", RuntimeError("boom"))
        return refs

    fake.fork = half_fork  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        await sb.fork(3)
    children = [i for i in await aclient.list(include_destroyed=True) if i.id != sb.id]
    assert len(children) == 3
    assert {c.status for c in children} == {S.FAILED}


async def test_auto_resume_is_decided_as_a_resume(home: Path, tmp_path: Path) -> None:
    policy = tmp_path / "p.cedar"
    policy.write_text(
        "permit (principal, action, resource);\n"
        'forbid (principal, action == Action::"resume", resource);\n'
    )
    fake = FakeBackend()
    async with AsyncSandlot(home, backends={"fake": fake}, policy=policy) as client:
        sb = await client.create()
        await sb.stop()
        with pytest.raises(PolicyDenied):
            await sb.resume()
        with pytest.raises(PolicyDenied):
            await sb.exec("echo hi")
        assert fake.calls_for(sb.id, "start") == []
        assert (await sb.refresh()).status is S.STOPPED


async def test_a_busy_sandbox_is_not_reaped_for_idleness(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create(idle_timeout=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sb.exec, "sleep 2")
        await anyio.sleep(1.5)
        assert (await aclient.stop_expired()).expired == []
    assert (await sb.refresh()).status is S.RUNNING


async def test_a_keyed_exec_longer_than_its_lease_is_not_declared_dead(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    assert aclient.manager.journal is not None
    aclient.manager.journal.lease_seconds = 0.3
    sb = await aclient.create()
    runs = []

    async def slow(req: FakeExec) -> ExecResult:
        runs.append(1)
        await anyio.sleep(1.5)
        return ExecResult(exit_code=0, stdout="done\n")

    fake.exec_handler = slow
    results: dict[str, str] = {}

    async def first() -> None:
        results["first"] = (await sb.exec(["deploy"], idempotency_key="K")).stdout

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.sleep(0.8)
        results["replay"] = (await sb.exec(["deploy"], idempotency_key="K")).stdout
    assert results == {"first": "done\n", "replay": "done\n"}
    assert len(runs) == 1


async def test_two_hosts_on_one_database_keep_to_their_own_sandboxes(tmp_path: Path) -> None:
    from dataclasses import replace

    from sandlot import InvalidRequest, InvalidState

    local_like = replace(FakeBackend().capabilities(), host_local=True)
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    async with (
        AsyncSandlot(
            tmp_path / "a", database=db, backends={"fake": FakeBackend(capabilities=local_like)}
        ) as a,
        AsyncSandlot(
            tmp_path / "b", database=db, backends={"fake": FakeBackend(capabilities=local_like)}
        ) as b,
    ):
        b.manager.host = "host-b"
        sb = await a.create(timeout=1)
        assert sb.info.host == a.manager.host
        assert (await b.reconcile()).updated == {}
        assert (await b.stop_expired()).expired == []
        with pytest.raises(InvalidState, match="lives on host"):
            await (await b.get(sb.id)).exec("echo hi")
        # Every operation that would touch the runtime is refused alike: marking the record
        # destroyed here would leave its runtime running on host a.
        theirs = await b.get(sb.id)
        for operation in (
            theirs.destroy,
            theirs.stop,
            theirs.resume,
            theirs.snapshot,
            theirs.reset,
            lambda: theirs.update_network("deny-all"),
            lambda: theirs.expose_port(8000),
            theirs.network_log,
            lambda: theirs.fork(1),
        ):
            with pytest.raises(InvalidState, match="lives on host"):
                await operation()
        assert "lives on host" in (await b.reconcile([sb.id])).errors[sb.id]
        assert (await sb.refresh()).status is S.RUNNING
        a_fake = a.manager.backends["fake"]
        assert f"fake-{sb.id}" in a_fake.sandboxes  # type: ignore[attr-defined]
        # A snapshot taken on a lives there too: b can neither delete nor fork it.
        snap = await sb.snapshot()
        with pytest.raises(InvalidState, match="lives on host"):
            await b.delete_snapshot(snap.id)
        with pytest.raises(InvalidState, match="lives on host"):
            await b.fork(snap.id)
        # Each home signs its own receipt log, so both can write to the shared database.
        other = await b.create()
        assert a.receipts.log_id != b.receipts.log_id
        assert (await other.exec("echo b")).stdout == "b\n"
        assert (await sb.exec("echo a")).stdout == "a\n"
        # Host a given up for lost: b closes the record without reaching a's runtime, and
        # host a, back, reaps what it still had of it.
        with pytest.raises(InvalidRequest, match="destroy it plainly"):
            await (await b.get(other.id)).destroy(forget_host=True)
        forgotten = await theirs.destroy(forget_host=True)
        assert forgotten.status is S.DESTROYED
        assert forgotten.death is not None
        assert forgotten.death.cause == "host_lost"
        assert f"fake-{sb.id}" in a_fake.sandboxes  # type: ignore[attr-defined]
        assert sb.id in (await a.reconcile()).reaped
        assert f"fake-{sb.id}" not in a_fake.sandboxes  # type: ignore[attr-defined]
