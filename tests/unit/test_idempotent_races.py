"""Repeats of a keyed call racing with the first call's own end."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from sandlot.journal import IntentState, Journal, process_owner
from sandlot.models import Actor, ExecResult
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec


class _FinishesFirst:
    """The Manager's journal, where the first call's worker records its result just before a
    repeat takes the intent over: the race is a few microseconds wide in real life, so this
    shim puts the worker's write exactly there."""

    def __init__(self, journal: Journal, finish: object) -> None:
        self._journal = journal
        self._finish = finish

    def __getattr__(self, name: str) -> object:
        return getattr(self._journal, name)

    def take_over(self, *args: object, **kwargs: object) -> object:
        self._finish()  # type: ignore[operator]
        return self._journal.take_over(*args, **kwargs)  # type: ignore[arg-type]


async def test_a_repeat_gets_the_result_recorded_as_it_takes_over(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    sb = await aclient.create()
    manager = aclient.manager
    assert manager.journal is not None
    # A worker on another host (so never provably dead) whose lease ran out mid-exec.
    worker = Journal(manager.journal.engine, owner="elsewhere:1:1", lease_seconds=0.2)
    request = {
        "sandbox_id": sb.id,
        "command": ["deploy"],
        "cwd": "/workspace",
        "env": {},
        "timeout": None,
        "stdin": None,
    }
    begun = worker.begin(
        tenant="default", principal="local", op="exec", request=request, idempotency_key="k"
    )
    lease = worker.advance(
        worker.authorize(begun.intent.intent_id, decision="ungated:test"), IntentState.RUNNING
    )
    time.sleep(0.3)
    recorded = {"exit_code": 0, "stdout": "deployed\n", "stderr": "", "duration_ms": 1.0}

    def finish() -> None:
        worker.record_result(lease, result=recorded, receipt_seq=None)

    manager.journal = _FinishesFirst(manager.journal, finish)  # type: ignore[assignment]
    result = await sb.exec(["deploy"], idempotency_key="k")
    assert result.stdout == "deployed\n"
    assert fake.calls_for(sb.id, "exec") == []


async def test_a_repeat_in_the_same_process_learns_the_outcome_at_once(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    ended: list[float] = []

    async def slow(req: FakeExec) -> ExecResult:
        await anyio.sleep(1.5)
        ended.append(time.monotonic())
        return ExecResult(exit_code=0, stdout="done\n")

    sb = await aclient.create()
    fake.exec_handler = slow
    returned: list[float] = []

    async def call() -> None:
        result = await sb.exec(["deploy"], idempotency_key="k")
        returned.append(time.monotonic())
        assert result.stdout == "done\n"

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.sleep(0.1)
        tg.start_soon(call)
    assert len(ended) == 1
    # The repeat's database polls are a second apart by then; only the wake-up from the
    # call that ran here makes it this prompt.
    assert max(returned) - ended[0] < 0.3, [r - ended[0] for r in returned]


HOLD = Path(__file__).parents[2] / "docs" / "policies" / "hold-undecidable.cedar"


async def test_a_repeat_of_a_held_call_waits_for_its_approval(
    home: Path, fake: FakeBackend
) -> None:
    async with AsyncSandlot(
        home, backends={"fake": fake}, policy=["default", HOLD], hold_timeout=30
    ) as sdk:
        journal = sdk.manager.journal
        assert journal is not None
        # Leases run out in half a second: a claim that lasted only a lease would be gone
        # long before anyone answers the HOLD.
        sdk.manager.journal = Journal(journal.engine, owner=process_owner(), lease_seconds=0.5)
        sb = await sdk.create()
        results: list[ExecResult] = []

        async def call() -> None:
            results.append(await sb.exec("echo $HOME", idempotency_key="k"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            with anyio.fail_after(10):
                while not await sdk.list_approvals():
                    await anyio.sleep(0.05)
            await anyio.sleep(1)
            tg.start_soon(call)
            await anyio.sleep(1)
            pending = await sdk.list_approvals()
            assert len(pending) == 1, "the repeat asked for an approval of its own"
            reviewer = Actor(tenant="default", principal="reviewer")
            await sdk.manager.approve(pending[0].id, actor=reviewer)
    assert len(results) == 2
    assert results[0] == results[1]
    assert len(fake.calls_for(sb.id, "exec")) == 1
