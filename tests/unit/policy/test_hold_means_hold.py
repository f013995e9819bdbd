"""Under hold-undecidable.cedar, code the gate never sees is held, however it gets in.

A shell string with ``$X`` was held while the same code fed to ``python3`` on stdin, typed into
a terminal, or put in a script file ran at once (issue 23): each of those is held here, and
nothing reaches the sandbox unless someone approves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from sandlot import PolicyDenied
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.testing import FakeBackend

from .conftest import DOCS


async def _chunks() -> AsyncIterator[bytes]:
    yield b"import os; os.system('rm -rf /workspace')\n"


Bypass = Callable[[AsyncSandbox], Awaitable[object]]
BYPASSES: dict[str, tuple[Bypass, str]] = {
    "python3 fed on stdin": (
        lambda sb: sb.exec(["python3"], stdin=b"import os; os.system('id')\n"),
        "exec",
    ),
    "python3 fed a stdin stream": (lambda sb: sb.exec("python3 -", stdin=_chunks()), "exec"),
    "a python3 terminal": (lambda sb: sb.open_pty(["python3"]), "open_pty"),
    "a script terminal": (lambda sb: sb.open_pty(["script"]), "open_pty"),
    "a shell terminal": (lambda sb: sb.open_pty(), "open_pty"),
    "sh x.sh": (lambda sb: sb.exec("sh x.sh"), "exec"),
    "python3 x.py": (lambda sb: sb.exec(["python3", "x.py"]), "exec"),
    "bash ./run.sh in the background": (
        lambda sb: sb.start_process("bash ./run.sh"),
        "start_process",
    ),
}


@pytest.fixture
async def held(home: Path) -> AsyncIterator[tuple[AsyncSandlot, FakeBackend]]:
    fake = FakeBackend()
    async with AsyncSandlot(
        home,
        backends={"fake": fake},
        policy=["default", DOCS / "hold-undecidable.cedar"],
        hold_timeout=0.2,
    ) as client:
        yield client, fake


@pytest.mark.parametrize("name", list(BYPASSES))
async def test_code_the_gate_cannot_see_is_held(
    held: tuple[AsyncSandlot, FakeBackend], name: str
) -> None:
    client, fake = held
    run, op = BYPASSES[name]
    sb = await client.create()
    with pytest.raises(PolicyDenied) as info:
        await run(sb)
    assert info.value.reason_code == "HOLD_TIMEOUT"
    assert "hold-undecidable-shell" in info.value.message
    assert fake.calls_for(sb.id, op) == []


@pytest.mark.parametrize(
    "command",
    [["ls", "-la"], "python3 -c 'print(1)'", ["python3", "--version"], "pytest -q"],
)
async def test_code_on_the_command_line_still_runs_at_once(
    held: tuple[AsyncSandlot, FakeBackend], command: str | list[str]
) -> None:
    client, fake = held
    sb = await client.create()
    await sb.exec(command)
    assert len(fake.calls_for(sb.id, "exec")) == 1
