"""Verified reset and egress control through the Manager, on the fake backend."""

from __future__ import annotations

import pytest

from sandlot import NotSupported, SandboxStatus
from sandlot.backends.base import Capabilities
from sandlot.errors import VerificationFailed
from sandlot.models import NetworkAllowlist
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend


async def test_reset_to_baseline_and_to_snapshot(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create(start="serve")
    await sb.write_file("/workspace/a.txt", "one")
    snap = await sb.snapshot()
    await sb.write_file("/workspace/a.txt", "two")
    info = await sb.reset(snap.id)
    assert info.status is SandboxStatus.RUNNING
    assert await sb.read_file("/workspace/a.txt") == b"one"
    assert isinstance(info.metadata["verification"], dict)
    info = await sb.reset()
    assert [f.name for f in await sb.list_files()] == []
    assert fake.calls_for(sb.id, "start_process")[-1].args["argv"] == ["sh", "-c", "serve"]
    await aclient.manager.flush_receipts()
    kinds = [r.body.get("op") for r in aclient.receipts.tail(40)]
    assert kinds.count("reset") == 4, "a decision and an execution receipt per reset"


async def test_failed_verification_fails_the_sandbox(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    fake.fail_next("reset", VerificationFailed("disk diverged", diverged=["disk"]))
    with pytest.raises(VerificationFailed):
        await sb.reset()
    info = await sb.refresh()
    assert info.status is SandboxStatus.FAILED
    assert info.death is not None
    assert info.death.cause == "verification"
    assert info.metadata["verification"] == {"diverged": ["disk"]}


async def test_update_network_gated_and_recorded(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    info = await sb.update_network(NetworkAllowlist(allow_domains=["example.com"]))
    assert isinstance(info.spec.network, NetworkAllowlist)
    assert info.spec.network.allow_domains == ["example.com"]
    (call,) = fake.calls_for(sb.id, "update_network")
    assert call.args["policy"]["allow_domains"] == ["example.com"]
    assert (await sb.update_network("deny-all")).spec.network == "deny-all"
    decision = [r for r in aclient.receipts.tail(8) if r.body.get("op") == "network.update"]
    assert decision


async def test_egress_log_becomes_receipts_once(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    fake.emit_egress(sb.id, "pypi.org", allowed=True)
    fake.emit_egress(sb.id, "evil.example", allowed=False)
    log = await sb.network_log()
    assert [(e["host"], e["decision"]) for e in log] == [
        ("pypi.org", "allow"),
        ("evil.example", "deny"),
    ]
    egress = [r for r in aclient.receipts.tail(10) if r.type == "network.egress"]
    assert [(r.body["detail"]["host"], r.body["decision"]) for r in egress] == [  # type: ignore[index]
        ("pypi.org", "ALLOW"),
        ("evil.example", "DENY"),
    ]
    await sb.network_log()
    again = [r for r in aclient.receipts.tail(10) if r.type == "network.egress"]
    assert len(again) == 2, "already recorded events are not recorded twice"
    fake.emit_egress(sb.id, "files.pythonhosted.org", allowed=True)
    await sb.destroy()
    final = [r for r in aclient.receipts.tail(12) if r.type == "network.egress"]
    assert len(final) == 3, "destroy drains the last events first"
    assert (await aclient.get(sb.id)).info.status is SandboxStatus.DESTROYED


async def test_suggest_network(aclient: AsyncSandlot, fake: FakeBackend) -> None:
    sb = await aclient.create()
    fake.emit_egress(sb.id, "pypi.org", allowed=True)
    assert (await sb.suggest_network()).allow_domains == ["pypi.org"]


async def test_network_and_reset_refused_where_unsupported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    weak = FakeBackend(capabilities=Capabilities(network=frozenset({"allow-all"})))
    async with AsyncSandlot(tmp_path / "h", backends={"fake": weak}) as client:
        sb = await client.create()
        with pytest.raises(NotSupported, match="deny-all"):
            await sb.update_network("deny-all")
        with pytest.raises(NotSupported, match="reset"):
            await sb.reset()


async def test_record_egress_sweeps_running_sandboxes(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    fake.emit_egress(sb.id, "pypi.org", allowed=True)
    assert await aclient.manager.record_egress() == 1
    assert [r for r in aclient.receipts.tail(5) if r.type == "network.egress"]
