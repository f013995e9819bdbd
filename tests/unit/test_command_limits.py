"""The command bounds of :mod:`sandlot.policy.limits` hold at the Manager, for every way a
command reaches a sandbox, with or without a policy: a clear error, and nothing runs."""

from __future__ import annotations

import pytest

from sandlot import InvalidRequest
from sandlot.models import CommandSpec, ExecResult
from sandlot.policy.limits import MAX_ARG_BYTES, MAX_ARGV_ITEMS, MAX_ENV_ITEMS
from sandlot.sdk import AsyncSandlot
from sandlot.testing import FakeBackend, FakeExec


async def test_an_oversized_command_is_refused_by_name_and_never_runs(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    ran: list[list[str]] = []

    def handler(req: FakeExec) -> ExecResult:
        ran.append(req.argv)
        return ExecResult(exit_code=0)

    fake.exec_handler = handler
    sb = await aclient.create()
    too_long = "true && " * (MAX_ARG_BYTES // 8) + "true"
    with pytest.raises(InvalidRequest, match="MAX_ARG_BYTES"):
        await sb.exec(too_long)
    with pytest.raises(InvalidRequest, match="MAX_ARGV_ITEMS"):
        await sb.exec(["echo"] * (MAX_ARGV_ITEMS + 1))
    with pytest.raises(InvalidRequest, match="MAX_ARGV_ITEMS"):
        await sb.exec(CommandSpec(cmd="echo", args=["a"] * MAX_ARGV_ITEMS))
    with pytest.raises(InvalidRequest, match="MAX_ARG_BYTES"):
        await sb.start_process(too_long)
    with pytest.raises(InvalidRequest, match="MAX_ENV_ITEMS"):
        await sb.exec("true", env={f"V{i}": "x" for i in range(MAX_ENV_ITEMS + 1)})
    assert ran == []
    # The largest allowed command runs.
    await sb.exec("echo " + "a" * (MAX_ARG_BYTES - 5))
    assert ran == [["sh", "-c", "echo " + "a" * (MAX_ARG_BYTES - 5)]]


async def test_explain_refuses_an_oversized_command_by_name(aclient: AsyncSandlot) -> None:
    sb = await aclient.create()
    with pytest.raises(InvalidRequest, match="MAX_ARG_BYTES") as info:
        await sb.explain("exec", command=" && ".join(["true"] * 200_000))
    assert info.value.details["maximum"] == MAX_ARG_BYTES


async def test_a_spec_with_an_oversized_command_is_refused_before_anything_is_made(
    aclient: AsyncSandlot, fake: FakeBackend
) -> None:
    too_long = "echo " + "a" * MAX_ARG_BYTES
    for spec in ({"setup": ["true", too_long]}, {"start": too_long}, {"resume": too_long}):
        with pytest.raises(InvalidRequest, match="MAX_ARG_BYTES"):
            await aclient.create(**spec)  # type: ignore[arg-type]
    assert await aclient.list() == []
    assert fake.sandboxes == {}
