"""Background processes and terminals through the Manager (on the fake backend): the gate
decides each operation and leaves receipts, a stopped sandbox wakes up, terminal use counts
as activity, and the sync SDK mirrors it all."""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import pytest

from sandlot import InvalidRequest, PolicyDenied
from sandlot.receipts import Receipt
from sandlot.sdk import AsyncSandlot
from sandlot.sync import Sandlot
from sandlot.testing import FakeBackend


async def test_each_operation_is_decided_and_leaves_receipts(home: Path, fake: FakeBackend) -> None:
    seen: list[Receipt] = []
    async with AsyncSandlot(home, backends={"fake": fake}, on_receipt=seen.append) as client:
        sb = await client.create()
        cat = await sb.start_process(["cat"], name="echoer")
        await sb.write_stdin(cat.id, b"secret input", close=True)
        assert [c.data async for c in sb.process_output(cat.id)] == [b"secret input"]
        assert (await sb.wait_process(cat.id, timeout=5)).exit_code == 0
        sleeper = await sb.start_process("sleep 1000")
        await sb.signal_process(sleeper.id, 9)
        assert {p.id for p in await sb.list_processes()} == {cat.id, sleeper.id}
        async with await sb.open_pty(["bash"], rows=10, cols=20):
            pass
        await client.manager.flush_receipts()
    decided = [r.body["op"] for r in seen if r.type == "decision"]
    assert decided[-8:] == [
        "process.start",
        "process.stdin",
        "process.output",
        "process.wait",
        "process.start",
        "process.signal",
        "process.list",
        "pty.open",
    ]
    executed = {r.body["decision_ref"]: r for r in seen if r.type == "execution"}
    decisions = [r for r in seen if r.type == "decision" and r.body["decision"] == "ALLOW"]
    assert all(d.entry_hash in executed for d in decisions[-8:]), "every allowed op completes"
    stdin = next(executed[d.entry_hash] for d in decisions if d.body["op"] == "process.stdin")
    # The receipt of a write to stdin carries the hash of what went in, not the bytes.
    assert stdin.body["output_hash"] == "sha256:" + hashlib.sha256(b"secret input").hexdigest()
    assert "secret input" not in str(stdin.body)


async def test_start_process_wakes_a_stopped_sandbox(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    await sb.stop()
    info = await sb.start_process(["echo", "awake"])
    assert (await sb.refresh()).status.value == "running"
    assert fake.calls_for(sb.id, "start")
    assert [c.data async for c in sb.process_output(info.id)] == [b"awake\n"]


POLICY = """
permit (principal, action, resource);

@id("no-typing")
@reason("this agent may not feed programs or open terminals")
forbid (principal, action, resource)
when { action == Action::"process.stdin" || action == Action::"pty.open" };

// Every member of the "processes" group shares one context shape, so a group-wide rule may
// read context.process_id (the schema validates it for all of them).
@id("leave-main-alone")
@reason("the main process is the operator's")
forbid (principal, action in Action::"processes", resource)
when { context.process_id == "main" };
"""


async def test_a_policy_can_forbid_stdin_terminals_and_one_process(
    home: Path, tmp_path: Path, fake: FakeBackend
) -> None:
    policy = tmp_path / "p.cedar"
    policy.write_text(POLICY)
    async with AsyncSandlot(home, backends={"fake": fake}, policy=policy) as client:
        sb = await client.create(start="serve")
        worker = await sb.start_process("sleep 100")
        fake.calls.clear()
        with pytest.raises(PolicyDenied) as typing:
            await sb.write_stdin(worker.id, b"rm -rf /\n")
        assert typing.value.reason_code
        with pytest.raises(PolicyDenied):
            await sb.open_pty()
        for attempt in (
            sb.signal_process("main", 9),
            sb.wait_process("main", timeout=1),
        ):
            with pytest.raises(PolicyDenied):
                await attempt
        with pytest.raises(PolicyDenied):
            _ = [c async for c in sb.process_output("main")]
        assert [c.op for c in fake.calls] == [], "nothing denied reached the backend"
        await sb.signal_process(worker.id)  # other processes are fine


async def test_terminal_use_counts_as_activity(
    aclient: AsyncSandlot, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot.manager import tuning

    sb = await aclient.create()
    before = (await sb.refresh()).last_active_at
    monkeypatch.setattr(tuning, "TOUCH_EVERY", 0.0)
    term = await sb.open_pty()
    await anyio.sleep(0.01)
    await term.write(b"x")
    after = (await sb.refresh()).last_active_at
    assert after > before
    await term.close()


async def test_bad_arguments_are_refused_before_anything_runs(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    fake.calls.clear()
    for call in (
        sb.start_process("true", cwd="relative"),
        sb.start_process("true", name=""),
        sb.start_process([]),
        sb.signal_process("p1", 99),
        sb.wait_process("p1", timeout=0),
        sb.signal_process(""),
        sb.open_pty(cols=70000),
    ):
        with pytest.raises(InvalidRequest):
            await call
    with pytest.raises(InvalidRequest):
        _ = [c async for c in sb.process_output("p1", offset=-1)]
    assert fake.calls == []


def test_the_sync_sdk_mirrors_it(client: Sandlot) -> None:
    sb = client.create()
    proc = sb.start_process(["cat"])
    sb.write_stdin(proc.id, "hello", close=True)
    assert [c.data for c in sb.process_output(proc.id, follow=True)] == [b"hello"]
    assert sb.wait_process(proc.id, timeout=5).exit_code == 0
    with sb.open_pty(rows=3, cols=4) as term:
        term.write("stty size\r")
        seen = b""
        while b"3 4" not in seen:
            seen += term.read(timeout=5)
        term.write(b"exit 2\r")
        assert term.wait(timeout=5) == 2
        assert b"".join(term) == b"exit 2\r\n"  # the rest of the output, then the end
        assert term.read() == b""
        assert term.exit_code == 2
