"""Fixtures shared by every suite: an isolated home, the fake backend, clients on both."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandlot.sdk import AsyncSandlot
from sandlot.sync import Sandlot
from sandlot.testing import FakeBackend


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test ever reads or writes the user's real sandlot state."""
    monkeypatch.setenv("SANDLOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SANDLOT_BACKEND", raising=False)
    monkeypatch.delenv("SANDLOT_DATABASE_URL", raising=False)
    monkeypatch.delenv("SANDLOT_URL", raising=False)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return Path(os.environ["SANDLOT_HOME"])


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def aclient(home: Path, fake: FakeBackend) -> AsyncIterator[AsyncSandlot]:
    async with AsyncSandlot(home, backends={"fake": fake}) as client:
        yield client


@pytest.fixture
def client(home: Path, fake: FakeBackend) -> Iterator[Sandlot]:
    with Sandlot(home, backends={"fake": fake}) as c:
        yield c


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """Run every ``async def`` test on anyio (asyncio), without a marker on each.

    The marker goes on the function before pytest parametrizes it, so anyio's backend
    parameter combines with the test's own parameters.
    """
    import inspect

    if name.startswith("test") and inspect.iscoroutinefunction(obj):
        pytest.mark.anyio(obj)
