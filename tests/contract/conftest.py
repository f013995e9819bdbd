"""Store implementations the contract suite runs against: SQLite always, PostgreSQL when a
server answers on 127.0.0.1:5432 (CI makes sure one does)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.store.sql import SqlStore

PG_ADMIN_URL = os.environ.get("SANDLOT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_database() -> Iterator[str]:
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
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.needs_postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'contract.db'}"
    else:
        yield from _pg_database()


@pytest.fixture
def store(store_url: str) -> Iterator[SqlStore]:
    s = SqlStore(store_url)
    yield s
    s.engine.dispose()
