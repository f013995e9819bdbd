"""Databases for the store-on-PostgreSQL suites: PostgreSQL on 127.0.0.1:5432 (a fresh database
per test, dropped afterwards; skipped, naming the server, when none answers) and SQLite for the
tests that compare the two."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    yield from _pg_database()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.needs_postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        yield from _pg_database()
