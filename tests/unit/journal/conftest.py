"""Databases the journal tests run on: SQLite always, PostgreSQL when a server answers on
127.0.0.1:5432 (each test gets its own database, dropped afterwards)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from sandlot.journal import Journal
from sandlot.store.migrate import upgrade
from sandlot.store.sql import open_engine

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
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'journal.db'}"
    else:
        yield from _pg_database()


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = open_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def journal(engine: Engine) -> Journal:
    return Journal(engine, owner="worker-a", lease_seconds=30.0)
