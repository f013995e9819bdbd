"""Fixtures shared by every suite: an isolated home, the fake backend, clients on both."""

from __future__ import annotations

import os
import secrets
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


PG_ADMIN_URL = os.environ.get("SANDLOT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards; skips naming the server if none answers."""
    try:
        import psycopg
    except ImportError:
        pytest.skip("needs psycopg (pip install 'psycopg[binary]')")
    name = f"sandlot_test_{secrets.token_hex(4)}"
    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        pytest.skip(f"needs PostgreSQL at {PG_ADMIN_URL}: {e}")
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database (skips, naming the server, when there is none)."""
    yield from _pg_database()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.needs_postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """SQLite, then PostgreSQL: the databases every store-level suite runs on."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sandlot-test.db'}"
    else:
        yield from _pg_database()
