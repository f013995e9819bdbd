"""Time to live, idle timeouts and failed creations: what stops a sandbox when nobody asks.

Issue 13 items 1 and 2: expired sandboxes must stop (the system acting as itself, in the
sandbox's tenant), refuse work until renewed, and a creation that fails or is interrupted must
never leave a sandbox running for good or unnamed.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import anyio
import pytest

from sandlot import ExecFailed, ExecResult, InvalidState, SandboxStatus
from sandlot.models import Actor, utcnow
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec

S = SandboxStatus
ACME = Actor(tenant="acme", principal="agent-7")


async def _expire(client: AsyncSandlot, sb: AsyncSandbox, seconds_ago: float = 1.0) -> None:
    """Make the sandbox's TTL have run out ``seconds_ago``, as another process's clock or
    waiting would (so this process's cached record is stale, too)."""
    info = await client.manager.store.get(sb.id)
    await client.manager.store.update(
        sb.id, info.version, {"expires_at": utcnow() - timedelta(seconds=seconds_ago)}
    )
    client.manager._recent.clear()


async def test_the_sweep_stops_a_tenants_expired_sandbox_as_the_system(
    home: Path, fake: FakeBackend
) -> None:
    async with AsyncSandlot(home, backends={"fake": fake}, actor=ACME) as acme:
        sb = await acme.create(timeout=60)
        report = await acme.manager.stop_expired(now=utcnow() + timedelta(seconds=61))
        assert report.expired == [sb.id]
        assert report.errors == {}
        info = await sb.refresh()
        assert info.status is S.STOPPED
        assert info.death is not None
        assert info.death.cause == "ttl"
        await acme.manager.flush_receipts()
        stops = [r.body for r in acme.receipts.tail(50, sandbox_id=sb.id) if r.body["op"] == "stop"]
        assert stops, "the stop left no receipt"
        assert {(b["principal"], b["tenant"]) for b in stops} == {("system", "acme")}
        assert "ALLOW" in {b.get("decision") for b in stops}


async def test_a_sweep_that_cannot_stop_a_sandbox_says_so(
    aclient: AsyncSandlot, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    sb = await aclient.create(timeout=60)
    fake.fail_next("stop")
    with caplog.at_level(logging.ERROR, logger="sandlot"):
        report = await aclient.manager.stop_expired(now=utcnow() + timedelta(seconds=61))
    assert report.expired == []
    assert sb.id in report.errors
    assert "injected failure in stop" in report.errors[sb.id]
    assert any(sb.id in r.getMessage() for r in caplog.records)


async def test_an_expired_sandbox_refuses_work_until_kept_alive(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create(timeout=60)
    await _expire(aclient, sb)
    with pytest.raises(InvalidState, match="expired") as refused:
        await sb.exec("echo hi")
    assert "keep_alive" in str(refused.value)
    assert not [c for c in fake.calls_for(sb.id, "exec") if c.args["argv"][-1] == "echo hi"]
    info = await sb.refresh()
    assert info.status is S.STOPPED, "touching it stopped it, as the sweep would"
    assert info.death is not None
    assert info.death.cause == "ttl"
    # Stopped by its TTL, it is not resumed behind the caller's back either.
    with pytest.raises(InvalidState, match="expired"):
        await sb.read_file("/workspace/x")
    await sb.keep_alive(120)
    assert (await sb.exec("echo hi")).stdout == "hi\n"
    assert (await sb.refresh()).status is S.RUNNING


async def test_resume_gives_an_expired_sandbox_a_new_ttl(aclient: AsyncSandlot) -> None:
    sb = await aclient.create(timeout=60)
    await _expire(aclient, sb)
    with pytest.raises(InvalidState, match="expired"):
        await sb.exec("true")
    resumed = await sb.resume()
    assert resumed.status is S.RUNNING
    assert resumed.expires_at is not None
    assert resumed.expires_at > utcnow() + timedelta(seconds=55)
    assert resumed.death is None, "a running sandbox shows no stale cause of death"
    assert (await sb.exec("echo ok")).stdout == "ok\n"


async def test_embedded_list_and_create_sweep_without_a_server(aclient: AsyncSandlot) -> None:
    sb = await aclient.create(timeout=60)
    await _expire(aclient, sb)
    aclient.manager.sweep_every = 0.0
    (listed,) = [i for i in await aclient.list(include_destroyed=True) if i.id == sb.id]
    assert listed.status is S.STOPPED
    assert listed.death is not None
    assert listed.death.cause == "ttl"
    # And create sweeps too, before making the new one.
    again = await aclient.create(timeout=60)
    await _expire(aclient, again)
    await aclient.create()
    assert (await again.refresh()).status is S.STOPPED


async def test_a_failed_setup_names_its_sandbox_stops_it_and_keeps_it_for_a_while(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    before = utcnow()
    with pytest.raises(ExecFailed) as failed:
        await aclient.create(setup="false")
    sandbox_id = failed.value.details.get("sandbox_id")
    assert isinstance(sandbox_id, str)
    assert sandbox_id in str(failed.value), "the message names the sandbox it left"
    assert "kept" in str(failed.value)
    info = await aclient.manager.get(sandbox_id)
    assert info.status is S.FAILED
    assert info.death is not None
    assert info.death.cause == "setup_failed"
    assert fake.sandboxes[f"fake-{sandbox_id}"].state == "stopped", "its processes were stopped"
    assert info.expires_at is not None
    keep = aclient.manager.failed_keep
    assert (
        before + timedelta(seconds=keep - 5) < info.expires_at <= utcnow() + timedelta(seconds=keep)
    )
    # Its time for inspection runs out: the sweep destroys it, and the record says why.
    report = await aclient.manager.stop_expired(now=info.expires_at + timedelta(seconds=1))
    assert report.discarded == [sandbox_id]
    gone = await aclient.manager.get(sandbox_id)
    assert gone.status is S.DESTROYED
    assert gone.death is not None
    assert gone.death.cause == "discarded"
    assert "setup_failed" in gone.death.message
    assert f"fake-{sandbox_id}" not in fake.sandboxes


async def test_a_failed_creation_keeps_no_longer_than_its_own_ttl(aclient: AsyncSandlot) -> None:
    with pytest.raises(ExecFailed) as failed:
        await aclient.create(setup="false", timeout=30)
    info = await aclient.manager.get(str(failed.value.details["sandbox_id"]))
    assert info.expires_at is not None
    assert info.expires_at <= utcnow() + timedelta(seconds=30)


async def test_resuming_a_failed_creation_gives_it_its_own_ttl_again(
    aclient: AsyncSandlot,
) -> None:
    with pytest.raises(ExecFailed) as failed:
        await aclient.create(setup="false")
    handle = await aclient.get(str(failed.value.details["sandbox_id"]))
    resumed = await handle.resume()
    assert resumed.status is S.RUNNING
    assert resumed.expires_at is None, "no TTL of its own: the inspection deadline is lifted"


async def test_a_backend_error_during_create_names_the_sandbox(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    from sandlot.errors import BackendError

    fake.fail_next("start_process")
    with pytest.raises(BackendError) as failed:
        await aclient.create(start="serve")
    (kept,) = await aclient.list(status=S.FAILED)
    assert failed.value.sandbox_id == kept.id
    assert kept.id in str(failed.value)


async def test_an_interrupted_create_leaves_nothing_behind(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    started = anyio.Event()

    async def slow(req: FakeExec) -> ExecResult | None:
        if req.argv[-1] == "slow setup":
            started.set()
            await anyio.sleep(30)
        return None

    fake.exec_handler = slow

    async def interrupted() -> None:
        await aclient.create(setup="slow setup")

    async with anyio.create_task_group() as tg:
        tg.start_soon(interrupted)
        with anyio.fail_after(5):
            await started.wait()
        tg.cancel_scope.cancel()  # as Ctrl-C does to the CLI's create
    (gone,) = await aclient.list(include_destroyed=True)
    assert gone.status is S.DESTROYED
    assert gone.death is not None
    assert gone.death.cause == "interrupted"
    assert f"fake-{gone.id}" not in fake.sandboxes


async def test_a_crashed_sandbox_is_seen_stopped_and_a_command_boots_it_again(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    await aclient.manager._drop_channel(sb.id)  # a new process: no channel open yet
    fake.external_stop(sb.id, reason="exited")
    with pytest.raises(InvalidState, match="crashed"):
        await sb.exec("echo hi", auto_resume=False)
    info = await sb.refresh()
    assert info.status is S.STOPPED
    assert info.death is not None
    assert info.death.cause == "crashed"
    assert (await sb.exec("echo hi")).stdout == "hi\n"
    assert (await sb.refresh()).status is S.RUNNING


async def test_resume_restarts_a_sandbox_whose_record_still_says_running(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    boots = fake.sandboxes[f"fake-{sb.id}"].boots
    fake.external_stop(sb.id, reason="exited")
    resumed = await sb.resume()
    assert resumed.status is S.RUNNING
    assert fake.sandboxes[f"fake-{sb.id}"].state == "running"
    assert fake.sandboxes[f"fake-{sb.id}"].boots == boots + 1


async def test_a_sandbox_kept_alive_after_the_sweep_listed_it_is_not_stopped(
    aclient: AsyncSandlot,
) -> None:
    """Review of issue 13: a keep_alive from another process between the sweep's list and its
    stop was overwritten by the stop."""
    sb = await aclient.create(timeout=60)
    listed = await aclient.manager.store.get(sb.id)  # what the sweep saw
    later = utcnow() + timedelta(seconds=61)
    await sb.keep_alive(600)  # meanwhile, elsewhere
    assert await aclient.manager._stop_system(listed, later) is None
    assert (await sb.refresh()).status is S.RUNNING


async def test_a_failed_stop_is_retried_by_the_next_sweep(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create(timeout=60)
    later = utcnow() + timedelta(seconds=61)
    fake.fail_next("stop")
    first = await aclient.manager.stop_expired(now=later)
    assert sb.id in first.errors
    assert (await sb.refresh()).status is S.FAILED
    assert fake.sandboxes[f"fake-{sb.id}"].state == "running", "its processes still run"
    again = await aclient.manager.stop_expired(now=later)
    assert again.expired == [sb.id]
    assert fake.sandboxes[f"fake-{sb.id}"].state == "stopped"
    info = await sb.refresh()
    assert info.status is S.STOPPED
    assert info.death is not None
    assert info.death.cause == "ttl"
    assert (await aclient.manager.stop_expired(now=later)).expired == []


async def test_a_long_command_is_activity_for_the_idle_timeout(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    async def slow(req: FakeExec) -> ExecResult | None:
        if req.argv[-1] == "long job":
            await anyio.sleep(2.5)
            return ExecResult(exit_code=0)
        return None

    fake.exec_handler = slow
    sb = await aclient.create(idle_timeout=1)
    seen: list[object] = []

    async def watch() -> None:
        await anyio.sleep(2.2)  # while the command still runs
        seen.append((await aclient.manager.store.get(sb.id)).last_active_at)

    started = utcnow()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await sb.exec("long job")
    (touched,) = seen
    assert isinstance(touched, type(started))
    assert (touched - started).total_seconds() > 0.9, "the record was not touched while it ran"


async def test_a_keyed_create_interrupted_names_its_sandbox_on_replay(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    started = anyio.Event()

    async def slow(req: FakeExec) -> ExecResult | None:
        if req.argv[-1] == "slow setup":
            started.set()
            await anyio.sleep(30)
        return None

    fake.exec_handler = slow

    async def interrupted() -> None:
        await aclient.create(setup="slow setup", idempotency_key="k-int")

    async with anyio.create_task_group() as tg:
        tg.start_soon(interrupted)
        with anyio.fail_after(5):
            await started.wait()
        tg.cancel_scope.cancel()
    fake.exec_handler = None
    with pytest.raises(InvalidState, match="interrupted") as replayed:
        await aclient.create(setup="slow setup", idempotency_key="k-int")
    (kept,) = await aclient.list(status=S.FAILED)
    assert replayed.value.sandbox_id == kept.id
    assert kept.id in str(replayed.value)
